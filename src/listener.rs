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
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{mpsc, OwnedSemaphorePermit, Semaphore},
};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::config::LimitsConfig;

/// Binds `addr` with `backlog` pending connections allowed (the kernel caps it at
/// `net.core.somaxconn`).
pub fn bind(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// An accepted connection on its way to another event loop, with its place under the cap.
pub type Handoff = (std::net::TcpStream, OwnedSemaphorePermit);

/// Serves `app` on `listener` until `shutdown`, then stops accepting and waits for every open
/// connection to finish its requests (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &LimitsConfig,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_spread(listener, app, limits, Vec::new(), shutdown).await
}

/// [`serve`], handing accepted connections in turn to this loop and to the loops behind
/// `others` (see [`serve_handed`]): one acceptor, so the connection cap is exact, and each
/// connection then lives on one loop. A loop that has gone away is skipped.
pub async fn serve_spread(
    listener: TcpListener,
    app: Router,
    limits: &LimitsConfig,
    others: Vec<mpsc::UnboundedSender<Handoff>>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let builder = conn_builder(limits);
    static ACCEPT: crate::logging::Throttle = crate::logging::Throttle::new(1);
    let mut turn = 0usize;
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
        turn = (turn + 1) % (others.len() + 1);
        let (tcp, permit) = match turn.checked_sub(1).map(|i| &others[i]) {
            None => (tcp, permit),
            Some(loop_) => match tcp.into_std() {
                Ok(std) => match loop_.send((std, permit)) {
                    Ok(()) => continue,
                    Err(mpsc::error::SendError((std, permit))) => {
                        (TcpStream::from_std(std)?, permit)
                    }
                },
                Err(e) => {
                    tracing::debug!("cannot hand a connection over: {e}");
                    continue;
                }
            },
        };
        serve_conn(&builder, &graceful, &app, tcp, permit);
    }
    drop(listener);
    drop(others);
    graceful.shutdown().await;
    Ok(())
}

/// Serves the connections handed over by [`serve_spread`] on the calling loop until the
/// acceptor stops, then waits for them to finish their requests.
pub async fn serve_handed(
    mut handed: mpsc::UnboundedReceiver<Handoff>,
    app: Router,
    limits: &LimitsConfig,
) {
    let graceful = GracefulShutdown::new();
    let builder = conn_builder(limits);
    while let Some((std, permit)) = handed.recv().await {
        match TcpStream::from_std(std) {
            Ok(tcp) => serve_conn(&builder, &graceful, &app, tcp, permit),
            Err(e) => tracing::debug!("cannot take a connection over: {e}"),
        }
    }
    graceful.shutdown().await;
}

fn conn_builder(limits: &LimitsConfig) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs_f64(limits.header_read_timeout_seconds));
    builder
}

/// Runs one connection on the calling loop; its permit is released when it closes.
fn serve_conn(
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    app: &Router,
    tcp: TcpStream,
    permit: OwnedSemaphorePermit,
) {
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
