//! The write-ahead log's fsync on a thread of its own: pipelined group commit on SQLite.
//!
//! With `synchronous=FULL` SQLite fsyncs the WAL inside `COMMIT`, on the writer's thread:
//! the writer sat idle for the whole fsync (1–2 ms on this machine kind's disk, measured
//! with `strace -T` under `idem bench`; half of the writer's time at concurrency 64), and
//! the requests that arrived meanwhile waited for the next batch. Now the writer's
//! connection runs `synchronous=NORMAL` — `COMMIT` writes the WAL frames to the file
//! without an fsync — and hands each batch's answers to the [`Syncer`], which fsyncs
//! (`fdatasync`) the WAL file and only then answers. The writer meanwhile runs the next
//! batch. One fsync covers every commit written before it started, so under load each
//! covers one or more batches.
//!
//! What that keeps:
//! - **No answer before its commit is durable.** A batch's answers are handed over only
//!   after its `COMMIT` returned, so its frames are in the file before the fsync that
//!   answers it starts. Batches are answered in order, so an answer that depends on an
//!   earlier batch's write (a replay of a key completed one batch before) waits for that
//!   write's fsync too.
//! - **Reads.** Readers on other connections see a commit as soon as `COMMIT` returns,
//!   before its fsync. Every read through the store therefore waits, after it read, until
//!   every commit started before the read ended is durable ([`Durability::settled`]): the
//!   writer counts a commit right before its `COMMIT`, so a read that saw any of its
//!   writes sees the count. Usually nothing is waited for, and a read never waits for a
//!   batch that is still waiting for another process's write lock.
//! - **SQLite's own rules.** With `synchronous=NORMAL` in WAL mode SQLite still syncs the
//!   WAL before each checkpoint, the database file after it, and the WAL header when the
//!   log starts over (<https://www.sqlite.org/pragma.html#pragma_synchronous>); only the
//!   per-commit sync moved here. The WAL's directory entry is synced once when the store
//!   opens (SQLite syncs it at the first sync of a new WAL under `FULL`, which no longer
//!   happens at commit), and the WAL is never deleted while the writer's connection is open.
//! - **A failed fsync stops writes.** After `fdatasync` fails, Linux may have dropped the
//!   dirty pages and a later fsync may succeed without them (PostgreSQL's "fsyncgate",
//!   2018). So the first failure is kept: the batches it covered and every later one are
//!   answered with it (503, the outcome unknown), reads fail with it, and the writer runs
//!   no more batches until idem is restarted (SQLite's recovery then reads what the WAL
//!   really holds).
//! - Other processes writing the file use their own connections' `synchronous=FULL`.
//!
//! `kill -9` never needed the fsync (the frames are in the OS's page cache once `COMMIT`
//! returns); the fsync is what keeps them through a power loss or an OS crash, and it is
//! still done before any answer.

use crate::StoreError;
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::time::Instant;
use tokio::sync::watch;

/// How far the writer's commits have got: numbered as they start, and durable.
#[derive(Debug)]
pub(crate) struct Durability {
    /// The number of the writer's last commit, counted right before its `COMMIT`.
    committed: AtomicU64,
    /// The number of the last commit whose writes are durable.
    durable: watch::Sender<u64>,
    /// Why the WAL could not be synced, once that happened.
    failed: OnceLock<String>,
}

impl Durability {
    fn new() -> Durability {
        Durability { committed: AtomicU64::new(0), durable: watch::Sender::new(0), failed: OnceLock::new() }
    }

