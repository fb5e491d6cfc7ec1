//! The newcomer's first hour (issue 15 §4): what someone who only read the README and the
//! book's getting-started pages meets first — the root URL, the first walkthrough run as
//! written.

mod common;

use common::{Backend, Db, Server};

/// `GET /` answered a JSON 404: a browser is now sent to the admin page, a client gets the
/// entry points, among them the probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_root_url_sends_browsers_to_the_admin_page_and_names_the_probes() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    // What Chromium and Firefox send for a navigation.
    for accept in ["text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", "TEXT/HTML"] {
        let r = http.get(s.url("/")).header("accept", accept).send().await.unwrap();
        assert_eq!(r.status(), 303, "{accept}");
        assert_eq!(r.headers()["location"], "/ui");
    }
    for accept in [None, Some("application/json"), Some("*/*")] {
        let mut req = http.get(s.url("/"));
        if let Some(a) = accept {
            req = req.header("accept", a);
        }
        let r = common::Resp::read(req.send().await.unwrap()).await;
        assert_eq!(r.status, 200, "{accept:?}: {r:?}");
        for (field, path) in
            [("admin_page", "/ui"), ("healthz", "/healthz"), ("readyz", "/readyz"), ("openapi", "/openapi.json")]
        {
            assert_eq!(r.body[field], path, "{r:?}");
            let target = http.get(s.url(path)).send().await.unwrap().status();
            assert!(target.is_success() || target.is_redirection(), "{path}: {target}");
        }
    }
    // Another unknown path is still a problem+json 404.
    let r = http.get(s.url("/nope")).header("accept", "text/html").send().await.unwrap();
    assert_eq!(r.status(), 404);
}

/// A retry that left out `fingerprint_fields` got a 422 whose text never mentioned the
/// field list; now the detail says what differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_says_what_differs_and_names_fingerprint_fields() {
    use common::ADMIN_KEY;
    use serde_json::json;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let payload = json!({"to": "c-9", "note": "first"});
    let first = json!({"key": "fp-1", "action": "send", "payload": payload, "fingerprint_fields": ["/to"]});
    assert_eq!(s.post(ADMIN_KEY, "/v1/operations", &first).await.status, 201);
    let cases = [
        // The input: the same request without its fingerprint_fields.
        (
            json!({"key": "fp-1", "action": "send", "payload": payload}),
            vec!["the payload is the one", "send the same fingerprint_fields"],
        ),
        // Neighbours: another field list; another payload; another action.
        (
            json!({"key": "fp-1", "action": "send", "payload": payload, "fingerprint_fields": ["/note"]}),
            vec!["[\"/note\"]", "send the same fingerprint_fields"],
        ),
        (
            json!({"key": "fp-1", "action": "send", "payload": {"to": "c-10"}}),
            vec!["another payload", "fingerprint_fields"],
        ),
        (
            json!({"key": "fp-1", "action": "notify", "payload": payload, "fingerprint_fields": ["/to"]}),
            vec!["action \"send\"", "\"notify\""],
        ),
    ];
    for (body, words) in cases {
        let r = s.post(ADMIN_KEY, "/v1/operations", &body).await;
        assert_eq!((r.status.as_u16(), r.problem()), (422, "fingerprint-mismatch"), "{body}");
        let detail = r.body["detail"].as_str().unwrap();
        for w in words {
            assert!(detail.contains(w), "{body}: {detail:?} lacks {w:?}");
        }
    }
    // The retry that matches is still a replay/in-progress, not a 422.
    let again = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": "fp-1", "action": "send", "payload": {"to": "c-9", "note": "other"}, "fingerprint_fields": ["/to"]})).await;
    assert_eq!(again.status, 409);
}

