//! `[outbox]`: the relay's configuration, in the same TOML file as the connectors
//! (`idem relay --config idem.toml`, or `idem serve --config` with `in_serve = true`).
//!
//! ```toml
//! [outbox]
//! database_url = "${APP_DATABASE_URL}"   # the application's database (schema installed)
//! poll_interval_ms = 500                 # polling; on PostgreSQL LISTEN/NOTIFY wakes it on commit
//! lease_ms = 30000                       # per claimed event; longer than every sink's timeout
//! batch = 100                            # events claimed at once (at most one per aggregate)
//! in_serve = false                       # true: `idem serve` runs the relay too
//! tenant = "default"                     # whose operators see it on the admin page (/ui/outbox)
//! retention = "7d"                       # delivered and skipped events are deleted after this (or "forever")
//!
//! [outbox.sinks.orders_hooks]
//! kind = "webhook"
//! url = "https://receiver.example.com/hooks"
//! topics = ["orders.*"]                  # NATS-style: * one token, > the rest
//! secrets = [{ env = "HOOK_SECRET" }, { file = "/run/secrets/hook_old" }]   # whsec_…; two while rotating
//! timeout_ms = 10000
//! retry = { base_ms = 1000, cap_ms = 60000, max_attempts = 8, budget_per_s = 10, budget_burst = 20 }
//!
//! [outbox.sinks.bus]
//! kind = "nats"
//! url = "nats://127.0.0.1:4222"
//! topics = [">"]
//! subject_prefix = ""                    # subject = prefix + topic
//! timeout_ms = 5000                      # waiting for the PubAck
//! ```
//!
//! An event goes to the first sink, in name order, with a matching topic pattern; an
//! event no sink takes is dead at once (`no_sink`) and held for an operator. Errors name
//! the field (`outbox.sinks.orders_hooks.secrets[0]: …`).

use idem_connect::config::{
    ConfigError, RetryConfig, SecretRef, field_error, interpolate, parse_retention, tagged_table_error,
};
use serde::Deserialize;
use std::collections::BTreeMap;

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

/// `[outbox]`.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The application's database (`${VAR}` replaced).
    pub database_url: String,
    /// Polling interval (ms).
    pub poll_interval_ms: u64,
    /// Lease per claimed event (ms).
    pub lease_ms: i64,
    /// Events claimed at once.
    pub batch: i64,
    /// Whether `idem serve` runs the relay.
    pub in_serve: bool,
    /// The tenant whose operator and admin keys see this outbox on `idem serve`'s admin
    /// page: the outbox belongs to an application database, not to a tenant of the ledger.
    pub tenant: String,
    /// How long delivered and skipped events are kept after they were appended (ms);
    /// `None` = forever.
    pub retention_ms: Option<i64>,
    /// Sinks by name.
    pub sinks: BTreeMap<String, SinkConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRelay {
    database_url: String,
    #[serde(default = "default_poll")]
    poll_interval_ms: u64,
    #[serde(default = "default_lease")]
    lease_ms: i64,
    #[serde(default = "default_batch")]
    batch: i64,
    #[serde(default)]
    in_serve: bool,
    #[serde(default = "default_tenant")]
    tenant: String,
    #[serde(default = "default_retention")]
    retention: String,
    #[serde(default)]
    sinks: BTreeMap<String, toml::Value>,
}

fn default_poll() -> u64 {
    500
}
fn default_lease() -> i64 {
    30_000
}
fn default_batch() -> i64 {
    100
}
fn default_tenant() -> String {
    "default".into()
}
fn default_retention() -> String {
    "7d".into()
}

/// `[outbox.sinks.NAME]`: where events go.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum SinkConfig {
    /// An HTTP endpoint, messages signed as Standard Webhooks.
    Webhook(WebhookSinkConfig),
    /// NATS JetStream.
    Nats(NatsSinkConfig),
}

impl SinkConfig {
    /// Topic patterns the sink takes.
    pub fn topics(&self) -> &[String] {
        match self {
            SinkConfig::Webhook(w) => &w.topics,
            SinkConfig::Nats(n) => &n.topics,
        }
    }
    /// Retry policy and budget.
    pub fn retry(&self) -> &RetryConfig {
        match self {
            SinkConfig::Webhook(w) => &w.retry,
            SinkConfig::Nats(n) => &n.retry,
        }
    }
    /// The longest one delivery can take (ms).
    pub fn timeout_ms(&self) -> u64 {
        match self {
            SinkConfig::Webhook(w) => w.timeout_ms,
            SinkConfig::Nats(n) => n.timeout_ms,
        }
    }
}

