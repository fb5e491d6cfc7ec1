//! The store's PostgreSQL connections send without Nagle's delay (`TCP_NODELAY`).
//!
//! sqlx 0.9.0 stopped setting it (sqlx#4335; fixed upstream by sqlx#4336, not yet
//! released), and the workspace patches sqlx-core with that fix (`vendor/README.md`).
//! Without it a statement whose message left in more than one segment — the hot path's
//! array parameters over TLS — waited for the server's delayed ACK: a batch writer
//! stalled 40–450 ms at a time. This test finds the connection's socket among the
//! process's file descriptors (by the client port PostgreSQL reports for it) and reads
//! the option back; it fails on the unpatched sqlx-core 0.9.0.

use idem_core::SystemClock;
use idem_store::postgres::PgStore;
use std::sync::Arc;

/// The local TCP port of socket `fd`, if it is an IPv4 or IPv6 socket.
fn local_port(fd: i32) -> Option<u16> {
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `addr` is a sockaddr_storage of `len` bytes; getsockname writes at most that.
    let r = unsafe { libc::getsockname(fd, (&raw mut addr).cast(), &mut len) };
    if r != 0 {
        return None;
    }
    match i32::from(addr.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a: &libc::sockaddr_in = unsafe { &*(&raw const addr).cast() };
            Some(u16::from_be(a.sin_port))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a: &libc::sockaddr_in6 = unsafe { &*(&raw const addr).cast() };
            Some(u16::from_be(a.sin6_port))
        }
        _ => None,
    }
}

/// `TCP_NODELAY` of socket `fd`.
fn nodelay(fd: i32) -> bool {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` is a c_int of `len` bytes.
    let r = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, (&raw mut v).cast(), &mut len) };
    assert_eq!(r, 0, "getsockopt(TCP_NODELAY) on fd {fd}");
    v != 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_connections_set_tcp_nodelay() {
    let db = idem_store::testing::fresh_pg_database("idem_nodelay").await;
    let store = PgStore::connect(&db.url, Arc::new(SystemClock), Default::default()).await.unwrap();
    let mut conn = store.pool().acquire().await.unwrap();
    let (port,): (i32,) = sqlx::query_as("SELECT client_port FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert!(port > 0, "the test connects over TCP (client_port {port}); set IDEM_TEST_PG_URL to a TCP address");
    let port = u16::try_from(port).unwrap();
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let socket = fds.into_iter().find(|&fd| local_port(fd) == Some(port));
    let fd = socket.unwrap_or_else(|| panic!("no socket of this process has local port {port}"));
    assert!(nodelay(fd), "the connection to PostgreSQL (local port {port}, fd {fd}) has Nagle's algorithm on");
}
