//! The SMTP connector (lettre) with lookups over IMAP (async-imap).
//!
//! Every message carries a deterministic `Message-ID` derived from tenant and key
//! (`<idem.{32 hex}@{domain}>`), so the same intent always has the same id and a lookup can
//! find it: `UID SEARCH HEADER Message-ID <id>` in the configured mailbox.
//!
//! The SMTP transaction is driven step by step so each failure is classified by *where*
//! it happened (RFC 5321 §4.2.1 reply classes):
//! - before the message body was sent (connect, EHLO, STARTTLS, AUTH, MAIL, RCPT, DATA):
//!   4xx or a lost connection ⇒ retryable (the server holds nothing); 5xx ⇒ final
//!   (`validation` for a refused recipient, `auth`, `rejected`);
//! - after the body and its final `.` were sent: 2xx ⇒ succeeded (evidence: the
//!   Message-ID), 4xx ⇒ retryable, 5xx ⇒ final, a lost connection or a timeout ⇒
//!   UNKNOWN — the server may have accepted the message.
//!
//! Payload: `{"to": "a@example.com" | ["a@…", …], "subject": "…", "text": "…",
//! "from": "…" (optional, default from the config)}`. A payload that is not a valid message
//! is a final `validation` failure; nothing is sent.

use crate::config::{ConfigError, ImapConfig, Secret, SmtpConfig, TlsMode};
use crate::connector::{Connector, OperationCtx, final_failure, retryable, unknown};
use async_trait::async_trait;
use idem_core::{Lookup, Outcome};
use lettre::Message;
use lettre::message::{Mailbox, Mailboxes};
use lettre::transport::smtp::authentication::{Credentials, Mechanism};
use lettre::transport::smtp::client::{AsyncSmtpConnection, TlsParameters};
use lettre::transport::smtp::commands::{Data, Mail, Rcpt};
use lettre::transport::smtp::extension::ClientId;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// SMTP steps that each may take up to `timeout_ms` (connect, EHLO/STARTTLS, AUTH, MAIL,
/// RCPT, DATA and body): an attempt may take this many timeouts.
const SMTP_STEPS: i64 = 7;

/// A configured SMTP connector.
#[derive(Debug)]
pub struct SmtpConnector {
    name: String,
    host: String,
    port: u16,
    tls: TlsMode,
    credentials: Option<(String, Secret)>,
    from: Mailbox,
    domain: String,
    timeout: Duration,
    imap: Option<(ImapConfig, Secret)>,
    lease_ms: i64,
}

/// Where in the SMTP transaction a failure happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connect,
    Auth,
    Mail,
    Rcpt,
    Data,
    /// The body and its final `.` were sent: the server may have the message.
    Body,
}

/// Classifies an SMTP error by the phase it happened in (see the module docs).
fn classify(phase: Phase, e: &lettre::transport::smtp::Error) -> Outcome {
    let code = e.status().map(|c| c.to_string()).unwrap_or_default();
    if e.is_transient() {
        return retryable("smtp_transient", format!("{phase:?}: {code} {e}"), None);
    }
    if e.is_permanent() {
        let class = match phase {
            Phase::Rcpt => "validation",
            Phase::Auth => "auth",
            _ => "rejected",
        };
        return final_failure(class, format!("{phase:?}: {code} {e}"));
    }
    if phase == Phase::Body {
        return unknown(format!("the connection failed after the message was sent: {e}"));
    }
    retryable("connect", format!("{phase:?}: the connection failed before the message was sent: {e}"), None)
}

fn tls_parameters(host: &str, field: &str) -> Result<TlsParameters, ConfigError> {
    TlsParameters::new(host.to_owned())
        .map_err(|e| ConfigError { field: field.to_owned(), message: format!("TLS setup failed: {e}") })
}

/// A `Message-ID` for `op`: the same for every attempt of the same intent.
pub fn message_id(op: &OperationCtx, domain: &str) -> String {
    format!("<idem.{}@{domain}>", op.stable_id())
}

impl SmtpConnector {
    /// Builds the connector, resolving secrets.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field.
    pub fn new(name: &str, c: &SmtpConfig) -> Result<Self, ConfigError> {
        let field = format!("connectors.{name}");
        let from: Mailbox = c.from.parse().map_err(|e| ConfigError {
            field: format!("{field}.from"),
            message: format!("not an e-mail address: {e}"),
        })?;
        let credentials = match (&c.username, &c.password) {
            (Some(u), Some(p)) => Some((u.clone(), p.resolve(&format!("{field}.password"))?)),
            (None, None) => None,
            _ => {
                return Err(ConfigError {
                    field: format!("{field}.password"),
                    message: "give both username and password, or neither".into(),
                });
            }
        };
        let imap = match &c.imap {
            Some(i) => {
                if i.tls == TlsMode::Starttls {
                    return Err(ConfigError {
                        field: format!("{field}.imap.tls"),
                        message: "IMAP supports tls or none here".into(),
                    });
                }
                Some((i.clone(), i.password.resolve(&format!("{field}.imap.password"))?))
            }
            None => None,
        };
        if c.tls != TlsMode::None {
            tls_parameters(&c.host, &format!("{field}.tls"))?;
        }
        let domain = c.message_id_domain.clone().unwrap_or_else(|| from.email.domain().to_owned());
        let lease_ms = c.lease_ms.unwrap_or(SMTP_STEPS * c.timeout_ms as i64 + 10_000);
        if lease_ms <= SMTP_STEPS * c.timeout_ms as i64 {
            return Err(ConfigError {
                field: format!("{field}.lease_ms"),
                message: format!("must exceed {SMTP_STEPS} × timeout_ms (each SMTP step may take timeout_ms)"),
            });
        }
        Ok(SmtpConnector {
            name: name.to_owned(),
            host: c.host.clone(),
            port: c.port,
            tls: c.tls,
            credentials,
            from,
            domain,
            timeout: Duration::from_millis(c.timeout_ms.max(1)),
            imap,
            lease_ms,
        })
    }

