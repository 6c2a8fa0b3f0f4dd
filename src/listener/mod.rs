//! The accept loop: a global connection cap, a deadline for request headers, and a graceful
//! drain; plus binding with a configurable listen backlog. HTTP/1.1 is served by the gateway's
//! own server (`h1`) until a request needs hyper's; HTTP/2 by hyper.
//!
//! A connection holds one permit of the cap from accept to close; at the cap the loop stops
//! accepting (new connections wait in the kernel's backlog) instead of letting slow or idle
//! clients exhaust descriptors and memory. HTTP/1 request headers must arrive within
//! `header_read_timeout_seconds` (the connection is closed otherwise), so a client trickling
//! header bytes holds its slot only that long. Running out of descriptors on accept is
//! logged (throttled) and retried after a short pause, never a busy loop.

mod h1;
mod rewind;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
};
use tokio::{
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{mpsc, OwnedSemaphorePermit, Semaphore},
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{config::LimitsConfig, dispatch::Gateway};

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
    app: Gateway,
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
    app: Gateway,
    limits: &LimitsConfig,
    others: Vec<mpsc::UnboundedSender<Handoff>>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let conns = Connections::new(limits);
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
        conns.serve(&app, tcp, permit);
    }
    drop(listener);
    drop(others);
    conns.drain().await;
    Ok(())
}

/// Serves the connections handed over by [`serve_spread`] on the calling loop until the
/// acceptor stops, then waits for them to finish their requests.
pub async fn serve_handed(
    mut handed: mpsc::UnboundedReceiver<Handoff>,
    app: Gateway,
    limits: &LimitsConfig,
) {
    let conns = Connections::new(limits);
    while let Some((std, permit)) = handed.recv().await {
        match TcpStream::from_std(std) {
            Ok(tcp) => conns.serve(&app, tcp, permit),
            Err(e) => tracing::debug!("cannot take a connection over: {e}"),
        }
    }
    conns.drain().await;
}

/// The connections of one event loop: how they are served, and their graceful drain.
struct Connections {
    http: Arc<Http>,
    /// Cancelled when the loop stops accepting: each connection finishes its request and closes.
    stop: CancellationToken,
    tracker: TaskTracker,
}

struct Http {
    http1: http1::Builder,
    /// For HTTP/2 with prior knowledge, and for a first segment too short to tell.
    auto: auto::Builder<TokioExecutor>,
    /// How long a new connection may stay silent before its first byte.
    first_byte: Duration,
}

/// HTTP/2's connection preface (RFC 9113 §3.4): how an h2c client with prior knowledge opens.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

enum Protocol {
    Http1,
    /// The preface, or a first segment that is a prefix of it.
    MaybeHttp2,
}

impl Connections {
    fn new(limits: &LimitsConfig) -> Self {
        let header_timeout = Duration::from_secs_f64(limits.header_read_timeout_seconds);
        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout);
        let mut auto = auto::Builder::new(TokioExecutor::new());
        auto.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout);
        Self {
            http: Arc::new(Http {
                http1,
                auto,
                first_byte: header_timeout,
            }),
            stop: CancellationToken::new(),
            tracker: TaskTracker::new(),
        }
    }

    /// Runs one connection on the calling loop; its permit is released when it closes.
    ///
    /// The protocol is told by peeking at the first bytes rather than reading them, as hyper's
    /// `auto` server does: read, they would reach HTTP/1's buffer as a short first read, and
    /// growing that buffer for the rest of the request doubles it to 16 KiB for the life of the
    /// connection (8 KiB of memory per open stream). HTTP/2 (rare here) still goes through `auto`.
    fn serve(&self, app: &Gateway, tcp: TcpStream, permit: OwnedSemaphorePermit) {
        // Without TCP_NODELAY an SSE event written right after the headers waits for the
        // client's delayed ACK (~40 ms on Linux).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
        let service = app.clone();
        let (http, stop) = (Arc::clone(&self.http), self.stop.clone());
        self.tracker.spawn(async move {
            let _permit = permit;
            let protocol = tokio::select! {
                p = tokio::time::timeout(http.first_byte, sniff(&tcp)) => match p {
                    Ok(Ok(Some(p))) => p,
                    // Closed, failed, or silent past the header deadline.
                    _ => return,
                },
                () = stop.cancelled() => return,
            };
            let ended = match protocol {
                Protocol::Http1 => match h1::serve(tcp, &service, http.first_byte, &stop).await {
                    h1::Ended::Closed => Ok(()),
                    h1::Ended::ToHyper(tcp, read) => {
                        tracing::debug!(
                            head = %String::from_utf8_lossy(&read[..read.len().min(80)]),
                            "a request for hyper's HTTP/1 server; it serves the rest of the connection"
                        );
                        // Boxed: kept out of the connection's task until it is needed.
                        let conn = Box::pin(
                            http.http1
                                .serve_connection(
                                    TokioIo::new(rewind::Rewound::new(read, tcp)),
                                    service,
                                )
                                .with_upgrades(),
                        );
                        until_stopped(conn, &stop, |c| c.get_mut().as_mut().graceful_shutdown())
                            .await
                            .map_err(|e| e.to_string())
                    }
                },
                Protocol::MaybeHttp2 => {
                    // Boxed: kept out of the (much more common) HTTP/1 connection's task.
                    let conn = Box::pin(
                        http.auto
                            .serve_connection_with_upgrades(TokioIo::new(tcp), service),
                    );
                    until_stopped(conn, &stop, |c| c.get_mut().as_mut().graceful_shutdown())
                        .await
                        .map_err(|e| e.to_string())
                }
            };
            if let Err(e) = ended {
                tracing::trace!("connection ended: {e}");
            }
        });
    }

    /// Asks every connection to finish its request and close, and waits until they have.
    async fn drain(self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// Which protocol the connection speaks, from its first bytes left unread in the socket; `None`
/// when it closes first.
async fn sniff(tcp: &TcpStream) -> std::io::Result<Option<Protocol>> {
    let mut first = [0u8; H2_PREFACE.len()];
    let n = tcp.peek(&mut first).await?;
    Ok(match n {
        0 => None,
        n if first[..n] == H2_PREFACE[..n] => Some(Protocol::MaybeHttp2),
        _ => Some(Protocol::Http1),
    })
}

/// Runs `conn` to its end; once `stop` fires, asks it (through `shut`) to finish gracefully.
async fn until_stopped<C, E>(
    conn: C,
    stop: &CancellationToken,
    shut: impl FnOnce(std::pin::Pin<&mut C>),
) -> Result<(), E>
where
    C: std::future::Future<Output = Result<(), E>>,
{
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        ended = conn.as_mut() => return ended,
        () = stop.cancelled() => {}
    }
    shut(conn.as_mut());
    conn.await
}
