//! The proxy's lookup: asks the upstream whether a request with a client's
//! Idempotency-Key took effect (`--lookup-url`).

use idem_core::Outcome;
use serde_json::Value;
use std::time::Duration;

/// The registry name of the proxy's lookup (lookup-only: never executed).
pub const PROXY_LOOKUP: &str = "lookup:proxy";

/// Asks the upstream whether a request with a client's Idempotency-Key took effect:
/// `GET` a URL template where `{key}` is the key the proxy sent the upstream
/// (`{tenant}/{principal}/{client's key}`, see `upstream_key`), as the HTTP connector's lookup
/// does (a reference at the pointer ⇒ Found; 404, `[]` or `null` ⇒ Absent once
/// `absent_after` has passed since the request; anything else ⇒ Inconclusive).
#[derive(Debug)]
pub struct ProxyLookup {
    inner: idem_connect::http::HttpConnector,
}

impl ProxyLookup {
    /// A lookup GETting `url_template` and reading the reference at `found_pointer`.
    ///
    /// # Errors
    /// A config error naming `--lookup-url` or `--lookup-found-pointer`.
    pub fn new(
        url_template: &str,
        found_pointer: &str,
        absent_after: Duration,
        timeout: Duration,
    ) -> Result<Self, idem_connect::ConfigError> {
        let ms = timeout.as_millis() as u64;
        let config = idem_connect::config::HttpConfig {
            url: "http://lookup-only.invalid/".into(),
            method: "GET".into(),
            headers: Default::default(),
            timeout_ms: ms.max(1),
            connect_timeout_ms: ms.clamp(1, 5_000),
            provider_ref: None,
            lookup: Some(idem_connect::config::HttpLookupConfig {
                url: url_template.into(),
                found_pointer: found_pointer.into(),
                absent_statuses: vec![404],
                absent_after_ms: absent_after.as_millis() as i64,
            }),
            provider_deduplicates: false,
            retry: Default::default(),
            lease_ms: None,
            tenants: idem_connect::tenants::TenantScope::All,
        };
        let inner =
            idem_connect::http::HttpConnector::new("proxy", &config).map_err(|e| idem_connect::ConfigError {
                field: if e.field.contains("pointer") {
                    "--lookup-found-pointer".into()
                } else {
                    "--lookup-url".into()
                },
                message: e.message,
            })?;
        Ok(ProxyLookup { inner })
    }
}

#[async_trait::async_trait]
impl idem_connect::Connector for ProxyLookup {
    async fn execute(&self, _op: &idem_connect::OperationCtx) -> Outcome {
        idem_connect::connector::final_failure("not_executable", "the proxy's lookup never performs requests")
    }

    async fn lookup(&self, op: &idem_connect::OperationCtx) -> idem_core::Lookup {
        let mut ctx = op.clone();
        // The upstream knows the key the proxy sent it (`upstream_key`; records made before
        // it was scoped hold only the client's own key).
        if let Some(k) =
            ["upstream_key", "idempotency_key"].iter().find_map(|f| op.payload.get(*f).and_then(Value::as_str))
        {
            ctx.key = k.to_owned();
        }
        self.inner.lookup(&ctx).await
    }

    fn lease_ms(&self) -> i64 {
        30_000
    }

    fn max_call_ms(&self) -> i64 {
        0
    }
}