    /// Builds the message from the payload; `Err` is a final validation failure.
    fn message(&self, op: &OperationCtx) -> Result<Message, Outcome> {
        let bad = |m: String| final_failure("validation", m);
        let p = &op.payload;
        if let Some(obj) = p.as_object()
            && let Some(unknown) = obj.keys().find(|k| !["to", "subject", "text", "from"].contains(&k.as_str()))
        {
            return Err(bad(format!("payload.{unknown} is not supported (to, subject, text, from)")));
        }
        let to: Vec<&str> = match p.get("to") {
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => {
                return Err(bad("payload.to must be an address or a list of addresses".into()));
            }
        };
        if to.is_empty() {
            return Err(bad("payload.to names no recipient".into()));
        }
        let mut builder = Message::builder().message_id(Some(message_id(op, &self.domain)));
        let from = match p.get("from").and_then(Value::as_str) {
            Some(f) => f.parse::<Mailbox>().map_err(|e| bad(format!("payload.from: {e}")))?,
            None => self.from.clone(),
        };
        builder = builder.from(from);
        let mut recipients = Mailboxes::new();
        for t in to {
            recipients.push(t.parse::<Mailbox>().map_err(|e| bad(format!("payload.to {t:?}: {e}")))?);
        }
        for m in recipients {
            builder = builder.to(m);
        }
        let subject = p.get("subject").and_then(Value::as_str).unwrap_or("");
        let text = p.get("text").and_then(Value::as_str).unwrap_or("").to_owned();
        builder.subject(subject).body(text).map_err(|e| bad(format!("the message cannot be built: {e}")))
    }

    async fn send(&self, message: &Message) -> Result<String, Outcome> {
        let hello = ClientId::Domain("idem".into());
        let tls = match self.tls {
            TlsMode::Tls => {
                Some(tls_parameters(&self.host, "tls").map_err(|e| final_failure("config", e.to_string()))?)
            }
            _ => None,
        };
        let mut conn =
            AsyncSmtpConnection::connect_tokio1((self.host.as_str(), self.port), Some(self.timeout), &hello, tls, None)
                .await
                .map_err(|e| classify(Phase::Connect, &e))?;
        if self.tls == TlsMode::Starttls {
            let params = tls_parameters(&self.host, "tls").map_err(|e| final_failure("config", e.to_string()))?;
            conn.starttls(params, &hello).await.map_err(|e| classify(Phase::Connect, &e))?;
        }
        if let Some((user, password)) = &self.credentials {
            let creds = Credentials::new(user.clone(), password.expose().to_owned());
            conn.auth(&[Mechanism::Plain, Mechanism::Login], &creds).await.map_err(|e| classify(Phase::Auth, &e))?;
        }
        let envelope = message.envelope();
        conn.command(Mail::new(envelope.from().cloned(), vec![])).await.map_err(|e| classify(Phase::Mail, &e))?;
        for to in envelope.to() {
            conn.command(Rcpt::new(to.clone(), vec![])).await.map_err(|e| classify(Phase::Rcpt, &e))?;
        }
        conn.command(Data).await.map_err(|e| classify(Phase::Data, &e))?;
        let reply = tokio::time::timeout(self.timeout, conn.message(&message.formatted()))
            .await
            .map_err(|_| unknown("no reply within the timeout after the message was sent"))?
            .map_err(|e| classify(Phase::Body, &e))?;
        let _ = conn.quit().await;
        Ok(reply.message().collect::<Vec<_>>().join(" "))
    }
}

#[async_trait]
impl Connector for SmtpConnector {
    async fn execute(&self, op: &OperationCtx) -> Outcome {
        let message = match self.message(op) {
            Ok(m) => m,
            Err(o) => return o,
        };
        match self.send(&message).await {
            Ok(reply) => Outcome::Succeeded {
                provider_ref: message_id(op, &self.domain),
                result: Some(serde_json::json!({"message_id": message_id(op, &self.domain), "smtp_reply": reply})),
            },
            Err(outcome) => {
                tracing::warn!(connector = %self.name, outcome = outcome.name(), "SMTP attempt failed");
                outcome
            }
        }
    }

