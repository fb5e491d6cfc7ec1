//! Group commit for the PostgreSQL store: concurrent requests of one kind are collected
//! and written by one multi-row statement (one round trip, one commit), and each is
//! answered only after that commit.
//!
//! One collector task per kind takes what is waiting (at most `max` requests) and hands
//! it to the writer function. It runs one batch of a kind at a time: what arrives while a
//! batch runs forms the next one, so the busier the node, the more requests a statement
//! carries and the less each costs the database (its parse-free execution, its commit,
//! its round trip are per statement). A second batch starts beside the first only once
//! every batch in flight has run for [`Policy::patience`]: a statement that waits (a row
//! lock another transaction holds, a stalled disk) holds back its own requests, not every
//! later one; at most [`Policy::in_flight`] run at once.
//!
//! Measured (`idem bench`-like load, 32 HTTP clients, PostgreSQL 15 on the same two
//! cores): four batches in flight whenever requests wait gave 1.4–1.7 requests a
//! statement and cost PostgreSQL 261–304 µs of CPU a pair; one at a time, 5–7 requests a
//! statement, 126–175 µs a pair, and 30–50 % more pairs a second with a lower p99.

use crate::StoreError;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

type Item<I, O> = (I, oneshot::Sender<O>);

/// How many batches of one kind may run at once.
#[derive(Debug, Clone, Copy)]
pub(super) struct Policy {
    /// Most requests in one batch.
    pub max: usize,
    /// Most batches in flight at once.
    pub in_flight: usize,
    /// How long a batch runs before another may start beside it.
    pub patience: Duration,
}

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
    /// Starts the collector. `write` gets a batch (1 to `policy.max` requests, in arrival
    /// order) and returns one answer per request, in the same order.
    pub(super) fn spawn<F, Fut>(policy: Policy, write: F) -> Self
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<O>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::channel::<Item<I, O>>(4 * policy.max);
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<u64>();
        let write = Arc::new(write);
        tokio::spawn(async move {
            // The batches in flight: their number and when each started.
            let mut running: Vec<(u64, Instant)> = Vec::new();
            let mut next_id = 0u64;
            while let Some(first) = rx.recv().await {
                // Wait for a turn; what arrives meanwhile joins this batch.
                loop {
                    while let Ok(id) = done_rx.try_recv() {
                        running.retain(|(r, _)| *r != id);
                    }
                    let youngest = running.iter().map(|(_, t)| *t).max();
                    let turn_at = match youngest {
                        None => break,
                        Some(_) if running.len() >= policy.in_flight => None,
                        Some(t) => Some(t + policy.patience),
                    };
                    if turn_at.is_some_and(|at| at <= Instant::now()) {
                        break;
                    }
                    tokio::select! {
                        id = done_rx.recv() => {
                            let Some(id) = id else { return };
                            running.retain(|(r, _)| *r != id);
                        }
                        () = sleep_until(turn_at) => {}
                    }
                }
                let mut batch = vec![first];
                while batch.len() < policy.max {
                    match rx.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                let (id, write, done) = (next_id, write.clone(), done_tx.clone());
                next_id += 1;
                running.push((id, Instant::now()));
                tokio::spawn(async move {
                    let (items, replies): (Vec<I>, Vec<oneshot::Sender<O>>) = batch.into_iter().unzip();
                    // Boxed: a writer's future (its statements, the retries of
                    // `write_distinct`) is several KiB, and a task that holds it inline is
                    // copied whole by `spawn`, into the task's cell and again when it ends.
                    // `scripts/callgrind.sh` on PostgreSQL: ~58 000 instructions of memcpy a
                    // batch; with this and the cold fallbacks boxed (`PgStore::acquire_waiting`,
                    // `complete_waiting`), 583 000 → 388 000 instructions a pair.
                    let answers = Box::pin(write(items)).await;
                    debug_assert_eq!(answers.len(), replies.len());
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                    let _ = done.send(id);
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

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::{Batcher, Policy};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A writer that sleeps `ms` per batch (forever for a batch holding `stuck`, until
    /// `release` is notified), counting batches and the most it saw running at once.
    #[derive(Clone, Default)]
    struct Probe {
        batches: Arc<AtomicUsize>,
        running: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
        release: Arc<tokio::sync::Notify>,
    }

    impl Probe {
        fn batcher(&self, policy: Policy, ms: u64, stuck: Option<u32>) -> Arc<Batcher<u32, u32>> {
            let p = self.clone();
            Arc::new(Batcher::spawn(policy, move |items: Vec<u32>| {
                let p = p.clone();
                async move {
                    p.batches.fetch_add(1, Ordering::SeqCst);
                    let now = p.running.fetch_add(1, Ordering::SeqCst) + 1;
                    p.most.fetch_max(now, Ordering::SeqCst);
                    if stuck.is_some_and(|s| items.contains(&s)) {
                        p.release.notified().await;
                    } else {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    p.running.fetch_sub(1, Ordering::SeqCst);
                    items.into_iter().map(|i| i * 10).collect::<Vec<_>>()
                }
            }))
        }
    }

    async fn submit_all(b: &Arc<Batcher<u32, u32>>, n: u32) {
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let b = b.clone();
                tokio::spawn(async move { (i, b.submit(i).await.unwrap()) })
            })
            .collect();
        for t in tasks {
            let (i, answer) = t.await.unwrap();
            assert_eq!(answer, i * 10, "each request gets its own answer");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quick_batches_run_one_at_a_time_and_share_requests() {
        let probe = Probe::default();
        let policy = Policy { max: 8, in_flight: 4, patience: Duration::from_secs(5) };
        submit_all(&probe.batcher(policy, 5, None), 64).await;
        let n = probe.batches.load(Ordering::SeqCst);
        assert!((8..64).contains(&n), "64 concurrent requests in batches of at most 8 took {n} batches");
        assert_eq!(probe.most.load(Ordering::SeqCst), 1, "a second batch started beside a young one");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_than_in_flight_batches_run_at_once() {
        let probe = Probe::default();
        let policy = Policy { max: 2, in_flight: 3, patience: Duration::from_millis(1) };
        submit_all(&probe.batcher(policy, 50, None), 24).await;
        assert_eq!(probe.most.load(Ordering::SeqCst), 3, "slow batches: up to in_flight at once, never more");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stuck_batch_holds_back_only_its_own_requests() {
        let probe = Probe::default();
        let policy = Policy { max: 8, in_flight: 4, patience: Duration::from_millis(20) };
        let b = probe.batcher(policy, 1, Some(0));
        let stuck = tokio::spawn({
            let b = b.clone();
            async move { b.submit(0).await.unwrap() }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        // Requests after it are answered one batch at a time beside the stuck one.
        for i in 1..20u32 {
            let answer = tokio::time::timeout(Duration::from_secs(2), b.submit(i)).await;
            assert_eq!(answer.expect("held back by the stuck batch").unwrap(), i * 10);
        }
        assert!(!stuck.is_finished());
        probe.release.notify_one();
        assert_eq!(stuck.await.unwrap(), 0);
        assert_eq!(probe.most.load(Ordering::SeqCst), 2, "one stuck batch and one at a time beside it");
    }
}
