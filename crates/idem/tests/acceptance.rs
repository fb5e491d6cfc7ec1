//! `idem scenarios run` passes the shipped matrix against idem and the provider double,
//! and fails, with a clear row and a non-zero exit, when a scenario's provider behaviour is
//! changed so that its expectation no longer holds; afterwards idem's `/metrics` counts
//! exactly what the suite did.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, idem_bin, metric, start_provider};
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
    for id in [
        "S1", "S2", "S3", "S4", "S4b", "S5", "S6", "S7", "S8", "C1", "C2", "W1", "W2", "W3", "W4", "W5", "W6", "W7",
        "W8", "C3", "C4", "C5",
    ] {
        assert!(text.lines().any(|l| l.starts_with(id) && l.contains("PASS")), "{id} did not pass:\n{text}");
    }
    assert!(text.contains("22 passed, 0 failed, 0 skipped"), "{text}");
    metrics_match_what_the_suite_did(&s, &text).await;

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
    assert!(text.contains("21 passed, 1 failed, 0 skipped"), "{text}");
    // Break W2: a lost reply under the manual policy pauses the instance instead.
    let broken = std::fs::read_to_string(format!("{SCENARIOS}/acceptance.toml")).unwrap().replace(
        r#"providers = { confirm = ["effect_then_hang"] }
starts = [ { expect_status = [201] } ]
expect = { state = "SUCCEEDED""#,
        r#"providers = { confirm = ["effect_then_hang", "effect_then_hang"] }
starts = [ { expect_status = [201] } ]
expect = { state = "PAUSED""#,
    );
    std::fs::write(&path, broken).unwrap();
    let (code, text) = run_matrix(&s, addr, &path);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.lines().any(|l| l.starts_with("W2") && l.contains("FAIL")), "{text}");
}

/// Compares `/metrics` with the runner's `totals:` line: every trigger's status, the
/// provider's calls and effects.
async fn metrics_match_what_the_suite_did(s: &Server, report: &str) {
    let totals = report.lines().find_map(|l| l.strip_prefix("totals: triggers ")).expect("a totals line");
    let (triggers_part, rest) = totals.split_once("; starts ").unwrap();
    let (starts_part, provider) = rest.split_once("; provider calls ").unwrap();
    let counts = |part: &str| -> (f64, Vec<(String, f64)>) {
        let (count, by) = part.split_once(" (").unwrap();
        let by = by.trim_end_matches(')');
        let pairs = by
            .split(' ')
            .filter(|p| !p.is_empty())
            .map(|p| p.split_once('=').unwrap())
            .map(|(s, n)| (s.to_string(), n.parse().unwrap()))
            .collect();
        (count.parse().unwrap(), pairs)
    };
    let (triggers, statuses) = counts(triggers_part);
    let (starts, start_statuses) = counts(starts_part);
    let (calls, rest) = provider.split_once(", effects ").unwrap();
    let (effects, unrecorded) = rest.split_once(", unrecorded ").unwrap();
    let (calls, effects, unrecorded): (f64, f64, f64) =
        (calls.parse().unwrap(), effects.parse().unwrap(), unrecorded.trim().parse().unwrap());
    assert!(triggers >= 20.0 && calls >= 10.0 && effects >= 5.0, "the suite did something: {totals}");

    let text = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let post = [("method", "POST"), ("route", "/v1/operations")];
    for (status, n) in &statuses {
        let labels = [post[0], post[1], ("status", status.as_str())];
        assert_eq!(metric(&text, "idem_http_requests_total", &labels), *n, "status {status}: {totals}\n{text}");
    }
    assert_eq!(metric(&text, "idem_http_requests_total", &post), triggers, "no other trigger was counted");
    let wf = [("method", "POST"), ("route", "/v1/workflows")];
    for (status, n) in &start_statuses {
        let labels = [wf[0], wf[1], ("status", status.as_str())];
        assert_eq!(metric(&text, "idem_http_requests_total", &labels), *n, "start status {status}: {totals}");
    }
    assert_eq!(metric(&text, "idem_http_requests_total", &wf), starts, "every workflow start was counted");
    let created = start_statuses.iter().find(|(s, _)| s == "201").map_or(0.0, |(_, n)| *n);
    assert_eq!(metric(&text, "idem_workflows_started_total", &[]), created, "one start counted per new instance");
    assert!(metric(&text, "idem_workflows_paused", &[]) >= 1.0, "W3's paused instance shows\n{text}");
    assert!(metric(&text, "idem_workflow_instances", &[("state", "SUCCEEDED")]) >= 3.0, "{text}");
    let n = |status: &str| statuses.iter().find(|(s, _)| s == status).map_or(0.0, |(_, n)| *n);
    assert_eq!(metric(&text, "idem_acquires_total", &[]), triggers, "one decision per trigger\n{text}");
    assert_eq!(metric(&text, "idem_acquires_total", &[("decision", "mismatch")]), n("422"));
    assert_eq!(metric(&text, "idem_acquires_total", &[("decision", "late")]), n("410"));
    assert_eq!(
        metric(&text, "idem_connector_attempts_total", &[("connector", "orders")]),
        calls,
        "every provider call is a counted attempt\n{text}"
    );
    let succeeded = metric(&text, "idem_completions_total", &[("outcome", "succeeded")]);
    let found = metric(&text, "idem_reconciliations_total", &[("result", "found")]);
    assert_eq!(
        succeeded + found,
        effects - unrecorded,
        "each effect was recorded once, by a completion or a lookup (but those waiting for a person)\n{text}"
    );
    assert!(metric(&text, "idem_http_request_duration_seconds_count", &post) >= triggers);
    assert!(metric(&text, "idem_store_batch_size_count", &[]) > 0.0, "the store reports its batches\n{text}");
}
