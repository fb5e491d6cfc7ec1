//! A failed fsync of the SQLite write-ahead log, end to end (idem-store `sqlite_sync`).
//!
//! `idem serve` runs under a small `LD_PRELOAD` library, compiled here with the C compiler,
//! that makes `fsync`/`fdatasync` of a `*-wal` file fail with EIO while a flag file
//! exists: what a dying disk does. After that, nothing may be acknowledged: writes and
//! reads answer 503 `not-durable`, `/healthz` and `/readyz` fail, and the node stays so
//! even once fsyncs succeed again (after a failed fsync Linux may have dropped the dirty
//! pages, so a later success proves nothing). A restart on a good disk finds everything
//! acknowledged before the failure.

mod common;

use common::Server;
use reqwest::StatusCode;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;

const SHIM: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Whether fd is a SQLite write-ahead log and the flag file exists. */
static int fail_now(int fd) {
    const char *flag = getenv("IDEM_TEST_WAL_SYNC_FAILS");
    if (flag == NULL || access(flag, F_OK) != 0) return 0;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 4) return 0;
    path[n] = 0;
    return strcmp(path + n - 4, "-wal") == 0;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    if (fail_now(fd)) { errno = EIO; return -1; }
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    if (fail_now(fd)) { errno = EIO; return -1; }
    return real(fd);
}
"#;

/// Compiles [`SHIM`] into `dir`; the library's path.
fn build_shim(dir: &Path) -> PathBuf {
    let src = dir.join("fail_wal_sync.c");
    let lib = dir.join("fail_wal_sync.so");
    std::fs::write(&src, SHIM).unwrap();
    let out = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .output()
        .expect("a C compiler (cc) to build the LD_PRELOAD library");
    assert!(out.status.success(), "cc failed: {}", String::from_utf8_lossy(&out.stderr));
    lib
}

/// Polls `path` until it answers `status` (at most 5 s); the last response.
async fn wait_status(s: &Server, path: &str, status: StatusCode) -> common::Resp {
    let start = std::time::Instant::now();
    loop {
        let r = common::Resp::read(s.http.get(s.url(path)).send().await.unwrap()).await;
        if r.status == status || start.elapsed() > Duration::from_secs(5) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failed_wal_fsync_nothing_is_acknowledged_until_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let lib = build_shim(dir.path());
    let flag = dir.path().join("fail-now");
    let db_url = format!("sqlite://{}", dir.path().join("idem.db").display());
    let s = Server::start_with_env(
        &db_url,
        &[],
        &[("LD_PRELOAD", lib.to_str().unwrap()), ("IDEM_TEST_WAL_SYNC_FAILS", flag.to_str().unwrap())],
    );

    // Acknowledged before the failure.
    let mut before = Vec::new();
    for i in 0..20 {
        let key = format!("before-{i}");
        let r = s.acquire(&key, json!({"i": i})).await;
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        let done = s
            .complete(
                &key,
                json!({"fencing_token": r.token(), "outcome": "succeeded", "provider_ref": format!("ref-{i}")}),
            )
            .await;
        assert_eq!(done.status, StatusCode::OK, "{done:?}");
        before.push((key, r.token()));
    }
    assert_eq!(wait_status(&s, "/healthz", StatusCode::OK).await.status, StatusCode::OK);

    // The disk starts failing fsyncs of the WAL.
    std::fs::write(&flag, b"").unwrap();
    let failed = s.acquire("after-1", json!({})).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE, "{failed:?}");
    assert_eq!(failed.problem(), "not-durable");
    assert!(failed.header("retry-after").is_some(), "{failed:?}");
    assert!(failed.body["detail"].as_str().unwrap().contains("fsync"), "the detail says why: {failed:?}");

    // Reads, liveness and readiness fail too.
    let read = s.record("before-0").await;
    assert_eq!(read.status, StatusCode::SERVICE_UNAVAILABLE, "{read:?}");
    assert_eq!(read.problem(), "not-durable");
    let live = wait_status(&s, "/healthz", StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(live.status, StatusCode::SERVICE_UNAVAILABLE, "{live:?}");
    assert_eq!(live.problem(), "not-durable");
    let ready = wait_status(&s, "/readyz", StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE, "{ready:?}");
    assert_eq!(ready.problem(), "not-durable");

    // fsyncs succeed again: the node still takes nothing until it is restarted.
    std::fs::remove_file(&flag).unwrap();
    for key in ["after-2", "before-0"] {
        let r = s.acquire(key, json!({})).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{key}: {r:?}");
        assert_eq!(r.problem(), "not-durable");
    }
    assert_eq!(wait_status(&s, "/healthz", StatusCode::OK).await.status, StatusCode::SERVICE_UNAVAILABLE);

    // A restart on a good disk: everything acknowledged is there; what was refused after
    // the failure never ran; writes are taken again.
    s.kill9();
    let s = Server::start(&db_url);
    for (key, token) in &before {
        let r = s.record(key).await;
        assert_eq!(r.status, StatusCode::OK, "{key}: {r:?}");
        assert_eq!(r.body["state"], "SUCCEEDED", "{key}: {r:?}");
        assert_eq!(r.body["fencing_token"], *token, "{key}");
    }
    assert_eq!(s.record("after-2").await.status, StatusCode::NOT_FOUND, "refused after the failure, never written");
    assert_eq!(s.acquire("after-3", json!({})).await.status, StatusCode::CREATED);
    assert_eq!(wait_status(&s, "/healthz", StatusCode::OK).await.status, StatusCode::OK);
}
