//! Requests the store tests send (`sqlite_writer_cache.rs`, `sqlite_fast_path.rs`,
//! `sqlite_durable_reads.rs`, `pg_batches.rs`). Each test binary uses only some of them.
#![allow(dead_code)]

use idem_core::{AcquireInput, Actor, Outcome};
use idem_store::CompleteRequest;
use serde_json::json;

/// A trigger of `key` in tenant `t` by principal `w`: action `send`, a payload and
/// fingerprint of its own, a lease of `lease_ms`.
pub fn input(key: &str, lease_ms: i64) -> AcquireInput {
    AcquireInput {
        tenant: "t".into(),
        key: key.into(),
        action: "send".into(),
        payload: json!({"to": "a@example.com", "key": key}),
        fingerprint: format!("fp-{key}"),
        lease_ms,
        redo_safe: false,
        connector: None,
        holder: None,
        actor: Actor { principal: "w".into(), request_id: None },
    }
}

/// A success of `key` under `token`, with evidence `ref-KEY`.
pub fn success(key: &str, token: i64) -> CompleteRequest {
    CompleteRequest {
        tenant: "t".into(),
        key: key.into(),
        fencing_token: token,
        outcome: Outcome::Succeeded { provider_ref: format!("ref-{key}"), result: None },
        actor: Actor { principal: "w".into(), request_id: None },
        policy: None,
    }
}
