//! Tenant isolation: tenant B cannot read, list, complete or learn of tenant A's key.

mod common;

use common::{Backend, Db, Server};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_b_cannot_read_acquire_or_learn_of_tenant_a_key() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let a = s.create_key("tenant-a", "client");
    let b = s.create_key("tenant-b", "admin");
    let key = "INQ-100:confirmation:v1";
    let granted = s.acquire_as(&a, key, json!({"to": "a-customer"})).await;
    assert_eq!(granted.status, 201);
    let done = s
        .post(
            &a,
            &format!("/v1/operations/{}/complete", common::enc(key)),
            &json!({"fencing_token": 1, "outcome": "succeeded", "provider_ref": "a-msg"}),
        )
        .await;
    assert_eq!(done.status, 200);

    // Reading A's key from B looks exactly like reading a key nobody has.
    let theirs = s
        .get(&b, &format!("/v1/operations/{}", common::enc(key)))
        .await;
    let nobodys = s.get(&b, "/v1/operations/never-used").await;
    assert_eq!(theirs.status, 404);
    assert_eq!(
        (theirs.problem(), &theirs.body["detail"]),
        (nobodys.problem(), &nobodys.body["detail"])
    );
    // Listing shows nothing of A.
    let page = s.get(&b, "/v1/operations").await;
    assert_eq!(page.body["items"], json!([]));
    // Completing A's key from B: 404, and A's record is untouched.
    let c = s
        .post(
            &b,
            &format!("/v1/operations/{}/complete", common::enc(key)),
            &json!({"fencing_token": 1, "outcome": "final_failure", "error_class": "x"}),
        )
        .await;
    assert_eq!(c.status, 404);
    // Acquiring the same key with another payload: B gets its own operation — never the
    // 409/422/200 that would reveal A's.
    let mine = s.acquire_as(&b, key, json!({"to": "b-customer"})).await;
    assert_eq!(mine.status, 201, "{mine:?}");
    assert_eq!(mine.body["payload"], json!({"to": "b-customer"}));
    let a_view = s
        .get(&a, &format!("/v1/operations/{}", common::enc(key)))
        .await;
    assert_eq!(a_view.body["state"], "SUCCEEDED");
    assert_eq!(a_view.body["provider_ref"], "a-msg");
    assert_eq!(a_view.body["payload"], json!({"to": "a-customer"}));
    assert!(
        a_view.body["events"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["principal"] == "client")
    );
}
