//! HTTP/1.1 from clients, served by the gateway itself for the requests that carry its traffic;
//! a connection goes to hyper's server at the first request that needs more.
//!
//! Why: on the overhead bench hyper's server was the largest block of user time kvroute could
//! still remove (its dispatcher, the request body's channel, head parsing and encoding; about
//! 9-10k of 42k instructions a proxied request), and with a core each kvroute trailed nginx by
//! its user time alone (`docs/measurements.md`, "Proxy overhead against nginx").
//!
//! Served here: HTTP/1.1 requests other than `HEAD` and `CONNECT`, with no body or a
//! `Content-Length` one, without `Transfer-Encoding`, `Expect` or `Upgrade`, whose head parses
//! within [`MAX_HEAD`] bytes and [`request::MAX_HEADERS`] fields. Anything else (HTTP/1.0,
//! chunked bodies, `100-continue`, upgrades, and malformed heads, which hyper answers 400 or
//! 431) is handed to hyper with the bytes already read and stays with it to the end of the
//! connection.
//!
//! Kept as hyper's server does it: the header deadline, counted from when the connection starts
//! waiting for a head; keep-alive and pipelined requests; a client that closes while its answer
//! is pending or streaming drops the answer, which aborts the worker's request; `Date` on every
//! answer; the graceful drain (an idle connection closes at once, a busy one after its answer).
//! A body the handler left unread closes the connection after the answer.

mod request;
mod response;

use std::{io, sync::Arc, time::Duration};

use bytes::{Bytes, BytesMut};
use tokio::{io::AsyncWriteExt, net::TcpStream, time::Instant};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::dispatch::Gateway;
use request::{BodyRead, Incoming};
use response::Out;

/// A request head longer than this goes to hyper (which allows about 400 KiB).
pub(super) const MAX_HEAD: usize = 64 * 1024;
/// Bytes asked of the socket per read of a head.
const READ_SIZE: usize = 8 * 1024;

/// How a connection served here ended.
pub(super) enum Ended {
    Closed,
    /// Its next request is hyper's to serve, and so is the rest of the connection: the
    /// connection and what was read of it.
    ToHyper(TcpStream, Bytes),
}

/// Serves `tcp`'s requests with `app` until the client leaves, a head misses `header_timeout`,
/// `stop` fires between answers, or a request needs hyper.
pub(super) async fn serve(
    tcp: TcpStream,
    app: &Gateway,
    header_timeout: Duration,
    stop: &CancellationToken,
) -> Ended {
    let tcp = Arc::new(tcp);
    let mut buf = BytesMut::new();
    // Made once per connection: a new one per request would register again each time.
    let mut stopped = std::pin::pin!(stop.cancelled());
    let deadline = tokio::time::sleep(header_timeout);
    let mut deadline = std::pin::pin!(deadline);
    loop {
        deadline.as_mut().reset(Instant::now() + header_timeout);
        let incoming = match next_request(&tcp, &mut buf, deadline.as_mut(), stopped.as_mut()).await
        {
            Next::Request(incoming) => incoming,
            Next::Closed => break,
            Next::ToHyper => {
                return match Arc::try_unwrap(tcp) {
                    Ok(tcp) => Ended::ToHyper(tcp, buf.freeze()),
                    Err(_) => Ended::Closed,
                }
            }
        };
        // A held stream keeps no read buffer: a pipelined request is rare.
        if buf.is_empty() {
            buf = BytesMut::new();
        }
        if !answer(&tcp, &mut buf, app, incoming, stop).await {
            break;
        }
    }
    if let Ok(mut tcp) = Arc::try_unwrap(tcp) {
        let _ = tcp.shutdown().await;
    }
    Ended::Closed
}

// One a request, returned once: boxing the request would cost an allocation for nothing.
#[allow(clippy::large_enum_variant)]
enum Next {
    Request(Incoming),
    Closed,
    ToHyper,
}

/// Reads until `buf` holds a whole request head.
async fn next_request(
    tcp: &Arc<TcpStream>,
    buf: &mut BytesMut,
    mut deadline: std::pin::Pin<&mut tokio::time::Sleep>,
    mut stopped: std::pin::Pin<&mut WaitForCancellationFuture<'_>>,
) -> Next {
    loop {
        if !buf.is_empty() {
            match request::parse(buf, tcp) {
                Ok(Some(incoming)) => return Next::Request(incoming),
                Ok(None) if buf.len() < MAX_HEAD => {}
                _ => return Next::ToHyper,
            }
        }
        let read = tokio::select! {
            biased;
            r = read_some(tcp, buf) => r,
            () = &mut stopped => return Next::Closed,
            () = &mut deadline => return Next::Closed,
        };
        match read {
            Ok(0) | Err(_) => return Next::Closed,
            Ok(_) => {}
        }
    }
}

async fn read_some(tcp: &TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    if buf.capacity() - buf.len() < READ_SIZE / 4 {
        buf.reserve(READ_SIZE);
    }
    let room = buf.capacity() - buf.len();
    loop {
        match tcp.try_read_buf(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => read_ready(tcp).await?,
            Ok(n) if n > 0 && n < room => {
                drained(tcp);
                return Ok(n);
            }
            read => return read,
        }
    }
}

/// Waits until `tcp` has something to read, or is closed. Through the socket's one reader
/// slot, which the connection's task alone waits in (its request body is read in the same
/// task): `readable()` would queue a waiter in a list under a lock and take it out again, for
/// every request, at each of the three waits an answer has.
pub(super) async fn read_ready(tcp: &TcpStream) -> io::Result<()> {
    std::future::poll_fn(|cx| tcp.poll_read_ready(cx)).await
}

