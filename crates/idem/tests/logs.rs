//! Structured logs: with `--log-format json`, every request's lines carry its request id,
//! tenant and key hash; with `--redact-keys` the raw key appears nowhere in the log.

mod common;

use common::{ADMIN_KEY, idem_bin};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Runs `idem serve` with `extra` flags, sends one trigger with `key`, stops the server and
/// returns (the response's request id, the JSON log lines).
async fn serve_and_log(extra: &[&str], key: &str) -> (String, Vec<Value>, String) {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("idem.log");
    let mut child = Command::new(idem_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json", "--database-url"])
        .arg(dir.path().join("idem.db"))
        .args(extra)
        .env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let base = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("idem: listening on ").map(str::to_owned))
        .expect("the server starts");
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let r = http
        .post(format!("{base}/v1/operations"))
        .bearer_auth(ADMIN_KEY)
        .json(&json!({"key": key, "action": "send_confirmation", "payload": {"to": "x"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let rid = r.headers()["x-request-id"].to_str().unwrap().to_string();
    // Let the access line reach the file, then stop the server.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log_path).unwrap();
    let lines = text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).collect();
    (rid, lines, text)
}

fn access_line<'a>(lines: &'a [Value], rid: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["target"] == "idem::access" && l["span"]["request_id"] == rid)
        .unwrap_or_else(|| panic!("no access line for request {rid}: {lines:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_request_id_tenant_and_key_hash() {
    let key = "INQ-42:confirmation:v1";
    let (rid, lines, _) = serve_and_log(&[], key).await;
    let line = access_line(&lines, &rid);
    assert_eq!(line["level"], "INFO");
    assert_eq!(line["fields"]["status"], 201);
    assert!(line["fields"]["latency_ms"].as_f64().unwrap() >= 0.0);
    let span = &line["span"];
    assert_eq!(span["tenant"], "default");
    assert_eq!(span["route"], "/v1/operations");
    assert_eq!(span["key_hash"], idem_core::key::log_hash(key));
    assert_eq!(span["key"], key, "without --redact-keys the key is logged too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redact_keys_keeps_the_raw_key_out_of_the_log() {
    let key = "INQ-43:confirmation:v1";
    let (rid, lines, text) = serve_and_log(&["--redact-keys"], key).await;
    let line = access_line(&lines, &rid);
    assert_eq!(line["span"]["key_hash"], idem_core::key::log_hash(key));
    assert!(line["span"].get("key").is_none(), "{line}");
    assert!(!text.contains("INQ-43"), "the raw key appears nowhere in the log:\n{text}");
}