    /// Numbers a commit of the writer's connection; call right before its `COMMIT` (a
    /// reader can see its writes only after that). Not before the batch's `BEGIN`: that
    /// may wait for another process's write lock, and reads would wait with it.
    pub(crate) fn committing(&self) -> u64 {
        self.committed.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The number of the writer's last commit (begun or done): a batch handed over with it
    /// is answered once every commit up to it is durable.
    pub(crate) fn last(&self) -> u64 {
        self.committed.load(Ordering::SeqCst)
    }

    /// The first fsync failure, if any (see the module's docs).
    pub(crate) fn failure(&self) -> Option<StoreError> {
        self.failed.get().map(|m| StoreError::NotDurable(m.clone()))
    }

    /// `value`, read from the database, once every commit started before this call is durable:
    /// what a read saw can no longer be lost. Errors with the fsync failure if there was
    /// one.
    pub(crate) async fn settled<T>(&self, value: T) -> Result<T, StoreError> {
        let committed = self.last();
        if *self.durable.borrow() < committed {
            let mut rx = self.durable.subscribe();
            // The sender lives in this struct, so the channel cannot close under us.
            let _ = rx.wait_for(|&d| d >= committed).await;
        }
        match self.failure() {
            Some(e) => Err(e),
            None => Ok(value),
        }
    }
}

/// Delivers a batch's answers; given `Err(why)` when its commit could not be made durable
/// (then [`StoreError::NotDurable`]`(why)` is the answer to every write of the batch).
pub(crate) type Deliver = Box<dyn FnOnce(Result<(), &str>) + Send>;

struct Job {
    /// The writer's last commit when the batch was handed over ([`Durability::last`]).
    upto: u64,
    /// Whether the batch changed a row (a batch that wrote nothing needs no fsync).
    wrote: bool,
    deliver: Deliver,
}

/// The thread that fsyncs the WAL and then answers (see the module's docs).
pub(crate) struct Syncer {
    /// `None` only while dropping (closing the channel ends the thread).
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    durability: Arc<Durability>,
}

impl Syncer {
    /// Opens `wal` (which must exist: the writer's connection has read the database),
    /// syncs its directory entry once, and starts the thread.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] if the WAL file or its directory cannot be opened or
    /// synced, or the thread cannot start.
    pub(crate) fn start(wal: &Path) -> Result<Syncer, StoreError> {
        let why = |what: &str, e: std::io::Error| StoreError::Invalid(format!("{what} {}: {e}", wal.display()));
        let file = File::open(wal).map_err(|e| why("cannot open the write-ahead log", e))?;
        let dir = wal.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| why("cannot sync the directory of the write-ahead log", e))?;
        Syncer::spawn(move || file.sync_data())
    }

    /// Starts the thread with `sync` as the fsync (tests give one that fails or waits).
    fn spawn(sync: impl FnMut() -> std::io::Result<()> + Send + 'static) -> Result<Syncer, StoreError> {
        let durability = Arc::new(Durability::new());
        let (tx, rx) = mpsc::channel::<Job>();
        let state = durability.clone();
        let thread = std::thread::Builder::new()
            .name("idem-sqlite-sync".into())
            .spawn(move || sync_loop(sync, &rx, &state))
            .map_err(|e| StoreError::Invalid(format!("cannot start the WAL's sync thread: {e}")))?;
        Ok(Syncer { jobs: Some(tx), thread: Some(thread), durability })
    }

    /// The shared counters readers wait on.
    pub(crate) fn durability(&self) -> &Arc<Durability> {
        &self.durability
    }

    /// Hands over a batch after its `COMMIT` (or its failure) returned; `deliver` runs once
    /// every commit of the writer's so far ([`Durability::last`]) is durable, in the order
    /// handed over.
    pub(crate) fn submit(&self, wrote: bool, deliver: Deliver) {
        let upto = self.durability.last();
        let jobs = self.jobs.as_ref().expect("the channel is open until the syncer is dropped");
        if let Err(mpsc::SendError(job)) = jobs.send(Job { upto, wrote, deliver }) {
            // The thread is gone (it panicked): answer rather than drop silently.
            (job.deliver)(Err("the WAL's sync thread stopped; the outcome is unknown"));
        }
    }
}

