//! The connector configuration file (`idem serve --config idem.toml`).
//!
//! ```toml
//! [executor]
//! poll_interval_ms = 100      # how often due retries (and due workflow instances) are looked for
//! concurrency = 32            # attempts in flight per node (and workflow passes)
//! workflow_hold_ms = 5000     # how long a workflow pass holds the instance it claimed
//! [reconciler]
//! interval_ms = 500           # how often due UNKNOWN operations are looked up
//! [retention]
//! default = "24h"             # final records are kept this long after completion
//! tombstone = "30d"           # then a tombstone answers late retries with 410
//!
//! [actions.create_order]      # optional: the connector an action runs on by default
//! connector = "orders"
//! retention = "forever"       # a permanent business key
//!
//! [connectors.orders]
//! kind = "http"
//! url = "https://orders.example.com/v1/orders"
//! headers = { Authorization = { env = "ORDERS_TOKEN", prefix = "Bearer " } }
//! provider_ref = { json_pointer = "/id" }     # or { header = "Location" }
//! lookup = { url = "https://orders.example.com/v1/orders?client_reference={idempotency_key}", found_pointer = "/0/id" }
//! provider_deduplicates = false  # true only if the provider answers a repeated Idempotency-Key with the first result
//! retry = { base_ms = 1000, cap_ms = 30000, max_attempts = 5, budget_per_s = 5, budget_burst = 10 }
//!
//! [connectors.events]
//! kind = "nats"
//! url = "nats://127.0.0.1:4222"
//! subject = "orders.created"
//! stream = "ORDERS"           # stores the subject; its duplicate window settles lost PubAcks
//! timeout_ms = 5000           # waiting for the PubAck; after it: UNKNOWN
//!
//! [connectors.mail]
//! kind = "smtp"
//! host = "smtp.example.com"
//! port = 587
//! tls = "starttls"
//! username = "idem"
//! password = { env = "SMTP_PASSWORD" }       # or { file = "/run/secrets/smtp" }
//! from = "noreply@example.com"
//! imap = { host = "imap.example.com", port = 993, tls = "tls", username = "idem", password = { env = "IMAP_PASSWORD" }, mailbox = "Sent" }
//! ```
//!
//! Environment overrides: every plain string may contain `${VAR}`, replaced by the
//! variable's value at start-up. Secrets (`password`, header values) are given as
//! `{ env = "VAR" }` or `{ file = "PATH" }` and are never logged, printed or returned by the
//! API ([`Secret`]'s `Debug` shows `***`). Every error names the field it is about.

use idem_core::RetryPolicy;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// A configuration problem, naming the field (`connectors.mail.password`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    /// Dotted path of the field.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

/// The whole file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The executor loop.
    #[serde(default)]
    pub executor: ExecutorConfig,
    /// The reconciler loop.
    #[serde(default)]
    pub reconciler: ReconcilerConfig,
    /// Retention of final records and tombstones.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Per-action defaults.
    #[serde(default)]
    pub actions: BTreeMap<String, ActionConfig>,
    /// Named connectors.
    #[serde(default)]
    pub connectors: BTreeMap<String, ConnectorConfig>,
    /// `[workflows.NAME]`: workflow definitions, kept as written here and read by idem-flow
    /// (`idem_flow::config`), which knows their shape; this crate only carries them.
    #[serde(default)]
    pub workflows: BTreeMap<String, toml::Value>,
    /// `[outbox]`: the relay of an application database's outbox, kept as written here and
    /// read by idem-outbox (`idem_outbox::relay::config`), which knows its shape.
    pub outbox: Option<toml::Value>,
}

/// `[executor]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutorConfig {
    /// How often due retries are looked for (ms).
    pub poll_interval_ms: u64,
    /// Attempts in flight at once on this node (and workflow passes in flight).
    pub concurrency: usize,
    /// How long a workflow pass holds the instance it claimed (ms): another node takes an
    /// instance whose node died mid-pass once this hold ends. A pass that runs longer may
    /// meet a second pass on the same instance, which is harmless (every step is one
    /// atomic claim), only wasted work.
    pub workflow_hold_ms: u64,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig { poll_interval_ms: 100, concurrency: 32, workflow_hold_ms: 5_000 }
    }
}

/// `[reconciler]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReconcilerConfig {
    /// How often due UNKNOWN operations are looked up (ms).
    pub interval_ms: u64,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        ReconcilerConfig { interval_ms: 500 }
    }
}

/// `[retention]` (DESIGN.md §6; see `idem_core::retention`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// How long a final record is kept after completion: a duration (`24h`, `90m`, `1s`)
    /// or `forever`.
    pub default: String,
    /// How long its tombstone is kept after completion (at least the retention).
    pub tombstone: String,
    /// How often the sweeper runs (ms).
    pub sweep_interval_ms: u64,
    /// Records removed per sweep transaction, at most.
    pub sweep_batch: i64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig { default: "24h".into(), tombstone: "30d".into(), sweep_interval_ms: 1_000, sweep_batch: 500 }
    }
}

