//! Tenant isolation: tenant B cannot read, list, complete or learn of tenant A's key.

mod common;

use common::{ADMIN_KEY, Backend, Db, Resp, Server};
use serde_json::{Value, json};

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
            &json!({"fencing_token": granted.token(), "outcome": "succeeded", "provider_ref": "a-msg"}),
        )
        .await;
    assert_eq!(done.status, 200);

    // Reading A's key from B looks exactly like reading a key nobody has.
    let theirs = s.get(&b, &format!("/v1/operations/{}", common::enc(key))).await;
    let nobodys = s.get(&b, "/v1/operations/never-used").await;
    assert_eq!(theirs.status, 404);
    assert_eq!((theirs.problem(), &theirs.body["detail"]), (nobodys.problem(), &nobodys.body["detail"]));
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
    let a_view = s.get(&a, &format!("/v1/operations/{}", common::enc(key))).await;
    assert_eq!(a_view.body["state"], "SUCCEEDED");
    assert_eq!(a_view.body["provider_ref"], "a-msg");
    assert_eq!(a_view.body["payload"], json!({"to": "a-customer"}));
    assert!(a_view.body["events"].as_array().unwrap().iter().all(|e| e["principal"] == "client"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_management_needs_the_admin_role_and_stays_in_the_tenant() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let client = s.create_key("tenant-a", "client");
    let admin_a = s.create_key("tenant-a", "admin");
    let admin_b = s.create_key("tenant-b", "admin");

    let r = s.post(&client, "/v1/keys", &json!({"role": "client"})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (403, "forbidden"));
    assert_eq!(s.get(&client, "/v1/keys").await.status, 403);

    let made = s.post(&admin_a, "/v1/keys", &json!({"role": "operator", "principal": "ops-bot"})).await;
    assert_eq!(made.status, 201, "{made:?}");
    assert_eq!(made.body["tenant"], "tenant-a");
    let secret = made.body["secret"].as_str().unwrap().to_string();
    let id = made.body["id"].as_str().unwrap().to_string();
    assert_eq!(s.get(&secret, "/v1/operations").await.status, 200);
    let listed = s.get(&admin_a, "/v1/keys").await.body;
    assert_eq!(listed.as_array().unwrap().len(), 3);
    assert!(!listed.to_string().contains(&secret), "secrets are never listed");
    assert!(s.get(&admin_b, "/v1/keys").await.body.as_array().unwrap().iter().all(|k| k["tenant"] == "tenant-b"));

    let bad = s.post(&admin_a, "/v1/keys", &json!({"role": "root"})).await;
    assert_eq!((bad.status.as_u16(), bad.problem()), (400, "invalid-request"));

    // B's admin cannot revoke A's key: it looks like no such key.
    let del = s.http.delete(s.url(&format!("/v1/keys/{id}"))).bearer_auth(&admin_b).send().await.unwrap();
    assert_eq!(del.status(), 404);
    assert_eq!(s.get(&secret, "/v1/operations").await.status, 200);
    let del = s.http.delete(s.url(&format!("/v1/keys/{id}"))).bearer_auth(&admin_a).send().await.unwrap();
    assert_eq!(del.status(), 204);
    assert_eq!(s.get(&secret, "/v1/operations").await.status, 401);
}

/// Issue 15: an admin could revoke its tenant's only admin key (a fuzzer did it in its
/// first minute) and lock everyone out of key management.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_active_admin_key_of_a_tenant_is_not_revoked() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let delete = |key: &str, id: &str| {
        let req = s.http.delete(s.url(&format!("/v1/keys/{id}"))).bearer_auth(key);
        async move { Resp::read(req.send().await.unwrap()).await }
    };
    let id_of = |keys: &Value, role: &str| -> Vec<String> {
        keys.as_array()
            .unwrap()
            .iter()
            .filter(|k| k["role"] == role && k["revoked_at"].is_null())
            .map(|k| k["id"].as_str().unwrap().to_string())
            .collect()
    };
    // The input: the bootstrap admin key revokes itself.
    let bootstrap = id_of(&s.get(ADMIN_KEY, "/v1/keys").await.body, "admin");
    assert_eq!(bootstrap.len(), 1);
    let r = delete(ADMIN_KEY, &bootstrap[0]).await;
    assert_eq!((r.status.as_u16(), r.problem()), (409, "last-admin-key"), "{r:?}");
    assert!(r.body["detail"].as_str().unwrap().contains("create another admin key first"), "{r:?}");
    assert_eq!(s.get(ADMIN_KEY, "/v1/keys").await.status, 200, "still works");

    // Neighbours: an operator key is revoked as before; with a second admin, either admin
    // may be revoked, and then the remaining one is the last again.
    let op = s.post(ADMIN_KEY, "/v1/keys", &json!({"role": "operator"})).await.body["id"].as_str().unwrap().to_string();
    assert_eq!(delete(ADMIN_KEY, &op).await.status, 204);
    let second = s.post(ADMIN_KEY, "/v1/keys", &json!({"role": "admin", "principal": "second"})).await;
    let (second_secret, second_id) =
        (second.body["secret"].as_str().unwrap().to_string(), second.body["id"].as_str().unwrap().to_string());
    assert_eq!(delete(&second_secret, &bootstrap[0]).await.status, 204, "another admin exists");
    let r = delete(&second_secret, &second_id).await;
    assert_eq!((r.status.as_u16(), r.problem()), (409, "last-admin-key"));
    // Another tenant's admins do not count.
    let other_admin = s.create_key("tenant-z", "admin");
    let z = id_of(&s.get(&other_admin, "/v1/keys").await.body, "admin");
    assert_eq!(delete(&other_admin, &z[0]).await.status, 409, "tenant-z's only admin");
    assert_eq!(delete(&second_secret, &second_id).await.status, 409, "tenant-z's admin is not default's");
}