/// Marks `tcp` as having nothing more to read after a read that did not fill its buffer. With
/// edge-triggered readiness such a read has drained the socket (tokio's own `AsyncRead` assumes
/// the same and does this), so the watch for a client's close ([`client_gone`]) waits for new
/// bytes instead of first costing a read that finds none: a system call a request, measured as
/// one `recvfrom` returning `EAGAIN` after every request head. On a single-threaded runtime, as
/// the gateway's event loops are, no readiness can arrive between the read and this; a close
/// already seen stays marked (tokio never clears it).
pub(super) fn drained(tcp: &TcpStream) {
    let _ = tcp.try_io(tokio::io::Interest::READABLE, || {
        Err::<(), _>(io::ErrorKind::WouldBlock.into())
    });
}

/// Answers one request; whether the connection stays open for the next.
async fn answer(
    tcp: &TcpStream,
    buf: &mut BytesMut,
    app: &Gateway,
    incoming: Incoming,
    stop: &CancellationToken,
) -> bool {
    let Incoming {
        request,
        close,
        body,
    } = incoming;
    let mut answer = app.answer(request);
    let resp = tokio::select! {
        biased;
        resp = &mut answer => match resp {
            Ok(resp) => resp,
            Err(never) => match never {},
        },
        () = client_gone(tcp, buf, body.as_deref()) => return false,
    };
    drop(answer);
    let unread = body.as_ref().is_some_and(|b| !b.done());
    let (parts, resp_body) = resp.into_parts();
    let mut head = Vec::with_capacity(256 + parts.headers.len() * 32);
    let (mut framing, close) = response::encode_head(
        &parts,
        &resp_body,
        close || unread || stop.is_cancelled(),
        &mut head,
    );
    drop(parts);
    let mut out = Out::default();
    out.head(head);
    let mut resp_body = std::pin::pin!(resp_body);
    // Frames are taken while they are ready, written together, and then waited for.
    let mut wait = false;
    let mut intact = true;
    loop {
        let next = if wait {
            tokio::select! {
                biased;
                f = std::future::poll_fn(|cx| http_body::Body::poll_frame(resp_body.as_mut(), cx)) => f,
                () = client_gone(tcp, buf, body.as_deref()) => return false,
            }
        } else {
            match std::future::poll_fn(|cx| {
                std::task::Poll::Ready(http_body::Body::poll_frame(resp_body.as_mut(), cx))
            })
            .await
            {
                std::task::Poll::Ready(f) => f,
                std::task::Poll::Pending => {
                    if !out.is_empty() && out.write(tcp).await.is_err() {
                        return false;
                    }
                    wait = true;
                    continue;
                }
            }
        };
        wait = false;
        match next {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    intact &= out.data(data, &mut framing);
                }
                if out.full() && out.write(tcp).await.is_err() {
                    return false;
                }
            }
            Some(Err(e)) => {
                tracing::debug!("an answer's body failed: {e}");
                intact = false;
                break;
            }
            None => {
                intact &= out.end(framing);
                break;
            }
        }
    }
    if !out.is_empty() && out.write(tcp).await.is_err() {
        return false;
    }
    intact && !close && body.is_none_or(|b| b.done())
}

/// Resolves when the client closes its side (or fails) while its answer is pending or
/// streaming; bytes it sends meanwhile (a pipelined request) are kept in `buf`. While the
/// request's body is still being read, the body's reads are the only ones.
async fn client_gone(tcp: &TcpStream, buf: &mut BytesMut, body: Option<&BodyRead>) {
    if let Some(body) = body {
        body.wait().await;
    }
    loop {
        if read_ready(tcp).await.is_err() {
            return;
        }
        let mut scratch = [0u8; 1024];
        match tcp.try_read(&mut scratch) {
            Ok(0) => return,
            Ok(n) if buf.len() + n <= MAX_HEAD => buf.extend_from_slice(&scratch[..n]),
            // More pipelined than a head may hold: stop reading; hyper would, too.
            Ok(n) => {
                buf.extend_from_slice(&scratch[..n]);
                std::future::pending::<()>().await;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// A connected pair on loopback for the tests: the client's end and the accepted one.
#[cfg(test)]
async fn socket_pair() -> (TcpStream, TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
    (client.unwrap(), accepted.unwrap().0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A request this server serves is answered here; at the first one it does not (HTTP/1.0),
    /// the connection comes back with exactly the bytes read and not yet answered.
    #[tokio::test]
    async fn the_connection_goes_to_hyper_at_the_first_request_it_needs_with_the_bytes_read() {
        let (mut client, tcp) = socket_pair().await;
        let app = Gateway::router_only(
            axum::Router::new().route("/a", axum::routing::get(|| async { "served" })),
        );
        let rest = b"GET /b HTTP/1.0\r\n\r\nGET /c HTTP/1.1\r\n";
        client
            .write_all(&[&b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"[..], rest].concat())
            .await
            .unwrap();
        let stop = CancellationToken::new();
        let ended = serve(tcp, &app, Duration::from_secs(5), &stop).await;
        let Ended::ToHyper(_, read) = ended else {
            panic!("served to the end")
        };
        assert_eq!(&read[..], rest);
        let mut answer = vec![0u8; 256];
        let n = client.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\nserved"), "{answer}");
    }
}