/// Parses a retention: `forever` ⇒ `None`, else a duration like `24h`, `30d`, `1s`, `500ms`.
///
/// # Errors
/// A [`ConfigError`] on `field`.
pub fn parse_retention(field: &str, text: &str) -> Result<Option<i64>, ConfigError> {
    if text.trim() == "forever" {
        return Ok(None);
    }
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| err(field, format!("{text:?} is not a duration like 24h, 30d, 1s or forever: {e}")))?;
    let ms = i64::try_from(d.as_millis()).map_err(|_| err(field, "too long"))?;
    if ms < 1 {
        return Err(err(field, "must be at least 1 ms"));
    }
    Ok(Some(ms))
}

/// `[actions.NAME]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionConfig {
    /// Connector that performs this action when a trigger names none.
    pub connector: Option<String>,
    /// Retention of this action's final records (`forever` for permanent business keys).
    pub retention: Option<String>,
}

/// `[connectors.NAME]`: one connector, by kind.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ConnectorConfig {
    /// An HTTP API or webhook.
    Http(HttpConfig),
    /// An SMTP server, with an IMAP mailbox for lookups.
    Smtp(SmtpConfig),
    /// A NATS JetStream stream (publish with `Nats-Msg-Id` = `tenant:key`).
    Nats(NatsConfig),
}

impl ConnectorConfig {
    /// The retry settings.
    pub fn retry(&self) -> &RetryConfig {
        match self {
            ConnectorConfig::Http(h) => &h.retry,
            ConnectorConfig::Smtp(s) => &s.retry,
            ConnectorConfig::Nats(n) => &n.retry,
        }
    }

    /// The tenants that may use it.
    pub fn tenants(&self) -> &crate::tenants::TenantScope {
        match self {
            ConnectorConfig::Http(h) => &h.tenants,
            ConnectorConfig::Smtp(s) => &s.tenants,
            ConnectorConfig::Nats(n) => &n.tenants,
        }
    }
}

/// Retry policy and retry budget of a connector (DESIGN.md §4).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Backoff base (ms).
    pub base_ms: i64,
    /// Backoff cap (ms).
    pub cap_ms: i64,
    /// Attempts before a retryable failure becomes FAILED.
    pub max_attempts: i64,
    /// No attempt is scheduled later than this after the operation was created (ms).
    pub max_elapsed_ms: Option<i64>,
    /// Retry budget: retries allowed per second, on average (token bucket refill).
    pub budget_per_s: f64,
    /// Retry budget: retries allowed in a burst (token bucket size).
    pub budget_burst: f64,
    /// Inconclusive lookups before an UNKNOWN operation is flagged for review.
    pub max_lookups: i64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            base_ms: 1_000,
            cap_ms: 60_000,
            max_attempts: 8,
            max_elapsed_ms: None,
            budget_per_s: 10.0,
            budget_burst: 20.0,
            max_lookups: 5,
        }
    }
}

impl RetryConfig {
    /// The durable schedule (idem-core's policy).
    pub fn policy(&self) -> RetryPolicy {
        RetryPolicy {
            base_ms: self.base_ms,
            cap_ms: self.cap_ms,
            max_attempts: self.max_attempts,
            max_elapsed_ms: self.max_elapsed_ms,
        }
    }

    /// Checks the settings; errors name `{field}.retry`.
    ///
    /// # Errors
    /// A [`ConfigError`] for a non-positive or inconsistent setting.
    pub fn check(&self, field: &str) -> Result<(), ConfigError> {
        if self.max_elapsed_ms.is_some_and(|m| m < 1) {
            return Err(err(format!("{field}.retry.max_elapsed_ms"), "must be positive"));
        }
        if !self.budget_per_s.is_finite() || !self.budget_burst.is_finite() {
            return Err(err(format!("{field}.retry"), "budget_per_s and budget_burst must be finite"));
        }
        if self.base_ms < 1 || self.cap_ms < self.base_ms {
            return Err(err(format!("{field}.retry"), "need 1 <= base_ms <= cap_ms"));
        }
        if self.max_attempts < 1 || self.max_lookups < 1 {
            return Err(err(format!("{field}.retry"), "max_attempts and max_lookups must be at least 1"));
        }
        if !(self.budget_per_s > 0.0 && self.budget_burst >= 1.0) {
            return Err(err(format!("{field}.retry"), "need budget_per_s > 0 and budget_burst >= 1"));
        }
        Ok(())
    }
}

/// A secret: from an environment variable or a file, never from the config text itself.
/// A secret written inline (`secret = "whsec_…"`) is refused without repeating it: the
/// error names the field and the two accepted forms, so the value does not reach a
/// terminal or a log.
#[derive(Clone)]
pub struct SecretRef {
    /// Environment variable holding the secret.
    pub env: Option<String>,
    /// File holding the secret (trailing newline trimmed).
    pub file: Option<String>,
    /// Text put before the secret (e.g. `"Bearer "`); empty by default.
    pub prefix: String,
}

