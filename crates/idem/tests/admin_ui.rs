//! The admin page end to end in real headless Chromium (Debian `chromium` +
//! `chromium-driver`, driven over WebDriver): an operator signs in, finds an UNKNOWN
//! operation in the review queue, resolves it with a reason and sees the timeline update;
//! a client-role key is refused (403) by the server; another tenant's operation is not
//! found. Screenshots of every step go to `$CARGO_TARGET_TMPDIR/ui-screenshots/`.
//!
//! Also, without a browser: the session cookie's attributes, CSRF refusals, and that
//! revoking the key ends its session.

mod common;

use common::webdriver::Browser;
use common::{ADMIN_KEY, Backend, Db, Server, enc};
use serde_json::json;
use std::path::PathBuf;

fn shots_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ui-screenshots")
}

/// Makes `key` UNKNOWN: the caller acquires it and reports a timeout after sending.
async fn unknown_op(s: &Server, api_key: &str, key: &str) {
    let r = s.acquire_as(api_key, key, json!({"amount": 1200, "currency": "EUR"})).await;
    assert_eq!(r.status, 201, "{r:?}");
    let body =
        json!({"fencing_token": r.token(), "outcome": "unknown", "message": "timeout after the request was sent"});
    let c = s.post(api_key, &format!("/v1/operations/{}/complete", enc(key)), &body).await;
    assert_eq!(c.status, 200, "{c:?}");
}

async fn sign_in(b: &Browser, s: &Server, key: &str) {
    b.goto(&s.url("/ui")).await;
    assert!(b.url().await.ends_with("/ui/login"), "signed-out visitors are sent to the sign-in page");
    b.type_into("#api_key", key).await;
    b.click_and_wait("#login button[type=submit]").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_resolves_an_unknown_operation_in_chromium() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let client_key = s.create_key("default", "client");
    let other_key = s.create_key("other", "admin");
    let key = "INQ-7:charge:v1";
    unknown_op(&s, ADMIN_KEY, key).await;
    unknown_op(&s, ADMIN_KEY, "INQ-8:charge:v1").await;
    unknown_op(&s, &other_key, "OTHER-1:charge:v1").await;
    // The reconciler finds no connector to ask and flags them for review.
    s.wait_for(key, 20, |r| r["needs_review"] == true).await;

    let shots = shots_dir();
    let b = Browser::start(&shots).await;
    b.goto(&s.url("/ui")).await;
    b.screenshot("01-sign-in").await;

    // A wrong key is refused on the sign-in page.
    sign_in(&b, &s, "idem_not-a-key").await;
    assert!(b.text("#error").await.contains("Unknown or revoked"), "{}", b.source().await);

    // The operator (admin key of tenant "default") signs in and sees the overview.
    sign_in(&b, &s, ADMIN_KEY).await;
    assert!(b.url().await.ends_with("/ui"), "{}", b.url().await);
    assert_eq!(b.text("#tenant").await, "default");
    assert!(b.text("#count-UNKNOWN").await.contains('2'), "two UNKNOWN in this tenant, not the other's");
    assert!(b.text("#review-depth").await.contains('2'));
    b.screenshot("02-overview").await;

    // The review queue lists the UNKNOWN operation; open it.
    b.click_and_wait("nav a[href='/ui/review']").await;
    let queue = b.text("#flagged").await;
    assert!(queue.contains(key) && queue.contains("UNKNOWN"), "{queue}");
    assert!(!queue.contains("OTHER-1"), "another tenant's operation is not in the queue");
    let inline = format!("#flagged form[data-key='{key}'] input[name=expected_state]");
    assert!(b.try_find(&inline).await.is_some(), "an operator gets a resolve form in the queue");
    b.screenshot("03-review-queue").await;
    b.click_and_wait(&format!("#flagged a[href='/ui/operations/{}']", enc_all(key))).await;
    assert_eq!(b.text("#op-state").await, "UNKNOWN");
    let before = b.text("#timeline").await;
    assert!(before.contains("completed") && !before.contains("resolved"), "{before}");
    b.screenshot("04-operation").await;

    // Resolve it as SUCCEEDED with a reason and the provider's reference.
    b.click("#resolve select[name=to] option[value=SUCCEEDED]").await;
    b.type_into("#resolve input[name=reason]", "charge ch_123 found in the provider's dashboard").await;
    b.type_into("#resolve input[name=evidence]", "ch_123").await;
    b.click_and_wait("#resolve button[type=submit]").await;
    assert_eq!(b.text("#op-state").await, "SUCCEEDED", "{}", b.source().await);
    let timeline = b.text("#timeline").await;
    let last = timeline.lines().last().unwrap_or_default().to_string();
    assert!(
        last.contains("resolved") && last.contains("charge ch_123 found") && last.contains("bootstrap"),
        "the resolution is the timeline's last entry, with who and why: {timeline}"
    );
    assert!(b.text("#fields").await.contains("ch_123"), "the evidence is shown");
    b.screenshot("05-resolved").await;

    // The API agrees: SUCCEEDED by an operator, with the reason in the event log.
    let rec = s.record(key).await;
    assert_eq!(rec.body["state"], "SUCCEEDED");
    assert_eq!(rec.body["provider_ref"], "ch_123");
    assert!(rec.body["events"].as_array().unwrap().iter().any(|e| e["kind"] == "resolved"));

    // Another tenant's operation is not found, exactly as in the API.
    b.goto(&s.url(&format!("/ui/operations/{}", enc_all("OTHER-1:charge:v1")))).await;
    assert!(b.text("h1").await.contains("404"), "{}", b.source().await);
    b.goto(&s.url("/ui/operations?key_prefix=OTHER")).await;
    assert!(b.try_find("#operations").await.is_none(), "the list does not show it either");
    b.screenshot("06-other-tenant-not-found").await;

    // Sign out; a client-role key signs in. It sees no resolve form, and a forged form
    // post (with its own valid CSRF token) is refused by the server with 403.
    b.click_and_wait("#sign-out").await;
    assert!(b.url().await.ends_with("/ui/login"));
    sign_in(&b, &s, &client_key).await;
    let second = "INQ-8:charge:v1";
    b.goto(&s.url(&format!("/ui/operations/{}", enc_all(second)))).await;
    assert!(b.try_find("#resolve").await.is_none(), "no resolve form for a client key");
    b.goto(&s.url("/ui/review")).await;
    assert!(b.try_find("form.inline-resolve").await.is_none(), "nor in the queue");
    b.goto(&s.url(&format!("/ui/operations/{}", enc_all(second)))).await;
    b.execute(&format!(
        r#"window.__idemOldPage = true;
           const f = document.createElement('form');
           f.method = 'post'; f.action = '/ui/operations/{}/resolve';
           for (const [k, v] of [['csrf', document.querySelector('meta[name=csrf-token]').content],
                                 ['to', 'FAILED'], ['reason', 'trying without the role']]) {{
             const i = document.createElement('input'); i.name = k; i.value = v; f.appendChild(i);
           }}
           document.body.appendChild(f); f.submit();"#,
        enc_all(second)
    ))
    .await;
    b.wait_for_new_page().await;
    assert!(b.source().await.contains("Error 403"), "{}", b.source().await);
    assert!(b.text("#error").await.contains("operator"), "{}", b.source().await);
    b.screenshot("07-client-forbidden").await;
    assert_eq!(s.record(second).await.body["state"], "UNKNOWN", "nothing changed");
    b.quit().await;

    for name in ["01-sign-in", "02-overview", "03-review-queue", "04-operation", "05-resolved", "07-client-forbidden"] {
        assert!(shots.join(format!("{name}.png")).metadata().unwrap().len() > 1000);
    }
    println!("screenshots in {}", shots.display());
}

