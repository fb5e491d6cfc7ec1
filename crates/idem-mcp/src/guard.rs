//! The ledger half of the guard: one operation per intent, whatever the transport.
//!
//! [`Guard::call`] takes a guarded call (its task id, tool, arguments) and a way to send it
//! to the server, and answers with what the agent is told ([`crate::texts`]):
//!
//! | the operation | the agent gets |
//! |---|---|
//! | new (the trigger is granted the lease) | the call is sent; the server's answer, unchanged |
//! | SUCCEEDED / FAILED | the recorded answer after one `idem:` line, `_meta` `io.idem/replayed` |
//! | EXECUTING (another call holds the lease) | waits up to `wait_ms`, then "in progress" |
//! | UNKNOWN, or EXECUTING whose lease ended | "outcome unknown", until a lookup or an operator settles it |
//! | same key, other arguments | "mismatch", naming the differing arguments |
//! | PENDING (a retryable error or a proven absence) | sent again |
//!
//! What the server's answer proves decides the record (DESIGN.md §4): a result ⇒ SUCCEEDED
//! (`isError: true` ⇒ FAILED, or released for a retry when the tool's errors are
//! retryable); a JSON-RPC error that says the request was refused (-32700, -32600, -32601,
//! -32602) or a call that could not be sent ⇒ released (nothing happened); no answer in
//! time, a dropped connection, an answer that is not a tool result or any other error ⇒
//! UNKNOWN — never "succeeded" without the server's result, never sent again on its own.
//!
//! The guard names no lease holder (like `idem proxy`): every call is a new trigger, never
//! the resend of an attempt, so a repeat is never handed the running call's lease.

use crate::config::{GuardConfig, LookupConfig, ToolConfig, ToolErrorIs};
use crate::intent::{Intent, differing_arguments};
use crate::texts::{self, meta, rfc3339};
use idem_core::{AcquireInput, Actor, Clock, Decision, Lookup, OperationRecord, Outcome, RetryPolicy, State};
use idem_store::{CompleteRequest, ListFilter, ReconcileRequest, Store};
use serde_json::{Map, Value};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// The principal guarded calls are recorded under.
pub const PRINCIPAL: &str = "idem-mcp";
/// Largest recorded result (bytes of its JSON text); a larger one is replayed as a note.
pub const MAX_STORED_RESULT_BYTES: usize = 1024 * 1024;

/// What became of a call sent to the server.
#[derive(Debug, Clone)]
pub enum Sent {
    /// The server answered with a tool result (`CallToolResult` as JSON).
    Result(Value),
    /// The server refused the request with a JSON-RPC error that proves it did nothing
    /// (parse error, invalid request, method not found, invalid params): passed on as it is.
    Refused(rmcp::model::ErrorData),
    /// Nothing reached the server (it is not running, the transport was closed before
    /// sending): why.
    NotSent(String),
    /// The call reached the server and no usable answer came back: why (the "why" of
    /// [`texts::outcome_unknown`]).
    Lost(String),
}

/// The JSON-RPC error codes that prove the server did not run the call (JSON-RPC 2.0 §5.1).
pub fn refusal_code(code: i32) -> bool {
    matches!(code, -32700 | -32600 | -32601 | -32602)
}

/// The ledger side of one guard (one downstream server).
pub struct Guard {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    config: Arc<GuardConfig>,
    server: String,
    finished: tokio::sync::Notify,
}

/// The connector name guarded calls of `server` are recorded with: lookup-only (idem's
/// executor never runs it, and an `idem serve` without it sends them to review at once).
pub fn connector_of(server: &str) -> String {
    format!("lookup:mcp:{server}")
}