/// The error for a secret written inline, which it does not repeat.
pub const INLINE_SECRET: &str = "a secret is never written in the config (its value is not repeated here): \
     give { env = \"VARIABLE\" } or { file = \"/path/to/file\" }";

/// What is wrong with `value` as a [`SecretRef`], if anything: written inline (a string),
/// or not `{ env | file [, prefix] }`. Never quotes the value.
fn secret_shape_error(value: &toml::Value) -> Option<&'static str> {
    match value {
        toml::Value::String(_) => Some(INLINE_SECRET),
        toml::Value::Table(t)
            if t.keys().all(|k| ["env", "file", "prefix"].contains(&k.as_str()))
                && t.values().all(toml::Value::is_str) =>
        {
            None
        }
        _ => Some(SECRET_SHAPE),
    }
}

/// The error for a secret of another shape, which it does not repeat.
pub const SECRET_SHAPE: &str =
    "expected { env = \"VARIABLE\" } or { file = \"/path/to/file\" }, with an optional prefix = \"…\"";

/// What is wrong with `value` as a list of secrets (`secrets = [{ env = … }, …]`), as
/// (`""` or `"[i]"`, message) for an error that names the place; never quotes a value.
#[must_use]
pub fn secret_list_error(value: &toml::Value) -> Option<(String, &'static str)> {
    match value {
        toml::Value::Array(items) => {
            items.iter().enumerate().find_map(|(i, v)| secret_shape_error(v).map(|m| (format!("[{i}]"), m)))
        }
        toml::Value::String(_) => Some((String::new(), INLINE_SECRET)),
        _ => Some((String::new(), "expected a list: [{ env = \"VARIABLE\" }] (two during a rotation)")),
    }
}

/// The first secret among `connectors` written inline or in the wrong shape
/// (`connectors.NAME.password`, `connectors.NAME.imap.password`), as (path, message), for
/// an error that names the field: serde buffers a connector's table (an internally tagged
/// enum), so its own error has only the table's position.
fn secret_field_error(config: &toml::Table) -> Option<(String, &'static str)> {
    let connectors = config.get("connectors")?.as_table()?;
    for (name, connector) in connectors {
        let Some(connector) = connector.as_table() else { continue };
        if let Some(m) = connector.get("password").and_then(secret_shape_error) {
            return Some((format!("connectors.{name}.password"), m));
        }
        let imap = connector.get("imap").and_then(toml::Value::as_table);
        if let Some(m) = imap.and_then(|i| i.get("password")).and_then(secret_shape_error) {
            return Some((format!("connectors.{name}.imap.password"), m));
        }
    }
    None
}

impl<'de> Deserialize<'de> for SecretRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Fields {
            env: Option<String>,
            file: Option<String>,
            #[serde(default)]
            prefix: String,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Given {
            Ref(Fields),
            Inline(#[allow(dead_code)] String),
            Other(serde::de::IgnoredAny),
        }
        use serde::de::Error as _;
        match Given::deserialize(d)? {
            Given::Ref(Fields { env, file, prefix }) => Ok(SecretRef { env, file, prefix }),
            Given::Inline(_) => Err(D::Error::custom(INLINE_SECRET)),
            Given::Other(_) => Err(D::Error::custom(SECRET_SHAPE)),
        }
    }
}

impl fmt::Debug for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretRef(env={:?}, file={:?})", self.env, self.file)
    }
}

/// A resolved secret. `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The secret itself, for the wire.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl SecretRef {
    /// Reads the secret now.
    ///
    /// # Errors
    /// A [`ConfigError`] on `field` when the variable is unset or the file unreadable.
    pub fn resolve(&self, field: &str) -> Result<Secret, ConfigError> {
        let value = match (&self.env, &self.file) {
            (Some(var), None) => {
                std::env::var(var).map_err(|_| err(field, format!("the environment variable {var} is not set")))?
            }
            (None, Some(path)) => std::fs::read_to_string(path)
                .map_err(|e| err(field, format!("cannot read the secret file {path}: {e}")))?
                .trim_end_matches(['\n', '\r'])
                .to_owned(),
            _ => {
                return Err(err(field, "give exactly one of env = \"VAR\" or file = \"PATH\""));
            }
        };
        if value.is_empty() {
            return Err(err(field, "the secret is empty"));
        }
        Ok(Secret(format!("{}{value}", self.prefix)))
    }
}

/// A header value: plain text (with `${VAR}` interpolation) or a secret.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum HeaderValueConfig {
    /// Plain text.
    Plain(String),
    /// A secret.
    Secret(SecretRef),
}

/// Where the provider's reference is in a 2xx answer.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderRefConfig {
    /// JSON pointer into the response body (`/id`).
    pub json_pointer: Option<String>,
    /// Response header (`Location`).
    pub header: Option<String>,
}

