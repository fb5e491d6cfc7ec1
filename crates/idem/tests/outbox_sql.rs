//! The README's outbox examples, run as written: `idem schema install`, the SQL block
//! through psql, the Python block (psycopg 3, Debian python3-psycopg) — then the Rust
//! library finds what they stored (same fingerprints, same rows).

mod common;

use idem_outbox::tx::{self, Claim};
use serde_json::json;
use std::process::Command;

/// The fenced block that follows `<!-- example:NAME -->` in the README.
fn readme_block(name: &str) -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let marker = format!("<!-- example:{name} -->");
    let after = &readme[readme.find(&marker).unwrap_or_else(|| panic!("no {marker} in the README")) + marker.len()..];
    let start = after.find("```").unwrap();
    let body = &after[start..];
    let body = &body[body.find('\n').unwrap() + 1..];
    body[..body.find("\n```").unwrap()].to_owned()
}

#[tokio::test]
async fn the_readme_sql_and_python_examples_run_and_agree_with_the_rust_library() {
    let url = idem_store::testing::fresh_pg_database("idem_app").await;
    let install = |expect: &str| {
        let out =
            Command::new(common::idem_bin()).args(["schema", "install", "--database-url", &url]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains(expect), "{text}");
    };
    install("installed the idem schema, version 2 (was 0)");
    install("already at version 2");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE jobs (id text PRIMARY KEY, batch text NOT NULL); \
         CREATE TABLE accounts (id integer PRIMARY KEY, balance integer NOT NULL); INSERT INTO accounts VALUES (7, 0)",
    )
    .execute(&pool)
    .await
    .unwrap();

    let psql = Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", &url, "-c", &readme_block("sql")])
        .output()
        .expect("psql (Debian postgresql-client, installed by scripts/test.sh)");
    assert!(psql.status.success(), "{}", String::from_utf8_lossy(&psql.stderr));

    let py = Command::new("/usr/bin/python3")
        .args(["-c", &readme_block("python")])
        .env("DATABASE_URL", &url.url)
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

    // The README's Python fingerprint is idem's for strings of any script (break-it: NFC and
    // UTF-16 member order differed from a plain `json.dumps(sort_keys=True)`), integers,
    // booleans, null, nesting and control characters.
    let payloads = [
        json!({"city": "Zu\u{0308}rich"}),
        json!({"\u{1F600}": 1, "\u{FB01}": 2, "z": 3, "a": [true, null, -7]}),
        json!({"t": "tab\there\u{0001}\u{007f}\"q\"\\", "nested": {"b": {"Å": "A\u{030A}"}, "a": 1}}),
    ];
    let defs = readme_block("python");
    let defs = &defs[..defs.find("def export_batch").expect("the README's Python defines export_batch")];
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
