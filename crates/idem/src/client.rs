//! `idem ops …`, `idem acquire`, `idem renew`, `idem complete`: HTTP calls to a running
//! server.

use crate::cli::{AcquireArgs, CompleteArgs, OpsCommand, OutcomeArg, RenewArgs, ServerArgs};
use crate::output;
use anyhow::{Context, bail};
use reqwest::{Method, StatusCode, Url};
use serde_json::{Value, json};
use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

/// Exit status of `idem acquire` for each answer (see `idem acquire --help`).
pub const EXIT_REPLAY: u8 = 10;
pub const EXIT_UNKNOWN: u8 = 11;
pub const EXIT_BUSY: u8 = 12;
/// 410 late-arrival: the operation finished and was removed after its retention window;
/// its tombstone answers until it expires. Nothing to do, and retrying changes nothing: a
/// script that retried on exit 1 kept retrying until the tombstone expired, and then the
/// key was new and the effect ran again (break-it finding).
pub const EXIT_LATE: u8 = 13;
/// 200 with `Idem-Performed-By: connector`: a connector of idem's performed the effect
/// during this call and it finished (SUCCEEDED or FAILED). Not 0, which only ever means
/// "the lease is yours: perform it" (issue 28: a default connector's success was exit 0,
/// and a script that followed the table sent the e-mail a second time).
pub const EXIT_PERFORMED: u8 = 14;
/// How often `idem acquire` and `idem complete` resend their request when no answer came
/// back (the reply was lost): an acquire is the same attempt with the same holder, so a
/// grant already made is given back; a completion repeats idempotently.
const RESENDS: usize = 3;

pub(crate) struct Api {
    http: reqwest::Client,
    base: Url,
    key: String,
}

/// A server answer: status, body (JSON or text), whether it was a replay, and whether a
/// connector performed the effect during the request (`Idem-Performed-By`).
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) body: Value,
    pub(crate) replayed: bool,
    pub(crate) performed: bool,
}

impl Api {
    pub(crate) fn new(args: &ServerArgs) -> anyhow::Result<Self> {
        let base = Url::parse(&args.server).with_context(|| format!("--server {:?} is not a URL", args.server))?;
        if !matches!(base.scheme(), "http" | "https") {
            bail!("--server must be an http:// or https:// URL");
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .context("cannot build the HTTP client")?;
        Ok(Api { http, base, key: args.api_key()? })
    }

    /// `segments` are appended percent-encoded (keys may hold `/`, `?`, spaces).
    pub(crate) fn url(&self, segments: &[&str]) -> anyhow::Result<Url> {
        let mut u = self.base.clone();
        u.path_segments_mut()
            .map_err(|()| anyhow::anyhow!("--server cannot be a base URL"))?
            .pop_if_empty()
            .extend(segments);
        Ok(u)
    }

    pub(crate) async fn call(&self, method: Method, url: Url, body: Option<Value>) -> anyhow::Result<Answer> {
        let mut req = self.http.request(method, url.clone()).bearer_auth(&self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.with_context(|| format!("cannot reach the idem server at {}", self.base))?;
        let status = resp.status();
        let replayed = resp.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
        let performed = resp.headers().get("idem-performed-by").is_some();
        let text = resp.text().await.context("the server's answer was cut off")?;
        // A success that is not JSON the CLI can read must not print as an empty table.
        let body = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) if status.is_success() => {
                anyhow::bail!("the server's answer ({status}) is not JSON the CLI can read: {e}")
            }
            Err(_) => Value::String(text),
        };
        Ok(Answer { status, body, replayed, performed })
    }
}

/// Fails with the problem's one-line summary for an error status.
pub(crate) fn check(a: &Answer) -> anyhow::Result<()> {
    if a.status.is_success() {
        return Ok(());
    }
    bail!("{}", output::problem_line(a.status.as_u16(), &a.body))
}

pub(crate) fn print(json_mode: bool, a: &Answer, human: impl FnOnce(&Value) -> String) {
    if json_mode {
        crate::out!("{}", a.body);
    } else {
        crate::out!("{}", human(&crate::output::printable(&a.body)));
    }
}