/// The book's first walkthrough (docs/src/getting-started/first-effect.md), run as
/// written: every `run` block of it in one bash script, with `set -euo pipefail`. Only
/// three things are substituted: the port (a free one instead of 8080), the API key
/// placeholder (`idem_5b0c…`, by the key the server printed on its first start, as the
/// reader would paste it) and the CLI's directory. The statuses and states the page shows
/// in its `# HTTP/1.1 …` and `# {…}` comments must be what the commands print.
/// (`IDEM_URL`, whose default is the page's port, names the free port for the CLI part.)
/// `tests/docs.rs` runs every page this way; this test also checks the states and problem
/// types the walkthrough is about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_first_walkthrough_runs_as_written() {
    let page = common::book::root().join("docs/src/getting-started/first-effect.md");
    let blocks = common::book::blocks(&page);
    let commands: Vec<&str> =
        blocks.iter().filter(|b| b.kind.as_deref() == Some("run")).map(|b| b.text.as_str()).collect();
    assert!(commands.len() >= 8, "{commands:?}");

    // Start the server as the reader does, and read the key it prints.
    let dir = tempfile::tempdir().unwrap();
    let server = common::book::FirstStart::new(dir.path());
    let (key, port) = (server.key.clone(), server.port);

    let mut script = String::from("set -euo pipefail\n");
    for block in &commands {
        let text = block
            .replace("localhost:8080", &format!("localhost:{port}"))
            .replace("127.0.0.1:8080", &format!("127.0.0.1:{port}"))
            .replace("idem_5b0c…", &key)
            .replace(
                "${CARGO_TARGET_DIR:-$PWD/target}/release",
                &common::idem_bin().parent().unwrap().display().to_string(),
            );
        script.push_str(&text);
        script.push('\n');
    }
    // The CLI's IDEM_URL default is the page's port; here it is the free one.
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(dir.path())
        .env("IDEM_URL", format!("http://127.0.0.1:{port}"))
        .env_remove("IDEM_API_KEY")
        .output()
        .unwrap();
    drop(server);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the walkthrough failed:\n{script}\n--- stdout\n{stdout}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // What the page promises, in its comments, is what the commands printed.
    let statuses = |text: &str, prefix: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.trim_start().strip_prefix(prefix))
            .map(|l| l.split_whitespace().next().unwrap().to_string())
            .collect()
    };
    let promised = statuses(&commands.join("\n"), "# HTTP/1.1 ");
    // curl -si prints a body without a final newline: the next status line follows it.
    let printed: Vec<String> =
        stdout.match_indices("HTTP/1.1 ").map(|(i, _)| stdout[i + 9..i + 12].to_string()).collect();
    assert_eq!(printed, promised, "statuses\n{stdout}");
    assert!(promised.len() >= 6, "{promised:?}");
    for state in ["EXECUTING", "SUCCEEDED"] {
        assert!(stdout.contains(&format!("\"state\":\"{state}\"")), "{state}: {stdout}");
    }
    assert!(stdout.contains("fingerprint-mismatch") && stdout.contains("operation-in-progress"), "{stdout}");
}

/// A start that fails — the port is taken, the configuration file is missing, the
/// bootstrap key breaks its rules — leaves the one-time admin key unused (the next good
/// start prints it) and no lock file or database file behind (the configuration and the
/// bootstrap key are checked and the socket is bound before the database is opened).
#[test]
fn a_failed_start_uses_up_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let serve = |extra: &[&str]| {
        std::process::Command::new(common::idem_bin())
            .args(["serve", "--database-url"])
            .arg(&db)
            .args(extra)
            .env_remove("IDEM_BOOTSTRAP_KEY")
            .env("RUST_LOG", "error")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let missing = dir.path().join("missing.toml");
    let out = serve(&["--config", missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!dir.path().join("idem.db.serve-lock").exists(), "no lock file left by a bad configuration");
    assert!(!db.exists(), "no database created by a bad configuration");
    for bad in ["short", "a key with spaces in it, long enough to pass the length rule"] {
        let out = serve(&["--listen", "127.0.0.1:0", "--bootstrap-key", bad]);
        assert_eq!(out.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("IDEM_BOOTSTRAP_KEY") && stderr.trim_end().lines().count() == 1, "{stderr}");
        assert!(!db.exists(), "no database created by a bad bootstrap key");
        assert!(!dir.path().join("idem.db.serve-lock").exists(), "no lock file left by a bad bootstrap key");
    }
    let out = serve(&["--listen", &taken.local_addr().unwrap().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("IDEM_API_KEY="), "a start that cannot listen prints no key: {stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot listen on"), "{stderr}");
    assert!(!db.exists(), "no database created by a start that cannot listen");
    assert!(!dir.path().join("idem.db.serve-lock").exists(), "no lock file left by a start that cannot listen");

    // The next good start creates and prints the key.
    let mut child = std::process::Command::new(common::idem_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url"])
        .arg(&db)
        .env_remove("IDEM_BOOTSTRAP_KEY")
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines().map_while(Result::ok);
    let mut key = None;
    for line in lines {
        if let Some(k) = line.strip_prefix("idem: IDEM_API_KEY=") {
            key = Some(k.to_owned());
        }
        if line.starts_with("idem: listening on") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(key.is_some_and(|k| k.starts_with("idem_")), "the key is printed by the first start that serves");
}
