//! Group commit for the PostgreSQL store: concurrent requests of one kind are collected
//! and written by one multi-row statement (one round trip, one commit), and each is
//! answered only after that commit.
//!
//! One collector task per kind takes what is waiting (at most `max` requests) and hands
//! it to the writer function; at most `in_flight` batches of a kind run at once, so what
//! arrives while they run forms the next batch. Under light load a batch holds one
//! request and costs what the single statement did; under load the round trips, the
//! commits (WAL flushes) and the statement overhead are shared.

use crate::StoreError;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::{Semaphore, mpsc, oneshot};

type Item<I, O> = (I, oneshot::Sender<O>);

/// A collector of requests `I`, each answered with `O`.
pub(super) struct Batcher<I, O> {
    tx: mpsc::Sender<Item<I, O>>,
}

impl<I, O> std::fmt::Debug for Batcher<I, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").field("waiting", &(self.tx.max_capacity() - self.tx.capacity())).finish()
    }
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// Starts the collector. `write` gets a batch (1 to `max` requests, in arrival order)
    /// and returns one answer per request, in the same order.
    pub(super) fn spawn<F, Fut>(max: usize, in_flight: usize, write: F) -> Self
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<O>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::channel::<Item<I, O>>(4 * max);
        let slots = Arc::new(Semaphore::new(in_flight));
        let write = Arc::new(write);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                // Wait for a free slot first: what arrives meanwhile joins this batch.
                let Ok(slot) = slots.clone().acquire_owned().await else { return };
                let mut batch = vec![first];
                while batch.len() < max {
                    match rx.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                let write = write.clone();
                tokio::spawn(async move {
                    let (items, replies): (Vec<I>, Vec<oneshot::Sender<O>>) = batch.into_iter().unzip();
                    let answers = write(items).await;
                    debug_assert_eq!(answers.len(), replies.len());
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                    drop(slot);
                });
            }
        });
        Batcher { tx }
    }

    /// Submits `item` and waits for its answer (after its batch committed).
    ///
    /// # Errors
    /// [`StoreError::Closed`] if the collector is gone (the runtime is shutting down).
    pub(super) async fn submit(&self, item: I) -> Result<O, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.tx.send((item, reply)).await.map_err(|_| StoreError::Closed)?;
        answer.await.map_err(|_| StoreError::Closed)
    }
}

#[cfg(test)]
mod tests {
    use super::Batcher;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_share_batches_and_each_gets_its_own_answer() {
        let batches = Arc::new(AtomicUsize::new(0));
        let seen = batches.clone();
        let b = Arc::new(Batcher::spawn(8, 1, move |items: Vec<u32>| {
            seen.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                items.into_iter().map(|i| i * 10).collect::<Vec<_>>()
            }
        }));
        let tasks: Vec<_> = (0..64u32)
            .map(|i| {
                let b = b.clone();
                tokio::spawn(async move { (i, b.submit(i).await.unwrap()) })
            })
            .collect();
        for t in tasks {
            let (i, answer) = t.await.unwrap();
            assert_eq!(answer, i * 10);
        }
        let n = batches.load(Ordering::SeqCst);
        assert!((8..64).contains(&n), "64 concurrent requests in batches of at most 8 took {n} batches");
    }
}
