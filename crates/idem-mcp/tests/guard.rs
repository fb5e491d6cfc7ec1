//! `Guard` on a real SQLite ledger, with the call to the server replaced by a closure that
//! counts how often it runs: what each answer of the server is recorded as, and that no
//! repeat ever sends again.

use idem_core::{Clock, Lookup, SystemClock};
use idem_mcp::GuardConfig;
use idem_mcp::guard::{Guard, Sent};
use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

async fn guard(config: &str) -> (Guard, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = idem_store::open(&url, clock.clone(), Default::default()).await.unwrap();
    let config = Arc::new(GuardConfig::parse(config).unwrap());
    (Guard::new(store, clock, config, "tickets".into()), dir)
}

fn args(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn text(v: &Value) -> &str {
    v["content"][0]["text"].as_str().unwrap()
}

async fn call(g: &Guard, sends: &AtomicUsize, answer: Sent) -> (Value, &'static str) {
    let (r, d) = g
        .call("task-1", "create_ticket", &args(json!({"customer": "c-1"})), |_, _| async {
            sends.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(100)).await;
            answer
        })
        .await;
    (r.unwrap_or_else(|e| json!({"jsonrpc_error": e.code.0})), d)
}

fn ok() -> Sent {
    Sent::Result(
        json!({"content": [{"type": "text", "text": "T-1"}], "structuredContent": {"id": "T-1"}, "isError": false}),
    )
}

#[tokio::test]
async fn twenty_concurrent_calls_of_one_intent_send_once() {
    let (g, _dir) = guard("[defaults]\nwait_ms = 5000").await;
    let sends = AtomicUsize::new(0);
    let answers = futures_util::future::join_all((0..20).map(|_| call(&g, &sends, ok()))).await;
    assert_eq!(sends.load(Ordering::SeqCst), 1);
    assert_eq!(answers.iter().filter(|(_, d)| *d == "performed").count(), 1);
    assert_eq!(answers.iter().filter(|(_, d)| *d == "replayed").count(), 19, "{answers:?}");
    for (r, _) in &answers {
        assert_eq!(r["structuredContent"], json!({"id": "T-1"}));
    }
}

#[tokio::test]
async fn a_repeat_that_does_not_wait_long_enough_is_told_it_is_in_progress() {
    let (g, _dir) = guard("[defaults]\nwait_ms = 0").await;
    let sends = AtomicUsize::new(0);
    let (a, b) = tokio::join!(call(&g, &sends, ok()), async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        call(&g, &sends, ok()).await
    });
    assert_eq!((a.1, b.1), ("performed", "in_progress"));
    assert!(text(&b.0).starts_with("idem: not performed: the same call is in progress since "), "{}", b.0);
    assert_eq!(sends.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_lost_answer_is_unknown_in_review_and_never_sent_again() {
    let (g, _dir) = guard("").await;
    let sends = AtomicUsize::new(0);
    let (r, d) = call(&g, &sends, Sent::Lost("the server did not answer within 5 ms".into())).await;
    assert_eq!(d, "unknown");
    assert!(
        text(&r).starts_with(
            "idem: outcome unknown: the server did not answer within 5 ms (operation mcp:tickets:task-1:create_ticket:"
        ),
        "{r}"
    );
    assert!(text(&r).contains("an operator settles it in idem's review queue (idem ops list --needs-review)"));
    for _ in 0..3 {
        let (r, d) = call(&g, &sends, ok()).await;
        assert_eq!(d, "unknown");
        assert!(text(&r).contains("it is in idem's review queue"), "{r}");
    }
    assert_eq!(sends.load(Ordering::SeqCst), 1);
    let page = g.store().list("default", &Default::default()).await.unwrap();
    assert_eq!((page.items[0].state, page.items[0].needs_review), (idem_core::State::Unknown, true));
}

#[tokio::test]
async fn a_refusal_or_an_unsent_call_is_sent_again_a_tool_error_is_replayed() {
    let (g, _dir) = guard("").await;
    let sends = AtomicUsize::new(0);
    let refused = Sent::Refused(rmcp_error(-32602));
    assert_eq!(call(&g, &sends, refused).await.0, json!({"jsonrpc_error": -32602}));
    let (r, _) = call(&g, &sends, Sent::NotSent("the tool server is not running".into())).await;
    assert!(text(&r).starts_with("idem: not performed: the call could not be sent to the tool server"), "{r}");
    let error = Sent::Result(json!({"content": [{"type": "text", "text": "no such customer"}], "isError": true}));
    assert_eq!(call(&g, &sends, error).await.1, "tool_error");
    let (r, d) = call(&g, &sends, ok()).await;
    assert_eq!(sends.load(Ordering::SeqCst), 3, "refused and unsent calls are sent again; a final tool error is not");
    assert_eq!(d, "replayed");
    assert_eq!((r["isError"].clone(), r["content"][1]["text"].clone()), (json!(true), json!("no such customer")));
    assert!(text(&r).ends_with("the tool answered with this error then; the tool was not called again."), "{r}");
}

#[tokio::test]
async fn a_retryable_tool_error_is_sent_again() {
    let (g, _dir) = guard("[defaults]\ntool_error = \"retryable\"").await;
    let sends = AtomicUsize::new(0);
    let error = Sent::Result(json!({"content": [{"type": "text", "text": "busy"}], "isError": true}));
    call(&g, &sends, error).await;
    assert_eq!(call(&g, &sends, ok()).await.1, "performed");
    assert_eq!(sends.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_lookup_settles_an_unknown_call_with_its_evidence_only() {
    let config = r#"
[tools.create_ticket]
lookup = { tool = "find_ticket", arguments = { request_id = "{idempotency_key}" }, evidence_pointer = "/structuredContent/id" }
"#;
    let (g, _dir) = guard(config).await;
    let sends = AtomicUsize::new(0);
    call(&g, &sends, Sent::Lost("the connection to the server ended before its answer".into())).await;
    let inconclusive = || async { Lookup::Inconclusive { why: "db down".into() } };
    assert_eq!(g.settle_pass(|_, _| inconclusive()).await, 1);
    assert_eq!(call(&g, &sends, ok()).await.1, "unknown", "an inconclusive lookup settles nothing");
    // Looked up again once its backoff has passed; a pass before that asks nobody.
    assert_eq!(g.settle_pass(|_, _| async { Lookup::Found { provider_ref: "T-9".into() } }).await, 0);
    let rec = &g.store().list("default", &Default::default()).await.unwrap().items[0];
    let due = rec.next_attempt_at.unwrap() - g.now_ms();
    tokio::time::sleep(Duration::from_millis(due.max(0) as u64 + 20)).await;
    assert_eq!(g.settle_pass(|_, _| async { Lookup::Found { provider_ref: "T-9".into() } }).await, 1);
    let (r, d) = call(&g, &sends, ok()).await;
    assert_eq!(d, "replayed");
    assert!(
        text(&r).starts_with("idem: already done: the lookup tool found it at ")
            && text(&r).contains("(evidence T-9, operation "),
        "{r}"
    );
    assert_eq!(sends.load(Ordering::SeqCst), 1);
}

fn rmcp_error(code: i32) -> idem_mcp::rmcp::model::ErrorData {
    idem_mcp::rmcp::model::ErrorData::new(idem_mcp::rmcp::model::ErrorCode(code), "refused", None)
}