/// How to ask the provider whether an operation happened.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpLookupConfig {
    /// URL template: `{key}`, `{tenant}`, `{idempotency_key}` are replaced (percent-encoded).
    pub url: String,
    /// JSON pointer to the provider's reference in a 200 answer; absent ⇒ Absent.
    pub found_pointer: String,
    /// 4xx statuses that prove absence (default none: e.g. `[404]` for a
    /// `GET /orders/{key}` lookup). An empty JSON array or `null` answer always does.
    #[serde(default)]
    pub absent_statuses: Vec<u16>,
    /// "Not found" proves absence only this long after the attempt ended (ms, default
    /// 30 000): a provider may still be processing a request whose reply timed out.
    #[serde(default = "default_absent_after")]
    pub absent_after_ms: i64,
}

fn default_absent_after() -> i64 {
    30_000
}

/// `kind = "http"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// URL template the payload is sent to (`{key}`, `{tenant}`, `{idempotency_key}`).
    pub url: String,
    /// HTTP method (default POST).
    #[serde(default = "default_method")]
    pub method: String,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, HeaderValueConfig>,
    /// Whole-request timeout (ms); after it the outcome is UNKNOWN.
    #[serde(default = "default_http_timeout")]
    pub timeout_ms: u64,
    /// Connect timeout (ms); a connect failure is retryable (nothing was sent).
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// Where the provider's reference is.
    pub provider_ref: Option<ProviderRefConfig>,
    /// How to look an operation up.
    pub lookup: Option<HttpLookupConfig>,
    /// The provider deduplicates by the `Idempotency-Key` idem sends (`tenant:key`): it
    /// answers a repeated key with the first request's result instead of acting again (as
    /// Stripe does; IETF httpapi Idempotency-Key draft). Then an answer that leaves open
    /// whether it acted — HTTP 500, 502, 504 and other 5xx, a timeout or a reset after the
    /// request was sent — is retried, and its 409 ("the first request is still in
    /// progress", draft §2.7) too. Default false: such answers make the outcome UNKNOWN,
    /// settled by the lookup or an operator (DESIGN.md §4). Setting it for a provider that
    /// does not deduplicate can cause duplicate side effects.
    #[serde(default, deserialize_with = "provider_deduplicates")]
    pub provider_deduplicates: bool,
    /// Retry policy and budget.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Lease per attempt (ms); default timeout + 10 s.
    pub lease_ms: Option<i64>,
    /// Tenants whose triggers may use it (`["default", "acme"]`, `["*"]` for all);
    /// default `["default"]` ([`crate::tenants`]).
    #[serde(default)]
    pub tenants: crate::tenants::TenantScope,
}

/// `provider_deduplicates`, with an error that names the field: inside `[connectors.NAME]`
/// (a tagged enum) the TOML error alone would not.
fn provider_deduplicates<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    <bool as Deserialize>::deserialize(d).map_err(|e| {
        serde::de::Error::custom(format!(
            "provider_deduplicates must be true or false ({e}): true only when the provider answers a repeated \
             Idempotency-Key with the first request's result"
        ))
    })
}

fn default_method() -> String {
    "POST".into()
}
fn default_http_timeout() -> u64 {
    10_000
}
fn default_connect_timeout() -> u64 {
    2_000
}

/// `kind = "nats"`: publish the payload to a JetStream stream (see `crate::nats`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URL, `nats://host:4222` (`${VAR}` replaced).
    pub url: String,
    /// Subject the payload is published to (`${VAR}` replaced; no wildcards).
    pub subject: String,
    /// The stream that stores `subject`: its duplicate window bounds when a lost PubAck
    /// may be settled by publishing again.
    pub stream: String,
    /// How long to wait for the PubAck (ms, default 5 000); after it: UNKNOWN.
    #[serde(default = "default_nats_timeout")]
    pub timeout_ms: u64,
    /// Lease per attempt (ms); default timeout + 10 s.
    pub lease_ms: Option<i64>,
    /// Safety margin before the end of the duplicate window (ms, default 1 000): a lookup
    /// re-publishes only if the window still covers the first publish by this much.
    #[serde(default = "default_window_margin")]
    pub duplicate_window_margin_ms: i64,
    /// Retry policy and budget.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Tenants whose triggers may use it (`["default", "acme"]`, `["*"]` for all);
    /// default `["default"]` ([`crate::tenants`]).
    #[serde(default)]
    pub tenants: crate::tenants::TenantScope,
}

fn default_nats_timeout() -> u64 {
    5_000
}
fn default_window_margin() -> i64 {
    1_000
}

/// TLS mode of a mail connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// Plain TCP (loopback and tests only).
    None,
    /// Plain, upgraded with STARTTLS (SMTP only).
    Starttls,
    /// TLS from the first byte.
    Tls,
}

