//! Issue 28 §7: ids and filters that cannot name anything stored — a NUL byte, a path that
//! climbs (`%00..%2F..%2F`), invalid UTF-8, control characters, an id far over any limit
//! — are refused on every API and admin route before they reach a query, with idem's own
//! words: never the database's message ("invalid byte sequence for encoding …"), never a
//! 5xx that tells a client to retry what can never succeed. Run on PostgreSQL, whose
//! `text` refuses NUL, with an outbox in the application's database. Free-text fields of
//! request bodies (reasons, evidence, names) get the same treatment.

mod common;

use common::{ADMIN_KEY, Server, ui_session};
use serde_json::{Value, json};

/// Path segments (already percent-encoded) that no stored id can be.
const BAD_SEGMENTS: [&str; 7] = [
    "%00..%2F..%2F",
    "%00",
    "a%00b",
    "%FF%FE",
    "%0A",
    "%C2%85x",
    // Far over every id's limit (keys 255 bytes, instance ids 192).
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
];

/// Query values (percent-encoded) that no stored field can match.
const BAD_FILTERS: [&str; 3] = ["%00", "a%00b", "%FF"];

/// What a database's own message looks like (PostgreSQL's, SQLite's, sqlx's wrapping).
const DATABASE_WORDS: [&str; 9] = [
    "invalid byte sequence",
    "UTF8",
    "0x00",
    "error returned from database",
    "relation",
    "sqlx",
    "SQLSTATE",
    "syntax error",
    "violates",
];

/// What was wrong with the answer to `what`, if anything: a 5xx (it tells a client to
/// retry what can never succeed), a 401/403 (the id is not the caller's fault), a 2xx
/// where only a refusal is right (`filter`: a filter that matches nothing may answer an
/// empty 200), or the database's own words anywhere in the body.
fn wrong(what: &str, status: u16, body: &str, filter: bool) -> Option<String> {
    let refused = (400..500).contains(&status) && status != 401 && status != 403;
    if !(refused || (filter && status == 200)) {
        return Some(format!("{what}: {status} {}", &body[..body.len().min(300)]));
    }
    DATABASE_WORDS.iter().find(|w| body.contains(*w)).map(|w| {
        let at = body.find(w).unwrap();
        let start = body[..at].char_indices().rev().nth(80).map_or(0, |(i, _)| i);
        format!(
            "{what}: the database's own words ({w:?}) reach the client: …{}…",
            &body[start..(at + 80).min(body.len())]
        )
    })
}

