//! A TCP fault proxy for tests: forwards bytes both ways, but for its first `cuts`
//! connections, once the client has sent `trigger` (e.g. the end of an SMTP DATA body,
//! `\r\n.\r\n`, or of HTTP headers), it swallows the upstream's next reply and closes the
//! connection: the side effect is done upstream, the reply is lost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy; stops with the test's runtime.
pub struct FaultProxy {
    pub addr: SocketAddr,
    cuts_left: Arc<AtomicUsize>,
    pub cut_done: Arc<AtomicUsize>,
}

impl FaultProxy {
    pub async fn start(upstream: SocketAddr, trigger: &'static [u8], cuts: usize) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cuts_left = Arc::new(AtomicUsize::new(cuts));
        let cut_done = Arc::new(AtomicUsize::new(0));
        let (left, done) = (cuts_left.clone(), cut_done.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let faulty = left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
                let done = done.clone();
                tokio::spawn(async move {
                    if let Ok(up) = TcpStream::connect(upstream).await {
                        pump(client, up, faulty.then_some(trigger), done).await;
                    }
                });
            }
        });
        FaultProxy { addr, cuts_left, cut_done }
    }

    /// Cuts still to make.
    pub fn cuts_left(&self) -> usize {
        self.cuts_left.load(Ordering::SeqCst)
    }
}

async fn pump(client: TcpStream, upstream: TcpStream, trigger: Option<&'static [u8]>, done: Arc<AtomicUsize>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let armed = AtomicBool::new(false);
    let to_upstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut tail: Vec<u8> = Vec::new();
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if uw.write_all(&buf[..n]).await.is_err() {
                return;
            }
            if let Some(t) = trigger {
                tail.extend_from_slice(&buf[..n]);
                if tail.windows(t.len()).any(|w| w == t) {
                    armed.store(true, Ordering::SeqCst);
                }
                let keep = tail.len().saturating_sub(t.len());
                tail.drain(..keep);
            }
        }
    };
    let to_client = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match ur.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if armed.load(Ordering::SeqCst) {
                done.fetch_add(1, Ordering::SeqCst);
                return; // the reply is lost: everything is dropped and closed
            }
            if cw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = to_upstream => {},
        () = to_client => {},
    }
}
