//! Structured logs: with `--log-format json`, every request's lines carry its request id,
//! tenant and key hash; with `--redact-keys` the raw key appears nowhere in the log. What
//! clients control (request ids, methods) stays bounded in logs and metric labels.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, idem_bin};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A running `idem serve` whose log (JSON lines, `RUST_LOG=info`) goes to a file.
struct Logged {
    child: std::process::Child,
    base: String,
    log_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Logged {
    fn start(extra: &[&str]) -> Logged {
        Logged::start_sub(&["serve"], extra)
    }

    /// `idem SUB... --listen ... --log-format json --database-url FILE EXTRA...`.
    fn start_sub(sub: &[&str], extra: &[&str]) -> Logged {
        let dir = tempfile::tempdir().unwrap();
        let log_path = dir.path().join("idem.log");
        let mut child = Command::new(idem_bin())
            .args(sub)
            .args(["--listen", "127.0.0.1:0", "--log-format", "json", "--database-url"])
            .arg(dir.path().join("idem.db"))
            .args(extra)
            .env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let base = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("idem: listening on ").map(str::to_owned))
            .expect("the server starts");
        Logged { child, base, log_path, _dir: dir }
    }

    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
        http.post(format!("{}{path}", self.base)).bearer_auth(ADMIN_KEY).json(body).send().await.unwrap()
    }

    /// Lets the last access lines reach the file, stops the server, returns the log text.
    async fn stop(mut self) -> String {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(&self.log_path).unwrap()
    }
}

/// Runs `idem serve` with `extra` flags, sends one trigger with `key`, stops the server and
/// returns (the response's request id, the JSON log lines, the log text).
async fn serve_and_log(extra: &[&str], key: &str) -> (String, Vec<Value>, String) {
    let server = Logged::start(extra);
    let r = server
        .post("/v1/operations", &json!({"key": key, "action": "send_confirmation", "payload": {"to": "x"}}))
        .await;
    assert_eq!(r.status(), 201);
    let rid = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let text = server.stop().await;
    let lines = text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).collect();
    (rid, lines, text)
}

/// Keys and instance ids idem refuses because they look like personal data (an e-mail
/// address) never reach the log, whichever route refused them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_ids_that_look_like_personal_data_stay_out_of_the_log() {
    let server = Logged::start(&[]);
    let id = "inst-mary@example.com";
    let steps = json!([{"name": "a", "action": "a"}]);
    for (path, body) in [
        ("/v1/operations".to_owned(), json!({"key": id, "action": "a", "payload": {}})),
        ("/v1/workflows".to_owned(), json!({"workflow": "w", "instance_id": id, "steps": steps})),
        (format!("/v1/workflows/{}/steps/a", common::enc(id)), json!({"payload": {}})),
    ] {
        let r = server.post(&path, &body).await;
        assert!(r.status().is_client_error(), "{path}: {}", r.status());
    }
    let text = server.stop().await;
    assert!(text.contains("idem::access"), "the requests were logged: {text}");
    assert!(!text.contains("mary@example.com"), "a refused id was logged: {text}");
}