fn form(fields: &[(&str, &str)]) -> String {
    reqwest::Url::parse_with_params("http://x/", fields).unwrap().query().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ids_and_filters_are_refused_on_every_route_in_idems_words() {
    let ledger = idem_store::testing::fresh_pg_database("idem_hostile").await;
    let app = idem_store::testing::fresh_pg_database("idem_hostile_app").await;
    idem_outbox::schema::install(&app.url).await.unwrap();
    let config = format!(
        "[outbox]\ndatabase_url = \"{}\"\nin_serve = true\n[outbox.sinks.none]\nkind = \"webhook\"\n\
         url = \"http://127.0.0.1:9/\"\ntopics = [\"x.*\"]\nsecrets = [{{ env = \"HOSTILE_SECRET\" }}]\n",
        app.url
    );
    let s = Server::start_with_config_env(
        &ledger.url,
        &config,
        &[("HOSTILE_SECRET", "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD")],
    );
    // Something stored, to see that nothing of it changes.
    let key = "INQ-7:confirmation:v1";
    let granted = s.acquire(key, json!({"to": "c"})).await;
    assert_eq!(granted.status, 201);
    let before = s.record(key).await.body;
    let mut failures: Vec<String> = Vec::new();

    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let api = |method: reqwest::Method, path: String, body: Option<Value>| {
        let mut r = http.request(method, s.url(&path)).bearer_auth(ADMIN_KEY);
        if let Some(b) = body {
            r = r.json(&b);
        }
        async move {
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    use reqwest::Method;
    let complete = json!({"fencing_token": 1, "outcome": "succeeded", "provider_ref": "x"});
    let resolve = json!({"to": "FAILED", "reason": "checked"});
    for bad in BAD_SEGMENTS {
        for (method, path, body) in [
            (Method::GET, format!("/v1/operations/{bad}"), None),
            (Method::POST, format!("/v1/operations/{bad}/complete"), Some(complete.clone())),
            (Method::POST, format!("/v1/operations/{bad}/renew"), Some(json!({"fencing_token": 1}))),
            (Method::POST, format!("/v1/operations/{bad}/resolve"), Some(resolve.clone())),
            (Method::POST, format!("/v1/operations/{bad}/reconcile"), Some(json!({}))),
            (Method::GET, format!("/v1/workflows/{bad}"), None),
            (Method::POST, format!("/v1/workflows/{bad}/rerun"), Some(json!({"reason": "r", "dry_run": true}))),
            (Method::POST, format!("/v1/workflows/{bad}/compensate"), Some(json!({"reason": "r"}))),
            (Method::POST, format!("/v1/workflows/{bad}/steps/s"), Some(json!({}))),
            (Method::POST, format!("/v1/workflows/w-1/steps/{bad}"), Some(json!({}))),
            (Method::POST, format!("/v1/workflows/w-1/steps/{bad}/complete"), Some(complete.clone())),
            (Method::DELETE, format!("/v1/keys/{bad}"), None),
            (Method::GET, format!("/problems/{bad}"), None),
        ] {
            let (status, text) = api(method.clone(), path.clone(), body).await;
            failures.extend(wrong(&format!("{method} {path}"), status, &text, false));
        }
    }
    for bad in BAD_FILTERS {
        for name in ["state", "action", "key_prefix", "cursor", "created_after"] {
            let path = format!("/v1/operations?{name}={bad}");
            let (status, text) = api(Method::GET, path.clone(), None).await;
            failures.extend(wrong(&path, status, &text, true));
        }
        for name in ["state", "workflow", "cursor", "created_before"] {
            let path = format!("/v1/workflows?{name}={bad}");
            let (status, text) = api(Method::GET, path.clone(), None).await;
            failures.extend(wrong(&path, status, &text, true));
        }
    }
    // Free text in bodies: a NUL in a reason, evidence, a provider_ref, a name.
    let nul = "checked\u{0}twice";
    for (path, body) in [
        (
            format!("/v1/operations/{}/complete", common::enc(key)),
            json!({"fencing_token": granted.token(), "outcome": "succeeded", "provider_ref": nul}),
        ),
        (
            format!("/v1/operations/{}/complete", common::enc(key)),
            json!({"fencing_token": granted.token(), "outcome": "final_failure", "error": {"class": "x", "message": nul}}),
        ),
        (format!("/v1/operations/{}/resolve", common::enc(key)), json!({"to": "FAILED", "reason": nul})),
        (
            format!("/v1/operations/{}/resolve", common::enc(key)),
            json!({"to": "SUCCEEDED", "reason": "r", "evidence": nul}),
        ),
        ("/v1/keys".to_string(), json!({"tenant": "default", "principal": nul, "role": "client"})),
        ("/v1/operations".to_string(), json!({"key": "k-nul", "action": nul, "payload": {}})),
        (
            "/v1/workflows".to_string(),
            json!({"workflow": "w", "instance_id": "i-1", "steps": [{"name": "a"}], "source_event": nul}),
        ),
    ] {
        let (status, text) = api(Method::POST, path.clone(), Some(body.clone())).await;
        failures.extend(wrong(&format!("POST {path} {body}"), status, &text, false));
    }

    // The admin page: signed in, with a valid CSRF token.
    let cookie = ui_session(&s, ADMIN_KEY).await;
    let page = http.get(s.url("/ui/outbox")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    let csrf = html.split("name=\"csrf-token\" content=\"").nth(1).unwrap().split('"').next().unwrap().to_string();
    let ui = |method: Method, path: String, fields: Vec<(&'static str, String)>| {
        let mut r = http.request(method, s.url(&path)).header("cookie", &cookie);
        if !fields.is_empty() {
            let mut all = vec![("csrf", csrf.clone())];
            all.extend(fields);
            let pairs: Vec<(&str, &str)> = all.iter().map(|(k, v)| (*k, v.as_str())).collect();
            r = r.header("content-type", "application/x-www-form-urlencoded").body(form(&pairs));
        }
        async move {
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let reason = || vec![("reason", "x".to_string())];
    for bad in BAD_SEGMENTS {
        for (method, path, fields) in [
            (Method::POST, format!("/ui/outbox/{bad}/skip"), reason()),
            (Method::POST, format!("/ui/outbox/{bad}/redrive"), reason()),
            (Method::GET, format!("/ui/operations/{bad}"), vec![]),
            (
                Method::POST,
                format!("/ui/operations/{bad}/resolve"),
                vec![("to", "FAILED".into()), ("reason", "x".into())],
            ),
            (Method::POST, format!("/ui/operations/{bad}/reconcile"), reason()),
            (Method::GET, format!("/ui/workflows/{bad}"), vec![]),
            (Method::POST, format!("/ui/workflows/{bad}/rerun"), reason()),
            (Method::POST, format!("/ui/workflows/{bad}/compensate"), reason()),
        ] {
            let (status, text) = ui(method.clone(), path.clone(), fields).await;
            failures.extend(wrong(&format!("{method} {path}"), status, &text, false));
        }
    }
    for bad in BAD_FILTERS {
        for (page, name) in [
            ("/ui/operations", "state"),
            ("/ui/operations", "action"),
            ("/ui/operations", "key_prefix"),
            ("/ui/operations", "cursor"),
            ("/ui/workflows", "state"),
            ("/ui/workflows", "workflow"),
        ] {
            let path = format!("{page}?{name}={bad}");
            let (status, text) = ui(Method::GET, path.clone(), vec![]).await;
            failures.extend(wrong(&path, status, &text, true));
        }
    }
    // The issue's input, a reason with a NUL in the admin page's forms.
    let (status, text) = ui(
        Method::POST,
        format!("/ui/operations/{}/resolve", common::enc(key)),
        vec![("to", "FAILED".into()), ("reason", nul.into())],
    )
    .await;
    failures.extend(wrong("a NUL in the admin page's resolve reason", status, &text, false));

    assert!(failures.is_empty(), "{} answers wrong:\n{}", failures.len(), failures.join("\n"));
    // Nothing recorded changed, and the server still serves.
    let after = s.record(key).await;
    assert_eq!(after.status, 200);
    assert_eq!(after.body["state"], before["state"]);
    assert_eq!(after.body["events"], before["events"]);
    assert_eq!(s.http.get(s.url("/readyz")).send().await.unwrap().status(), 200);
}

/// Issue 28 §7's second input: the ledger's database dropped and created again under a
/// running node. `/healthz` and `/readyz` say the node cannot serve (503
/// `schema-missing`), and so does every request — never 200 on the health checks while
/// each request fails, never the database's "relation … does not exist".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_dropped_under_the_node_fails_its_health_checks() {
    let ledger = idem_store::testing::fresh_pg_database("idem_dropped").await;
    let s = Server::start(&ledger.url);
    assert_eq!(s.acquire("INQ-8:confirmation:v1", json!({"to": "c"})).await.status, 201);
    for path in ["/healthz", "/readyz"] {
        assert_eq!(s.http.get(s.url(path)).send().await.unwrap().status(), 200, "{path} before");
    }
    let name = ledger.url.rsplit('/').next().unwrap().to_owned();
    let admin = sqlx::PgPool::connect(&idem_store::testing::pg_admin_url()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{name}\" WITH (FORCE)"))).execute(&admin).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\""))).execute(&admin).await.unwrap();

    // The prober looks every 250 ms; the pool reconnects to the new, empty database.
    let start = std::time::Instant::now();
    let mut answers = Vec::new();
    loop {
        answers.clear();
        for path in ["/healthz", "/readyz", "/v1/operations/INQ-8%3Aconfirmation%3Av1"] {
            let r = s.http.get(s.url(path)).bearer_auth(ADMIN_KEY).send().await.unwrap();
            let status = r.status().as_u16();
            answers.push((path, status, r.text().await.unwrap()));
        }
        if answers.iter().all(|(_, status, _)| *status == 503) || start.elapsed().as_secs() > 15 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    for (path, status, body) in &answers {
        assert_eq!(*status, 503, "{path}: {body}");
        assert!(body.contains("/problems/schema-missing"), "{path}: {body}");
        assert!(!body.contains("does not exist") && !body.contains("relation"), "{path}: {body}");
    }
    drop(s);
    admin.close().await;
}