    async fn lookup(&self, op: &OperationCtx) -> Lookup {
        let Some((imap, password)) = &self.imap else {
            return Lookup::Inconclusive { why: format!("connector {} has no imap mailbox configured", self.name) };
        };
        let id = message_id(op, &self.domain);
        match tokio::time::timeout(self.timeout, imap_search(imap, password, &id)).await {
            Ok(Ok(true)) => Lookup::Found { provider_ref: id },
            Ok(Ok(false)) => {
                let since = idem_core::Clock::now_ms(&idem_core::SystemClock) - op.updated_at;
                if since < imap.delivery_grace_ms {
                    Lookup::TooEarly {
                        why: format!("{id} is not in {} yet; waiting out the delivery grace", imap.mailbox),
                        retry_in_ms: imap.delivery_grace_ms - since,
                    }
                } else {
                    Lookup::Absent
                }
            }
            Ok(Err(e)) => Lookup::Inconclusive { why: format!("IMAP lookup failed: {e}") },
            Err(_) => Lookup::Inconclusive { why: "IMAP lookup timed out".into() },
        }
    }

    fn lease_ms(&self) -> i64 {
        self.lease_ms
    }

    fn max_call_ms(&self) -> i64 {
        SMTP_STEPS * self.timeout.as_millis() as i64
    }

    fn has_lookup(&self) -> bool {
        self.imap.is_some()
    }
}

/// Whether a message with `message_id` is in the configured mailbox.
async fn imap_search(c: &ImapConfig, password: &Secret, message_id: &str) -> Result<bool, String> {
    let tcp = tokio::net::TcpStream::connect((c.host.as_str(), c.port)).await.map_err(|e| format!("connect: {e}"))?;
    match c.tls {
        TlsMode::Tls => {
            let mut roots = tokio_rustls::rustls::RootCertStore::empty();
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            let config =
                tokio_rustls::rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(c.host.clone())
                .map_err(|e| format!("server name: {e}"))?;
            let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            search_on(async_imap::Client::new(stream), c, password, message_id).await
        }
        _ => search_on(async_imap::Client::new(tcp), c, password, message_id).await,
    }
}

async fn search_on<T>(
    mut client: async_imap::Client<T>,
    c: &ImapConfig,
    password: &Secret,
    message_id: &str,
) -> Result<bool, String>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + std::fmt::Debug + Send,
{
    client
        .read_response()
        .await
        .map_err(|e| format!("greeting: {e}"))?
        .ok_or("the server closed before its greeting")?;
    let mut session = client.login(&c.username, password.expose()).await.map_err(|(e, _)| format!("login: {e}"))?;
    session.select(&c.mailbox).await.map_err(|e| format!("select {}: {e}", c.mailbox))?;
    // The id is ours (hex and a domain), so quoting it is enough.
    let found =
        session.uid_search(format!("HEADER Message-ID \"{message_id}\"")).await.map_err(|e| format!("search: {e}"))?;
    let _ = session.logout().await;
    Ok(!found.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(key: &str, payload: Value) -> OperationCtx {
        OperationCtx {
            tenant: "acme".into(),
            key: key.into(),
            action: "send".into(),
            payload,
            fencing_token: 1,
            attempt: 1,
            updated_at: 0,
        }
    }

    fn connector() -> SmtpConnector {
        let c: SmtpConfig =
            toml::from_str("host = \"127.0.0.1\"\nport = 2525\ntls = \"none\"\nfrom = \"idem@example.org\"\n").unwrap();
        SmtpConnector::new("mail", &c).unwrap()
    }

    #[test]
    fn message_ids_are_deterministic_per_tenant_and_key() {
        let a = message_id(&op("INQ-004:confirmation:v1", Value::Null), "example.org");
        assert_eq!(a, message_id(&op("INQ-004:confirmation:v1", Value::Null), "example.org"));
        assert_ne!(a, message_id(&op("INQ-005:confirmation:v1", Value::Null), "example.org"));
        let mut other_tenant = op("INQ-004:confirmation:v1", Value::Null);
        other_tenant.tenant = "globex".into();
        assert_ne!(a, message_id(&other_tenant, "example.org"));
        assert!(a.starts_with("<idem.") && a.ends_with("@example.org>"));
    }

    #[test]
    fn a_bad_payload_is_a_final_validation_failure() {
        let c = connector();
        for p in [serde_json::json!({}), serde_json::json!({"to": "not an address"}), serde_json::json!({"to": []})] {
            match c.message(&op("k", p.clone())) {
                Err(Outcome::FinalFailure { error_class, .. }) => {
                    assert_eq!(error_class, "validation", "{p}")
                }
                other => panic!("{p}: {other:?}"),
            }
        }
        let m =
            c.message(&op("k", serde_json::json!({"to": "c@example.org", "subject": "Hi", "text": "Body"}))).unwrap();
        let text = String::from_utf8(m.formatted()).unwrap();
        assert!(text.contains("Message-ID: <idem."), "{text}");
    }
}