fn access_line<'a>(lines: &'a [Value], rid: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["target"] == "idem::access" && l["span"]["request_id"] == rid)
        .unwrap_or_else(|| panic!("no access line for request {rid}: {lines:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_request_id_tenant_and_key_hash() {
    let key = "INQ-42:confirmation:v1";
    let (rid, lines, _) = serve_and_log(&[], key).await;
    let line = access_line(&lines, &rid);
    assert_eq!(line["level"], "INFO");
    assert_eq!(line["fields"]["status"], 201);
    assert!(line["fields"]["latency_ms"].as_f64().unwrap() >= 0.0);
    let span = &line["span"];
    assert_eq!(span["tenant"], "default");
    assert_eq!(span["route"], "/v1/operations");
    assert_eq!(span["key_hash"], idem_core::key::log_hash(key));
    assert_eq!(span["key"], key, "without --redact-keys the key is logged too");
}

/// `idem proxy` logs what it forwards and what it refuses itself like the API's requests:
/// one access line each, under the route `proxied` (never the upstream's raw path, which
/// may hold a key), with the tenant and key hash once known; its `/_idem/` API keeps its
/// own route templates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_logs_proxied_and_refused_requests() {
    // Nothing listens on the upstream's port: a forwarded request is a 502.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let upstream = format!("http://{closed}/");
    let server = Logged::start_sub(&["proxy", "--upstream", &upstream], &[]);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let send = |method: reqwest::Method, path: &str, key: Option<&str>| {
        let mut r = http.request(method, format!("{}{path}", server.base)).header("idem-api-key", ADMIN_KEY);
        if let Some(k) = key {
            r = r.header("idempotency-key", k).header("content-type", "application/json").body("{}");
        }
        r.send()
    };
    let no_key = send(reqwest::Method::POST, "/charges/secret-path-1", None).await.unwrap();
    assert_eq!(no_key.status(), 400);
    let forwarded = send(reqwest::Method::GET, "/charges/secret-path-2", None).await.unwrap();
    assert_eq!(forwarded.status(), 502);
    let keyed = send(reqwest::Method::POST, "/charges", Some("proxy-log-key-1")).await.unwrap();
    // Refused after the key was read (a body that is not JSON): the line names the key.
    let bad_json = http
        .post(format!("{}/charges", server.base))
        .header("idem-api-key", ADMIN_KEY)
        .header("idempotency-key", "proxy-log-key-2")
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(bad_json.status(), 400);
    let api = http.get(format!("{}/_idem/healthz", server.base)).send().await.unwrap();
    assert_eq!(api.status(), 200);
    let ids: Vec<String> = [&no_key, &forwarded, &keyed, &api, &bad_json]
        .iter()
        .map(|r| r.headers()["x-request-id"].to_str().unwrap().to_owned())
        .collect();
    let keyed_status = keyed.status().as_u16();
    let text = server.stop().await;
    let lines: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).collect();
    for (rid, status) in [(&ids[0], 400), (&ids[1], 502), (&ids[2], keyed_status)] {
        let line = access_line(&lines, rid);
        assert_eq!(line["fields"]["status"], status, "{line}");
        assert_eq!(line["span"]["route"], "proxied", "{line}");
    }
    // The proxy keeps a client's key as `principal/key` in tenant `T.proxy`.
    let keyed_line = access_line(&lines, &ids[2]);
    assert_eq!(keyed_line["span"]["tenant"], "default.proxy", "{keyed_line}");
    assert_eq!(keyed_line["span"]["key_hash"], idem_core::key::log_hash("bootstrap/proxy-log-key-1"), "{keyed_line}");
    assert_eq!(access_line(&lines, &ids[3])["span"]["route"], "/_idem/healthz");
    let refused = access_line(&lines, &ids[4]);
    assert_eq!(refused["span"]["key_hash"], idem_core::key::log_hash("bootstrap/proxy-log-key-2"), "{refused}");
    let api_lines = lines.iter().filter(|l| l["target"] == "idem::access" && l["span"]["request_id"] == ids[3]).count();
    assert_eq!(api_lines, 1, "the /_idem/ API is logged once, by its own router");
    assert!(!text.contains("secret-path"), "the raw path is not logged: {text}");
    assert!(!lines.iter().any(|l| l["level"] == "ERROR"), "an upstream's 5xx is no error of idem's: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redact_keys_keeps_the_raw_key_out_of_the_log() {
    let key = "INQ-43:confirmation:v1";
    let (rid, lines, text) = serve_and_log(&["--redact-keys"], key).await;
    let line = access_line(&lines, &rid);
    assert_eq!(line["span"]["key_hash"], idem_core::key::log_hash(key));
    assert!(line["span"].get("key").is_none(), "{line}");
    assert!(!text.contains("INQ-43"), "the raw key appears nowhere in the log:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_request_ids_and_methods_stay_bounded() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let post = |rid: String| {
        s.http
            .post(s.url("/v1/operations"))
            .bearer_auth(ADMIN_KEY)
            .header("x-request-id", rid)
            .json(&json!({"key": "rid-1", "action": "send", "payload": {}}))
            .send()
    };
    // A well-formed client id is kept (for correlation) and recorded on the event.
    let r = post("job-42.run:7".into()).await.unwrap();
    assert_eq!(r.headers()["x-request-id"], "job-42.run:7");
    let rec = s.record("rid-1").await.body;
    assert_eq!(rec["events"][0]["request_id"], "job-42.run:7");
    // Oversized or with markup: replaced by a generated one, never stored.
    for bad in ["r".repeat(200), "abc\" status=200".to_string(), "<b>x</b>".to_string()] {
        let r = post(bad.clone()).await.unwrap();
        let got = r.headers()["x-request-id"].to_str().unwrap().to_string();
        assert!(got != bad && got.len() == 36, "{bad:?} became {got:?}");
    }
    let rec = s.record("rid-1").await.body;
    assert!(rec["events"].as_array().unwrap().iter().all(|e| e["request_id"].as_str().unwrap().len() <= 128));

    // Made-up methods are one `other` series, not one series each.
    for i in 0..20 {
        let m = reqwest::Method::from_bytes(format!("M{i}").as_bytes()).unwrap();
        s.http.request(m, s.url("/metrics")).send().await.unwrap();
    }
    let text = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(!text.contains("method=\"M1"), "{text}");
    assert!(text.contains("idem_http_requests_total{method=\"other\",route=\"/metrics\",status=\"405\"} 20"), "{text}");
    assert!(text.contains("# HELP idem_acquires_total"), "metrics are described");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_require_a_token() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_args(&db.url, &["--metrics-token", "scrape-secret-1"]);
    let r = s.http.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let r = s.http.get(s.url("/metrics")).bearer_auth("scrape-secret-2").send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = s.http.get(s.url("/metrics")).bearer_auth("scrape-secret-1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("idem_operations"));
}