pub async fn ops(cmd: OpsCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        OpsCommand::Get { server, key } => {
            let api = Api::new(&server)?;
            let a = api.call(Method::GET, api.url(&["v1", "operations", &key])?, None).await?;
            check(&a)?;
            print(server.json, &a, output::operation_with_events);
        }
        OpsCommand::List {
            server,
            state,
            action,
            needs_review,
            key_prefix,
            created_after,
            created_before,
            limit,
            cursor,
        } => {
            let api = Api::new(&server)?;
            let mut url = api.url(&["v1", "operations"])?;
            {
                let mut q = url.query_pairs_mut();
                q.append_pair("limit", &limit.to_string());
                if let Some(s) = &state {
                    q.append_pair("state", s);
                }
                if let Some(a) = &action {
                    q.append_pair("action", a);
                }
                if needs_review {
                    q.append_pair("needs_review", "true");
                }
                for (name, v) in [
                    ("key_prefix", &key_prefix),
                    ("created_after", &created_after),
                    ("created_before", &created_before),
                ] {
                    if let Some(v) = v {
                        q.append_pair(name, v);
                    }
                }
                if let Some(c) = &cursor {
                    q.append_pair("cursor", c);
                }
            }
            let a = api.call(Method::GET, url, None).await?;
            check(&a)?;
            print(server.json, &a, output::operation_table);
        }
        OpsCommand::Reconcile { server, key } => {
            let api = Api::new(&server)?;
            let a = api.call(Method::POST, api.url(&["v1", "operations", &key, "reconcile"])?, None).await?;
            check(&a)?;
            print(server.json, &a, output::operation_summary);
        }
        OpsCommand::Resolve { server, key, to, reason, evidence, expected_state } => {
            let api = Api::new(&server)?;
            let to = match to {
                crate::cli::ResolveTo::Succeeded => "SUCCEEDED",
                crate::cli::ResolveTo::Pending => "PENDING",
                crate::cli::ResolveTo::Failed => "FAILED",
            };
            let body = json!({"to": to, "reason": reason, "evidence": evidence, "expected_state": expected_state});
            let a = api.call(Method::POST, api.url(&["v1", "operations", &key, "resolve"])?, Some(body)).await?;
            check(&a)?;
            print(server.json, &a, output::operation_summary);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn read_payload(args: &AcquireArgs) -> anyhow::Result<Option<Value>> {
    read_json(args.payload.as_deref(), args.payload_file.as_deref(), "payload")
}

/// JSON from `--NAME TEXT` or `--NAME-file PATH` (`-`: stdin), parsed with the server's
/// payload rules; `None` when neither is given.
pub(crate) fn read_json(
    text: Option<&str>,
    file: Option<&std::path::Path>,
    name: &str,
) -> anyhow::Result<Option<Value>> {
    let text = match (text, file) {
        (Some(p), _) => p.to_owned(),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).with_context(|| format!("cannot read the {name} from stdin"))?;
            s
        }
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?,
        (None, None) => return Ok(None),
    };
    client_json(&text, &format!("the {name}")).map(Some)
}

/// `text` parsed with the server's rules for a payload or a result ([`idem_core::Payload`]:
/// no duplicate member names, no number literal a double does not carry exactly), so what
/// is sent is exactly what was written and a refusal is local, naming the member or number.
fn client_json(text: &str, what: &str) -> anyhow::Result<Value> {
    let v: idem_core::Payload = serde_json::from_str(text).map_err(|e| {
        let hint = idem_core::payload::json_error_hint(&e.to_string());
        anyhow::anyhow!(
            "{what} is not valid JSON for idem (JSON text, no duplicate member names, numbers exact as IEEE 754 doubles within ±2^53): {e}{hint}"
        )
    })?;
    Ok(v.0)
}

pub async fn acquire(args: AcquireArgs) -> anyhow::Result<ExitCode> {
    let api = Api::new(&args.server)?;
    let mut body = json!({ "key": args.key, "action": args.action });
    if let Some(p) = read_payload(&args)? {
        body["payload"] = p;
    }
    if !args.fingerprint_fields.is_empty() {
        body["fingerprint_fields"] = json!(args.fingerprint_fields);
    }
    if let Some(l) = args.lease_ms {
        body["lease_ms"] = json!(l);
    }
    if let Some(w) = args.wait_ms {
        body["wait_ms"] = json!(w);
    }
    if args.redo_safe {
        body["redo_safe"] = json!(true);
    }
    if let Some(c) = &args.connector {
        body["connector"] = json!(c);
    }
    let holder = match &args.holder {
        Some(h) => {
            let now_ms =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
            idem_core::holder::validate_holder(h, &args.key, now_ms).map_err(|e| anyhow::anyhow!("--holder: {e}"))?;
            h.to_ascii_lowercase()
        }
        None => uuid::Uuid::now_v7().to_string(),
    };
    body["holder"] = json!(holder);
    let url = api.url(&["v1", "operations"])?;
    let a = resend_until_answered(|| api.call(Method::POST, url.clone(), Some(body.clone()))).await?;
    let code = acquire_exit(&a)?;
    if args.server.json {
        crate::out!("{}", a.body);
    } else if matches!(a.status.as_u16(), 409 | 410) {
        crate::out!("{}", output::problem_line(a.status.as_u16(), &a.body));
    } else {
        crate::out!("{}", output::acquire_summary(a.status.as_u16(), a.performed, &output::printable(&a.body)));
    }
    Ok(ExitCode::from(code))
}