/// `kind = "webhook"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSinkConfig {
    /// Endpoint (http or https; `${VAR}` replaced). Redirects are not followed.
    pub url: String,
    /// Topic patterns.
    pub topics: Vec<String>,
    /// Signing secrets (`whsec_…`), from env or file: one, or two during a rotation.
    pub secrets: Vec<SecretRef>,
    /// Whole request (ms); after it the delivery is unknown and retried.
    #[serde(default = "default_webhook_timeout")]
    pub timeout_ms: u64,
    /// Connect (ms); a connect failure is retryable.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// Retry policy and budget.
    #[serde(default)]
    pub retry: RetryConfig,
}

/// `kind = "nats"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// Server URL (`nats://host:4222`; `${VAR}` replaced).
    pub url: String,
    /// Topic patterns.
    pub topics: Vec<String>,
    /// Put before the topic to make the subject.
    #[serde(default)]
    pub subject_prefix: String,
    /// Waiting for the PubAck (ms); after it the delivery is unknown and retried (the
    /// stream dedupes by `Nats-Msg-Id` within its duplicate window).
    #[serde(default = "default_nats_timeout")]
    pub timeout_ms: u64,
    /// Retry policy and budget.
    #[serde(default)]
    pub retry: RetryConfig,
}

fn default_webhook_timeout() -> u64 {
    10_000
}
fn default_connect_timeout() -> u64 {
    2_000
}
fn default_nats_timeout() -> u64 {
    5_000
}

/// Whether `pattern` is a valid topic pattern: dot-separated tokens of `[A-Za-z0-9_:-]`,
/// `*` (one token) or a final `>` (one or more tokens).
fn pattern_ok(pattern: &str) -> bool {
    let tokens: Vec<&str> = pattern.split('.').collect();
    tokens.iter().enumerate().all(|(i, t)| {
        *t == "*"
            || (*t == ">" && i == tokens.len() - 1)
            || (!t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"_:-".contains(&b)))
    })
}

