//! OpenTelemetry export (cargo feature `otel`): the real `idem serve` sends its `request`
//! spans over OTLP/HTTP + protobuf to a collector, here a tiny receiver on loopback that
//! records every request it gets. Run with `cargo test -p idem --features otel --test otel`.
#![cfg(feature = "otel")]

mod common;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use common::{ADMIN_KEY, idem_bin};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One request the receiver got: method, path, content type, body.
#[derive(Clone, Debug)]
struct Export {
    method: String,
    path: String,
    content_type: String,
    body: Vec<u8>,
}

/// A stand-in OTLP/HTTP collector on 127.0.0.1: answers 200 with an empty protobuf
/// `ExportTraceServiceResponse` (zero bytes) and records everything.
struct Receiver {
    base: String,
    got: Arc<Mutex<Vec<Export>>>,
}

impl Receiver {
    async fn start() -> Receiver {
        let got: Arc<Mutex<Vec<Export>>> = Arc::default();
        let sink = got.clone();
        let app = axum::Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let sink = sink.clone();
            async move {
                let content_type =
                    headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
                sink.lock().unwrap().push(Export {
                    method: method.to_string(),
                    path: uri.path().to_string(),
                    content_type,
                    body: body.to_vec(),
                });
                (StatusCode::OK, [("content-type", "application/x-protobuf")], Vec::<u8>::new())
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Receiver { base, got }
    }

    fn exports(&self) -> Vec<Export> {
        self.got.lock().unwrap().clone()
    }

    /// Waits (at most `secs` seconds) until some export satisfies `ok`; returns them all.
    async fn wait_for(&self, secs: u64, ok: impl Fn(&Export) -> bool) -> Vec<Export> {
        let start = Instant::now();
        loop {
            let all = self.exports();
            if all.iter().any(&ok) {
                return all;
            }
            let seen: Vec<_> = all.iter().map(|e| (&e.method, &e.path, e.body.len())).collect();
            assert!(start.elapsed() < Duration::from_secs(secs), "no matching export within {secs} s; got {seen:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The protobuf encoding of the resource attribute `service.name` = `name`
/// (KeyValue{key: 1, value: 2 → AnyValue{string_value: 1}}), so a stray "idem" elsewhere
/// (span names, targets) cannot pass for it.
fn service_name_attribute(name: &str) -> Vec<u8> {
    let mut b = vec![0x0a, 12];
    b.extend_from_slice(b"service.name");
    b.extend_from_slice(&[0x12, (name.len() + 2) as u8, 0x0a, name.len() as u8]);
    b.extend_from_slice(name.as_bytes());
    b
}

/// A trace export that holds the `request` span (with its `key_hash` attribute) from
/// service `service`.
fn is_request_trace(e: &Export, service: &str) -> bool {
    e.method == "POST"
        && e.path == "/v1/traces"
        && e.content_type == "application/x-protobuf"
        && contains(&e.body, b"request")
        && contains(&e.body, b"key_hash")
        && contains(&e.body, &service_name_attribute(service))
}

/// `idem serve --otlp-endpoint endpoint` with extra environment; returns the child and
/// its base URL.
fn serve(db: &std::path::Path, endpoint: &str, env: &[(&str, &str)]) -> (Child, String) {
    let mut cmd = Command::new(idem_bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--otlp-endpoint", endpoint, "--database-url"])
        .arg(db)
        .env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY)
        // The request spans are INFO under idem_server; the rest stays quiet.
        .env("RUST_LOG", "warn,idem_server=info")
        .env_remove("OTEL_SERVICE_NAME")
        .env_remove("OTEL_RESOURCE_ATTRIBUTES")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("spawn idem serve");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("idem: listening on ") {
                let _ = tx.send(addr.to_string());
            }
        }
    });
    let base = rx.recv_timeout(Duration::from_secs(30)).expect("idem serve did not start within 30 s");
    (child, base)
}

/// Two triggers (acquires of fresh keys), each answered 201.
async fn two_requests(base: &str) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    for i in 0..2 {
        let body =
            json!({"key": format!("OTEL-{i}:confirmation:v1"), "action": "send_confirmation", "payload": {"to": i}});
        let r = http.post(format!("{base}/v1/operations")).bearer_auth(ADMIN_KEY).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    }
}

fn wait_exit(child: &mut Child, secs: u64) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            panic!("idem serve did not exit within {secs} s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_spans_reach_an_otlp_http_collector() {
    let collector = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    // A short batch interval (ms) so the export comes without a shutdown.
    let (mut child, base) = serve(&dir.path().join("idem.db"), &collector.base, &[("OTEL_BSP_SCHEDULE_DELAY", "200")]);
    two_requests(&base).await;
    let got = collector.wait_for(15, |e| is_request_trace(e, "idem")).await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(got.iter().all(|e| e.path == "/v1/traces"), "only traces are exported: {got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_spans_are_flushed_on_sigterm_under_otel_service_name() {
    let collector = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    // A batch interval of 10 min: nothing leaves before the shutdown flush.
    let endpoint = format!("{}/", collector.base); // a base URL with a trailing slash
    let env = [("OTEL_BSP_SCHEDULE_DELAY", "600000"), ("OTEL_SERVICE_NAME", "idem-node-7")];
    let (mut child, base) = serve(&dir.path().join("idem.db"), &endpoint, &env);
    two_requests(&base).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(collector.exports().is_empty(), "exported before the batch interval: {:?}", collector.exports());
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let status = wait_exit(&mut child, 15);
    assert!(status.success(), "graceful shutdown exits 0: {status:?}");
    let got = collector.exports();
    assert!(got.iter().any(|e| is_request_trace(e, "idem-node-7")), "no flushed request span: {got:?}");
    assert!(!got.iter().any(|e| contains(&e.body, &service_name_attribute("idem"))), "OTEL_SERVICE_NAME ignored");
}