/// Sends a request again when no answer came back (connection refused, reset, timed
/// out), up to [`RESENDS`] times 250 ms apart; an answer of any status ends it.
/// Only for requests whose resend is the same request to the server: an acquire with its
/// holder (the same attempt gets its grant back), a completion (the same fencing token and
/// outcome answer as the first did).
async fn resend_until_answered<F, Fut>(send: F) -> anyhow::Result<Answer>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Answer>>,
{
    let mut tries = 0;
    loop {
        match send().await {
            Err(e) if tries < RESENDS && e.chain().any(|c| c.downcast_ref::<reqwest::Error>().is_some()) => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            other => return other,
        }
    }
}

/// The exit status of an acquire's answer (see `idem acquire --help`): 0 only for a grant
/// of an operation the caller performs — a 201 naming a connector (an older server) is
/// read by its state, never as "perform it".
fn acquire_exit(a: &Answer) -> anyhow::Result<u8> {
    let by_connector = a.body.get("connector").is_some_and(Value::is_string);
    let is_final = matches!(a.body["state"].as_str(), Some("SUCCEEDED" | "FAILED"));
    Ok(match a.status.as_u16() {
        201 if !by_connector && a.body["state"] == "EXECUTING" => 0,
        201 | 200 if by_connector && is_final && !a.replayed => EXIT_PERFORMED,
        201 if by_connector => EXIT_UNKNOWN,
        200 if a.performed => EXIT_PERFORMED,
        200 => EXIT_REPLAY,
        202 => EXIT_UNKNOWN,
        409 => EXIT_BUSY,
        410 => EXIT_LATE,
        _ => {
            check(a)?;
            bail!("unexpected answer {} from the server", a.status)
        }
    })
}

pub async fn renew(args: RenewArgs) -> anyhow::Result<ExitCode> {
    let api = Api::new(&args.server)?;
    let mut body = json!({ "fencing_token": args.token });
    if let Some(ms) = args.lease_ms {
        body["lease_ms"] = json!(ms);
    }
    let a = api.call(Method::POST, api.url(&["v1", "operations", &args.key, "renew"])?, Some(body)).await?;
    check(&a)?;
    print(args.server.json, &a, output::renewal_summary);
    Ok(ExitCode::SUCCESS)
}

pub async fn complete(args: CompleteArgs) -> anyhow::Result<ExitCode> {
    let api = Api::new(&args.server)?;
    let outcome = match args.outcome {
        OutcomeArg::Succeeded => "succeeded",
        OutcomeArg::RetryableFailure => "retryable_failure",
        OutcomeArg::FinalFailure => "final_failure",
        OutcomeArg::Unknown => "unknown",
    };
    let mut body = json!({ "fencing_token": args.token, "outcome": outcome });
    if let Some(r) = &args.provider_ref {
        body["provider_ref"] = json!(r);
    }
    if let Some(r) = &args.result {
        body["result"] = client_json(r, "--result")?;
    }
    if let Some(c) = &args.error_class {
        body["error_class"] = json!(c);
    }
    if let Some(m) = &args.message {
        body["message"] = json!(m);
    }
    if let Some(ms) = args.retry_after_ms {
        body["retry_after_ms"] = json!(ms);
    }
    // A completion sent again is the same completion (its fencing token and outcome make
    // the repeat idempotent): after a lost answer it is resent, as an acquire is, instead of
    // reporting an unreachable server for what the server may have recorded.
    let url = api.url(&["v1", "operations", &args.key, "complete"])?;
    let a = resend_until_answered(|| api.call(Method::POST, url.clone(), Some(body.clone()))).await?;
    check(&a)?;
    print(args.server.json, &a, output::operation_summary);
    Ok(ExitCode::SUCCESS)
}
