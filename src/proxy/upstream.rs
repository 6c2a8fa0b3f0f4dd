//! Connections to the workers: HTTP/1.1 keep-alive connections, pooled per worker.
//!
//! A gateway sends every request to one of a handful of workers it already knows, so the pool is
//! a queue of connections per worker and nothing more: no per-request key built from the URI, no
//! task spawned to watch a connection become idle, no boxed future. A connection goes back in its
//! queue as soon as the response head has arrived; it is busy until that response's body has
//! been read to the end, and a request takes the first connection in the queue that is ready,
//! passing over the busy ones (kept) and the closed ones (dropped: the worker closed them, or a
//! client went away mid-body and the connection was closed to abort the generation). When none
//! is ready within a few, it opens a new one.
//!
//! A request that a pooled connection could not send (the worker closed it while idle) is sent
//! again on another, as it never reached the worker; a failure once it was sent is the caller's.

use std::{
    collections::{HashMap, VecDeque},
    fmt, io,
    sync::Mutex,
    time::Duration,
};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper::{body::Incoming, client::conn::http1};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::workers::Worker;

type Sender = http1::SendRequest<Full<Bytes>>;

/// Pooled connections looked at, at most, before a request opens a new one: the oldest first,
/// since a connection goes back in its queue when its response starts and is ready again only
/// once that response has ended.
const READY_SCAN: usize = 4;

/// Why a request got no response from its worker.
#[derive(Debug)]
pub enum UpstreamError {
    /// No connection could be opened (refused, unreachable, timed out): the worker never saw the
    /// request, so another may take it.
    Connect(io::Error),
    /// The connection failed after the request was handed to it.
    Request(hyper::Error),
}

impl UpstreamError {
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }
}

impl fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpstreamError::Connect(_) => f.write_str("connect failed"),
            UpstreamError::Request(_) => f.write_str("request failed"),
        }
    }
}

impl std::error::Error for UpstreamError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            UpstreamError::Connect(e) => Some(e),
            UpstreamError::Request(e) => Some(e),
        }
    }
}

/// Keep-alive connections to the workers, by worker.
pub struct Connections {
    connect_timeout: Duration,
    idle: Mutex<HashMap<u64, VecDeque<Sender>>>,
}

impl Connections {
    pub fn new(connect_timeout: Duration) -> Self {
        Self {
            connect_timeout,
            idle: Mutex::new(HashMap::new()),
        }
    }

    /// Sends `req` (origin-form URI, `Host` set) to `worker` and returns the response head; the
    /// body streams from the connection, which is reused once the body has been read to its end.
    pub async fn send(
        &self,
        worker: &Worker,
        mut req: Request<Full<Bytes>>,
    ) -> Result<http::Response<Incoming>, UpstreamError> {
        loop {
            let (mut sender, pooled) = match self.checkout(worker.id_hash) {
                Some(s) => (s, true),
                None => (self.connect(worker).await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    self.checkin(worker.id_hash, sender);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    // Never written: the pooled connection had closed. Another one sends it.
                    Some(unsent) if pooled => req = unsent,
                    _ => return Err(UpstreamError::Request(e.into_error())),
                },
            }
        }
    }

    fn checkout(&self, worker: u64) -> Option<Sender> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let queue = idle.get_mut(&worker)?;
        let mut looked = 0;
        while looked < READY_SCAN {
            let sender = queue.pop_front()?;
            if sender.is_ready() {
                return Some(sender);
            }
            if !sender.is_closed() {
                queue.push_back(sender); // still streaming a response
                looked += 1;
            }
        }
        None
    }

    fn checkin(&self, worker: u64, sender: Sender) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.entry(worker).or_default().push_back(sender);
    }

    async fn connect(&self, worker: &Worker) -> Result<Sender, UpstreamError> {
        if worker.scheme != http::uri::Scheme::HTTP {
            return Err(UpstreamError::Connect(io::Error::new(
                io::ErrorKind::InvalidInput,
                "only http:// workers are supported",
            )));
        }
        let host = worker.authority.host();
        // An IPv6 literal comes bracketed in a URL, not in an address.
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let addr = (host, worker.authority.port_u16().unwrap_or(80));
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(UpstreamError::Connect(e)),
                Err(_) => {
                    return Err(UpstreamError::Connect(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no connection within {:?}", self.connect_timeout),
                    )))
                }
            };
        stream.set_nodelay(true).map_err(UpstreamError::Connect)?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(UpstreamError::Request)?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "worker connection ended");
            }
        });
        Ok(sender)
    }
}
