//! S3 as a real race: 100 rounds of 16 concurrent acquires of one key, spread over two
//! `idem serve` processes sharing one PostgreSQL database. Exactly one acquire per round.

mod common;

use common::{Backend, Db, Server};
use serde_json::json;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_one_database_exactly_one_acquire_per_round() {
    let db = Db::new(Backend::Postgres).await;
    let nodes = [Arc::new(Server::start(&db.url)), Arc::new(Server::start(&db.url))];
    for round in 0..100 {
        let key = format!("INQ-003:confirmation:v1:round-{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(16));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let (node, key, barrier) = (nodes[i % 2].clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    node.acquire(&key, json!({"to": "customer-42"})).await
                })
            })
            .collect();
        let mut granted = Vec::new();
        for (i, t) in tasks.into_iter().enumerate() {
            let r = t.await.unwrap();
            match r.status.as_u16() {
                201 => granted.push((i % 2, r.token())),
                409 => assert_eq!(r.problem(), "operation-in-progress"),
                other => panic!("round {round}: unexpected {other}: {r:?}"),
            }
        }
        assert_eq!(granted.len(), 1, "round {round}: {granted:?}");
        let (node, token) = granted[0];
        // The winner completes through the other node: the record is shared.
        let done = nodes[1 - node]
            .complete(
                &key,
                json!({"fencing_token": token, "outcome": "succeeded", "provider_ref": format!("msg-{round}")}),
            )
            .await;
        assert_eq!(done.status, 200, "{done:?}");
        let rec = nodes[node].record(&key).await.body;
        assert_eq!(rec["state"], "SUCCEEDED");
        assert_eq!(rec["attempt"], 1);
        assert_eq!(rec["events"].as_array().unwrap().len(), 17, "all 16 triggers logged");
    }
}
