//! The accept loop: a global connection cap, a deadline for request headers, and a graceful
//! drain; plus binding with a configurable listen backlog.
//!
//! A connection holds one permit of the cap from accept to close; at the cap the loop stops
//! accepting (new connections wait in the kernel's backlog) instead of letting slow or idle
//! clients exhaust descriptors and memory. HTTP/1 request headers must arrive within
//! `header_read_timeout_seconds` (hyper's timer closes the connection otherwise), so a client
//! trickling header bytes holds its slot only that long. Running out of descriptors on accept is
//! logged (throttled) and retried after a short pause, never a busy loop.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{body::Body, Router};
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use tokio::{
    net::{TcpListener, TcpSocket},
    sync::Semaphore,
};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::config::LimitsConfig;

/// Binds `addr` with `backlog` pending connections allowed (the kernel caps it at
/// `net.core.somaxconn`).
pub fn bind(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    bind_with(addr, backlog, false)
}

/// `n` listening sockets on `addr` with `SO_REUSEPORT`, so the kernel spreads new connections
/// over them (one per event loop); with port 0, all on the port the first one got. Must be
/// called inside a Tokio runtime; hand each socket to its loop with `into_std`.
pub fn bind_many(addr: SocketAddr, backlog: u32, n: usize) -> std::io::Result<Vec<TcpListener>> {
    let first = bind_with(addr, backlog, n > 1)?;
    let addr = first.local_addr()?;
    let mut all = vec![first];
    for _ in 1..n {
        all.push(bind_with(addr, backlog, true)?);
    }
    Ok(all)
}

fn bind_with(addr: SocketAddr, backlog: u32, reuse_port: bool) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    #[cfg(unix)]
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Serves `app` on `listener` until `shutdown`, then stops accepting and waits for every open
/// connection to finish its requests (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &LimitsConfig,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    serve_capped(listener, app, limits, permits, shutdown).await
}

/// [`serve`] with the connection cap's permits given: several accept loops share one cap.
pub async fn serve_capped(
    listener: TcpListener,
    app: Router,
    limits: &LimitsConfig,
    permits: Arc<Semaphore>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs_f64(limits.header_read_timeout_seconds));
    static ACCEPT: crate::logging::Throttle = crate::logging::Throttle::new(1);
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            p = Arc::clone(&permits).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let tcp = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    if let Some(suppressed) = ACCEPT.allow() {
                        tracing::warn!(error = %e, suppressed, "accept failed; pausing accepts briefly");
                    }
                    // Out of descriptors or similar: let connections close before trying again.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Without TCP_NODELAY an SSE event written right after the headers waits for the
        // client's delayed ACK (~40 ms on Linux).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
        let service = app
            .clone()
            .map_request(|req: http::Request<Incoming>| req.map(Body::new));
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(tcp), TowerToHyperService::new(service))
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::trace!("connection ended: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
