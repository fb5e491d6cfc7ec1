//! NATS JetStream: the one publish function ([`publish`]) and the connector built on it
//! ([`NatsConnector`], `kind = "nats"`). The relay's NATS sink (idem-outbox) calls
//! [`publish`] too, so both read a publish the same way.
//!
//! A JetStream stream deduplicates by the `Nats-Msg-Id` header within its
//! `duplicate_window` (2 minutes by default): a second publish with the same id is
//! answered with the *first* message's sequence and `duplicate: true`, and nothing new is
//! stored. That makes a publish safe to repeat inside the window — and only there.
//!
//! Classification of one publish, by what the answer proves:
//!
//! | answer | proves | [`PublishOutcome`] |
//! |---|---|---|
//! | PubAck (stream, sequence; `duplicate` or not) | stored once | `Stored` |
//! | not handed to the connection (not connected, too many in flight) | nothing was sent | `NotSent` (`connect`, `busy`) |
//! | no responders (no stream takes the subject), payload over the server's `max_payload`, an invalid subject | refused | `Refused` (`no_stream`, `too_large`, `validation`) |
//! | a JetStream error reply | not stored | `NotSent` (`jetstream`) |
//! | no PubAck within the timeout, or the connection dropped while waiting | nothing: it may be stored | `Unknown` |
//!
//! The connector publishes the operation's payload (JSON) to `subject` with
//! `Nats-Msg-Id` = `tenant:key` (the operation's key, scoped like the HTTP connector's
//! `Idempotency-Key`); the evidence is `{stream}:{sequence}` from the PubAck. A lost PubAck
//! is UNKNOWN; the reconciler's lookup settles it by publishing again with the same id
//! while the stream's duplicate window surely still covers the first publish: the server
//! answers `duplicate` with the original sequence (found), or stores it now if the first
//! never arrived (then this is the one message). Outside the window a re-publish could
//! store a second message, so the lookup is inconclusive and the operation goes to review.

use crate::config::{ConfigError, NatsConfig, interpolate};
use crate::connector::{Connector, OperationCtx, final_failure, retryable, unknown};
use async_nats::jetstream::{self, context::PublishErrorKind};
use async_trait::async_trait;
use idem_core::{Lookup, Outcome};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::OnceCell;

/// What one JetStream publish proved (see the module's table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishOutcome {
    /// A PubAck: the message is in `stream` at `sequence`; `duplicate` when the stream had
    /// it already under this `Nats-Msg-Id` (then `sequence` is the first one's).
    Stored {
        /// Stream name.
        stream: String,
        /// Sequence in the stream.
        sequence: u64,
        /// The server recognised the id within its duplicate window.
        duplicate: bool,
    },
    /// Nothing was stored, and publishing again may succeed.
    NotSent {
        /// Error class.
        class: &'static str,
        /// Detail.
        message: String,
    },
    /// The server refused; publishing again gets the same answer.
    Refused {
        /// Error class.
        class: &'static str,
        /// Detail.
        message: String,
    },
    /// Sent, but no PubAck: it may be stored.
    Unknown {
        /// Detail.
        message: String,
    },
}

/// Publishes `payload` to `subject` with `Nats-Msg-Id: msg_id` and `headers`, and waits
/// for the PubAck (the context's timeout). Never retries.
pub async fn publish(
    js: &jetstream::Context,
    subject: &str,
    msg_id: &str,
    headers: &BTreeMap<String, String>,
    payload: Vec<u8>,
) -> PublishOutcome {
    let mut msg = jetstream::message::PublishMessage::build().payload(payload.into()).message_id(msg_id);
    for (k, v) in headers {
        msg = msg.header(k.as_str(), v.as_str());
    }
    let ack = match js.send_publish(subject.to_owned(), msg).await {
        Ok(ack) => ack,
        Err(e) => {
            let message = format!("not published: {e}");
            return match e.kind() {
                PublishErrorKind::MaxPayloadExceeded => PublishOutcome::Refused { class: "too_large", message },
                PublishErrorKind::MaxAckPending => PublishOutcome::NotSent { class: "busy", message },
                PublishErrorKind::TimedOut => PublishOutcome::NotSent { class: "connect", message },
                _ => PublishOutcome::Refused { class: "validation", message },
            };
        }
    };
    match ack.await {
        Ok(a) => PublishOutcome::Stored { stream: a.stream, sequence: a.sequence, duplicate: a.duplicate },
        Err(e) => match e.kind() {
            PublishErrorKind::StreamNotFound => PublishOutcome::Refused {
                class: "no_stream",
                message: format!("no JetStream stream takes subject {subject:?} (no responders)"),
            },
            PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                PublishOutcome::Unknown { message: format!("sent, but no PubAck: {e}; the message may be stored") }
            }
            _ => PublishOutcome::NotSent { class: "jetstream", message: format!("JetStream refused to store it: {e}") },
        },
    }
}

/// A JetStream context connected on first use (a server that is down when idem starts
/// is a retryable failure of the first publish, not a start-up error).
#[derive(Debug)]
pub struct LazyJetStream {
    url: String,
    timeout: Duration,
    context: OnceCell<jetstream::Context>,
}

impl LazyJetStream {
    /// A context for `url` whose publishes wait `timeout` for their PubAck.
    pub fn new(url: &str, timeout: Duration) -> Self {
        LazyJetStream { url: url.to_owned(), timeout, context: OnceCell::new() }
    }