impl Guard {
    /// A guard for `server` (its name in keys) over `store`, judging time by `clock`.
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>, config: Arc<GuardConfig>, server: String) -> Self {
        Guard { store, clock, config, server, finished: tokio::sync::Notify::new() }
    }

    /// The server's name in keys.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The configuration.
    pub fn config(&self) -> &GuardConfig {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Now on the ledger's clock (epoch ms).
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Runs one guarded call of `tool` with `arguments` in task `task`; `send` sends the
    /// arguments it is given (the agent's, with the idempotency-key argument set) to the
    /// server at most once, and only when this trigger is granted the lease. Returns the
    /// answer for the agent and the decision label for metrics.
    pub async fn call<F, Fut>(
        &self,
        task: &str,
        tool: &str,
        arguments: &Map<String, Value>,
        send: F,
    ) -> (Result<Value, rmcp::model::ErrorData>, &'static str)
    where
        F: FnOnce(Map<String, Value>, Duration) -> Fut,
        Fut: Future<Output = Sent>,
    {
        let cfg = self.config.tool(tool);
        let intent = match crate::intent::intent_of(
            &self.server,
            task,
            tool,
            arguments,
            cfg.intent.as_deref(),
            cfg.idempotency_key_argument.as_deref(),
            cfg.max_argument_bytes,
        ) {
            Ok(i) => i,
            Err(e) => {
                return (
                    Ok(texts::result(&texts::refused(&e.to_string()), true, meta("refused", None, None, None))),
                    "refused",
                );
            }
        };
        let input = AcquireInput {
            tenant: self.config.tenant.clone(),
            key: intent.key.clone(),
            action: action_of(tool),
            payload: intent.payload.clone(),
            fingerprint: intent.fingerprint.clone(),
            lease_ms: cfg.lease_ms as i64,
            redo_safe: false,
            connector: Some(connector_of(&self.server)),
            holder: None,
            actor: Actor { principal: PRINCIPAL.into(), request_id: None },
        };
        let out = match self.acquire_waiting(&input, cfg.wait_ms).await {
            Ok(o) => o,
            Err(e) => {
                tracing::error!(error = %e, "idem mcp: the ledger refused a trigger");
                let why = format!("idem's ledger is unavailable ({})", ledger_error(&e));
                return (Ok(texts::result(&texts::refused(&why), true, meta("refused", None, None, None))), "refused");
            }
        };
        let rec = out.record;
        let op = rec.key.as_str();
        let answer = match out.decision {
            Decision::Acquire => return self.perform(&intent, cfg, rec.fencing_token, arguments, send).await,
            Decision::Replay => replay(&rec),
            Decision::InProgress { .. } | Decision::RetryNotDue { .. } | Decision::AlreadyHeld => {
                let at = rfc3339(rec.updated_at);
                let text = texts::in_progress(&at, op, cfg.wait_ms);
                return (
                    Ok(texts::result(&text, true, meta("in_progress", Some(op), Some(rec.state.as_str()), Some(&at)))),
                    "in_progress",
                );
            }
            Decision::Unknown | Decision::ExpireToUnknown => {
                return (Ok(unknown_answer(&rec, cfg.lookup.as_ref())), "unknown");
            }
            Decision::Mismatch => {
                let differing = differing_arguments(&rec.payload, &intent.payload);
                let fields = cfg.intent.clone().unwrap_or_default();
                let text = texts::mismatch(op, &differing, &fields);
                return (
                    Ok(texts::result(
                        &text,
                        true,
                        meta("mismatch", Some(op), Some(rec.state.as_str()), Some(&rfc3339(rec.created_at))),
                    )),
                    "mismatch",
                );
            }
            Decision::Late => {
                return (Ok(texts::result(&texts::late(op), true, meta("late", Some(op), None, None))), "late");
            }
        };
        (Ok(answer), "replayed")
    }

    /// Triggers until the answer is not "in progress" or `wait_ms` has passed. Between
    /// triggers it reads the record (no event) until its state changes or its lease ends.
    async fn acquire_waiting(
        &self,
        input: &AcquireInput,
        wait_ms: u64,
    ) -> Result<idem_store::AcquireOutcome, idem_store::StoreError> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
        loop {
            let out = self.store.acquire(input.clone()).await?;
            if let Decision::RetryNotDue { retry_after_ms } = out.decision
                && retry_after_ms <= 100
            {
                tokio::time::sleep(Duration::from_millis(retry_after_ms as u64 + 1)).await;
                continue;
            }
            // A released call's retry is due within a millisecond (release_policy): waited for
            // like a running call, never answered "in progress".
            let waits = matches!(out.decision, Decision::InProgress { .. } | Decision::RetryNotDue { .. });
            if !waits || tokio::time::Instant::now() >= deadline {
                return Ok(out);
            }
            loop {
                let notified = self.finished.notified();
                tokio::select! {
                    () = notified => {}
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                    () = tokio::time::sleep_until(deadline) => {}
                }
                let now = self.clock.now_ms();
                let changed = match self.store.get(&input.tenant, &input.key).await? {
                    Some(r) if r.state == State::Pending => r.next_attempt_at.is_none_or(|t| t <= now),
                    Some(r) => r.state != State::Executing || !r.lease_valid_at(now) || r.version != out.record.version,
                    None => true,
                };
                if changed || tokio::time::Instant::now() >= deadline {
                    break;
                }
            }
        }
    }

    /// Sends the call under the lease of `token` and records what its answer proves.
    async fn perform<F, Fut>(
        &self,
        intent: &Intent,
        cfg: &ToolConfig,
        token: i64,
        arguments: &Map<String, Value>,
        send: F,
    ) -> (Result<Value, rmcp::model::ErrorData>, &'static str)
    where
        F: FnOnce(Map<String, Value>, Duration) -> Fut,
        Fut: Future<Output = Sent>,
    {
        let mut args = arguments.clone();
        if let Some(k) = &cfg.idempotency_key_argument {
            args.insert(k.clone(), Value::String(intent.key.clone()));
        }
        let sent = send(args, Duration::from_millis(cfg.timeout_ms)).await;
        let op = intent.key.as_str();
        let (outcome, answer, label) = match sent {
            Sent::Result(r) => {
                let is_error = r.get("isError").and_then(Value::as_bool) == Some(true);
                let stored = stored_result(&r);
                let outcome = match (is_error, cfg.tool_error) {
                    (false, _) => Outcome::Succeeded { provider_ref: evidence_of(&r), result: Some(stored) },
                    (true, ToolErrorIs::Final) => Outcome::FinalFailure {
                        error_class: "tool_error".into(),
                        message: Some(first_text(&r)),
                        result: Some(stored),
                    },
                    (true, ToolErrorIs::Retryable) => Outcome::RetryableFailure {
                        error_class: "tool_error".into(),
                        message: Some(first_text(&r)),
                        retry_after_ms: Some(0),
                    },
                };
                (outcome, Ok(r), if is_error { "tool_error" } else { "performed" })
            }
            Sent::Refused(e) => {
                let outcome = Outcome::RetryableFailure {
                    error_class: "refused".into(),
                    message: Some(format!("the server refused the request: {} ({})", e.message, e.code.0)),
                    retry_after_ms: Some(0),
                };
                (outcome, Err(e), "refused_by_server")
            }
            Sent::NotSent(why) => {
                let outcome = Outcome::RetryableFailure {
                    error_class: "not_sent".into(),
                    message: Some(why.clone()),
                    retry_after_ms: Some(0),
                };
                (
                    outcome,
                    Ok(texts::result(&texts::not_sent(&why), true, meta("refused", Some(op), None, None))),
                    "not_sent",
                )
            }
            Sent::Lost(why) => {
                let settle = texts::settled_by(cfg.lookup.as_ref().map(|l| l.tool.as_str()));
                let text = texts::outcome_unknown(&why, op, &settle);
                let at = rfc3339(self.clock.now_ms());
                let m = meta("outcome_unknown", Some(op), Some("UNKNOWN"), Some(&at));
                (Outcome::Unknown { message: Some(why) }, Ok(texts::result(&text, true, m)), "unknown")
            }
        };
        let unknown = matches!(outcome, Outcome::Unknown { .. });
        let req = CompleteRequest {
            tenant: self.config.tenant.clone(),
            key: intent.key.clone(),
            fencing_token: token,
            outcome: outcome.into_storable(),
            actor: Actor { principal: PRINCIPAL.into(), request_id: None },
            policy: Some(release_policy()),
        };
        if let Err(e) = self.store.complete(req).await {
            // The answer is the truth even when it cannot be recorded: the lease then ends
            // into UNKNOWN, and a repeat is told the outcome is unknown, never sent again.
            tracing::error!(key = %intent.key, error = %e, "idem mcp: recording the server's answer failed");
        }
        self.finished.notify_waiters();
        if unknown && cfg.lookup.is_none() {
            self.flag_for_review(&intent.key).await;
        }
        (answer, label)
    }

    /// Records that nobody can be asked about an unknown call of a tool without a lookup:
    /// it goes to the review queue at once.
    async fn flag_for_review(&self, key: &str) {
        let why = "no lookup tool is configured for this tool: an operator must resolve it".to_owned();
        self.reconcile(key, Lookup::Inconclusive { why }, 1).await;
    }

    async fn reconcile(&self, key: &str, lookup: Lookup, max_lookups: i64) {
        let req = ReconcileRequest {
            tenant: self.config.tenant.clone(),
            key: key.to_owned(),
            lookup,
            actor: Actor { principal: PRINCIPAL.into(), request_id: None },
            policy: RetryPolicy::default(),
            max_lookups,
        };
        if let Err(e) = self.store.reconcile(req).await {
            tracing::warn!(key, error = %e, "idem mcp: recording a lookup failed");
        }
    }

    /// One pass over this server's UNKNOWN calls in the tenant (and EXECUTING ones whose
    /// lease ended: a guard that died mid-call): each whose next lookup is due is looked up
    /// with its tool's lookup (`lookup` runs a lookup tool call) and the answer recorded;
    /// one whose tool has none goes to review. Returns how many were looked at.
    pub async fn settle_pass<L, Fut>(&self, lookup: L) -> usize
    where
        L: Fn(LookupConfig, OperationRecord) -> Fut,
        Fut: Future<Output = Lookup>,
    {
        let now = self.clock.now_ms();
        let mut seen = 0;
        for state in [State::Unknown, State::Executing] {
            let filter = ListFilter {
                state: Some(state),
                key_prefix: Some(format!("mcp:{}:", self.server)),
                limit: 200,
                ..Default::default()
            };
            let page = match self.store.list(&self.config.tenant, &filter).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = %e, "idem mcp: listing unknown calls failed");
                    return seen;
                }
            };
            for rec in page.items {
                let due = match rec.state {
                    State::Unknown => !rec.needs_review && rec.next_attempt_at.is_none_or(|t| t <= now),
                    _ => !rec.lease_valid_at(now),
                };
                if !due || rec.connector.as_deref() != Some(connector_of(&self.server).as_str()) {
                    continue;
                }
                seen += 1;
                let tool = rec.payload.get("tool").and_then(Value::as_str).unwrap_or_default().to_owned();
                match self.config.tool(&tool).lookup.clone() {
                    None => self.flag_for_review(&rec.key).await,
                    Some(l) => {
                        let max = l.max_lookups;
                        let answer = lookup(l, rec.clone()).await;
                        self.reconcile(&rec.key, answer, max).await;
                    }
                }
            }
        }
        if seen > 0 {
            self.finished.notify_waiters();
        }
        seen
    }
}