/// `kind = "smtp"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SmtpConfig {
    /// SMTP server host.
    pub host: String,
    /// SMTP server port.
    pub port: u16,
    /// TLS mode.
    #[serde(default = "default_tls")]
    pub tls: TlsMode,
    /// SMTP AUTH user.
    pub username: Option<String>,
    /// SMTP AUTH password.
    pub password: Option<SecretRef>,
    /// Default `From:` address (a payload's `from` overrides it).
    pub from: String,
    /// Domain of the deterministic `Message-ID`s (default: the host of `from`).
    pub message_id_domain: Option<String>,
    /// Timeout of each SMTP step (ms).
    #[serde(default = "default_http_timeout")]
    pub timeout_ms: u64,
    /// Where sent messages can be found again.
    pub imap: Option<ImapConfig>,
    /// Retry policy and budget.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Lease per attempt (ms); default 4 × timeout + 10 s.
    pub lease_ms: Option<i64>,
    /// Tenants whose triggers may use it (`["default", "acme"]`, `["*"]` for all);
    /// default `["default"]` ([`crate::tenants`]).
    #[serde(default)]
    pub tenants: crate::tenants::TenantScope,
}

fn default_tls() -> TlsMode {
    TlsMode::Starttls
}

/// `imap = {…}` of an SMTP connector: the mailbox that receives (a copy of) every message.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImapConfig {
    /// IMAP server host.
    pub host: String,
    /// IMAP server port.
    pub port: u16,
    /// `none` or `tls`.
    #[serde(default = "default_imap_tls")]
    pub tls: TlsMode,
    /// Login.
    pub username: String,
    /// Password.
    pub password: SecretRef,
    /// Mailbox to search (default INBOX).
    #[serde(default = "default_mailbox")]
    pub mailbox: String,
    /// A message not found this soon after the attempt is "not yet delivered"
    /// (inconclusive), not "absent" (ms, default 60 000).
    #[serde(default = "default_grace")]
    pub delivery_grace_ms: i64,
}

fn default_imap_tls() -> TlsMode {
    TlsMode::Tls
}
fn default_mailbox() -> String {
    "INBOX".into()
}
fn default_grace() -> i64 {
    60_000
}

/// Replaces `${VAR}` with the environment variable's value.
///
/// # Errors
/// A [`ConfigError`] on `field` for an unset variable or an unclosed `${`.
pub fn interpolate(field: &str, text: &str) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| err(field, "unclosed ${ in the value"))?;
        let var = &after[..end];
        let value = std::env::var(var).map_err(|_| err(field, format!("the environment variable {var} is not set")))?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Placeholders a URL template may use.
pub const TEMPLATE_VARS: [&str; 3] = ["key", "tenant", "idempotency_key"];

/// Checks a URL template: balanced braces, known placeholders, an http(s) URL.
///
/// # Errors
/// A [`ConfigError`] on `field` naming the problem.
pub fn check_template(field: &str, template: &str) -> Result<(), ConfigError> {
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let close = after.find('}').ok_or_else(|| err(field, "a { in the template is not closed"))?;
        let name = &after[..close];
        if !TEMPLATE_VARS.contains(&name) {
            return Err(err(
                field,
                format!("unknown placeholder {{{name}}} (expected one of {{key}}, {{tenant}}, {{idempotency_key}})"),
            ));
        }
        rest = &after[close + 1..];
    }
    if rest.contains('}') {
        return Err(err(field, "a } in the template has no {"));
    }
    let probe = template.replace("{key}", "k").replace("{tenant}", "t").replace("{idempotency_key}", "i");
    let url = reqwest::Url::parse(&probe).map_err(|e| err(field, format!("not a valid URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(err(field, "must be an http:// or https:// URL"));
    }
    Ok(())
}

impl Config {
    /// The retention policy of this configuration.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field with a bad duration.
    pub fn retention(&self) -> Result<idem_core::Retention, ConfigError> {
        let default_ms = parse_retention("retention.default", &self.retention.default)?;
        let tombstone_ms = parse_retention("retention.tombstone", &self.retention.tombstone)?
            .ok_or_else(|| err("retention.tombstone", "a tombstone window cannot be forever"))?;
        let mut per_action = BTreeMap::new();
        for (name, a) in &self.actions {
            if let Some(r) = &a.retention {
                per_action.insert(name.clone(), parse_retention(&format!("actions.{name}.retention"), r)?);
            }
        }
        // The tombstone window is what answers late retries: it must outlast every
        // record's retention, or a record would vanish with no 410 window after it.
        let longest = per_action.values().chain(std::iter::once(&default_ms)).filter_map(|r| *r).max().unwrap_or(0);
        if tombstone_ms <= longest {
            return Err(err(
                "retention.tombstone",
                format!(
                    "must be longer than every retention ({longest} ms), or late retries would find nothing and run again"
                ),
            ));
        }
        Ok(idem_core::Retention { default_ms, per_action, tombstone_ms })
    }

    /// Reads and checks `path` (see the module docs).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (or `config` for unreadable or malformed TOML).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| err("config", format!("cannot read {}: {e}", path.display())))?;
        Config::parse(&text)
    }

    /// Parses and checks TOML text.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let table = toml::from_str::<toml::Table>(text).ok();
            match table
                .as_ref()
                .and_then(|t| secret_field_error(t).map(|(p, m)| (p, m.to_owned())).or_else(|| connector_error(t)))
            {
                Some((path, message)) => err(path, message),
                None => err("config", toml_error(text, &e)),
            }
        })?;
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<(), ConfigError> {
        for (name, action) in &self.actions {
            if let Some(c) = &action.connector
                && !self.connectors.contains_key(c)
            {
                return Err(err(format!("actions.{name}.connector"), format!("unknown connector {c:?}")));
            }
        }
        for (name, c) in &self.connectors {
            let field = format!("connectors.{name}");
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b)) {
                return Err(err(&field, "connector names are [A-Za-z0-9_-]+"));
            }
            c.retry().check(&field)?;
            c.tenants().check(&format!("{field}.tenants"))?;
        }
        self.retention()?;
        if self.retention.sweep_interval_ms == 0 || self.retention.sweep_batch < 1 {
            return Err(err("retention", "sweep_interval_ms and sweep_batch must be positive"));
        }
        if self.executor.concurrency == 0 || self.executor.poll_interval_ms == 0 || self.reconciler.interval_ms == 0 {
            return Err(err("executor", "concurrency and intervals must be positive"));
        }
        Ok(())
    }
}

