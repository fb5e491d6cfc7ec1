//! Example events for tests here and in idem-outbox (the SQL function must refuse the same
//! ones): a good event, and each bad one with the rule it breaks.

use super::*;
use serde_json::json;

/// A valid event.
pub fn event() -> NewEvent {
    NewEvent {
        id: "order-42:created".into(),
        aggregate_type: "order".into(),
        aggregate_id: "42".into(),
        topic: "orders.created".into(),
        payload: json!({"order": 42}),
        headers: BTreeMap::new(),
    }
}

/// Each bad event of the list, and its neighbours: the rule it breaks.
pub fn bad_events() -> Vec<(&'static str, NewEvent, EventError)> {
    let with = |f: &dyn Fn(&mut NewEvent)| {
        let mut e = event();
        f(&mut e);
        e
    };
    vec![
        ("no id", with(&|e| e.id.clear()), EventError::MissingId),
        ("id with a space", with(&|e| e.id = "a b".into()), EventError::BadId),
        ("id too long", with(&|e| e.id = "x".repeat(256)), EventError::BadId),
        ("id not ascii", with(&|e| e.id = "é".into()), EventError::BadId),
        ("no aggregate type", with(&|e| e.aggregate_type.clear()), EventError::MissingAggregateType),
        ("no aggregate id", with(&|e| e.aggregate_id.clear()), EventError::MissingAggregateId),
        ("aggregate id too long", with(&|e| e.aggregate_id = "9".repeat(256)), EventError::BadAggregate),
        ("aggregate type with a newline inside", with(&|e| e.aggregate_type = "a\nb".into()), EventError::BadAggregate),
        ("aggregate type a newline", with(&|e| e.aggregate_type = "\n".into()), EventError::PaddedAggregate),
        ("blank aggregate id", with(&|e| e.aggregate_id = "   ".into()), EventError::PaddedAggregate),
        ("padded aggregate id", with(&|e| e.aggregate_id = " 42".into()), EventError::PaddedAggregate),
        (
            "aggregate type ending in a no-break space",
            with(&|e| e.aggregate_type = "order\u{a0}".into()),
            EventError::PaddedAggregate,
        ),
        (
            "aggregate id starting with a BOM",
            with(&|e| e.aggregate_id = "\u{feff}42".into()),
            EventError::PaddedAggregate,
        ),
        ("no topic", with(&|e| e.topic.clear()), EventError::MissingTopic),
        ("topic with a wildcard", with(&|e| e.topic = "orders.*".into()), EventError::BadTopic),
        ("topic with an empty token", with(&|e| e.topic = "orders..created".into()), EventError::BadTopic),
        ("topic with a space", with(&|e| e.topic = "orders created".into()), EventError::BadTopic),
        (
            "oversized payload",
            with(&|e| e.payload = json!({"blob": "x".repeat(MAX_PAYLOAD_BYTES)})),
            EventError::PayloadTooLarge(MAX_PAYLOAD_BYTES + 11),
        ),
        (
            "reserved header",
            with(&|e| {
                e.headers.insert("Webhook-Id".into(), "x".into());
            }),
            EventError::BadHeaders,
        ),
        (
            "a framing header (it truncated the delivered body)",
            with(&|e| {
                e.headers.insert("content-length".into(), "2".into());
            }),
            EventError::BadHeaders,
        ),
        (
            "a transfer coding",
            with(&|e| {
                e.headers.insert("Transfer-Encoding".into(), "chunked".into());
            }),
            EventError::BadHeaders,
        ),
        (
            "another host",
            with(&|e| {
                e.headers.insert("HOST".into(), "evil.example".into());
            }),
            EventError::BadHeaders,
        ),
        (
            "header value with a newline",
            with(&|e| {
                e.headers.insert("x-trace".into(), "a\r\nb".into());
            }),
            EventError::BadHeaders,
        ),
    ]
}
