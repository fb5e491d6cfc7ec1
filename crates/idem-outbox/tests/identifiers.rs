//! One rule for every identifier (issue 28 §3), the same in the Rust library on both
//! databases and in the SQL functions other languages call: idem-core's table of bad ids
//! ([`idem_core::ident::BAD_IDS`]) through every entry point that stores an id, and the
//! SQL rules compared with the Rust ones over thousands of generated ids.

mod common;

use common::AppDb;
use idem_core::ident::{BAD_IDS, GOOD_IDS};
use idem_core::inbox::InboxDecision;
use idem_core::outbox::examples::event;
use idem_outbox::tx;
use idem_outbox::{OutboxError, append, inbox};
use serde_json::json;

/// The message of a database error (what a SQL caller sees), or panics.
fn db_message(e: sqlx::Error) -> (String, String) {
    let d = e.as_database_error().expect("a database error");
    (d.code().unwrap_or_default().into_owned(), d.message().to_owned())
}

/// Every entry point refuses every bad id, says why in the words Rust uses, and stores
/// nothing; the inputs are among them (`'    '`, `' evt-7'`, `'  '` as a key).
#[tokio::test]
async fn every_entry_point_refuses_the_same_bad_ids() {
    for db in AppDb::both().await {
        for (bad, _) in BAD_IDS {
            let fp = "fp-1";
            let as_message = in_tx!(&db, commit, |conn| inbox::claim_message(&mut *conn, "payments", bad, fp).await);
            let as_consumer = in_tx!(&db, commit, |conn| inbox::claim_message(&mut *conn, bad, "evt-7", fp).await);
            let as_key = in_tx!(&db, commit, |conn| tx::claim(&mut *conn, bad, "export", &json!({})).await);
            let mut e = event();
            e.aggregate_id = (*bad).to_owned();
            let as_aggregate = in_tx!(&db, commit, |conn| append(&mut *conn, &e).await);
            for (entry, refused) in [
                ("message id", as_message.map(|_| ()).err()),
                ("consumer", as_consumer.map(|_| ()).err()),
                ("key", as_key.map(|_| ()).err()),
                ("aggregate", as_aggregate.map(|_| ()).err()),
            ] {
                let err = refused.unwrap_or_else(|| panic!("{}: {entry} {bad:?} was taken", db.name()));
                assert!(
                    matches!(err, OutboxError::Inbox(_) | OutboxError::Key(_) | OutboxError::Event(_)),
                    "{entry} {bad:?}: {err}"
                );
            }
            let Some(pool) = db.pg_pool() else { continue };
            // The SQL functions: the same refusal, the same words (SQLSTATE 22023).
            let rust = idem_core::inbox::check_id("message id", bad).unwrap_err().to_string();
            let sql =
                sqlx::query("SELECT * FROM idem.inbox_claim('payments', $1, 'fp-1')").bind(bad).execute(pool).await;
            assert_eq!(db_message(sql.unwrap_err()), ("22023".into(), rust), "message id {bad:?}");
            let rust = idem_core::inbox::check_id("consumer", bad).unwrap_err().to_string();
            let sql = sqlx::query("SELECT * FROM idem.inbox_claim($1, 'evt-7', 'fp-1')").bind(bad).execute(pool).await;
            assert_eq!(db_message(sql.unwrap_err()), ("22023".into(), rust), "consumer {bad:?}");
            let rust = idem_core::IdempotencyKey::parse(bad).unwrap_err().to_string();
            let sql = sqlx::query("SELECT * FROM idem.key_claim($1, 'fp-1')").bind(bad).execute(pool).await;
            assert_eq!(db_message(sql.unwrap_err()), ("22023".into(), rust), "key {bad:?}");
        }
        for table in ["idem.inbox", "idem.outbox"] {
            assert_eq!(db.count(&format!("SELECT count(*) FROM {table}")).await, 0, "{}: {table} untouched", db.name());
        }
        // Good ids go in, inner spaces and all.
        for (i, good) in GOOD_IDS.iter().enumerate() {
            let d = in_tx!(&db, commit, |conn| inbox::claim_message(&mut *conn, "payments", good, "fp").await.unwrap());
            assert_eq!(d, InboxDecision::Apply, "{good:?}");
            assert_eq!(db.count("SELECT count(*) FROM idem.inbox").await, i as i64 + 1);
        }
    }
}

/// A small deterministic generator (xorshift64*), so a failure names a reproducible id.
struct Ids(u64);

impl Ids {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// An id of up to 12 pieces chosen to reach the edges of every rule: the parts of
    /// e-mail addresses and phone numbers, and (in one id of four) padding, control and
    /// non-ASCII characters.
    fn id(&mut self) -> String {
        const ASCII: &[&str] = &[
            "a",
            "Zq",
            "0",
            "555",
            "1234",
            "@",
            ".",
            "%40",
            "+",
            "(",
            ")",
            "-",
            " ",
            ":",
            "_",
            "%",
            "com",
            "x86",
            "..",
            "e2",
            "+49",
            "/",
            "123-4567",
            "(555) ",
            "jane@example.",
            "io",
        ];
        const OTHER: &[&str] = &["\u{a0}", "é", "\t", "\u{feff}", "\u{7}", "\u{85}", "\u{3000}", "\u{200b}"];
        let wild = self.next() % 4 == 0;
        let n = self.next() % 13;
        (0..n)
            .map(|_| {
                let r = self.next();
                if wild && r % 5 == 0 {
                    OTHER[(r / 5 % OTHER.len() as u64) as usize]
                } else {
                    ASCII[(r % ASCII.len() as u64) as usize]
                }
            })
            .collect()
    }
}