    /// The connected context.
    ///
    /// # Errors
    /// [`PublishOutcome::NotSent`] (`connect`) when the server cannot be reached.
    pub async fn get(&self) -> Result<&jetstream::Context, PublishOutcome> {
        self.context
            .get_or_try_init(|| async {
                let client = async_nats::ConnectOptions::new()
                    .connection_timeout(self.timeout)
                    .connect(self.url.as_str())
                    .await
                    .map_err(|e| PublishOutcome::NotSent {
                        class: "connect",
                        message: format!("cannot connect to NATS: {e}"),
                    })?;
                let mut js = jetstream::new(client);
                js.set_timeout(self.timeout);
                Ok(js)
            })
            .await
    }

    /// [`publish`] through this context.
    pub async fn publish(
        &self,
        subject: &str,
        msg_id: &str,
        headers: &BTreeMap<String, String>,
        payload: Vec<u8>,
    ) -> PublishOutcome {
        match self.get().await {
            Ok(js) => publish(js, subject, msg_id, headers, payload).await,
            Err(not_sent) => not_sent,
        }
    }
}

/// A configured NATS JetStream connector (`kind = "nats"`).
#[derive(Debug)]
pub struct NatsConnector {
    js: LazyJetStream,
    subject: String,
    stream: String,
    lease_ms: i64,
    max_call_ms: i64,
    margin_ms: i64,
}

impl NatsConnector {
    /// Builds the connector (no connection yet).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (`connectors.NAME.subject`, …).
    pub fn new(name: &str, c: &NatsConfig) -> Result<Self, ConfigError> {
        let field = format!("connectors.{name}");
        let bad = |f: &str, m: &str| ConfigError { field: format!("{field}.{f}"), message: m.into() };
        let url = interpolate(&format!("{field}.url"), &c.url)?;
        if !(url.starts_with("nats://") || url.starts_with("tls://")) {
            return Err(bad("url", "must be a nats:// or tls:// URL"));
        }
        let subject = interpolate(&format!("{field}.subject"), &c.subject)?;
        let subject_ok = !subject.is_empty()
            && subject
                .split('.')
                .all(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic() && b != b'*' && b != b'>'));
        if !subject_ok {
            return Err(bad("subject", "must be a NATS subject: dot-separated tokens, no spaces or wildcards"));
        }
        if c.stream.is_empty() {
            return Err(bad(
                "stream",
                "name the JetStream stream that stores the subject (its duplicate window is read)",
            ));
        }
        if c.timeout_ms == 0 {
            return Err(bad("timeout_ms", "must be positive"));
        }
        let lease_ms = c.lease_ms.unwrap_or(c.timeout_ms as i64 + 10_000);
        if lease_ms <= c.timeout_ms as i64 {
            return Err(bad("lease_ms", "must exceed timeout_ms, or a lease could expire under a live publish"));
        }
        Ok(NatsConnector {
            js: LazyJetStream::new(&url, Duration::from_millis(c.timeout_ms)),
            subject,
            stream: c.stream.clone(),
            lease_ms,
            max_call_ms: c.timeout_ms as i64,
            margin_ms: c.duplicate_window_margin_ms,
        })
    }

    fn evidence(stream: &str, sequence: u64) -> String {
        format!("{stream}:{sequence}")
    }
}

#[async_trait]
impl Connector for NatsConnector {
    async fn execute(&self, op: &OperationCtx) -> Outcome {
        let payload = op.payload.to_string().into_bytes();
        match self.js.publish(&self.subject, &op.provider_key(), &BTreeMap::new(), payload).await {
            PublishOutcome::Stored { stream, sequence, duplicate } => Outcome::Succeeded {
                provider_ref: Self::evidence(&stream, sequence),
                result: Some(serde_json::json!({"stream": stream, "seq": sequence, "duplicate": duplicate})),
            },
            PublishOutcome::NotSent { class, message } => retryable(class, message, None),
            PublishOutcome::Refused { class, message } => final_failure(class, message),
            PublishOutcome::Unknown { message } => unknown(message),
        }
    }

    async fn lookup(&self, op: &OperationCtx) -> Lookup {
        let js = match self.js.get().await {
            Ok(js) => js,
            Err(e) => return Lookup::Inconclusive { why: format!("{e:?}") },
        };
        let window_ms = match js.get_stream(&self.stream).await {
            Ok(mut s) => match s.info().await {
                Ok(info) => info.config.duplicate_window.as_millis() as i64,
                Err(e) => return Lookup::Inconclusive { why: format!("cannot read stream {}: {e}", self.stream) },
            },
            Err(e) => return Lookup::Inconclusive { why: format!("cannot read stream {}: {e}", self.stream) },
        };
        // The first publish reached the server no earlier than the attempt's start, which
        // is at most a lease before the record last changed (when the attempt ended or its
        // lease expired). Re-publish only while the window surely still covers it.
        let earliest_first_publish = op.updated_at - self.lease_ms;
        if op.now_ms + self.margin_ms >= earliest_first_publish + window_ms {
            return Lookup::Inconclusive {
                why: format!(
                    "outside stream {}'s duplicate window ({window_ms} ms): a re-publish could store the message twice",
                    self.stream
                ),
            };
        }
        let payload = op.payload.to_string().into_bytes();
        match self.js.publish(&self.subject, &op.provider_key(), &BTreeMap::new(), payload).await {
            PublishOutcome::Stored { stream, sequence, .. } => {
                Lookup::Found { provider_ref: Self::evidence(&stream, sequence) }
            }
            other => Lookup::Inconclusive { why: format!("the re-publish proved nothing: {other:?}") },
        }
    }

    fn lease_ms(&self) -> i64 {
        self.lease_ms
    }

    fn max_call_ms(&self) -> i64 {
        self.max_call_ms
    }
}