/// Percent-encodes like the admin page's links (every byte but ASCII letters and digits).
fn enc_all(s: &str) -> String {
    s.bytes().map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") }).collect()
}

/// An `application/x-www-form-urlencoded` body.
fn form(fields: &[(&str, &str)]) -> String {
    fields.iter().map(|(k, v)| format!("{}={}", enc_all(k), enc_all(v))).collect::<Vec<_>>().join("&")
}

/// The Set-Cookie header named `name` of a response.
fn set_cookie<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} cookie: {:?}", r.headers()))
}

fn cookie_value(set_cookie: &str) -> String {
    set_cookie.split(';').next().unwrap().split_once('=').unwrap().1.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_http_only_csrf_checked_and_end_with_their_key() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let operator = s.create_key("default", "operator");
    unknown_op(&s, ADMIN_KEY, "K-1").await;
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();

    // Signed out: every page redirects to the sign-in page.
    let r = http.get(s.url("/ui/review")).send().await.unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/ui/login");

    // The sign-in form without its double-submit cookie is refused.
    let r = http
        .post(s.url("/ui/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("api_key", operator.as_str()), ("csrf", "x")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);

    let login_page = http.get(s.url("/ui/login")).send().await.unwrap();
    let login = cookie_value(set_cookie(&login_page, "idem_login"));
    let r = http
        .post(s.url("/ui/login"))
        .header("cookie", format!("idem_login={login}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("api_key", operator.as_str()), ("csrf", login.as_str())]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    let sc = set_cookie(&r, "idem_session").to_string();
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/ui"] {
        assert!(sc.contains(attr), "{sc}");
    }
    assert!(!sc.contains(&operator), "the cookie never holds the API key");
    let cookie = format!("idem_session={}", cookie_value(&sc));

    let page = http.get(s.url("/ui/operations/K-1")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert_eq!(page.headers()["cache-control"], "no-store", "tenant data is not cached");
    assert_eq!(page.headers()["x-frame-options"], "DENY", "the resolve form cannot be framed");
    let html = page.text().await.unwrap();
    let csrf = html.split("name=\"csrf-token\" content=\"").nth(1).unwrap().split('"').next().unwrap().to_string();

    // A resolve without the session's CSRF token (as a cross-site form would send) is
    // refused, and nothing changes.
    for bad in ["", "0000", &"a".repeat(64)] {
        let r = http
            .post(s.url("/ui/operations/K-1/resolve"))
            .header("cookie", &cookie)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(&[("csrf", bad), ("to", "FAILED"), ("reason", "r")]))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "csrf {bad:?}");
    }
    assert_eq!(s.record("K-1").await.body["state"], "UNKNOWN");

    // A resolution without evidence for SUCCEEDED is refused (400) with the page's message.
    let r = http
        .post(s.url("/ui/operations/K-1/resolve"))
        .header("cookie", &cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("csrf", csrf.as_str()), ("to", "SUCCEEDED"), ("reason", "seen it")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(s.record("K-1").await.body["state"], "UNKNOWN");

    // With the token, the operator's resolution goes through.
    let r = http
        .post(s.url("/ui/operations/K-1/resolve"))
        .header("cookie", &cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("csrf", csrf.as_str()), ("to", "FAILED"), ("reason", "the provider has no such charge")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303, "{:?}", r.text().await);
    assert_eq!(s.record("K-1").await.body["state"], "FAILED");

    // A resolution decided from a state the operation is no longer in is refused (409),
    // in the page and in the API: a second operator cannot overwrite a decision unseen.
    unknown_op(&s, ADMIN_KEY, "K-2").await;
    let pending = json!({"to": "PENDING", "reason": "try again", "expected_state": "UNKNOWN"});
    let r = s.post(&operator, "/v1/operations/K-2/resolve", &pending).await;
    assert_eq!(r.status, 200, "{r:?}");
    let r = http
        .post(s.url("/ui/operations/K-2/resolve"))
        .header("cookie", &cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("csrf", &csrf), ("to", "FAILED"), ("reason", "give up"), ("expected_state", "UNKNOWN")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    assert!(r.text().await.unwrap().contains("PENDING now"));
    let r = s.post(&operator, "/v1/operations/K-2/resolve", &pending).await;
    assert_eq!((r.status.as_u16(), r.problem()), (409, "state-changed"));
    assert_eq!(s.record("K-2").await.body["state"], "PENDING");

    // A form posted from another origin is refused, whatever its token.
    let r = http
        .post(s.url("/ui/operations/K-2/resolve"))
        .header("cookie", &cookie)
        .header("origin", "http://evil.example")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("csrf", &csrf), ("to", "FAILED"), ("reason", "x")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // Same host, other scheme: another origin too.
    let https_origin = s.base.replacen("http://", "https://", 1);
    let r = http
        .post(s.url("/ui/operations/K-2/resolve"))
        .header("cookie", &cookie)
        .header("origin", https_origin)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("csrf", &csrf), ("to", "FAILED"), ("reason", "x")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // Text that is not UTF-8 is refused, not stored as U+FFFD.
    let r = http
        .post(s.url("/ui/operations/K-2/resolve"))
        .header("cookie", &cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("csrf={csrf}&to=FAILED&reason=%FF"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Unknown admin pages and methods are HTML pages as well.
    let r = http.get(s.url("/ui/nope")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    // A form without its CSRF field is a 403 page too, not a framework error.
    let r = http
        .post(s.url("/ui/operations/K-2/resolve"))
        .header("cookie", &cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("to", "FAILED"), ("reason", "x")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    assert_eq!(s.record("K-2").await.body["state"], "PENDING");

    // Revoking the key ends its session at once.
    let keys = s.get(ADMIN_KEY, "/v1/keys").await;
    let id = keys.body["items"]
        .as_array()
        .or(keys.body.as_array())
        .unwrap()
        .iter()
        .find(|k| k["role"] == "operator")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = s.http.delete(s.url(&format!("/v1/keys/{id}"))).bearer_auth(ADMIN_KEY).send().await.unwrap();
    assert!(r.status().is_success(), "{r:?}");
    let r = http.get(s.url("/ui")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(r.status(), 303, "a revoked key's session is over");
}

/// The workflow view in Chromium: an operator finds a PAUSED instance among those waiting
/// for a person, sees its last good step, previews a re-run naming the stopped step (the
/// plan says it is redone under a new key and everything else is kept), gives a reason and
/// runs it; the instance finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_reruns_a_paused_workflow_in_chromium() {
    let (provider, addr) = common::start_provider().await;
    let config = format!(
        "{}\n[workflows.order-intake]\nsteps = [\n  {{ name = \"create_order\", connector = \"orders\" }},\n  {{ name = \"reserve_stock\", connector = \"orders\", policy = \"manual\" }},\n  {{ name = \"notify\", connector = \"orders\" }},\n]\n",
        common::orders_config(addr, "")
    );
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config);
    let id = "ORD-UI-1";
    provider.script(&format!("{id}:reserve_stock"), vec![idem::acceptance::provider::Step::Hang]);
    let r = s
        .post(
            ADMIN_KEY,
            "/v1/workflows",
            &json!({"workflow": "order-intake", "instance_id": id, "input": {"sku": "A-1"}}),
        )
        .await;
    assert_eq!(r.status, 201, "{r:?}");
    let start = std::time::Instant::now();
    while s.get(ADMIN_KEY, &format!("/v1/workflows/{id}")).await.body["state"] != "PAUSED" {
        assert!(start.elapsed().as_secs() < 30, "the instance never paused");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    let shots = shots_dir();
    let b = Browser::start(&shots).await;
    sign_in(&b, &s, ADMIN_KEY).await;
    b.click_and_wait("nav a[href='/ui/workflows']").await;
    let waiting = b.text("#waiting").await;
    assert!(waiting.contains(id) && waiting.contains("PAUSED") && waiting.contains("create_order"), "{waiting}");
    b.screenshot("08-workflows-waiting").await;
    b.click_and_wait(&format!("#waiting a[href='/ui/workflows/{}']", enc_all(id))).await;
    assert_eq!(b.text("#state").await, "PAUSED");
    assert_eq!(b.text("#last-good-step").await, "create_order");
    b.screenshot("09-workflow-paused").await;

    // Preview: the stopped step, named, is redone under a new key; nothing changes yet.
    b.type_into("#rerun input[name=steps]", "reserve_stock").await;
    b.click_and_wait("#rerun button[type=submit]").await;
    let plan = b.text("#plan").await;
    assert!(plan.contains("redone") && plan.contains(&format!("{id}:reserve_stock:rerun-1")), "{plan}");
    assert!(plan.contains("kept"), "{plan}");
    assert_eq!(b.text("#state").await, "PAUSED", "a preview changes nothing");
    b.screenshot("10-rerun-preview").await;

    // Run exactly that plan, with a reason.
    b.type_into("#rerun-confirm input[name=reason]", "nothing arrived at the stock system; send it again").await;
    b.click_and_wait("#rerun-confirm button[type=submit]").await;
    assert!(b.text("#message").await.contains("Re-run started"), "{}", b.source().await);
    let start = std::time::Instant::now();
    loop {
        b.goto(&s.url(&format!("/ui/workflows/{}", enc_all(id)))).await;
        if b.text("#state").await == "SUCCEEDED" {
            break;
        }
        assert!(start.elapsed().as_secs() < 30, "the re-run did not finish: {}", b.source().await);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let events = b.text("#events").await;
    assert!(events.contains("rerun") && events.contains("send it again"), "{events}");
    b.screenshot("11-rerun-done").await;
    b.quit().await;
    assert_eq!(provider.effects(&format!("{id}:reserve_stock:rerun-1")), 1);
    assert_eq!(provider.effects(&format!("{id}:create_order")), 1, "the kept step was not redone");
    for name in ["08-workflows-waiting", "09-workflow-paused", "10-rerun-preview", "11-rerun-done"] {
        assert!(shots.join(format!("{name}.png")).metadata().unwrap().len() > 1000);
    }
}

/// Issue 15 §3, the operator's first minute: at 1280×900 the reason an operation is
/// UNKNOWN, its last good state and the resolve form come before its fields; empty fields
/// are hidden; an operation the caller performed offers no "Ask the provider now" and no
/// "Next attempt"; the resolve target has no default; a refused form keeps what was typed
/// and says what to fix in the page's words; the review queue shows the error and the
/// age; and at phone width neither the header nor a wide timeline pushes the page
/// sideways. Screenshots: `10-…` to `15-…`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operation_page_puts_the_cause_and_the_actions_first() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let key = "INQ-9:charge:v1";
    unknown_op(&s, ADMIN_KEY, key).await;
    // Retries with long request ids make a long, wide timeline.
    for i in 0..14 {
        let r = s
            .http
            .post(s.url("/v1/operations"))
            .bearer_auth(ADMIN_KEY)
            .header("x-request-id", format!("{}-{i}", "retry-of-the-nightly-billing-run".repeat(3)))
            .json(&json!({"key": key, "action": "send_confirmation", "payload": {"amount": 1200, "currency": "EUR"}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
    }
    s.wait_for(key, 20, |r| r["needs_review"] == true).await;

    let shots = shots_dir();
    let b = Browser::start(&shots).await;
    b.set_window_size(1280, 900).await;
    sign_in(&b, &s, ADMIN_KEY).await;
    b.goto(&s.url(&format!("/ui/operations/{}", enc_all(key)))).await;
    b.screenshot("10-operation-first-screen").await;
    assert!(
        b.text("#cause").await.contains("timeout after the request was sent"),
        "the cause comes first: {}",
        b.source().await
    );
    assert!(b.text("#before").await.contains("EXECUTING"), "{}", b.source().await);
    let fold = b
        .execute(
            "const r = document.querySelector('#resolve').getBoundingClientRect();
             const c = document.querySelector('#cause').getBoundingClientRect();
             return [r.bottom, c.top, window.innerHeight];",
        )
        .await;
    let (form_bottom, cause_top, height) =
        (fold[0].as_f64().unwrap(), fold[1].as_f64().unwrap(), fold[2].as_f64().unwrap());
    assert!(form_bottom <= height && cause_top < form_bottom, "above the fold ({height}): form ends at {form_bottom}");
    assert!(b.try_find("#reconcile").await.is_none(), "no provider to ask for an operation the caller performed");
    assert!(b.try_find("#no-connector").await.is_some());
    let fields = b.text("#fields").await;
    assert!(!fields.contains("Next attempt") && !fields.contains("Lease holder"), "{fields}");
    let empty = b
        .execute("return [...document.querySelectorAll('#fields td')].filter(td => !td.textContent.trim()).length;")
        .await;
    assert_eq!(empty, json!(0), "empty fields are hidden");
    assert_eq!(
        b.execute("return document.querySelector('#resolve select[name=to]').value;").await,
        json!(""),
        "no silent default"
    );

    // SUCCEEDED without evidence: refused in the page's words, with what was typed kept.
    b.click("#resolve select[name=to] option[value=SUCCEEDED]").await;
    b.type_into("#resolve input[name=reason]", "found in the provider's dashboard").await;
    b.click_and_wait("#resolve button[type=submit]").await;
    let error = b.text("#error").await;
    assert!(error.contains("Evidence") && !error.contains("--evidence"), "{error}");
    assert_eq!(b.execute("return document.querySelector('#resolve select[name=to]').value;").await, json!("SUCCEEDED"));
    assert_eq!(
        b.execute("return document.querySelector('#resolve input[name=reason]').value;").await,
        json!("found in the provider's dashboard")
    );
    b.screenshot("11-form-error-keeps-input").await;
    assert_eq!(s.record(key).await.body["state"], "UNKNOWN", "nothing changed");

    // The review queue: the error and the age of each row.
    b.goto(&s.url("/ui/review")).await;
    let row = b.text("#flagged").await;
    assert!(row.contains("timeout after the request was sent") && row.contains(" s"), "{row}");
    assert!(row.contains("Error") && row.contains("Age"), "{row}");
    b.screenshot("12-review-queue-error-and-age").await;

    // Phone width: nothing pushes the page sideways.
    b.set_window_size(390, 844).await;
    for (page, shot) in [
        (format!("/ui/operations/{}", enc_all(key)), "13-phone-operation"),
        ("/ui/review".to_string(), "14-phone-review"),
        ("/ui".to_string(), "15-phone-overview"),
    ] {
        b.goto(&s.url(&page)).await;
        let widths = b
            .execute("return [document.documentElement.scrollWidth, document.querySelector('header').scrollWidth, window.innerWidth];")
            .await;
        let (page_w, header_w, viewport) =
            (widths[0].as_f64().unwrap(), widths[1].as_f64().unwrap(), widths[2].as_f64().unwrap());
        b.screenshot(shot).await;
        assert!(
            page_w <= viewport && header_w <= viewport,
            "{page}: page {page_w}, header {header_w}, viewport {viewport}"
        );
    }
    b.quit().await;
}
