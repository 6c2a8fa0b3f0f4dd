//! Connections to the workers: HTTP/1.1 keep-alive connections, pooled per worker.
//!
//! A gateway sends every request to one of a handful of workers it already knows, so the pool is
//! a queue of idle connections per worker and nothing more: no per-request key built from the
//! URI, no task per connection, no boxed future. A request takes the most recently idle
//! connection to its worker (or opens one), writes itself and reads the response head in its own
//! task (`http1/`); the response body owns the connection and puts it back in the queue when it
//! has been read to its end. A body dropped before that (the client went away) closes the
//! connection, which is how the worker learns to abort the generation.
//!
//! A request that a pooled connection could not send (the worker closed it while idle) is sent
//! again on another, as it never reached the worker; a failure once it was sent is the caller's.
//! A connection that may have been idle for the idle timeout (`timeouts.worker_idle_seconds`) is
//! closed and never sent on: the workers close theirs too (vLLM after 5 s), and a request written
//! as the worker closes its end is lost after it was sent, which no proxy can safely repeat. So
//! the pool must give up a connection first; it also keeps a burst's connections from staying.

use std::{
    collections::{HashMap, VecDeque},
    fmt, io,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Weak,
    },
    time::Duration,
};

use parking_lot::Mutex;

use bytes::BytesMut;
use tokio::{net::TcpStream, time::Instant};

use super::{
    http1::{self, DrainedAt, UpstreamBody},
    Outgoing,
};
use crate::workers::Worker;

/// Why a request got no response from its worker.
#[derive(Debug)]
pub enum UpstreamError {
    /// No connection could be opened (refused, unreachable, timed out): the worker never saw the
    /// request, so another may take it.
    Connect(io::Error),
    /// The request was written, at least in part, and no valid response head came back.
    Request(io::Error),
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
            UpstreamError::Connect(e) | UpstreamError::Request(e) => Some(e),
        }
    }
}

/// An idle connection, and the earliest it may have become idle, as the worker sees it.
struct Pooled {
    io: TcpStream,
    since: Instant,
}

impl Pooled {
    /// Perhaps idle for `timeout`, as the worker sees it: to be closed.
    fn expired(&self, now: Instant, timeout: Duration) -> bool {
        now.duration_since(self.since) >= timeout
    }