/// The first `[connectors.NAME]` table that does not read as a connector, as
/// `(path of the field, what is wrong)`. serde reads an internally tagged enum (`kind`)
/// from a buffered copy of the table, so the whole file's error has lost the table's path
/// and position ("line 1: missing field `port`"); reading each table alone, as the struct
/// its `kind` names, gives the field's path (`connectors.orders.timeout_ms`,
/// `connectors.orders.lookup` for a field missing inside `lookup`).
fn connector_error(config: &toml::Table) -> Option<(String, String)> {
    let connectors = config.get("connectors")?.as_table()?;
    connectors.iter().find_map(|(name, value)| {
        let at = format!("connectors.{}", toml_key(name));
        let by_kind = tagged_table_error(&at, value, &["http", "smtp", "nats"], |kind, inner| match kind {
            "http" => field_error::<HttpConfig>(inner),
            "smtp" => field_error::<SmtpConfig>(inner),
            _ => field_error::<NatsConfig>(inner),
        });
        by_kind.or_else(|| {
            let e = ConnectorConfig::deserialize(value.clone()).err()?;
            Some((at, e.message().trim_end().replace('\n', " ")))
        })
    })
}

/// What is wrong in the table at `at` (its TOML path) whose `kind`, one of `kinds`, names
/// the struct it reads as: `(path of the failing field, message)`. serde reads an
/// internally tagged enum from a buffered copy of the table, which loses that path;
/// `read` reads the table without `kind` as the struct of `kind` (with [`field_error`]).
/// A value that is not a table is named as such. `None` when it reads, and for a missing
/// or unknown kind (the enum's own error says that).
pub fn tagged_table_error(
    at: &str,
    value: &toml::Value,
    kinds: &[&str],
    read: impl FnOnce(&str, toml::Value) -> Option<(String, String)>,
) -> Option<(String, String)> {
    let Some(table) = value.as_table() else {
        let quoted: Vec<String> = kinds.iter().map(|k| format!("{k:?}")).collect();
        let listed = match quoted.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => quoted.concat(),
        };
        return Some((at.to_owned(), format!("must be a table with kind = {listed} and its settings")));
    };
    let mut fields = table.clone();
    let kind = fields.remove("kind")?;
    let kind = kind.as_str().filter(|k| kinds.contains(k))?;
    let (path, message) = read(kind, toml::Value::Table(fields))?;
    Some((if path == "." { at.to_owned() } else { format!("{at}.{path}") }, message))
}

/// Where and why `value` does not read as a `T`: `(path inside it, message)`, the path
/// as `serde_path_to_error` writes it (`timeout_ms`, `retry.base_ms`, `.` for `value`
/// itself). `None` when it reads. For tables whose `kind` picks a struct: serde reads an
/// internally tagged enum from a buffered copy, which loses the failing field's path.
pub fn field_error<T: serde::de::DeserializeOwned>(value: toml::Value) -> Option<(String, String)> {
    let e = serde_path_to_error::deserialize::<_, T>(value).err()?;
    Some((e.path().to_string(), e.inner().message().trim_end().replace('\n', " ")))
}

/// `name` as a TOML key: bare when it can be, else quoted (`"we ird.name"`).
fn toml_key(name: &str) -> String {
    if !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b)) {
        name.to_owned()
    } else {
        toml::Value::String(name.to_owned()).to_string()
    }
}