impl Drop for Syncer {
    /// Answers everything handed over (after its fsync) before the writer closes the
    /// connection.
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn sync_loop(mut sync: impl FnMut() -> std::io::Result<()>, jobs: &mpsc::Receiver<Job>, state: &Durability) {
    while let Ok(first) = jobs.recv() {
        let mut group = vec![first];
        group.extend(jobs.try_iter());
        let last = group.iter().map(|j| j.upto).max().unwrap_or(0);
        let result = if let Some(why) = state.failed.get() {
            Err(why.clone())
        } else if !group.iter().any(|j| j.wrote) {
            Ok(())
        } else {
            let start = Instant::now();
            match sync() {
                Ok(()) => {
                    metrics::histogram!("idem_store_sync_seconds", "backend" => "sqlite")
                        .record(start.elapsed().as_secs_f64());
                    Ok(())
                }
                Err(e) => {
                    let why = format!(
                        "fsync of the SQLite write-ahead log failed ({e}): what was committed since the last \
                         fsync may not be durable"
                    );
                    tracing::error!("{why}; idem takes no more writes until it is restarted");
                    Err(state.failed.get_or_init(|| why).clone())
                }
            }
        };
        // Durable first, so a reader woken by an answer finds its batch counted.
        state.durable.send_modify(|d| *d = (*d).max(last));
        for job in group {
            (job.deliver)(result.as_ref().map(|_| ()).map_err(String::as_str));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    /// What happened, in order: `sync start`, `sync end`, `deliver N ok|err`.
    type Log = Arc<Mutex<Vec<String>>>;

    fn note(log: &Log, what: String) {
        log.lock().unwrap().push(what);
    }

    fn deliver(log: &Log, n: u64) -> Deliver {
        let log = log.clone();
        Box::new(move |r: Result<(), &str>| note(&log, format!("deliver {n} {}", if r.is_ok() { "ok" } else { "err" })))
    }

    /// A sync that takes 20 ms and fails on the calls `fail_on` names (1-based).
    fn slow_sync(log: &Log, fail_on: &'static [usize]) -> impl FnMut() -> std::io::Result<()> + Send + 'static {
        let (log, mut calls) = (log.clone(), 0);
        move || {
            calls += 1;
            note(&log, "sync start".into());
            std::thread::sleep(Duration::from_millis(20));
            note(&log, "sync end".into());
            if fail_on.contains(&calls) { Err(std::io::Error::other("injected")) } else { Ok(()) }
        }
    }

    #[test]
    fn answers_follow_the_fsync_that_covers_them_in_batch_order() {
        let log: Log = Arc::default();
        let syncer = Syncer::spawn(slow_sync(&log, &[])).unwrap();
        for n in 1..=5 {
            let number = syncer.durability().committing();
            assert_eq!(number, n);
            assert_eq!(syncer.durability().last(), n);
            syncer.submit(true, deliver(&log, n));
        }
        drop(syncer); // joins: everything handed over is answered
        let log = log.lock().unwrap().clone();
        let delivered: Vec<&String> = log.iter().filter(|l| l.starts_with("deliver")).collect();
        assert_eq!(delivered, ["deliver 1 ok", "deliver 2 ok", "deliver 3 ok", "deliver 4 ok", "deliver 5 ok"]);
        // Every answer comes after a sync that ended after it was handed over: the first
        // answer follows the first "sync end", and no answer sits between a start and its end.
        let first_end = log.iter().position(|l| l == "sync end").unwrap();
        let first_deliver = log.iter().position(|l| l.starts_with("deliver")).unwrap();
        assert!(first_deliver > first_end, "{log:?}");
        let mut in_sync = false;
        for l in &log {
            match l.as_str() {
                "sync start" => in_sync = true,
                "sync end" => in_sync = false,
                _ => assert!(!in_sync, "an answer during a sync: {log:?}"),
            }
        }
    }

    #[test]
    fn a_batch_that_wrote_nothing_costs_no_fsync() {
        let log: Log = Arc::default();
        let syncer = Syncer::spawn(slow_sync(&log, &[])).unwrap();
        syncer.submit(false, deliver(&log, 1));
        drop(syncer);
        assert_eq!(log.lock().unwrap().clone(), ["deliver 1 ok"]);
    }

    #[tokio::test]
    async fn a_failed_fsync_fails_its_batches_every_later_one_and_reads() {
        let log: Log = Arc::default();
        let syncer = Syncer::spawn(slow_sync(&log, &[1])).unwrap();
        let durability = syncer.durability().clone();
        let n = durability.committing();
        syncer.submit(true, deliver(&log, n));
        // Wait for the failure to be recorded, then a later batch that wrote nothing.
        assert!(durability.settled(()).await.is_err(), "a read after a failed fsync fails");
        let failure = durability.failure().unwrap();
        assert!(matches!(failure, StoreError::NotDurable(_)), "{failure:?}");
        assert!(failure.to_string().contains("fsync of the SQLite write-ahead log failed"), "{failure}");
        syncer.submit(false, deliver(&log, 2));
        drop(syncer);
        let log = log.lock().unwrap().clone();
        assert_eq!(log.iter().filter(|l| *l == "sync start").count(), 1, "no fsync after a failure: {log:?}");
        assert!(log.contains(&"deliver 1 err".to_owned()) && log.contains(&"deliver 2 err".to_owned()), "{log:?}");
    }

    #[tokio::test]
    async fn a_read_waits_until_every_commit_started_before_it_is_durable() {
        let log: Log = Arc::default();
        let syncer = Syncer::spawn(slow_sync(&log, &[])).unwrap();
        let durability = syncer.durability().clone();
        // Nothing begun: a read does not wait.
        assert_eq!(durability.settled(7).await.unwrap(), 7);
        let n = durability.committing();
        // The commit is under way (not handed over): a read must not finish before it is
        // durable.
        let reader = {
            let d = durability.clone();
            let log = log.clone();
            tokio::spawn(async move {
                d.settled(()).await.unwrap();
                note(&log, "read done".into());
            })
        };
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!reader.is_finished(), "the read waits for the batch it may have seen");
        syncer.submit(true, deliver(&log, n));
        reader.await.unwrap();
        let log = log.lock().unwrap().clone();
        let end = log.iter().position(|l| l == "sync end").unwrap();
        let read = log.iter().position(|l| l == "read done").unwrap();
        assert!(read > end, "{log:?}");
    }
}
