//! A webhook receiver for tests and `idem bench`: it checks every Standard Webhooks
//! signature with its own verifier (HMAC-SHA256 over `{id}.{timestamp}.{body}`, written
//! here from the specification, not idem-outbox's signer), answers by a script, records
//! what arrived, and optionally applies each message through the inbox (a consumer that
//! counts business rows).
//!
//! Script: per `webhook-id`, a list of statuses for its first arrivals (then 204), e.g.
//! `[503, 503]` — two refusals, then success. With an inbox database, a verified message
//! answered 2xx is claimed (`idem_outbox::receive`'s claim) and, on `apply`, a row
//! `(event_id, body)` is inserted into table `applied` in the same transaction.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One request that arrived.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// `webhook-id`.
    pub id: String,
    /// `webhook-timestamp` (s).
    pub timestamp: i64,
    /// The body.
    pub body: Vec<u8>,
    /// Whether a signature matched one of the receiver's keys.
    pub verified: bool,
    /// The status answered.
    pub status: u16,
    /// When it arrived.
    pub at: Instant,
}

struct Inner {
    keys: Vec<Vec<u8>>,
    script: Mutex<HashMap<String, Vec<u16>>>,
    arrivals: Mutex<Vec<Arrival>>,
    inbox: Option<(sqlx::PgPool, String)>,
}

/// A running receiver; it stops with the runtime.
#[derive(Clone)]
pub struct Receiver {
    inner: Arc<Inner>,
    /// Where it listens (`http://{addr}/hook`).
    pub addr: SocketAddr,
}

/// The key of a `whsec_…` secret: the bytes of its base64 part.
pub fn secret_key(secret: &str) -> Vec<u8> {
    B64.decode(secret.trim_start_matches("whsec_")).expect("a base64 secret")
}

/// Whether one `v1,…` entry of `signatures` is HMAC-SHA256 with one of `keys` of
/// `{id}.{timestamp}.{body}`.
fn verify(keys: &[Vec<u8>], id: &str, timestamp: &str, signatures: &str, body: &[u8]) -> bool {
    let signed = [id.as_bytes(), b".", timestamp.as_bytes(), b".", body].concat();
    signatures.split_whitespace().filter_map(|s| s.strip_prefix("v1,")).filter_map(|s| B64.decode(s).ok()).any(|sig| {
        keys.iter().any(|k| {
            let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(k).expect("any key length");
            mac.update(&signed);
            mac.verify_slice(&sig).is_ok()
        })
    })
}

impl Receiver {
    /// Starts a receiver on a free loopback port that accepts signatures made with one of
    /// `secrets` (`whsec_…`). With `inbox = Some((pool, consumer))` it applies messages
    /// through the inbox into table `applied (event_id text, body text)`, which must exist.
    pub async fn start(secrets: &[&str], inbox: Option<(sqlx::PgPool, String)>) -> Receiver {
        let inner = Arc::new(Inner {
            keys: secrets.iter().map(|s| secret_key(s)).collect(),
            script: Mutex::new(HashMap::new()),
            arrivals: Mutex::new(Vec::new()),
            inbox,
        });
        let app = axum::Router::new().route("/hook", post(hook)).with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
        let addr = listener.local_addr().expect("bound");
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver { inner, addr }
    }

    /// The URL the relay posts to.
    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// The statuses answered to the first arrivals of `id` (then 204).
    pub fn script(&self, id: &str, statuses: &[u16]) {
        self.inner.script.lock().unwrap().insert(id.to_owned(), statuses.to_vec());
    }

    /// Everything that arrived so far, in arrival order.
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.inner.arrivals.lock().unwrap().clone()
    }
}

async fn hook(State(s): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let at = Instant::now();
    let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let (id, ts, sig) = (h("webhook-id"), h("webhook-timestamp"), h("webhook-signature"));
    let verified = verify(&s.keys, &id, &ts, &sig, &body);
    let scripted = {
        let mut script = s.script.lock().unwrap();
        script.get_mut(&id).filter(|v| !v.is_empty()).map(|v| v.remove(0))
    };
    let mut status = if !verified { 401 } else { scripted.unwrap_or(204) };
    if status == 204
        && let Some((pool, consumer)) = &s.inbox
        && apply(pool, consumer, &id, &body).await.is_err()
    {
        status = 500;
    }
    s.arrivals.lock().unwrap().push(Arrival {
        id,
        timestamp: ts.parse().unwrap_or(0),
        body: body.to_vec(),
        verified,
        status,
        at,
    });
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// The consumer: claim the message id, insert the business row, commit together.
async fn apply(pool: &sqlx::PgPool, consumer: &str, id: &str, body: &[u8]) -> Result<(), idem_outbox::OutboxError> {
    let mut tx = pool.begin().await?;
    let fp = idem_core::fingerprint::sha256_hex(body);
    if idem_outbox::inbox::claim_message(&mut *tx, consumer, id, &fp).await? == idem_outbox::InboxDecision::Apply {
        sqlx::query("INSERT INTO applied (event_id, body) VALUES ($1, $2)")
            .bind(id)
            .bind(String::from_utf8_lossy(body).into_owned())
            .execute(&mut *tx)
            .await?;
        idem_outbox::inbox::finish(&mut *tx, consumer, id, &serde_json::json!("applied")).await?;
    }
    tx.commit().await?;
    Ok(())
}