/// Whether `topic` matches `pattern` (NATS subject matching).
pub fn topic_matches(pattern: &str, topic: &str) -> bool {
    let mut p = pattern.split('.');
    let mut t = topic.split('.');
    loop {
        match (p.next(), t.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

impl RelayConfig {
    /// Reads `[outbox]` (as kept by idem-connect's `Config::outbox`) and checks it.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field: an unknown sink kind, a bad pattern, no topics,
    /// no secret, a lease not longer than a sink's timeout, …
    pub fn parse(value: &toml::Value) -> Result<RelayConfig, ConfigError> {
        let raw = RawRelay::deserialize(value.clone())
            .map_err(|e| err("outbox", e.to_string().trim_end().replace('\n', " ")))?;
        let database_url = interpolate("outbox.database_url", &raw.database_url)?;
        if raw.poll_interval_ms == 0 || raw.batch < 1 || raw.batch > 1000 {
            return Err(err("outbox", "poll_interval_ms must be positive and batch between 1 and 1000"));
        }
        let mut sinks = BTreeMap::new();
        for (name, v) in raw.sinks {
            let field = format!("outbox.sinks.{name}");
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b)) {
                return Err(err(&field, "sink names are [A-Za-z0-9_-]+"));
            }
            // A secret written inline is named by its place (serde's error, from inside the
            // sink's buffered table, could not say which one).
            if let Some((path, message)) = v.get("secrets").and_then(idem_connect::config::secret_list_error) {
                return Err(err(format!("{field}.secrets{path}"), message));
            }
            let sink = SinkConfig::deserialize(v.clone()).map_err(|e| {
                // The failing field's path, which serde's tagged-enum error has lost.
                let by_kind = tagged_table_error(&field, &v, &["webhook", "nats"], |kind, inner| match kind {
                    "webhook" => field_error::<WebhookSinkConfig>(inner),
                    _ => field_error::<NatsSinkConfig>(inner),
                });
                match by_kind {
                    Some((path, message)) => err(path, message),
                    None => err(&field, e.to_string().trim_end().replace('\n', " ")),
                }
            })?;
            if sink.topics().is_empty() {
                return Err(err(
                    format!("{field}.topics"),
                    "list at least one topic pattern, e.g. [\"orders.*\"] or [\">\"]",
                ));
            }
            if let Some(p) = sink.topics().iter().find(|p| !pattern_ok(p)) {
                return Err(err(
                    format!("{field}.topics"),
                    format!("{p:?} is not a topic pattern: dot-separated tokens of [A-Za-z0-9_:-], * or a final >"),
                ));
            }
            sink.retry().check(&field)?;
            if sink.timeout_ms() == 0 || raw.lease_ms <= sink.timeout_ms() as i64 {
                return Err(err(
                    "outbox.lease_ms",
                    format!(
                        "must exceed {field}.timeout_ms ({}), or a lease could expire under a live delivery",
                        sink.timeout_ms()
                    ),
                ));
            }
            if let SinkConfig::Webhook(w) = &sink
                && !(1..=2).contains(&w.secrets.len())
            {
                return Err(err(format!("{field}.secrets"), "give one secret, or two during a rotation"));
            }
            sinks.insert(name, sink);
        }
        if sinks.is_empty() {
            return Err(err(
                "outbox.sinks",
                "configure at least one sink ([outbox.sinks.NAME] with kind = \"webhook\" or \"nats\")",
            ));
        }
        Ok(RelayConfig {
            database_url,
            poll_interval_ms: raw.poll_interval_ms,
            lease_ms: raw.lease_ms,
            batch: raw.batch,
            in_serve: raw.in_serve,
            tenant: raw.tenant,
            retention_ms: parse_retention("outbox.retention", &raw.retention)?,
            sinks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RelayConfig, ConfigError> {
        let v: toml::Value = toml::from_str(text).unwrap();
        RelayConfig::parse(v.get("outbox").unwrap())
    }

    const OK: &str = "[outbox]\ndatabase_url = \"postgres://x/y\"\n[outbox.sinks.hooks]\nkind = \"webhook\"\n\
                      url = \"http://127.0.0.1:1/h\"\ntopics = [\"orders.*\"]\nsecrets = [{ env = \"S\" }]\n";

    #[test]
    fn a_good_config_and_errors_that_name_the_field() {
        assert_eq!(parse(OK).unwrap().sinks.len(), 1);
        let e = parse(&OK.replace("\"webhook\"", "\"kafka\"")).unwrap_err();
        assert_eq!(e.field, "outbox.sinks.hooks");
        assert!(e.message.contains("kafka"), "{e}");
        let e = parse(&OK.replace("[\"orders.*\"]", "[\"orders.>.x\"]")).unwrap_err();
        assert_eq!(e.field, "outbox.sinks.hooks.topics");
        let e = parse(&OK.replace("[{ env = \"S\" }]", "[]")).unwrap_err();
        assert_eq!(e.field, "outbox.sinks.hooks.secrets");
        let e = parse(&OK.replace("[{ env = \"S\" }]", "[{ env = \"S\" }, \"whsec_topsecret\"]")).unwrap_err();
        assert_eq!(e.field, "outbox.sinks.hooks.secrets[1]");
        assert!(e.message.contains("env =") && !e.to_string().contains("topsecret"), "{e}");
        // Not in a list, or of another shape: named, never repeated.
        for (secrets, path) in [
            ("\"whsec_topsecret\"", "outbox.sinks.hooks.secrets"),
            ("[{ env = \"S\" }, 12345678]", "outbox.sinks.hooks.secrets[1]"),
            ("[{ value = \"whsec_topsecret\" }]", "outbox.sinks.hooks.secrets[0]"),
        ] {
            let e = parse(&OK.replace("[{ env = \"S\" }]", secrets)).unwrap_err();
            assert_eq!(e.field, path, "{secrets}: {e}");
            assert!(!e.to_string().contains("topsecret") && !e.to_string().contains("12345678"), "{e}");
        }
        let e = parse(&OK.replace("[outbox]\n", "[outbox]\nlease_ms = 5000\n")).unwrap_err();
        assert_eq!(e.field, "outbox.lease_ms");
        let e = parse("[outbox]\ndatabase_url = \"x\"\n").unwrap_err();
        assert_eq!(e.field, "outbox.sinks");
        let e = parse(&OK.replace("[outbox]\n", "[outbox]\nbogus = 1\n")).unwrap_err();
        assert!(e.message.contains("bogus"), "{e}");
        // A wrong type or an unknown field inside a sink names the field, not only the sink.
        for (extra, path) in [
            ("timeout_ms = \"ten\"\n", "outbox.sinks.hooks.timeout_ms"),
            ("retry = { base_ms = \"x\" }\n", "outbox.sinks.hooks.retry.base_ms"),
            ("bogus = 1\n", "outbox.sinks.hooks.bogus"),
        ] {
            let e = parse(&format!("{OK}{extra}")).unwrap_err();
            assert_eq!(e.field, path, "{extra}: {e}");
        }
        let e = parse("[outbox]\ndatabase_url = \"x\"\n[outbox.sinks]\nhooks = 5\n").unwrap_err();
        assert_eq!(e.field, "outbox.sinks.hooks", "{e}");
        assert!(e.message.contains("must be a table"), "{e}");
    }

    #[test]
    fn topics_match_as_nats_subjects() {
        assert!(topic_matches("orders.*", "orders.created"));
        assert!(!topic_matches("orders.*", "orders.created.v2"));
        assert!(topic_matches("orders.>", "orders.created.v2"));
        assert!(!topic_matches("orders.>", "orders"));
        assert!(topic_matches(">", "anything.at.all"));
        assert!(topic_matches("export.created", "export.created"));
        assert!(!topic_matches("export.created", "export.deleted"));
    }
}
