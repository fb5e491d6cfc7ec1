//! The HTTP/1.1 and HTTP/2 server loop (hyper), with what `axum::serve` does not offer: a
//! deadline for a client to send its request headers, so a connection that trickles its
//! headers (or sends nothing) is closed instead of held open indefinitely (issue 15 §1).
//! Body deadlines and the in-flight budget are [`crate::request_body`]'s.

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

/// How long connections still open at shutdown may finish their requests.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` until `shutdown` completes, then lets open connections
/// finish (at most 30 s). A client gets `header_read_timeout` to send its first byte and
/// then each request's headers (HTTP/1.1; the connection is closed after it).
///
/// # Errors
/// None today: accept errors (e.g. too many open files) are logged and retried.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    header_read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            // hyper's header deadline starts with the first byte: a client that connects
            // and sends nothing gets the same deadline for that first byte.
            let mut first = [0u8; 1];
            if !matches!(tokio::time::timeout(header_read_timeout, stream.peek(&mut first)).await, Ok(Ok(n)) if n > 0) {
                return;
            }
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            // A client that goes away, or is closed for its slow headers, ends here.
            let _ = watcher.watch(conn.into_owned()).await;
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await;
    Ok(())
}
