//! `idem scenarios run` passes the shipped matrix against idem and the provider double,
//! and fails, with a clear row and a non-zero exit, when a scenario's provider behaviour is
//! changed so that its expectation no longer holds.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, idem_bin, start_provider};
use std::process::Command;

const SCENARIOS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scenarios");

fn run_matrix(s: &Server, provider: std::net::SocketAddr, file: &std::path::Path) -> (Option<i32>, String) {
    let out = Command::new(idem_bin())
        .args(["scenarios", "run"])
        .arg(file)
        .args(["--server", &s.base, "--api-key", ADMIN_KEY, "--provider", &format!("http://{provider}")])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_matrix_passes_and_a_broken_scenario_fails() {
    let (_provider, addr) = start_provider().await;
    let config =
        std::fs::read_to_string(format!("{SCENARIOS}/idem.toml")).unwrap().replace("127.0.0.1:8090", &addr.to_string());
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config);

    let (code, text) = run_matrix(&s, addr, std::path::Path::new(&format!("{SCENARIOS}/acceptance.toml")));
    assert_eq!(code, Some(0), "{text}");
    for id in ["S1", "S2", "S3", "S4", "S5", "S6", "S7", "S8", "C1", "C2"] {
        assert!(text.lines().any(|l| l.starts_with(id) && l.contains("PASS")), "{id} did not pass:\n{text}");
    }
    assert!(text.contains("10 passed, 0 failed, 0 skipped"), "{text}");

    // Break S6: the provider never recovers, so the operation ends FAILED, not SUCCEEDED.
    let broken = std::fs::read_to_string(format!("{SCENARIOS}/acceptance.toml"))
        .unwrap()
        .replace(r#"provider = ["503:1", "503", "ok"]"#, r#"provider = ["503", "503", "503", "503", "503"]"#);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.toml");
    std::fs::write(&path, broken).unwrap();
    let (code, text) = run_matrix(&s, addr, &path);
    assert_eq!(code, Some(1), "{text}");
    let row = text.lines().find(|l| l.starts_with("S6")).unwrap();
    assert!(row.contains("FAIL"), "{text}");
    assert!(text.contains("actual:   FAILED"), "the row says what happened:\n{text}");
    assert!(text.contains("9 passed, 1 failed, 0 skipped"), "{text}");
}
