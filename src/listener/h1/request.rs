//! A client's request head parsed into an `http::Request`, and its body as the handler reads it.

use std::{
    io,
    mem::MaybeUninit,
    ops::Range,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{ready, Context, Poll},
};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, Version};
use http_body::{Frame, SizeHint};
use tokio::{net::TcpStream, sync::Notify};

/// Header fields in a request head, at most (hyper's default).
pub(super) const MAX_HEADERS: usize = 100;

/// A request head this server does not serve itself: hyper's server takes the connection from
/// here, and answers a malformed head (400) or one with too many fields (431) as it always has.
#[derive(Debug)]
pub(super) struct ToHyper;

/// A parsed request, its body, and what it says about the connection.
pub(super) struct Incoming {
    pub request: Request<Body>,
    /// The client asked for the connection to close after this answer.
    pub close: bool,
    /// Set once the handler has read the whole body (`None`: it came whole with the head).
    pub body: Option<Arc<BodyRead>>,
}

/// Where one header field lies in the head.
#[derive(Clone, Copy, Default)]
struct Field {
    name: (u32, u32),
    value: (u32, u32),
}

fn range((from, to): (u32, u32)) -> Range<usize> {
    from as usize..to as usize
}

/// Parses the request head at the front of `buf`: `Ok(None)` while it is incomplete. A complete
/// one is taken out of `buf` with as much of its body as `buf` holds; bytes past the body (a
/// pipelined request) stay.
pub(super) fn parse(buf: &mut BytesMut, tcp: &Arc<TcpStream>) -> Result<Option<Incoming>, ToHyper> {
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut fields = [Field::default(); MAX_HEADERS];
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| {
        let from = (s.as_ptr() as usize - base) as u32;
        (from, from + s.len() as u32)
    };
    let mut req = httparse::Request::new(&mut []);
    let len = match req.parse_with_uninit_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(ToHyper),
    };
    if req.version != Some(1) {
        return Err(ToHyper);
    }
    let method = match req.method.map(|m| Method::from_bytes(m.as_bytes())) {
        Some(Ok(m)) if m != Method::HEAD && m != Method::CONNECT => m,
        _ => return Err(ToHyper),
    };
    let path = at(req.path.ok_or(ToHyper)?.as_bytes());
    let count = req.headers.len();
    let (mut length, mut close) = (None, false);
    for (field, h) in fields.iter_mut().zip(req.headers.iter()) {
        *field = Field {
            name: at(h.name.as_bytes()),
            value: at(h.value),
        };
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") && length.is_none() {
            length = Some(content_length(h.value)?);
        } else if [
            &b"content-length"[..],
            b"transfer-encoding",
            b"expect",
            b"upgrade",
        ]
        .iter()
        .any(|n| name.eq_ignore_ascii_case(n))
        {
            return Err(ToHyper);
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in h.value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if token.eq_ignore_ascii_case(b"upgrade") {
                    return Err(ToHyper);
                }
            }
        }
    }
    let head = buf.split_to(len).freeze();
    let built = (|| {
        let uri = Uri::from_maybe_shared(head.slice(range(path))).map_err(|_| ToHyper)?;
        let mut headers = HeaderMap::with_capacity(count);
        for field in &fields[..count] {
            let name = HeaderName::from_bytes(&head[range(field.name)]).map_err(|_| ToHyper)?;
            let value = HeaderValue::from_maybe_shared(head.slice(range(field.value)))
                .map_err(|_| ToHyper)?;
            headers.append(name, value);
        }
        Ok((uri, headers))
    })();
    let (uri, headers) = match built {
        Ok(built) => built,
        Err(e) => {
            // Put the head back for hyper.
            let mut whole = BytesMut::from(&head[..]);
            whole.extend_from_slice(buf);
            *buf = whole;
            return Err(e);
        }
    };
    let mut request = Request::new(Body::empty());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    let length = length.unwrap_or(0);
    let whole = buf.len() as u64 >= length;
    let body = if length == 0 {
        None
    } else if whole {
        *request.body_mut() = Body::from(buf.split_to(length as usize).freeze());
        None
    } else {
        let read = Arc::new(BodyRead::default());
        let left = length - buf.len() as u64;
        *request.body_mut() = Body::new(RequestBody {
            tcp: Arc::clone(tcp),
            first: buf.split().freeze(),
            left,
            read: Arc::clone(&read),
        });
        Some(read)
    };
    Ok(Some(Incoming {
        request,
        close,
        body,
    }))
}

/// A `Content-Length` value: digits only (hyper answers anything else 400).
fn content_length(digits: &[u8]) -> Result<u64, ToHyper> {
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(ToHyper);
    }
    digits
        .iter()
        .try_fold(0u64, |n, d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })
        .ok_or(ToHyper)
}

/// Whether a request's body has been read to its end; the connection watches the client for a
/// close only after that, since until then the body's reads are the connection's reads.
#[derive(Default)]
pub(super) struct BodyRead {
    done: AtomicBool,
    notify: Notify,
}

impl BodyRead {
    pub(super) fn done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Resolves once the body has been read to its end.
    pub(super) async fn wait(&self) {
        if !self.done() {
            // `notify_one` stores its wake-up when no one waits yet: none is lost.
            self.notify.notified().await;
        }
    }