    /// The worker has closed it, or sent bytes nobody asked for: either way, not to be used.
    /// Costs no system call unless the event loop has seen the socket become readable, so a close
    /// that arrived after the loop last polled epoll goes unseen, and the request sent on it
    /// fails (nginx watches its idle worker connections through the same events).
    fn closed(&self) -> bool {
        !matches!(self.io.try_read(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

type Queues = Mutex<HashMap<u64, VecDeque<Pooled>>>;

/// Keep-alive connections to the workers, by worker.
pub struct Connections {
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Arc<Queues>,
    reaping: AtomicBool,
}

/// Where a response body puts its connection back.
pub(super) struct Home {
    queues: Weak<Queues>,
    worker: u64,
}

impl Home {
    /// The body ended where its framing said: the connection may serve another request. The
    /// worker has been idle on it since `drained_at` at the earliest.
    pub(super) fn reuse(self, io: TcpStream, drained_at: DrainedAt) {
        if let Some(queues) = self.queues.upgrade() {
            checkin(&queues, self.worker, io, drained_at);
        }
    }
}

fn lock(queues: &Queues) -> parking_lot::MutexGuard<'_, HashMap<u64, VecDeque<Pooled>>> {
    queues.lock()
}

fn checkin(queues: &Queues, worker: u64, io: TcpStream, since: Instant) {
    lock(queues)
        .entry(worker)
        .or_default()
        .push_back(Pooled { io, since });
}

impl Connections {
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Self {
            connect_timeout,
            idle_timeout,
            idle: Arc::default(),
            reaping: AtomicBool::new(false),
        }
    }

    /// Idle connections pooled for `worker`.
    #[cfg(test)]
    pub fn pooled(&self, worker: u64) -> usize {
        lock(&self.idle).get(&worker).map_or(0, VecDeque::len)
    }

    /// Waits until the event loop has seen the most recently pooled connection to `worker`
    /// become readable (bytes or a close from the worker), and pools it again.
    #[cfg(test)]
    pub async fn until_pooled_readable(&self, worker: u64) {
        let pooled = lock(&self.idle)
            .get_mut(&worker)
            .and_then(VecDeque::pop_back)
            .expect("a pooled connection");
        pooled.io.readable().await.unwrap();
        checkin(&self.idle, worker, pooled.io, pooled.since);
    }

    /// From the first connection on, a task that closes the expired and forgets the closed
    /// ones every half idle timeout, for as long as these connections exist.
    fn start_reaper(&self) {
        if self.reaping.swap(true, Ordering::Relaxed) {
            return;
        }
        let queues: Weak<Queues> = Arc::downgrade(&self.idle);
        let timeout = self.idle_timeout;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(timeout / 2);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(queues) = queues.upgrade() else {
                    return;
                };
                let now = Instant::now();
                let mut queues = lock(&queues);
                for queue in queues.values_mut() {
                    queue.retain(|p| !p.expired(now, timeout) && !p.closed());
                }
                queues.retain(|_, q| !q.is_empty());
            }
        });
    }

    /// Sends `req` (origin-form URI, `Host` set) to `worker` and returns the response head; the
    /// body streams from the connection, which is reused once the body has been read to its end.
    pub async fn send(
        &self,
        worker: &Worker,
        req: &Outgoing<'_>,
    ) -> Result<http::Response<UpstreamBody>, UpstreamError> {
        let (mut io, pooled, mut drained_at) = loop {
            let (mut io, pooled) = match self.checkout(worker.id_hash) {
                Some(io) => (io, true),
                None => (self.connect(worker).await?, false),
            };
            // Nothing of the answer can be there before the request is.
            let sent_at = Instant::now();
            let rank = worker.data_parallel_rank.as_ref().map(|r| &r.1);
            match http1::write_request(&mut io, req, &worker.host_header, rank).await {
                Ok(()) => break (io, pooled, sent_at),
                // Nothing written: the pooled connection had closed. Another one sends it.
                Err((_, 0)) if pooled => continue,
                Err((e, _)) => return Err(UpstreamError::Request(e)),
            }
        };
        let mut buf = BytesMut::new();
        let read = http1::read_head(&mut io, &mut buf, &req.parts.method, &mut drained_at);
        let head = match read.await {
            Ok(Some(head)) => head,
            Ok(None) => {
                // Sent, then closed unanswered: the worker may have begun it, so it is not
                // repeated. On a pooled connection, the worker's idle close crossed the request.
                let why = if pooled {
                    "the worker closed a kept-alive connection as the request was sent"
                } else {
                    "the worker closed the connection without answering"
                };
                return Err(UpstreamError::Request(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    why,
                )));
            }
            Err(e) => return Err(UpstreamError::Request(e)),
        };
        let home = Home {
            queues: Arc::downgrade(&self.idle),
            worker: worker.id_hash,
        };
        let body =
            UpstreamBody::new(io, buf, &head, home, drained_at).map_err(UpstreamError::Request)?;
        let mut resp = http::Response::new(body);
        *resp.status_mut() = head.status;
        *resp.headers_mut() = head.headers;
        Ok(resp)
    }

    /// The most recently idle connection to `worker` that is still open and not expired.
    fn checkout(&self, worker: u64) -> Option<TcpStream> {
        let now = Instant::now();
        let mut idle = lock(&self.idle);
        let queue = idle.get_mut(&worker)?;
        while let Some(pooled) = queue.pop_back() {
            if pooled.expired(now, self.idle_timeout) {
                // Older ones have idled longer still.
                queue.clear();
                return None;
            }
            if !pooled.closed() {
                return Some(pooled.io);
            }
        }
        None
    }

    async fn connect(&self, worker: &Worker) -> Result<TcpStream, UpstreamError> {
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
        self.start_reaper();
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;

    use super::*;
    use crate::{config::WorkerConfig, metrics::Metrics};

    const IDLE: Duration = Duration::from_secs(4);

    /// A loopback worker answering `ok` on keep-alive connections; counts those it accepts.
    async fn worker() -> (Worker, Arc<AtomicUsize>) {
        worker_answering(Bytes::from_static(b"ok")).await
    }

    /// [`worker`], answering `body`.
    async fn worker_answering(body: Bytes) -> (Worker, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let body = body.clone();
                tokio::spawn(async move {
                    let ok = hyper::service::service_fn(move |_| {
                        let body = body.clone();
                        async move {
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(body)))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), ok)
                        .await;
                });
            }
        });
        let cfg = WorkerConfig::from_url(format!("http://{addr}"));
        (Worker::new(&cfg, &Metrics::new()).unwrap(), accepted)
    }

    /// Sends a GET; the answer's head, its body not yet read.
    async fn send_get(conns: &Connections, w: &Worker) -> http::Response<UpstreamBody> {
        let (parts, ()) = http::Request::get("/").body(()).unwrap().into_parts();
        let req = Outgoing {
            parts: &parts,
            body: Bytes::new(),
            authorization: None,
        };
        conns.send(w, &req).await.unwrap()
    }

    async fn get(conns: &Connections, w: &Worker) -> Bytes {
        let resp = send_get(conns, w).await;
        resp.into_body().collect().await.unwrap().to_bytes()
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_left_unread_counts_as_idle_from_when_the_worker_finished_it() {
        // A 24 KiB answer, all in the socket at once; a slow client reads its end 4.5 s later.
        // The worker has been idle since it wrote it, so the connection is past the 4 s limit,
        // however recently the pool got it back.
        let (w, accepted) = worker_answering(Bytes::from(vec![b'x'; 24 * 1024])).await;
        let conns = Connections::new(Duration::from_secs(3600), IDLE);
        let resp = send_get(&conns, &w).await;
        tokio::time::sleep(Duration::from_millis(4_500)).await;
        assert_eq!(
            resp.into_body().collect().await.unwrap().to_bytes().len(),
            24 * 1024
        );
        assert_eq!(conns.pooled(w.id_hash), 1, "back in the pool");
        assert_eq!(get(&conns, &w).await.len(), 24 * 1024);
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "not sent on the stale one"
        );
        // Read as it arrives, the same answer leaves the connection fresh: reused.
        assert_eq!(get(&conns, &w).await.len(), 24 * 1024);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_reused_and_closed_once_idle_for_the_timeout() {
        let (w, accepted) = worker().await;
        // No connect timeout to fire while the paused clock jumps ahead.
        let conns = Connections::new(Duration::from_secs(3600), IDLE);
        assert_eq!(get(&conns, &w).await, "ok");
        // Back in the pool as soon as the body was read to its end.
        assert_eq!(conns.pooled(w.id_hash), 1);
        assert_eq!(get(&conns, &w).await, "ok");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the second request reused it"
        );
        assert_eq!(conns.pooled(w.id_hash), 1);
        // Idle for longer than the timeout: the reaper closes it, and the next request opens
        // a new one.
        tokio::time::sleep(IDLE * 2).await;
        assert_eq!(conns.pooled(w.id_hash), 0);
        assert_eq!(get(&conns, &w).await, "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Who closed a connection of [`uvicorn_like`].
    #[derive(Debug, PartialEq)]
    enum Closed {
        ByClient,
        ByWorkerIdle,
    }

    /// A loopback worker that, like uvicorn (vLLM's server), closes a keep-alive connection
    /// idle for `keep_alive`; records who closed each connection it accepted.
    async fn uvicorn_like(keep_alive: Duration) -> (Worker, Arc<Mutex<Vec<Closed>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let closed = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&closed);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let log = Arc::clone(&log);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    loop {
                        let n = match tokio::time::timeout(keep_alive, stream.read(&mut buf)).await
                        {
                            Err(_) => {
                                log.lock().push(Closed::ByWorkerIdle);
                                return;
                            }
                            Ok(Ok(0)) | Ok(Err(_)) => {
                                log.lock().push(Closed::ByClient);
                                return;
                            }
                            Ok(Ok(n)) => n,
                        };
                        head.extend_from_slice(&buf[..n]);
                        // Bodyless requests: a head is a whole request.
                        while let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                            head.drain(..end + 4);
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if stream.write_all(answer).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        let cfg = WorkerConfig::from_url(format!("http://{addr}"));
        (Worker::new(&cfg, &Metrics::new()).unwrap(), closed)
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_may_have_idled_for_the_timeout_is_closed_before_the_worker_closes_it(
    ) {
        // The worker closes after 5 s idle, as vLLM does; the pool gives up after 4 s.
        let (w, closed) = uvicorn_like(Duration::from_secs(5)).await;
        let conns = Connections::new(Duration::from_secs(3600), IDLE);
        assert_eq!(get(&conns, &w).await, "ok");
        // Idle for less than the timeout: reused.
        tokio::time::sleep(Duration::from_millis(3_900)).await;
        assert_eq!(get(&conns, &w).await, "ok");
        assert_eq!(conns.pooled(w.id_hash), 1);
        // Idle for 4.5 s: past the pool's timeout, still short of the worker's. Not sent on.
        tokio::time::sleep(Duration::from_millis(4_500)).await;
        assert_eq!(get(&conns, &w).await, "ok");
        // The first connection was closed by the pool, never by the worker's idle timer: the race
        // in which a request meets the worker's close cannot happen.
        for _ in 0..100 {
            if !closed.lock().is_empty() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(*closed.lock(), vec![Closed::ByClient]);
        // A connection left alone is forgotten (whoever closes it first: it is never sent on).
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(conns.pooled(w.id_hash), 0);
        assert_eq!(closed.lock().len(), 2);
    }

    #[tokio::test]
    async fn a_kept_connection_the_worker_has_since_closed_is_not_sent_on() {
        // A worker on a thread of its own that answers once per connection with keep-alive
        // framing, then closes it, and says so once it has.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
        let worker = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut closed_tx = Some(closed_tx);
            for _ in 0..2 {
                let (mut stream, _) = listener.accept().unwrap();
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap() == 1 {
                    head.push(byte[0]);
                }
                stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .unwrap();
                drop(stream);
                if let Some(tx) = closed_tx.take() {
                    tx.send(()).unwrap();
                }
            }
        });
        let w = Worker::new(
            &WorkerConfig::from_url(format!("http://{addr}")),
            &Metrics::new(),
        )
        .unwrap();
        let conns = Connections::new(Duration::from_secs(3600), IDLE);
        assert_eq!(get(&conns, &w).await, "ok");
        assert_eq!(
            conns.pooled(w.id_hash),
            1,
            "kept: nothing said it would close"
        );
        // Once the event loop has seen the close (on a loaded machine the kernel may deliver it
        // after the worker's message), reads that left tokio believing the socket empty must
        // not hide it: the next request goes out on a new connection.
        closed_rx.await.unwrap();
        conns.until_pooled_readable(w.id_hash).await;
        assert_eq!(get(&conns, &w).await, "ok");
        worker.join().unwrap();
    }
}