/// `e` as `line N: what is wrong`, without the source line the TOML error would quote
/// (it may hold a secret written where a reference was expected).
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim_end().replace('\n', " ");
    match e.span() {
        Some(span) => format!("line {}: {message}", text[..span.start.min(text.len())].matches('\n').count() + 1),
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_field() {
        let e = Config::parse("[connectors.x]\nkind = \"ftp\"\n").unwrap_err();
        assert_eq!(e.field, "connectors.x");
        assert!(e.message.contains("ftp"), "{e}");
        let e = Config::parse("[actions.send]\nconnector = \"mial\"\n").unwrap_err();
        assert_eq!(e.field, "actions.send.connector");
        let e = Config::parse("[connectors.h]\nkind = \"http\"\nurl = \"http://x/\"\nbogus = 1\n").unwrap_err();
        assert!(e.message.contains("bogus"), "{e}");
        assert_eq!(
            check_template("connectors.h.lookup.url", "http://x/o?ref={keyy}").unwrap_err().field,
            "connectors.h.lookup.url"
        );
        assert!(check_template("f", "http://x/o/{key}?t={tenant}&i={idempotency_key}").is_ok());
        assert!(check_template("f", "ftp://x/{key}").is_err());
        assert!(check_template("f", "http://x/{key").is_err());
    }

    #[test]
    fn provider_deduplicates_is_a_flag_and_its_errors_name_it() {
        let http = |extra: &str| format!("[connectors.orders]\nkind = \"http\"\nurl = \"http://x/\"\n{extra}");
        let c = Config::parse(&http("")).unwrap();
        let ConnectorConfig::Http(h) = &c.connectors["orders"] else { panic!() };
        assert!(!h.provider_deduplicates, "off unless declared");
        let c = Config::parse(&http("provider_deduplicates = true\n")).unwrap();
        let ConnectorConfig::Http(h) = &c.connectors["orders"] else { panic!() };
        assert!(h.provider_deduplicates);
        let e = Config::parse(&http("provider_deduplicates = \"yes\"\n")).unwrap_err();
        assert!(e.message.contains("provider_deduplicates must be true or false"), "{e}");
        let e = Config::parse(&http("provider_dedupe = true\n")).unwrap_err();
        assert!(e.message.contains("provider_deduplicates"), "the known fields are listed: {e}");
    }

    #[test]
    fn a_bad_connector_table_is_named_by_its_path() {
        // A missing required field used to read "config: line 1: missing field `port`".
        let smtp = "[connectors.ok]\nkind = \"http\"\nurl = \"http://x/\"\n\n\
                    [connectors.mail]\nkind = \"smtp\"\nhost = \"127.0.0.1\"\nfrom = \"a@example.com\"\n";
        let e = Config::parse(smtp).unwrap_err();
        assert_eq!(e.field, "connectors.mail", "{e}");
        assert!(e.message.contains("missing field `port`"), "{e}");
        for (table, field, says) in [
            ("kind = \"http\"\n", "connectors.c", "missing field `url`"),
            ("url = \"http://x/\"\n", "connectors.c", "kind"),
            ("kind = \"nats\"\n", "connectors.c", "missing field"),
            ("kind = \"http\"\nurl = 5\n", "connectors.c.url", "invalid type"),
            ("kind = \"http\"\nurl = \"http://x/\"\ntimeout_ms = \"ten\"\n", "connectors.c.timeout_ms", "invalid type"),
            ("kind = \"smtp\"\nhost = \"h\"\nport = \"25\"\nfrom = \"a@b.c\"\n", "connectors.c.port", "invalid type"),
            (
                "kind = \"http\"\nurl = \"http://x/\"\n[connectors.c.lookup]\nurl = \"http://x/{key}\"\n",
                "connectors.c.lookup",
                "missing field",
            ),
            ("kind = \"http\"\nurl = \"http://x/\"\nbogus = 1\n", "connectors.c.bogus", "unknown field"),
            (
                "kind = \"http\"\nurl = \"http://x/\"\nretry = { max_attempts = \"x\" }\n",
                "connectors.c.retry.max_attempts",
                "invalid type",
            ),
        ] {
            let e = Config::parse(&format!("[connectors.c]\n{table}")).unwrap_err();
            assert_eq!(e.field, field, "{table}: {e}");
            assert!(e.message.contains(says), "{table}: {e}");
        }
        // Not a table; a name that is not a bare key.
        let e = Config::parse("[connectors]\norders = \"http://x\"\n").unwrap_err();
        assert_eq!(e.field, "connectors.orders", "{e}");
        assert!(e.message.contains("must be a table") && !e.message.contains("ConnectorConfig"), "{e}");
        let e = Config::parse("[connectors.\"we ird.name\"]\nkind = \"http\"\n").unwrap_err();
        assert_eq!(e.field, "connectors.\"we ird.name\"", "{e}");
        // A mistake outside the connectors keeps its line.
        let e =
            Config::parse("[connectors.ok]\nkind = \"http\"\nurl = \"http://x/\"\n[executor]\nconcurrency = \"x\"\n")
                .unwrap_err();
        assert_eq!(e.field, "config", "{e}");
        assert!(e.message.starts_with("line 5:"), "{e}");
    }

    #[test]
    fn a_secret_written_inline_is_refused_without_repeating_it() {
        #[derive(Deserialize)]
        struct W {
            #[allow(dead_code)]
            s: SecretRef,
        }
        let e = toml::from_str::<W>("s = \"whsec_topsecret123\"").err().unwrap();
        assert!(e.message().contains("env =") && e.message().contains("file ="), "{e}");
        assert!(!e.message().contains("topsecret123"), "{e}");
        let e = toml::from_str::<W>("s = { envv = \"X\" }").err().unwrap();
        assert!(e.message().contains("expected { env ="), "{e}");
        // Through the config's own errors, which do not quote the source line either.
        let text = "[connectors.mail]\nkind = \"smtp\"\nhost = \"smtp.example.com\"\nport = 587\n\
                    tls = \"starttls\"\nusername = \"idem\"\npassword = \"hunter2-topsecret\"\nfrom = \"a@example.com\"\n";
        let e = Config::parse(text).unwrap_err().to_string();
        assert!(!e.contains("hunter2") && e.contains("env ="), "{e}");
        assert!(e.starts_with("connectors.mail.password: ") && !e.ends_with(' '), "the field is named: {e:?}");
        // The IMAP mailbox's password too, inline or as a table further down the file.
        let base =
            "[actions.a]\n\n[connectors.mail]\nkind = \"smtp\"\nhost = \"h\"\nport = 25\nfrom = \"a@example.com\"\n";
        // Other shapes: named, never repeated.
        for password in [
            "987654321",
            "[\"topsecret\"]",
            "true",
            "{ value = \"topsecret\" }",
            "{ env = \"X\", secret = \"topsecret\" }",
        ] {
            let e = Config::parse(&format!("{base}password = {password}\n")).unwrap_err().to_string();
            assert!(e.starts_with("connectors.mail.password: expected { env"), "{password}: {e}");
            assert!(!e.contains("topsecret") && !e.contains("987654321"), "{e}");
        }
        for imap in [
            "imap = { host = \"h\", port = 143, username = \"u\", password = \"imap-topsecret\" }\n",
            "\n[connectors.mail.imap]\nhost = \"h\"\nport = 143\nusername = \"u\"\npassword = \"imap-topsecret\"\n",
        ] {
            let e = Config::parse(&format!("{base}{imap}")).unwrap_err().to_string();
            assert!(!e.contains("imap-topsecret") && e.starts_with("connectors.mail.imap.password: "), "{e}");
        }
        let ok = toml::from_str::<W>("s = { env = \"X\", prefix = \"Bearer \" }").unwrap();
        assert_eq!((ok.s.env.as_deref(), ok.s.prefix.as_str()), (Some("X"), "Bearer "));
        // A header value may still be plain text.
        let h: HeaderValueConfig = toml::from_str::<std::collections::BTreeMap<String, HeaderValueConfig>>("h = \"x\"")
            .unwrap()
            .remove("h")
            .unwrap();
        assert!(matches!(h, HeaderValueConfig::Plain(ref t) if t == "x"));
    }

    #[test]
    fn secrets_come_from_env_or_file_and_never_print() {
        let r = SecretRef { env: Some("IDEM_TEST_SURELY_UNSET_VAR".into()), file: None, prefix: String::new() };
        let e = r.resolve("connectors.mail.password").unwrap_err();
        assert_eq!(e.field, "connectors.mail.password");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s");
        std::fs::write(&f, "hunter2\n").unwrap();
        let r = SecretRef { env: None, file: Some(f.display().to_string()), prefix: "Bearer ".into() };
        let s = r.resolve("x").unwrap();
        assert_eq!(s.expose(), "Bearer hunter2");
        assert!(!format!("{s:?}").contains("hunter2"));
    }

    #[test]
    fn retention_durations() {
        assert_eq!(parse_retention("f", "24h").unwrap(), Some(86_400_000));
        assert_eq!(parse_retention("f", "1s").unwrap(), Some(1000));
        assert_eq!(parse_retention("f", "forever").unwrap(), None);
        assert_eq!(parse_retention("actions.x.retention", "soon").unwrap_err().field, "actions.x.retention");
        let c = Config::parse("[actions.export]\nretention = \"forever\"\n[retention]\ndefault = \"2h\"\n").unwrap();
        let r = c.retention().unwrap();
        assert_eq!((r.of("export"), r.of("other")), (None, Some(7_200_000)));
        assert!(Config::parse("[retention]\ntombstone = \"forever\"\n").is_err());
        let e = Config::parse("[retention]\ntombstone = \"5s\"\n[actions.a]\nretention = \"6s\"\n").unwrap_err();
        assert_eq!(e.field, "retention.tombstone");
    }

    #[test]
    fn interpolation_reads_the_environment() {
        assert_eq!(interpolate("f", "plain").unwrap(), "plain");
        assert!(
            interpolate("f", "${IDEM_TEST_SURELY_UNSET_VAR}")
                .unwrap_err()
                .message
                .contains("IDEM_TEST_SURELY_UNSET_VAR")
        );
        assert!(interpolate("f", "${OPEN").is_err());
    }
}
