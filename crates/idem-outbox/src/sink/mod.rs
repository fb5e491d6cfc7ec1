//! Sinks: where the relay delivers events. Each classifies its answer by what it proves
//! ([`DeliveryResult`]): delivered with evidence, retryable (nothing arrived, or the
//! receiver asked to try later), unknown (sent, no answer: retried, since receivers dedupe
//! by the event id), or rejected for good (dead at once).
//!
//! - [`webhook`]: HTTP POST signed per Standard Webhooks (`webhook-id` = the event id).
//! - [`nats`]: NATS JetStream with `Nats-Msg-Id` = the event id, the PubAck awaited; a
//!   duplicate ack counts as delivered.

pub mod nats;
pub mod webhook;

use async_trait::async_trait;
use idem_core::outbox::DeliveryResult;
use std::collections::BTreeMap;

/// One event as a sink sends it.
#[derive(Debug, Clone, Copy)]
pub struct Envelope<'a> {
    /// The event id: the receiver's dedupe key.
    pub id: &'a str,
    /// Topic.
    pub topic: &'a str,
    /// The payload's JSON text, sent as is.
    pub payload: &'a str,
    /// Headers appended with the event.
    pub headers: &'a BTreeMap<String, String>,
    /// Now, on the database's clock (epoch ms): the webhook timestamp.
    pub now_ms: i64,
}

/// Delivers events to one destination. Never retries itself: the relay's schedule does.
#[async_trait]
pub trait Sink: Send + Sync + std::fmt::Debug {
    /// Delivers one event once and classifies the answer.
    async fn deliver(&self, event: &Envelope<'_>) -> DeliveryResult;
}
