//! The served OpenAPI document is the contract (issue 15 §2), checked against a running
//! `idem serve` with tools from outside this project, so routes added later are covered
//! without a change here:
//! - `openapi-spec-validator` accepts the document (unique operation ids, every path
//!   parameter declared, …);
//! - schemathesis generates requests from it (valid and invalid ones, every phase) and
//!   finds no answer the document does not describe, no valid request refused and no
//!   invalid one accepted (bounded: 20 examples per operation, at most 120 s);
//! - a client generated from it (openapi-python-client) does acquire → complete → replay.
//!
//! The Python tools are pinned in `scripts/requirements-openapi.txt`; `scripts/test.sh`
//! installs them into a venv and sets `IDEM_OPENAPI_VENV`.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server};
use std::path::PathBuf;
use std::process::Command;

fn venv_bin(tool: &str) -> PathBuf {
    let venv = std::env::var("IDEM_OPENAPI_VENV").expect(
        "IDEM_OPENAPI_VENV (the venv of scripts/requirements-openapi.txt): run ./scripts/test.sh, which makes it",
    );
    let bin = PathBuf::from(venv).join("bin").join(tool);
    assert!(bin.exists(), "{} is missing: run ./scripts/test.sh", bin.display());
    bin
}

fn scripts() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts"))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_document_validates_fuzzes_clean_and_generates_a_working_client() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let dir = tempfile::tempdir().unwrap();
    let doc_path = dir.path().join("openapi.json");
    let doc = s.http.get(s.url("/openapi.json")).send().await.unwrap().text().await.unwrap();
    std::fs::write(&doc_path, &doc).unwrap();

    run(Command::new(venv_bin("openapi-spec-validator")).arg(&doc_path));

    let generated = dir.path().join("idem_client");
    run(Command::new(venv_bin("openapi-python-client"))
        .args(["generate", "--meta", "none", "--path"])
        .arg(&doc_path)
        .arg("--output-path")
        .arg(&generated)
        .arg("--config")
        .arg(scripts().join("openapi-python-client.yaml")));
    let out = run(Command::new(venv_bin("python"))
        .arg(scripts().join("openapi_client_roundtrip.py"))
        .arg(&generated)
        .arg(&s.base)
        .arg(ADMIN_KEY));
    assert!(out.contains("round trip ok"), "{out}");

    // Last: the fuzzer may revoke the admin key (after making another admin, as a user may).
    let report = run(Command::new(venv_bin("st"))
        .arg("--config-file")
        .arg(scripts().join("schemathesis.toml"))
        .args(["run", &s.url("/openapi.json")])
        .env("IDEM_TEST_API_KEY", ADMIN_KEY)
        .args(["--max-examples", "20", "--max-time", "120", "--generation-deterministic", "--continue-on-failure"])
        .args(["--request-timeout", "30", "--no-color"])
        .env("SCHEMATHESIS_HOOKS", "schemathesis_hooks")
        .env("PYTHONPATH", scripts())
        .current_dir(dir.path()));
    assert!(!report.contains("failures") || report.contains(" 0 failures"), "{report}");
}