/// The action a tool's calls are recorded under: `mcp:{tool}` (or `mcp:tool` for a name
/// outside the action alphabet).
pub fn action_of(tool: &str) -> String {
    let a = format!("mcp:{tool}");
    if a.len() <= 128 && a.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b)) {
        a
    } else {
        "mcp:tool".into()
    }
}

/// The client's retry is the agent's: a released call may be sent again at once, any
/// number of times (as `idem proxy` does).
fn release_policy() -> RetryPolicy {
    RetryPolicy { base_ms: 1, cap_ms: 1, max_attempts: i64::MAX, max_elapsed_ms: None }
}

fn ledger_error(e: &idem_store::StoreError) -> String {
    // Never the database's own words (they may name hosts, users or tables).
    match e {
        idem_store::StoreError::Invalid(m) => m.clone(),
        _ => "the database did not accept the write; see the guard's log".into(),
    }
}

/// The evidence of a successful answer: `result sha256:` + 16 hex digits of its canonical
/// JSON, or the structured content's `id` when it is a short string.
fn evidence_of(r: &Value) -> String {
    if let Some(id) = r
        .pointer("/structuredContent/id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty() && s.len() <= 200 && !s.chars().any(char::is_control))
    {
        return id.to_owned();
    }
    let canonical = idem_core::fingerprint::canonical_json(r).unwrap_or_else(|_| r.to_string());
    format!("result sha256:{}", &idem_core::fingerprint::sha256_hex(canonical.as_bytes())[..16])
}

fn stored_result(r: &Value) -> Value {
    let size = r.to_string().len();
    if size > MAX_STORED_RESULT_BYTES { serde_json::json!({"io.idem/omitted_bytes": size}) } else { r.clone() }
}

fn first_text(r: &Value) -> String {
    let t = r.pointer("/content/0/text").and_then(Value::as_str).unwrap_or("the tool answered with isError: true");
    idem_core::completion::clip_message(t)
}

/// The answer to a repeat of a finished call.
fn replay(rec: &OperationRecord) -> Value {
    let op = rec.key.as_str();
    let at = rfc3339(rec.completed_at.unwrap_or(rec.updated_at));
    let m = meta("replayed", Some(op), Some(rec.state.as_str()), Some(&at));
    let source = rec.evidence_source.as_deref().unwrap_or_default();
    match &rec.result {
        Some(r) if r.get("io.idem/omitted_bytes").is_some() => {
            let n = r["io.idem/omitted_bytes"].as_u64().unwrap_or(0);
            texts::result(&texts::replayed_omitted(&at, op, n), rec.state == State::Failed, m)
        }
        Some(r) if rec.state == State::Failed => texts::prepend(r.clone(), &texts::replayed_error(&at, op), m),
        Some(r) if source != "lookup" && source != "operator" => {
            texts::prepend(r.clone(), &texts::replayed(&at, op), m)
        }
        _ if rec.state == State::Succeeded => {
            let evidence = rec.provider_ref.as_deref().unwrap_or("none");
            // isError: the server's result is not there to give (and a tool with an
            // outputSchema must not be answered with content that does not follow it).
            texts::result(&texts::settled_done(&at, op, source, evidence), true, m)
        }
        _ => {
            let reason = rec.error_message.as_deref().unwrap_or("no reason recorded");
            texts::result(&texts::settled_failed(&at, op, reason), true, m)
        }
    }
}

/// The answer to a repeat of a call whose outcome is unknown.
fn unknown_answer(rec: &OperationRecord, lookup: Option<&LookupConfig>) -> Value {
    let at = rfc3339(rec.created_at);
    // No message: nobody reported — the guard's lease ended (swept, or looked up) while the
    // call was out. The guard records every answer it gets with its words.
    let reason = match (rec.error_class.as_deref(), rec.error_message.as_deref()) {
        (Some("lease_expired"), _) | (_, None) => "the guard stopped before the server answered".to_owned(),
        (_, Some(m)) => m.to_owned(),
    };
    let settle = if rec.needs_review {
        "it is in idem's review queue, where an operator settles it (idem ops list --needs-review)".to_owned()
    } else {
        texts::settled_by(lookup.map(|l| l.tool.as_str()))
    };
    let text = texts::outcome_unknown(&texts::earlier_call_unknown(&at, &reason), &rec.key, &settle);
    texts::result(&text, true, meta("outcome_unknown", Some(&rec.key), Some("UNKNOWN"), Some(&at)))
}
