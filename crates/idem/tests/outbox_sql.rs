//! The book's outbox examples (docs/src/guides/outbox-inbox.md), run as written: `idem schema install`, the SQL block
//! through psql, the Python block (psycopg 3, Debian python3-psycopg) — then the Rust
//! library finds what they stored (same fingerprints, same rows).

mod common;

use idem_outbox::tx::{self, Claim};
use serde_json::json;
use std::process::Command;

const PAGE: &str = "docs/src/guides/outbox-inbox.md";

/// The block of the book's outbox page named `outbox-NAME`.
fn page_block(name: &str) -> String {
    common::book::named(PAGE, &format!("outbox-{name}"))
}

/// Runs the page's setup block as written in bash — `createdb`, `idem schema install`,
/// the tables — with the database's name `app` made unique for this run, on the test
/// server's host and role; `idem` is this build's binary on `PATH`. Returns the database's
/// URL as the block exports it.
fn run_readme_setup(name: &str) -> String {
    let admin = reqwest::Url::parse(&idem_store::testing::pg_admin_url()).unwrap();
    let block = page_block("setup").replace(" app\n", &format!(" {name}\n")).replace("/app\n", &format!("/{name}\n"));
    assert!(block.contains(name), "the setup block names the database `app`: {block}");
    let bin_dir = common::idem_bin().parent().unwrap().to_owned();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &format!("{block}\necho \"$DATABASE_URL\"")])
        .env("PATH", path)
        .env("PGPASSWORD", admin.password().unwrap_or_default())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the page's setup block failed:\n{block}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("installed the idem schema, version 2 (was 0)"), "{stdout}");
    stdout.lines().last().unwrap().to_owned()
}

#[tokio::test]
async fn the_books_sql_and_python_examples_run_and_agree_with_the_rust_library() {
    // A fresh machine after the README's two commands: the setup block as written, then
    // the SQL block through psql and the Python block as a file under Debian's python3.
    let name = format!("idem_app_{}", uuid::Uuid::now_v7().simple());
    let _drop = common::book::DropDatabase(name.clone());
    let exported = run_readme_setup(&name);
    let admin = reqwest::Url::parse(&idem_store::testing::pg_admin_url()).unwrap();
    let mut url = admin.clone();
    url.set_path(&format!("/{name}"));
    let url = url.to_string();
    assert_eq!(exported.rsplit('/').next(), Some(name.as_str()), "{exported}");
    let install = |expect: &str| {
        let out =
            Command::new(common::idem_bin()).args(["schema", "install", "--database-url", &url]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains(expect), "{text}");
    };
    install("already at version 2");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();

    let psql = Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", &url, "-c", &page_block("sql")])
        .output()
        .expect("psql (Debian postgresql-client, installed by scripts/test.sh)");
    assert!(psql.status.success(), "{}", String::from_utf8_lossy(&psql.stderr));

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("outbox_example.py");
    std::fs::write(&file, page_block("python")).unwrap();
    let py = Command::new("/usr/bin/python3")
        .arg(&file)
        .env("DATABASE_URL", &url)
        .output()
        .expect("python3 with psycopg (Debian python3-psycopg, installed by scripts/test.sh)");
    assert!(py.status.success(), "{}", String::from_utf8_lossy(&py.stderr));
    let printed = String::from_utf8(py.stdout).unwrap();
    assert_eq!(
        printed.lines().collect::<Vec<_>>(),
        [
            "{'job': 'job-B-7'} {'job': 'job-B-7'}",
            "('apply', {'credited': 10})",
            "('duplicate', {'credited': 10})",
            "('conflict', None)",
        ]
    );

    // The page's Python fingerprint is idem's for strings of any script (break-it: NFC and
    // UTF-16 member order differed from a plain `json.dumps(sort_keys=True)`), integers,
    // booleans, null, nesting and control characters.
    let payloads = [
        json!({"city": "Zu\u{0308}rich"}),
        json!({"\u{1F600}": 1, "\u{FB01}": 2, "z": 3, "a": [true, null, -7]}),
        json!({"t": "tab\there\u{0001}\u{007f}\"q\"\\", "nested": {"b": {"Å": "A\u{030A}"}, "a": 1}}),
    ];
    let defs = page_block("python");
    let defs = &defs[..defs.find("def export_batch").expect("the page's Python defines export_batch")];
    let script = format!("{defs}\nimport sys\nfor line in sys.stdin:\n    print(fingerprint(json.loads(line)))\n");
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        for p in &payloads {
            writeln!(stdin, "{p}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    let python: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_owned).collect();
    let rust: Vec<String> = payloads.iter().map(|p| idem_core::fingerprint::fingerprint(p, None).unwrap().0).collect();
    assert_eq!(python, rust, "{payloads:?}");

    let one = |sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap() }
    };
    assert_eq!(one("SELECT count(*) FROM jobs").await, 2, "job-43 (SQL) and job-B-7 (Python), once each");
    assert_eq!(one("SELECT count(*) FROM idem.outbox WHERE state = 'PENDING'").await, 2);
    assert_eq!(one("SELECT balance::bigint FROM accounts WHERE id = 7").await, 10, "credited once");
    assert_eq!(one("SELECT conflicts::bigint FROM idem.inbox WHERE message_id = 'pay-1'").await, 1);

    // Keys claimed from SQL and Python replay in Rust: the fingerprints agree.
    let mut t = pool.begin().await.unwrap();
    for (key, batch, job) in [("B-8:export:v1", "B-8", "job-43"), ("B-7:export:v1", "B-7", "job-B-7")] {
        let c = tx::claim(&mut *t, key, "export", &json!({"source_batch": batch})).await.unwrap();
        assert_eq!(c, Claim::Replay(Some(json!({"job": job}))), "{key}");
    }
}
