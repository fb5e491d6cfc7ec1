//! Slow clients (issue 15 §1): a connection that trickles its headers, or a declared body,
//! at 1 byte/s was held open indefinitely (still open after 60 s). Headers and bodies now
//! have deadlines (`--header-read-timeout-ms`, `--body-read-timeout-ms`).

mod common;

use common::{ADMIN_KEY, Backend, Db, Server};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Writes `head` at once, then `slow` one byte per `every`, while reading; returns what
/// the server sent and when the connection ended (EOF or reset), or `None` if it was
/// still open after `give_up`.
async fn trickle(
    addr: &str,
    head: &[u8],
    slow: &[u8],
    every: Duration,
    give_up: Duration,
) -> (String, Option<Duration>) {
    let started = Instant::now();
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let head = head.to_vec();
    let slow = slow.to_vec();
    let writer = tokio::spawn(async move {
        if wr.write_all(&head).await.is_err() {
            return;
        }
        for b in slow {
            tokio::time::sleep(every).await;
            if wr.write_all(&[b]).await.is_err() {
                return;
            }
        }
        std::future::pending::<()>().await;
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let ended = loop {
        match tokio::time::timeout_at((started + give_up).into(), rd.read(&mut buf)).await {
            Err(_) => break None,
            Ok(Ok(0) | Err(_)) => break Some(started.elapsed()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    };
    writer.abort();
    (String::from_utf8_lossy(&got).into_owned(), ended)
}

fn host(s: &Server) -> String {
    s.base.trim_start_matches("http://").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_slow_bodies_are_cut_off() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_args(&db.url, &["--header-read-timeout-ms", "1000", "--body-read-timeout-ms", "1500"]);
    let addr = host(&s);
    let second = Duration::from_secs(1);
    let give_up = Duration::from_secs(6);
    let body = br#"{"key": "slow-1", "action": "send_confirmation", "payload": {"pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}}"#;
    let headers = |len: usize| {
        format!(
            "POST /v1/operations HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ADMIN_KEY}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        )
    };

    // The issue's inputs. Headers at 1 byte/s: the connection is closed.
    let (_, ended) = trickle(&addr, b"", headers(body.len()).as_bytes(), second, give_up).await;
    let took = ended.expect("a connection trickling its headers is closed");
    assert!(took < Duration::from_secs(4), "closed after {took:?}");
    // A declared 1000-byte body at 1 byte/s: 408 problem+json, then closed.
    let (got, ended) = trickle(&addr, headers(1000).as_bytes(), &[b' '; 1000], second, give_up).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("/problems/request-timeout"), "{got}");
    assert!(ended.expect("closed after the 408") < Duration::from_secs(4));

    // Neighbours. A client that connects and sends nothing is closed too.
    let (_, ended) = trickle(&addr, b"", b"", second, give_up).await;
    assert!(ended.expect("an idle connection is closed") < Duration::from_secs(4));
    // A chunked body that never ends: 408.
    let chunked = format!(
        "POST /v1/operations HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ADMIN_KEY}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{{\r\n"
    );
    let (got, ended) = trickle(&addr, chunked.as_bytes(), b"1\r\n \r\n1\r\n \r\n", second, give_up).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(ended.is_some());
    // A slow but timely body (two halves 300 ms apart) is served, and nothing the slow
    // ones sent was recorded.
    let (half, rest) = body.split_at(body.len() / 2);
    let mut head = headers(body.len()).into_bytes();
    head.extend_from_slice(half);
    let (got, _) = trickle(&addr, &head, rest, Duration::from_millis(3), Duration::from_millis(1500)).await;
    assert!(got.starts_with("HTTP/1.1 201"), "{got}");
    let listed = s.get(ADMIN_KEY, "/v1/operations").await.body;
    assert_eq!(listed["items"].as_array().unwrap().len(), 1, "{listed}");
    // Fast clients on the same server are unaffected meanwhile.
    assert_eq!(s.get(ADMIN_KEY, "/v1/operations/slow-1").await.status, 200);
}
