//! The NATS JetStream sink: publish with `Nats-Msg-Id` = the event id, subject = the
//! sink's prefix + the event's topic, and wait for the PubAck. It calls idem-connect's
//! [`publish`](idem_connect::nats::publish) — the NATS connector's own — so a publish is
//! read the same way everywhere. A duplicate ack (the stream had the id within its
//! duplicate window) counts as delivered: the message is in the stream once.

use super::{Envelope, Sink};
use crate::relay::config::NatsSinkConfig;
use async_trait::async_trait;
use idem_connect::config::ConfigError;
use idem_connect::nats::{LazyJetStream, PublishOutcome};
use idem_core::outbox::DeliveryResult;
use std::time::Duration;

/// A configured JetStream destination.
#[derive(Debug)]
pub struct NatsSink {
    js: LazyJetStream,
    prefix: String,
}

impl NatsSink {
    /// Builds the sink `name` (it connects on first use).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field.
    pub fn new(name: &str, c: &NatsSinkConfig) -> Result<Self, ConfigError> {
        let field = format!("outbox.sinks.{name}.url");
        let url = idem_connect::config::interpolate(&field, &c.url)?;
        if !(url.starts_with("nats://") || url.starts_with("tls://")) {
            return Err(ConfigError { field, message: "must be a nats:// or tls:// URL".into() });
        }
        Ok(NatsSink {
            js: LazyJetStream::new(&url, Duration::from_millis(c.timeout_ms)),
            prefix: c.subject_prefix.clone(),
        })
    }
}

#[async_trait]
impl Sink for NatsSink {
    async fn deliver(&self, e: &Envelope<'_>) -> DeliveryResult {
        let subject = format!("{}{}", self.prefix, e.topic);
        match self.js.publish(&subject, e.id, e.headers, e.payload.as_bytes().to_vec()).await {
            PublishOutcome::Stored { stream, sequence, duplicate } => DeliveryResult::Delivered {
                evidence: format!("{stream}:{sequence}{}", if duplicate { " (duplicate)" } else { "" }),
            },
            PublishOutcome::NotSent { class, message } => {
                DeliveryResult::Retryable { error_class: class.into(), message, retry_after_ms: None }
            }
            PublishOutcome::Refused { class, message } => {
                DeliveryResult::Rejected { error_class: class.into(), message }
            }
            PublishOutcome::Unknown { message } => DeliveryResult::Unknown { error_class: "no_ack".into(), message },
        }
    }
}