/// The SQL functions and the Rust rules agree on every generated id: the key rule
/// (personal-data detector included) and the identifier rule, error for error.
#[tokio::test]
async fn the_sql_rules_are_the_rust_rules() {
    let db = AppDb::postgres().await;
    let pool = db.pg_pool().unwrap();
    let mut ids_of = Ids(0x9E37_79B9_7F4A_7C15);
    let mut ids: Vec<String> = (0..8000).map(|_| ids_of.id()).collect();
    ids.extend(BAD_IDS.iter().map(|(b, _)| (*b).to_owned()));
    ids.extend(
        ["welcome:jane.doe@example.com", "sms:555-123-4567:v1", "call:+1 (555) 123-4567", "x@y.c0m", "a@b..com."]
            .map(String::from),
    );
    let rows: Vec<(Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT idem.key_error(x), idem.identifier_error('message id', x, 255) FROM unnest($1::text[]) AS x",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await
    .unwrap();
    let (mut keys_refused, mut emails, mut phones) = (0, 0, 0);
    for (id, (key_sql, ident_sql)) in ids.iter().zip(rows) {
        let key_rust = idem_core::IdempotencyKey::parse(id).err();
        emails += usize::from(key_rust == Some(idem_core::KeyError::ContainsEmail));
        phones += usize::from(key_rust == Some(idem_core::KeyError::ContainsPhone));
        keys_refused += usize::from(key_rust.is_some());
        assert_eq!(key_sql, key_rust.map(|e| e.to_string()), "key {id:?}");
        let ident_rust = idem_core::ident::check_identifier("message id", id, 255).err().map(|e| e.to_string());
        assert_eq!(ident_sql, ident_rust, "identifier {id:?}");
    }
    // The generator reaches every rule, so agreement means something.
    eprintln!("{emails} e-mails, {phones} phones, {keys_refused} refused of {}", ids.len());
    assert!(
        emails > 20 && phones > 20 && keys_refused < ids.len(),
        "{emails} e-mails, {phones} phones, {keys_refused} refused"
    );
}

/// A database whose schema is version 1 took the inputs; `idem schema install`
/// upgrades it to version 2 in place: what was recorded stays, the bad ids are refused.
#[tokio::test]
async fn version_1_took_blank_ids_and_the_upgrade_refuses_them() {
    let url = idem_store::testing::fresh_pg_database("idem_outbox").await;
    let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&url.url).await.unwrap();
    let v1 = idem_outbox::schema::install_postgres_up_to(&mut c, 1).await.unwrap();
    assert_eq!((v1.from, v1.to), (0, 1));
    let claim = |id: &str| {
        sqlx::query_scalar::<_, String>("SELECT decision FROM idem.inbox_claim('payments', $1, $2)").bind(id.to_owned())
    };
    // The report, as it was: a blank id applied; another message with it a conflict.
    assert_eq!(claim("    ").bind("fp-a").fetch_one(&mut c).await.unwrap(), "apply");
    assert_eq!(claim("    ").bind("fp-b").fetch_one(&mut c).await.unwrap(), "conflict");
    assert_eq!(claim(" evt-7").bind("fp-c").fetch_one(&mut c).await.unwrap(), "apply");
    assert_eq!(claim("evt-7").bind("fp-c").fetch_one(&mut c).await.unwrap(), "apply", "two messages");
    let key = sqlx::query_scalar::<_, String>("SELECT decision FROM idem.key_claim('  ', 'fp')");
    assert_eq!(key.fetch_one(&mut c).await.unwrap(), "apply");
    drop(c);
    let up = idem_outbox::schema::install(&url.url).await.unwrap();
    assert_eq!((up.from, up.to), (1, idem_outbox::schema::VERSION));
    let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&url.url).await.unwrap();
    for id in ["    ", " evt-7"] {
        let e = claim(id).bind("fp-d").fetch_one(&mut c).await.unwrap_err();
        assert_eq!(db_message(e).0, "22023", "{id:?}");
    }
    let e = sqlx::query("SELECT * FROM idem.key_claim('  ', 'fp')").execute(&mut c).await.unwrap_err();
    assert_eq!(db_message(e).1, "the idempotency key starts or ends with a space");
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM idem.inbox").fetch_one(&mut c).await.unwrap();
    assert_eq!(kept, 4, "the upgrade changes no row");
    // The rest of the functions still work after the upgrade.
    assert_eq!(claim("evt-8").bind("fp").fetch_one(&mut c).await.unwrap(), "apply");
    let seq: i64 = sqlx::query_scalar("SELECT idem.outbox_append('e-1', 'order', '42', 'orders.created', '{}'::json)")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert!(seq > 0);
    let e = sqlx::query("SELECT idem.outbox_append('e-2', 'order', ' 42', 'orders.created', '{}'::json)")
        .execute(&mut c)
        .await
        .unwrap_err();
    assert!(db_message(e).1.contains("must not be blank or start or end with whitespace"));
}
