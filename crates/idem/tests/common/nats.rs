//! JetStream streams for tests, on the local NATS server (127.0.0.1:4222, started by
//! scripts/test.sh): each test makes its own stream, named `IDEMTEST_<uuid>` over subjects
//! `t<uuid>.>`, and deletes it; streams left by killed runs are deleted after 10 minutes.

use async_nats::jetstream;

pub const NATS_URL: &str = "nats://127.0.0.1:4222";

pub struct TestStream {
    pub js: jetstream::Context,
    pub name: String,
    /// Subjects `{prefix}.…` go to this stream.
    pub prefix: String,
}

impl TestStream {
    /// A new stream with a duplicate window of `window`.
    pub async fn create(window: std::time::Duration) -> TestStream {
        let client = async_nats::connect(NATS_URL).await.unwrap_or_else(|e| {
            panic!("NATS at {NATS_URL} is not reachable ({e}); run ./scripts/test.sh, which starts it")
        });
        let js = jetstream::new(client);
        {
            use futures_util::StreamExt;
            let mut streams = js.streams();
            let cutoff = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(600);
            let mut stale = Vec::new();
            while let Some(Ok(info)) = streams.next().await {
                let created = jiff::Timestamp::from_second(info.created.unix_timestamp()).unwrap();
                if info.config.name.starts_with("IDEMTEST_") && created < cutoff {
                    stale.push(info.config.name.clone());
                }
            }
            for s in stale {
                let _ = js.delete_stream(&s).await;
            }
        }
        let id = uuid::Uuid::now_v7().simple().to_string();
        let (name, prefix) = (format!("IDEMTEST_{id}"), format!("t{id}"));
        js.create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: window,
            ..Default::default()
        })
        .await
        .unwrap();
        TestStream { js, name, prefix }
    }

    pub async fn messages(&self) -> u64 {
        self.js.get_stream(&self.name).await.unwrap().info().await.unwrap().state.messages
    }

    /// The `Nats-Msg-Id` and payload of message `seq`.
    pub async fn message(&self, seq: u64) -> (String, Vec<u8>) {
        let m = self.js.get_stream(&self.name).await.unwrap().get_raw_message(seq).await.unwrap();
        let id = m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned()).unwrap_or_default();
        (id, m.payload.to_vec())
    }

    pub async fn delete(self) {
        self.js.delete_stream(&self.name).await.unwrap();
    }
}