    fn finish(&self) {
        self.done.store(true, Ordering::Release);
        self.notify.notify_one();
    }
}

/// The part of a request body that had not arrived with its head, read from the client's
/// socket as the handler asks for it, and never past its `Content-Length` (a pipelined request
/// behind it stays in the socket for the connection).
struct RequestBody {
    tcp: Arc<TcpStream>,
    /// What was read with the head.
    first: Bytes,
    left: u64,
    read: Arc<BodyRead>,
}

/// The most one frame of a request body reads at a time.
const BODY_READ: u64 = 64 * 1024;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if !self.first.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(std::mem::take(&mut self.first)))));
        }
        if self.left == 0 {
            return Poll::Ready(None);
        }
        loop {
            ready!(self.tcp.poll_read_ready(cx))?;
            let want = self.left.min(BODY_READ) as usize;
            // Read into this thread's scratch and copied out at the size read: a frame that
            // kept a buffer of `BODY_READ` for a few bytes would hold 64 KiB for each of a slow
            // client's trickles until the whole body is read.
            let read = SCRATCH.with_borrow_mut(|scratch| {
                scratch.resize(BODY_READ as usize, 0);
                let n = self.tcp.try_read(&mut scratch[..want])?;
                Ok::<_, io::Error>(Bytes::copy_from_slice(&scratch[..n]))
            });
            match read {
                Ok(chunk) if chunk.is_empty() => {
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the client closed before the request body ended",
                    ))))
                }
                Ok(chunk) => {
                    if chunk.len() < want {
                        super::drained(&self.tcp);
                    }
                    self.left -= chunk.len() as u64;
                    if self.left == 0 {
                        self.read.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(chunk))));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_empty() && self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.first.len() as u64 + self.left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected socket and its peer.
    async fn pair() -> (Arc<TcpStream>, TcpStream) {
        let (client, accepted) = super::super::socket_pair().await;
        (Arc::new(accepted), client)
    }

    async fn socket() -> Arc<TcpStream> {
        pair().await.0
    }

    #[tokio::test]
    async fn a_body_that_comes_after_its_head_is_read_to_its_length_and_no_further() {
        use tokio::io::AsyncWriteExt;
        let (tcp, mut peer) = pair().await;
        let mut buf = BytesMut::from(
            &b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\nhello"[..],
        );
        let got = parse(&mut buf, &tcp).unwrap().unwrap();
        assert!(buf.is_empty());
        let read = got.body.expect("a body still to read");
        assert!(!read.done());
        let body = got.request.into_body();
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(11));
        peer.write_all(b" world").await.unwrap();
        peer.write_all(b"GET /next HTTP/1.1\r\n\r\n").await.unwrap();
        let body = http_body_util::BodyExt::collect(body).await.unwrap();
        assert_eq!(&body.to_bytes()[..], b"hello world");
        assert!(read.done());
        read.wait().await;
        let mut rest = [0u8; 64];
        tcp.readable().await.unwrap();
        let n = tcp.try_read(&mut rest).unwrap();
        assert_eq!(&rest[..n], b"GET /next HTTP/1.1\r\n\r\n");
    }

    #[tokio::test]
    async fn a_head_with_its_body_leaves_the_pipelined_request_behind_it() {
        let tcp = socket().await;
        let mut buf = BytesMut::from(
            &b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nX-Two: b\r\n\r\nhelloGET /health HTTP/1.1\r\n"[..],
        );
        let got = parse(&mut buf, &tcp).unwrap().unwrap();
        assert!(got.body.is_none() && !got.close);
        let req = got.request;
        assert_eq!(req.method(), Method::POST);
        assert_eq!(req.uri().path(), "/v1/completions");
        assert_eq!(req.uri().query(), Some("x=1"));
        assert_eq!(req.headers()["host"], "a");
        assert_eq!(req.headers()["x-two"], "b");
        let body = http_body_util::BodyExt::collect(req.into_body())
            .await
            .unwrap();
        assert_eq!(&body.to_bytes()[..], b"hello");
        assert_eq!(&buf[..], b"GET /health HTTP/1.1\r\n");
        assert!(parse(&mut buf, &tcp).unwrap().is_none(), "incomplete");
    }

    #[tokio::test]
    async fn what_hyper_serves_instead_is_left_to_it() {
        let tcp = socket().await;
        for head in [
            &b"GET / HTTP/1.0\r\n\r\n"[..],
            b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n",
            b"GET / HTTP/1.1\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
            b"POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\nabc",
            b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        ] {
            let mut buf = BytesMut::from(head);
            assert!(
                parse(&mut buf, &tcp).is_err(),
                "{}",
                String::from_utf8_lossy(head)
            );
            assert_eq!(&buf[..], head, "nothing taken from the buffer");
        }
    }

    #[tokio::test]
    async fn connection_close_is_heard_among_other_tokens() {
        let tcp = socket().await;
        let mut buf = BytesMut::from(&b"GET /health HTTP/1.1\r\nConnection: te, Close\r\n\r\n"[..]);
        assert!(parse(&mut buf, &tcp).unwrap().unwrap().close);
    }
}
