//! The test suite leaves no PostgreSQL database behind (issue 15 §4: a successful run left
//! ~19 `idem_*` databases): each test's database is dropped with its guard, also when the
//! test panics and while something is still connected to it.

use sqlx::Connection;

async fn exists(name: &str) -> bool {
    let mut admin = sqlx::PgConnection::connect(&idem_store::testing::pg_admin_url()).await.unwrap();
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(name)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    n == 1
}

fn name_of(url: &str) -> String {
    url.rsplit('/').next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_test_database_is_dropped_with_its_guard() {
    // Dropped while a connection (as an idem node would hold) is still open on it.
    let db = idem_store::testing::fresh_pg_database("idem_guard").await;
    let name = name_of(&db);
    let mut held = sqlx::PgConnection::connect(&db).await.unwrap();
    sqlx::query("SELECT 1").execute(&mut held).await.unwrap();
    assert!(exists(&name).await);
    drop(db);
    assert!(!exists(&name).await, "{name} is left behind");

    // Dropped when the test that made it panics.
    let made = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let seen = made.clone();
    let failed = tokio::spawn(async move {
        let db = idem_store::testing::fresh_pg_database("idem_guard").await;
        *seen.lock().unwrap() = name_of(&db);
        panic!("a failing test");
    })
    .await;
    assert!(failed.is_err());
    let name = made.lock().unwrap().clone();
    assert!(!name.is_empty());
    assert!(!exists(&name).await, "{name} is left behind by a panicking test");
}
