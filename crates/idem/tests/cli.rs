//! The `idem` CLI against a running server: acquire/complete/ops with their exit codes,
//! keys, and one-line errors for bad input.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, idem_bin};
use reqwest::StatusCode;
use std::process::{Command, Output};
use std::time::Duration;

fn idem(s: &Server, args: &[&str]) -> Output {
    Command::new(idem_bin()).args(args).env("IDEM_URL", &s.base).env("IDEM_API_KEY", ADMIN_KEY).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_complete_and_replay_from_the_command_line() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let key = "INQ-300:confirmation:v1";
    let payload = r#"{"to":"c-300","template":"confirmation"}"#;
    let first = idem(&s, &["acquire", key, "--action", "send_confirmation", "--payload", payload]);
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    let out = text(&first.stdout);
    let token =
        out.split("fencing token ").nth(1).and_then(|t| t.split(',').next()).expect("the token is printed").to_string();
    assert!(token.parse::<i64>().is_ok(), "{out}");
    let busy = idem(&s, &["acquire", key, "--action", "send_confirmation", "--payload", payload]);
    assert_eq!(busy.status.code(), Some(12));
    let done = idem(
        &s,
        &["complete", key, "--token", &token, "--outcome", "succeeded", "--provider-ref", "msg-300", "--json"],
    );
    assert_eq!(done.status.code(), Some(0), "{}", text(&done.stderr));
    let v: serde_json::Value = serde_json::from_slice(&done.stdout).unwrap();
    assert_eq!(v["state"], "SUCCEEDED");
    let replay = idem(&s, &["acquire", key, "--action", "send_confirmation", "--payload", payload]);
    assert_eq!(replay.status.code(), Some(10));
    assert!(text(&replay.stdout).contains("msg-300"));
    let mismatch = idem(&s, &["acquire", key, "--action", "send_confirmation", "--payload", r#"{"to":"x"}"#]);
    assert_eq!(mismatch.status.code(), Some(1));
    let err = text(&mismatch.stderr);
    assert!(err.starts_with("idem: 422 fingerprint-mismatch") && err.trim_end().lines().count() == 1, "{err}");
    let got = idem(&s, &["ops", "get", key]);
    assert!(text(&got.stdout).contains("SUCCEEDED") && text(&got.stdout).contains("replayed"));
    let list = idem(&s, &["ops", "list", "--state", "SUCCEEDED", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(v["items"][0]["key"], key);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_one_line_and_non_zero() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    for args in [
        &["acquire", "k", "--action", "a", "--payload", "{not json"][..],
        &["acquire", "mail:jane@example.com", "--action", "a"][..],
        &["complete", "k", "--token", "1", "--outcome", "succeeded"][..],
        &["ops", "get", "never-used"][..],
        &["ops", "list", "--state", "DONE"][..],
        &["acquire", "k", "--action", "a", "--payload", r#"{"a":1,"a":2}"#][..],
    ] {
        let out = idem(&s, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.starts_with("idem: ") && err.trim_end().lines().count() == 1, "{args:?}: {err}");
    }
    // A key or id the command puts in a URL path: empty, `.` or `..` would address
    // another route (or none, a bare 404); refused before anything is sent.
    for args in [
        &["ops", "get", ""][..],
        &["ops", "get", ".."][..],
        &["ops", "resolve", ".", "--to", "failed", "--reason", "r"][..],
        &["complete", "", "--token", "1", "--outcome", "succeeded"][..],
        &["wf", "get", ""][..],
    ] {
        let out = idem(&s, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(
            err.starts_with("idem: ")
                && err.trim_end().lines().count() == 1
                && (err.contains("directory steps") || err.contains("must not be empty")),
            "{args:?}: {err}"
        );
    }
    let unreachable = Command::new(idem_bin())
        .args(["ops", "list", "--server", "http://127.0.0.1:9", "--api-key", "x"])
        .output()
        .unwrap();
    assert_eq!(unreachable.status.code(), Some(1));
    assert!(text(&unreachable.stderr).contains("cannot reach the idem server"));

    // The acceptance runner stops at once on a refused API key (it used to poll for minutes).
    let (_provider, addr) = common::start_provider().await;
    let started = std::time::Instant::now();
    let out = Command::new(idem_bin())
        .args(["scenarios", "run", concat!(env!("CARGO_MANIFEST_DIR"), "/../../scenarios/acceptance.toml")])
        .args(["--server", &s.base, "--api-key", "idem_wrong", "--provider", &format!("http://{addr}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("401"), "{}", text(&out.stderr));
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_create_list_revoke() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let secret = s.create_key("acme", "operator");
    let ok = s.get(&secret, "/v1/operations").await;
    assert_eq!(ok.status, 200);
    let list = Command::new(idem_bin())
        .args(["keys", "list", "--json", "--tenant", "acme", "--database-url", &db.url])
        .output()
        .unwrap();
    let keys: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(keys.as_array().unwrap().len(), 1);
    assert!(!text(&list.stdout).contains(&secret), "secrets are never listed");
    let id = keys[0]["id"].as_str().unwrap();
    let revoke = Command::new(idem_bin()).args(["keys", "revoke", id, "--database-url", &db.url]).output().unwrap();
    assert!(revoke.status.success());
    // The server learns of a revocation made by another process from the key epoch it
    // polls every 100 ms (idem_store::sqlite::KEY_EPOCH_POLL).
    let mut status = StatusCode::OK;
    for _ in 0..20 {
        status = s.get(&secret, "/v1/operations").await.status;
        if status == StatusCode::UNAUTHORIZED {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(status, StatusCode::UNAUTHORIZED, "revoked within the epoch poll");
    let bad = Command::new(idem_bin())
        .args(["keys", "create", "--tenant", "bad tenant", "--role", "client", "--database-url", &db.url])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(text(&bad.stderr).contains("tenant"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_per_sqlite_file_and_keys_never_create_a_database() {
    let db = Db::new(Backend::Sqlite).await;
    let _s = Server::start(&db.url);
    let second = Command::new(idem_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", &db.url])
        .env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY)
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(1));
    assert!(text(&second.stderr).contains("another idem serve already uses"), "{}", text(&second.stderr));
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("typo.db");
    let keys =
        Command::new(idem_bin()).args(["keys", "list", "--database-url", wrong.to_str().unwrap()]).output().unwrap();
    assert_eq!(keys.status.code(), Some(1));
    assert!(!wrong.exists(), "a wrong path must not become a new empty database");
    let scheme = Command::new(idem_bin()).args(["keys", "list", "--database-url", "mysql://x/y"]).output().unwrap();
    assert_eq!(scheme.status.code(), Some(1));
    assert!(text(&scheme.stderr).contains("unsupported database URL"));
}

/// A PostgreSQL database that does not exist is one plain line, said once: not sqlx's
/// "error returned from database: … at line 948" (a line of the server's C source) three
/// times over, as the cause chain printed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_postgres_database_is_one_plain_line() {
    let pg = Db::new(Backend::Postgres).await;
    let (base, _) = pg.url.rsplit_once('/').unwrap();
    let missing = format!("{base}/idem_surely_missing_{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let relay_config = dir.path().join("relay.toml");
    std::fs::write(
        &relay_config,
        format!(
            "[outbox]\ndatabase_url = \"{missing}\"\n[outbox.sinks.hooks]\nkind = \"webhook\"\n\
             url = \"http://127.0.0.1:9/h\"\ntopics = [\"orders.*\"]\nsecrets = [{{ env = \"IDEM_TEST_HOOK_SECRET\" }}]\n"
        ),
    )
    .unwrap();
    let relay_config = relay_config.to_str().unwrap();
    for args in [
        vec!["keys", "list", "--database-url", &missing],
        vec!["serve", "--listen", "127.0.0.1:0", "--database-url", &missing],
        vec!["schema", "install", "--database-url", &missing],
        vec!["outbox", "list", "--database-url", &missing],
        vec!["relay", "--config", relay_config],
    ] {
        let out = Command::new(idem_bin())
            .args(&args)
            .env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY)
            .env("IDEM_TEST_HOOK_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert_eq!(err.matches("does not exist").count(), 1, "{args:?}: {err}");
        assert!(!err.contains("at line") && !err.contains("error returned from database"), "{args:?}: {err}");
        assert!(!err.contains("the clock"), "a connection failure is not the clock's: {err}");
    }
    // A port nothing listens on is "refused", not sqlx's "pool timed out" after the wait.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let refused = format!("postgres://postgres@127.0.0.1:{closed}/postgres");
    let refused_relay = dir.path().join("refused-relay.toml");
    std::fs::write(&refused_relay, std::fs::read_to_string(relay_config).unwrap().replace(&missing, &refused)).unwrap();
    let refused_relay = refused_relay.to_str().unwrap();
    for args in [
        vec!["keys", "list", "--database-url", &refused],
        vec!["outbox", "list", "--database-url", &refused],
        vec!["outbox", "get", "some-event", "--database-url", &refused],
        vec!["relay", "--config", refused_relay],
    ] {
        // The outbox commands waited sqlx's 30 s pool timeout before naming the cause.
        let started = std::time::Instant::now();
        let out = Command::new(idem_bin())
            .args(&args)
            .env("IDEM_TEST_HOOK_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.to_lowercase().contains("refused") && !err.contains("timed out"), "{args:?}: {err}");
        assert!(started.elapsed() < Duration::from_secs(8), "{args:?} took {:?}", started.elapsed());
    }
}

/// SQLite creates a database file but never its directory, and then says only "unable to
/// open database file": every command that opens one names the missing directory (or the
/// missing file, where it must exist), in one line, and creates nothing.
#[test]
fn a_sqlite_path_in_a_missing_directory_names_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("no-such-dir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let in_gone = format!("sqlite://{}/idem.db", gone.display());
    let under_file = format!("{}/idem.db", file.display());
    // Also an empty path, and a directory where the file should be.
    let the_dir = format!("sqlite://{}", dir.path().display());
    for (url, says) in [
        (in_gone.as_str(), "does not exist"),
        (under_file.as_str(), "is not a directory"),
        ("sqlite://", "path is empty"),
        ("sqlite:", "path is empty"),
        (the_dir.as_str(), "is a directory"),
    ] {
        for args in [
            vec!["serve", "--listen", "127.0.0.1:0", "--database-url", url],
            vec!["keys", "list", "--database-url", url],
            vec!["schema", "install", "--database-url", url],
            vec!["outbox", "list", "--database-url", url],
        ] {
            let out = Command::new(idem_bin()).args(&args).env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY).output().unwrap();
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
            assert!(err.contains(says) && !err.contains("unable to open"), "{args:?}: {err}");
        }
    }
    assert!(!gone.exists(), "nothing was created");
    // The outbox commands do not create a database: a missing file is named as such.
    let missing = dir.path().join("missing.db");
    let url = format!("sqlite://{}", missing.display());
    let out = Command::new(idem_bin()).args(["outbox", "list", "--database-url", &url]).output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no database at") && err.contains("schema install"), "{err}");
    assert!(!missing.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_is_not_a_crash() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    for i in 0..30 {
        s.acquire(&format!("k-{i}"), serde_json::json!({"i": i})).await;
    }
    let mut child = Command::new(idem_bin())
        .args(["ops", "list", "--limit", "30"])
        .env("IDEM_URL", &s.base)
        .env("IDEM_API_KEY", ADMIN_KEY)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader went away (like `| head -c 0`)
    let out = child.wait_with_output().unwrap();
    assert_ne!(out.status.code(), Some(101), "panicked: {}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("panicked"));
}

#[test]
fn logs_piped_to_a_file_have_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(idem_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url"])
        .arg(dir.path().join("logs.db"))
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut stdout, &mut line).unwrap() > 0, "serve exited");
    }
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(err.contains("bootstrap admin key"), "{err}");
    assert!(!err.contains('\u{1b}'), "ANSI escape codes in piped logs: {err:?}");
}

/// A build without the `otel` feature cannot export traces: asking for it (flag or the
/// standard variable, on `serve` and `proxy`) fails at start with one line naming the
/// feature, before any database is created.
#[cfg(not(feature = "otel"))]
#[test]
fn otlp_endpoint_without_the_otel_feature_fails_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("otel.db");
    let runs: [(&[&str], bool); 2] = [(&["serve"], false), (&["proxy", "--upstream", "http://127.0.0.1:9"], true)];
    for (sub, via_env) in runs {
        let mut cmd = Command::new(idem_bin());
        cmd.args(sub)
            .args(["--listen", "127.0.0.1:0", "--database-url"])
            .arg(&db)
            .env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if via_env {
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        } else {
            cmd.args(["--otlp-endpoint", "http://127.0.0.1:4318"]);
        }
        let mut child = cmd.spawn().unwrap();
        let start = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > std::time::Duration::from_secs(30) {
                child.kill().unwrap();
                panic!("{sub:?} with an OTLP endpoint started anyway");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{sub:?}: {err}");
        assert!(err.starts_with("idem: ") && err.trim_end().lines().count() == 1, "{sub:?}: {err}");
        assert!(err.contains("--otlp-endpoint") && err.contains("--features otel"), "{sub:?}: {err}");
        assert!(!db.exists(), "{sub:?} opened the database before refusing");
    }
}

/// Issue 15: without a key, clap said "required: --api-key" and never named IDEM_API_KEY;
/// and `idem --help` called `ops` read-only although it resolves and reconciles.
#[test]
fn a_missing_api_key_names_the_environment_variable_and_ops_says_what_it_changes() {
    for args in [
        &["ops", "list"][..],
        &["ops", "get", "k"][..],
        &["acquire", "k", "--action", "a"][..],
        &["wf", "list"][..],
        &["scenarios", "run", "scenarios/acceptance.toml"][..],
    ] {
        for env_key in [None, Some("")] {
            let mut cmd = Command::new(idem_bin());
            cmd.args(args).args(["--server", "http://127.0.0.1:9"]).env_remove("IDEM_API_KEY");
            if let Some(k) = env_key {
                cmd.env("IDEM_API_KEY", k);
            }
            let out = cmd.output().unwrap();
            assert_eq!(out.status.code(), Some(1), "{args:?}");
            let err = text(&out.stderr);
            assert!(err.starts_with("idem: no API key") && err.trim_end().lines().count() == 1, "{args:?}: {err}");
            assert!(err.contains("IDEM_API_KEY") && err.contains("--api-key"), "{err}");
        }
    }
    let help = text(&Command::new(idem_bin()).arg("--help").output().unwrap().stdout);
    let ops = help.lines().find(|l| l.trim_start().starts_with("ops ")).unwrap();
    assert!(!ops.contains("Read operations"), "{ops}");
    assert!(ops.contains("resolve") && ops.contains("reconcile"), "{ops}");
}

/// A command line the parser refuses is one line (`idem: …` with the command's usage) and
/// exit status 2; help still prints whole.
#[test]
fn usage_errors_are_one_line_with_exit_2() {
    for args in [
        &["bench", "--seconds", "0"][..],
        &["wf", "start"][..],
        &["ops", "list", "--no-such-flag"][..],
        &["acquire", "k", "--lease-ms", "soon"][..],
    ] {
        let out = Command::new(idem_bin()).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.starts_with("idem: ") && err.trim_end().lines().count() == 1, "{args:?}: {err}");
        assert!(err.contains("usage: idem"), "{err}");
    }
    // The missing arguments are named, and an invalid value's usage names the command
    // (break-it: "were not provided: (usage …)" with an empty list; "usage: idem [COMMAND]").
    let missing = text(&Command::new(idem_bin()).args(["wf", "rerun"]).output().unwrap().stderr);
    assert!(missing.contains("were not provided: <INSTANCE_ID>"), "{missing}");
    let invalid = text(&Command::new(idem_bin()).args(["acquire", "k", "--lease-ms", "soon"]).output().unwrap().stderr);
    assert!(invalid.contains("usage: idem acquire"), "{invalid}");
    let payload = Command::new(idem_bin())
        .args([
            "acquire",
            "k",
            "--action",
            "a",
            "--payload",
            "{bad",
            "--server",
            "http://127.0.0.1:9",
            "--api-key",
            "x",
        ])
        .output()
        .unwrap();
    assert!(text(&payload.stderr).contains("member name"), "{}", text(&payload.stderr));
    let help = Command::new(idem_bin()).args(["wf", "--help"]).output().unwrap();
    assert_eq!(help.status.code(), Some(0));
    assert!(text(&help.stdout).lines().count() > 5);
    let wf = text(&Command::new(idem_bin()).arg("--help").output().unwrap().stdout);
    let wf = wf.lines().find(|l| l.trim_start().starts_with("wf ")).unwrap().to_owned();
    assert!(wf.contains("re-run") && wf.contains("compensate"), "{wf}");
}
