//! HTTP/1.1 on a worker connection: the request written in one vectored write, the response head
//! parsed, and the body decoded in the request's own task as the client reads it.
//!
//! The proxy speaks to a handful of known workers over kept-alive connections, so this is the
//! client side of HTTP/1.1 and no more: no pipelining, no upgrades, no `Expect`. A connection is
//! reusable when its response said nothing against keep-alive and its body ended exactly where
//! its framing said (`Content-Length` or the last chunk); everything else closes it. Driving the
//! connection here instead of in a connection task of its own means a request costs no channel
//! hand-offs or task wake-ups between the client's side and the worker's, and a connection holds
//! no buffer while it waits.

use std::{
    io::{self, IoSlice},
    mem::MaybeUninit,
    pin::Pin,
    task::{ready, Context, Poll},
};

use bytes::{Buf, Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::{io::AsyncWriteExt, net::TcpStream};

use super::{end_to_end, upstream::Home, Outgoing};

/// Bytes asked of the socket per read, at first: a response head and a small body.
const READ_SIZE: usize = 8 * 1024;
/// Reads that fill their buffer double the next one's, up to this (a long answer in a burst).
const MAX_READ_SIZE: usize = 64 * 1024;
/// Read buffers of ended answers that each thread keeps for the next ones, at most.
const SPARES: usize = 4;
/// A response head longer than this is refused (vLLM's are a few hundred bytes).
const MAX_HEAD: usize = 64 * 1024;
/// Header fields in a response head, at most.
const MAX_HEADERS: usize = 100;
/// A chunk-size line or trailer field longer than this is refused.
const MAX_LINE: usize = 4 * 1024;

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Writes `req`'s head (with `host` as its `Host`, and `rank` as its `X-data-parallel-rank` when
/// given) and body. On failure, also says how many bytes had been written: none means the worker
/// never saw any of the request.
pub(super) async fn write_request(
    io: &mut TcpStream,
    req: &Outgoing<'_>,
    host: &HeaderValue,
    rank: Option<&HeaderValue>,
) -> Result<(), (io::Error, usize)> {
    let head = encode_head(req, host, rank);
    let body = &req.body[..];
    let mut slices = [IoSlice::new(&head), IoSlice::new(body)];
    let mut bufs: &mut [IoSlice<'_>] = if body.is_empty() {
        &mut slices[..1]
    } else {
        &mut slices[..]
    };
    let mut written = 0;
    while !bufs.is_empty() {
        match io.write_vectored(bufs).await {
            Ok(0) => return Err((io::ErrorKind::WriteZero.into(), written)),
            Ok(n) => {
                written += n;
                IoSlice::advance_slices(&mut bufs, n);
            }
            Err(e) => return Err((e, written)),
        }
    }
    Ok(())
}

/// vLLM's header naming the data-parallel engine a request is for (its API server reads it).
const DATA_PARALLEL_RANK: &str = "x-data-parallel-rank";

/// The request line and headers: the client's end-to-end headers, then `Host`, the body's
/// length (unless the method needs none and there is no body), the gateway's key, and the
/// data-parallel rank the gateway chose (replacing any the client named).
pub(super) fn encode_head(
    req: &Outgoing<'_>,
    host: &HeaderValue,
    rank: Option<&HeaderValue>,
) -> Vec<u8> {
    let parts = req.parts;
    let mut out = Vec::with_capacity(
        96 + parts
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>(),
    );
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    out.extend_from_slice(if target.is_empty() { "/" } else { target }.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let field = |out: &mut Vec<u8>, name: &[u8], value: &[u8]| {
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    };
    for (name, value) in end_to_end(&parts.headers) {
        let replaced = *name == header::HOST
            || *name == header::CONTENT_LENGTH
            || (*name == header::AUTHORIZATION && req.authorization.is_some())
            || (rank.is_some() && name.as_str() == DATA_PARALLEL_RANK);
        if !replaced {
            field(&mut out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    field(&mut out, b"host", host.as_bytes());
    let needs_length =
        !req.body.is_empty() || matches!(parts.method, Method::POST | Method::PUT | Method::PATCH);
    if needs_length {
        let mut digits = [0u8; 20];
        field(
            &mut out,
            b"content-length",
            decimal(req.body.len(), &mut digits),
        );
    }
    if let Some(key) = req.authorization {
        field(&mut out, b"authorization", key.as_bytes());
    }
    if let Some(rank) = rank {
        field(&mut out, DATA_PARALLEL_RANK.as_bytes(), rank.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// `n` in decimal, written at the end of `buf`.
fn decimal(mut n: usize, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// A parsed response head, and how its body is framed.
#[derive(Debug)]
pub(super) struct Head {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// The connection may carry another request once this body has ended.
    pub keep_alive: bool,
}

/// The last time a connection's socket was seen holding nothing unread. Whatever is read after
/// it, the worker wrote after it, so the worker's idle timer (started by its last write) cannot
/// have started earlier: measured from here, the pool's idle estimate errs long, even when a
/// slow client left the end of an answer unread in the socket for a while.
pub(super) type DrainedAt = tokio::time::Instant;

/// Reads the response head to `req_method` from `io` into `buf` (which keeps what follows it),
/// passing over interim (1xx) responses. `Ok(None)`: the worker closed the connection before
/// sending a byte of an answer.
pub(super) async fn read_head(
    io: &mut TcpStream,
    buf: &mut BytesMut,
    req_method: &Method,
    drained_at: &mut DrainedAt,
) -> io::Result<Option<Head>> {
    loop {
        if let Some(head) = parse_head(buf, req_method)? {
            if head.status.is_informational() {
                continue; // 100 Continue, 103 Early Hints: the answer follows
            }
            return Ok(Some(head));
        }
        if buf.len() >= MAX_HEAD {
            return Err(invalid("response head too large"));
        }
        // The buffer is taken only once the answer starts: a request waiting for its worker
        // (a whole generation, when not streamed) holds none.
        io.readable().await?;
        make_room(buf, READ_SIZE);
        let n = match std::future::poll_fn(|cx| Poll::Ready(read_some(io, cx, buf))).await {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                *drained_at = DrainedAt::now();
                continue;
            }
            read => read?,
        };
        if n == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the worker closed the connection mid-head",
                ))
            };
        }
    }
}

/// Gives `buf` room for `n` more bytes: an empty one from this thread's spares if it has none.
fn make_room(buf: &mut BytesMut, n: usize) {
    if buf.is_empty() && buf.capacity() < n {
        *buf = spare::take(n);
    } else {
        buf.reserve(n);
    }
}

/// The read buffers of answers that have ended, kept by the thread (an event loop) that read
/// them for its next answers.
///
/// An answer is read into a buffer taken when its first bytes arrive, and its frames are cut
/// from that buffer and written to the client from it, so the buffer cannot be written again
/// until they are. A connection or stream waiting for its worker keeps none (8 KiB each
/// otherwise). So without these, every answer (and every burst of a stream) allocated a new
/// buffer, through glibc's slow path for its size. Here an emptied buffer is kept, and
/// taken again once its frames are gone, that is once nothing else holds it. A thread keeps
/// [`SPARES`] at most, the oldest dropped first, so what they hold is bounded per thread
/// whatever the number of streams. Under jemalloc (the binary's default allocator), whose
/// thread cache holds 8 KiB buffers, they save about 0.4% of a request's instructions; built
/// with glibc's allocator (`--no-default-features`), about 1.3%.
mod spare {
    use std::{cell::RefCell, collections::VecDeque};

    use bytes::BytesMut;

    thread_local! {
        static SPARE: RefCell<VecDeque<BytesMut>> = const { RefCell::new(VecDeque::new()) };
    }

    /// An empty buffer with room for `n` bytes: a spare that nothing else holds any more, or a
    /// new one.
    pub(super) fn take(n: usize) -> BytesMut {
        SPARE.with_borrow_mut(|spares| {
            let found = spares.iter_mut().position(|b| b.try_reclaim(n));
            found
                .and_then(|i| spares.remove(i))
                .unwrap_or_else(|| BytesMut::with_capacity(n))
        })
    }

    /// Keeps `buf`, emptied, for a later [`take`]. One with no room left is dropped: it may
    /// never have held anything, and the public API cannot tell.
    pub(super) fn put(buf: BytesMut) {
        if !buf.is_empty() || buf.capacity() == 0 {
            return;
        }
        SPARE.with_borrow_mut(|spares| {
            if spares.len() == super::SPARES {
                spares.pop_front();
            }
            spares.push_back(buf);
        });
    }

    #[cfg(test)]
    pub(super) fn count() -> usize {
        SPARE.with_borrow(|spares| spares.len())
    }
}

/// Reads once into `buf`'s spare room, or fails with `WouldBlock` and wakes the task once the
/// socket is readable again. Unlike `try_read_buf`, a read that leaves room in the buffer tells
/// tokio the socket is drained (as an edge-triggered epoll allows), so the next look at it, such
/// as the pool's check for a closed connection at checkout, costs no system call until the worker
/// sends again: one `recvfrom` fewer per proxied request.
fn read_some(io: &mut TcpStream, cx: &mut Context<'_>, buf: &mut BytesMut) -> io::Result<usize> {
    match tokio_util::io::poll_read_buf(Pin::new(io), cx, buf) {
        Poll::Ready(read) => read,
        Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
    }
}

/// Parses one head off the front of `buf`; `None` until it is complete.
pub(super) fn parse_head(buf: &mut BytesMut, req_method: &Method) -> io::Result<Option<Head>> {
    // Left uninitialised for the parser to fill: zeroing 100 fields (3.2 KB) for every answer was
    // the largest single item in a callgrind count of a proxied request's instructions.
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(invalid(format!("malformed response head: {e}"))),
    };
    let status = resp
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or_else(|| invalid("malformed response status"))?;
    let version = if resp.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // Where each field lies in the head, so that names and values are read from its bytes once
    // it is split off the buffer, and the values share them.
    let base = buf.as_ptr() as usize;
    // Offsets within a head of at most `MAX_HEAD` bytes, in half the room of `usize`s.
    let mut spans = [(0u32, 0u32, 0u32, 0u32); MAX_HEADERS];
    let count = resp.headers.len();
    let offset = |b: &[u8]| (b.as_ptr() as usize - base) as u32;
    for (span, h) in spans.iter_mut().zip(resp.headers.iter()) {
        let name = h.name.as_bytes();
        *span = (
            offset(name),
            name.len() as u32,
            offset(h.value),
            h.value.len() as u32,
        );
    }
    let head = buf.split_to(len).freeze();
    let mut headers = HeaderMap::with_capacity(count);
    for &(name_at, name_len, at, n) in &spans[..count] {
        let (name_at, name_len, at, n) =
            (name_at as usize, name_len as usize, at as usize, n as usize);
        let name = HeaderName::from_bytes(&head[name_at..name_at + name_len])
            .map_err(|_| invalid("malformed header name"))?;
        let value = HeaderValue::from_maybe_shared(head.slice(at..at + n))
            .map_err(|_| invalid("malformed header value"))?;
        headers.append(name, value);
    }
    let framing = framing(status, req_method, &headers)?;
    let says_close = connection_has(&headers, "close")
        // Both framings at once is how requests are smuggled: the connection ends with this one.
        || (headers.contains_key(header::TRANSFER_ENCODING)
            && headers.contains_key(header::CONTENT_LENGTH));
    let keep_alive = match version {
        Version::HTTP_11 => !says_close,
        _ => connection_has(&headers, "keep-alive") && !says_close,
    } && !matches!(framing, Framing::Close);
    Ok(Some(Head {
        status,
        headers,
        framing,
        keep_alive,
    }))
}

fn connection_has(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// How the body of a response is delimited (RFC 9112 §6.3).
fn framing(status: StatusCode, method: &Method, headers: &HeaderMap) -> io::Result<Framing> {
    if *method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Length(0));
    }
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(invalid(
            "the worker switched protocols, which the gateway does not relay",
        ));
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        let last = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .rfind(|t| !t.is_empty());
        return Ok(match last {
            Some(t) if t.eq_ignore_ascii_case("chunked") => Framing::Chunked(Chunk::Size),
            _ => Framing::Close,
        });
    }
    let mut length = None;
    for v in headers.get_all(header::CONTENT_LENGTH) {
        for part in v.as_bytes().split(|&b| b == b',') {
            let part = part.trim_ascii();
            if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
                return Err(invalid("malformed content-length"));
            }
            let n: u64 = std::str::from_utf8(part)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| invalid("malformed content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(invalid("conflicting content-length values"));
            }
            length = Some(n);
        }
    }
    Ok(length.map_or(Framing::Close, Framing::Length))
}

/// Where the body decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// This many bytes of body to come.
    Length(u64),
    /// Chunked transfer coding, at this point of it.
    Chunked(Chunk),
    /// The body runs until the worker closes the connection.
    Close,
    /// The body has ended where its framing said.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// This many bytes of chunk data to come.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer fields until an empty line.
    Trailer,
}

impl Framing {
    /// Takes the next piece of body out of `buf`, consuming the framing around it; `None` when
    /// `buf` holds no body bytes yet or the body has ended ([`Framing::Done`]). Having taken data,
    /// it consumes the framing that follows as far as `buf` goes, so an ending already read is
    /// seen at once.
    pub fn decode(&mut self, buf: &mut BytesMut) -> io::Result<Option<Bytes>> {
        self.skip_framing(buf)?;
        let n = match *self {
            Framing::Length(left) | Framing::Chunked(Chunk::Data(left)) => {
                usize::try_from(left).map_or(buf.len(), |l| l.min(buf.len()))
            }
            Framing::Close => buf.len(),
            _ => 0,
        };
        if n == 0 {
            return Ok(None);
        }
        let data = buf.split_to(n).freeze();
        match self {
            Framing::Length(left) => *left -= n as u64,
            Framing::Chunked(Chunk::Data(left)) => {
                *left -= n as u64;
                if *left == 0 {
                    *self = Framing::Chunked(Chunk::DataEnd);
                }
            }
            _ => {}
        }
        self.skip_framing(buf)?;
        Ok(Some(data))
    }

    /// Consumes framing bytes (chunk sizes, CRLFs, trailers) from the front of `buf` until data
    /// or the end of the body, or until `buf` runs out.
    fn skip_framing(&mut self, buf: &mut BytesMut) -> io::Result<()> {
        loop {
            match *self {
                Framing::Length(0) => *self = Framing::Done,
                Framing::Chunked(Chunk::Size) => match httparse::parse_chunk_size(buf) {
                    Ok(httparse::Status::Complete((used, size))) => {
                        buf.advance(used);
                        *self = Framing::Chunked(if size == 0 {
                            Chunk::Trailer
                        } else {
                            Chunk::Data(size)
                        });
                    }
                    Ok(httparse::Status::Partial) if buf.len() < MAX_LINE => return Ok(()),
                    _ => return Err(invalid("malformed chunk size")),
                },
                Framing::Chunked(Chunk::DataEnd) => {
                    if buf.len() < 2 {
                        return Ok(());
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(invalid("chunk data longer than its size"));
                    }
                    buf.advance(2);
                    *self = Framing::Chunked(Chunk::Size);
                }
                Framing::Chunked(Chunk::Trailer) => {
                    let Some(eol) = memchr::memmem::find(buf, b"\r\n") else {
                        if buf.len() >= MAX_LINE {
                            return Err(invalid("trailer field too long"));
                        }
                        return Ok(());
                    };
                    buf.advance(eol + 2);
                    if eol == 0 {
                        *self = Framing::Done; // the empty line ends the trailers
                    }
                }
                _ => return Ok(()),
            }
        }
    }

    /// The connection reached its end of file here.
    pub fn at_eof(&mut self) -> io::Result<()> {
        match self {
            Framing::Close | Framing::Done => {
                *self = Framing::Done;
                Ok(())
            }
            _ => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the worker closed the connection before the body ended",
            )),
        }
    }
}

/// A response body read from a worker connection as the client asks for it.
pub struct UpstreamBody {
    io: Option<TcpStream>,
    buf: BytesMut,
    framing: Framing,
    keep_alive: bool,
    /// Bytes to ask for in the next read.
    read_size: usize,
    /// Where the connection goes back once the body has ended; taken then.
    home: Option<Home>,
    drained_at: DrainedAt,
}

impl UpstreamBody {
    pub(super) fn new(
        io: TcpStream,
        buf: BytesMut,
        head: &Head,
        home: Home,
        drained_at: DrainedAt,
    ) -> io::Result<Self> {
        let mut body = Self {
            io: Some(io),
            buf,
            framing: head.framing,
            keep_alive: head.keep_alive,
            read_size: READ_SIZE,
            home: Some(home),
            drained_at,
        };
        body.framing.skip_framing(&mut body.buf)?;
        body.settle_if_done();
        Ok(body)
    }

    /// Once the body has ended and nothing follows it, the connection goes back for reuse.
    fn settle_if_done(&mut self) {
        if self.framing != Framing::Done || !self.buf.is_empty() {
            return;
        }
        // What is left of the last read's buffer goes with the frames that share it, and back
        // to this thread's spares once they are written.
        spare::put(std::mem::take(&mut self.buf));
        if let (true, Some(io), Some(home)) = (self.keep_alive, self.io.take(), self.home.take()) {
            home.reuse(io, self.drained_at);
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        loop {
            match this.framing.decode(&mut this.buf) {
                Ok(Some(data)) => {
                    this.settle_if_done();
                    if this.buf.is_empty() {
                        // Nothing held while the stream waits for the worker's next event.
                        spare::put(std::mem::take(&mut this.buf));
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(None) if this.framing == Framing::Done => {
                    this.settle_if_done();
                    return Poll::Ready(None);
                }
                Ok(None) => {}
                Err(e) => {
                    this.io = None;
                    return Poll::Ready(Some(Err(e)));
                }
            }
            let Some(io) = this.io.as_mut() else {
                return Poll::Ready(None);
            };
            // A buffer only once there is something to read: a stream waiting for the worker's
            // next event holds none (8 KiB per open stream otherwise).
            let ready = io.poll_read_ready(cx);
            if ready.is_pending() {
                this.drained_at = DrainedAt::now();
            }
            if let Err(e) = ready!(ready) {
                this.io = None;
                this.framing = Framing::Done;
                return Poll::Ready(Some(Err(e)));
            }
            make_room(&mut this.buf, this.read_size);
            let room = this.buf.capacity() - this.buf.len();
            let read = read_some(io, cx, &mut this.buf);
            if this.buf.is_empty() && this.buf.capacity() > 0 && read.is_err() {
                spare::put(std::mem::take(&mut this.buf));
            }
            match read {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    this.drained_at = DrainedAt::now();
                    continue;
                }
                Ok(0) => {
                    this.keep_alive = false;
                    if let Err(e) = this.framing.at_eof() {
                        this.io = None;
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                Ok(n) => {
                    if n == room {
                        this.read_size = (this.read_size * 2).min(MAX_READ_SIZE);
                    }
                }
                Err(e) => {
                    this.io = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Done && self.buf.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn an_answers_buffer_is_read_into_again_once_its_frames_are_written() {
        let mut buf = spare::take(READ_SIZE);
        let start = buf.as_ptr();
        buf.extend_from_slice(b"HTTP/1.1 200 OK\r\n\r\nhello");
        let frame = buf.split().freeze();
        spare::put(buf);
        assert_eq!(spare::count(), 1);

        // The frame still holds the buffer: the next answer gets another.
        let other = spare::take(READ_SIZE);
        assert_ne!(other.as_ptr(), start);
        assert!(other.capacity() >= READ_SIZE);
        assert_eq!(spare::count(), 1, "kept for later");

        drop(frame);
        let again = spare::take(READ_SIZE);
        assert_eq!(again.as_ptr(), start, "the first buffer, from its start");
        assert!(again.is_empty() && again.capacity() >= READ_SIZE);
        assert_eq!(spare::count(), 0);
    }

    #[test]
    fn a_thread_keeps_a_few_spare_buffers_and_not_an_empty_one() {
        spare::put(BytesMut::new());
        assert_eq!(spare::count(), 0, "one that never held anything");
        let held: Vec<Bytes> = (0..SPARES + 3)
            .map(|_| {
                let mut buf = spare::take(READ_SIZE);
                buf.extend_from_slice(b"x");
                let frame = buf.split().freeze();
                spare::put(buf);
                frame
            })
            .collect();
        assert_eq!(spare::count(), SPARES);
        drop(held);
        for _ in 0..SPARES {
            spare::take(READ_SIZE);
        }
        assert_eq!(spare::count(), 0);
    }

    fn head(text: &str) -> io::Result<Option<Head>> {
        parse_head(&mut BytesMut::from(text), &Method::POST)
    }

    /// Feeds `wire` to a decoder in pieces cut at `cuts`; the body, and what followed it.
    fn decode_in_pieces(mut framing: Framing, wire: &[u8], cuts: &[usize]) -> (Vec<u8>, Vec<u8>) {
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        let mut at = 0;
        let mut ends: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        ends.push(wire.len());
        ends.sort_unstable();
        for end in ends {
            buf.extend_from_slice(&wire[at..end.max(at)]);
            at = end.max(at);
            while let Some(data) = framing.decode(&mut buf).unwrap() {
                body.extend_from_slice(&data);
            }
        }
        assert_eq!(
            framing,
            Framing::Done,
            "the body ended where its framing said"
        );
        (body, buf.to_vec())
    }

    proptest! {
        #[test]
        fn a_chunked_body_decodes_the_same_however_its_reads_are_cut(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 0..8),
            extension in any::<bool>(),
            trailer in any::<bool>(),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut wire = Vec::new();
            for chunk in &chunks {
                let ext = if extension { ";name=value" } else { "" };
                wire.extend_from_slice(format!("{:X}{ext}\r\n", chunk.len()).as_bytes());
                wire.extend_from_slice(chunk);
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"0\r\n");
            if trailer {
                wire.extend_from_slice(b"x-trailer: 1\r\n");
            }
            wire.extend_from_slice(b"\r\nHTTP/1.1 next");
            let (body, rest) = decode_in_pieces(Framing::Chunked(Chunk::Size), &wire, &cuts);
            prop_assert_eq!(body, chunks.concat());
            prop_assert_eq!(rest, b"HTTP/1.1 next".to_vec());
        }

        #[test]
        fn a_sized_body_takes_exactly_its_length(
            body in prop::collection::vec(any::<u8>(), 0..2000),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut wire = body.clone();
            wire.extend_from_slice(b"tail");
            let (got, rest) = decode_in_pieces(Framing::Length(body.len() as u64), &wire, &cuts);
            prop_assert_eq!(got, body);
            prop_assert_eq!(rest, b"tail".to_vec());
        }
    }

    #[test]
    fn a_body_cut_short_is_an_error_unless_it_runs_to_the_close() {
        let mut buf = BytesMut::from(&b"abc"[..]);
        let mut sized = Framing::Length(10);
        assert_eq!(sized.decode(&mut buf).unwrap().unwrap(), "abc");
        assert_eq!(
            sized.at_eof().unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        let mut chunked = Framing::Chunked(Chunk::Data(4));
        assert!(chunked.at_eof().is_err());
        let mut close = Framing::Close;
        let mut buf = BytesMut::from(&b"all of it"[..]);
        assert_eq!(close.decode(&mut buf).unwrap().unwrap(), "all of it");
        close.at_eof().unwrap();
        assert_eq!(close, Framing::Done);
    }

    #[test]
    fn malformed_chunk_framing_is_refused() {
        for wire in [&b"zz\r\n"[..], b"4\r\nabcdXY", b"FFFFFFFFFFFFFFFFFFFF\r\n"] {
            let mut buf = BytesMut::from(wire);
            let mut f = Framing::Chunked(Chunk::Size);
            let outcome = loop {
                match f.decode(&mut buf) {
                    Ok(Some(_)) => continue,
                    other => break other,
                }
            };
            assert!(outcome.is_err(), "{:?}", String::from_utf8_lossy(wire));
        }
    }

    #[test]
    fn a_head_keeps_every_field_up_to_the_limit_with_its_value_and_no_more() {
        let fields: String = (0..MAX_HEADERS)
            .map(|i| format!("x-field-{i}: value {i}\r\n"))
            .collect();
        let mut wire = BytesMut::from(format!("HTTP/1.1 200 OK\r\n{fields}\r\nbody").as_str());
        let parsed = parse_head(&mut wire, &Method::POST).unwrap().unwrap();
        assert_eq!(parsed.headers.len(), MAX_HEADERS);
        for i in [0, 1, MAX_HEADERS / 2, MAX_HEADERS - 1] {
            assert_eq!(
                parsed.headers[format!("x-field-{i}").as_str()],
                format!("value {i}").as_str()
            );
        }
        // What follows the head stays in the buffer for the body.
        assert_eq!(&wire[..], b"body");
        let one_more = format!("HTTP/1.1 200 OK\r\n{fields}x-extra: 1\r\n\r\n");
        assert!(head(&one_more).is_err());
    }

    #[test]
    fn a_head_says_how_its_body_is_framed_and_whether_the_connection_stays() {
        let h = head("HTTP/1.1 200 OK\r\ncontent-length: 12\r\nx-a: 1\r\n\r\nbody")
            .unwrap()
            .unwrap();
        assert_eq!(h.status, StatusCode::OK);
        assert_eq!(h.headers["x-a"], "1");
        let chunked = Framing::Chunked(Chunk::Size);
        for (text, framing, keep_alive) in [
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n",
                Framing::Length(12),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                chunked,
                true,
            ),
            // No length: the body runs to the close, and the connection cannot be reused.
            ("HTTP/1.1 200 OK\r\n\r\n", Framing::Close, false),
            (
                "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
                Framing::Length(0),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n",
                Framing::Length(0),
                false,
            ),
            // Connection's tokens are a list, in any case, with spaces around them.
            (
                "HTTP/1.0 200 OK\r\nconnection:  Keep-Alive \r\ncontent-length: 0\r\n\r\n",
                Framing::Length(0),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nconnection: keep-alive,CLOSE\r\ncontent-length: 0\r\n\r\n",
                Framing::Length(0),
                false,
            ),
            // Both framings: chunked wins, and the connection ends with this answer.
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n",
                chunked,
                false,
            ),
            ("HTTP/1.1 204 No Content\r\n\r\n", Framing::Length(0), true),
        ] {
            let h = head(text).unwrap().unwrap();
            assert_eq!((h.framing, h.keep_alive), (framing, keep_alive), "{text}");
        }
        // Interim answers are heads too; the caller passes over them.
        assert!(head("HTTP/1.1 100 Continue\r\n\r\n")
            .unwrap()
            .unwrap()
            .status
            .is_informational());
        assert!(head("HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none());
        for bad in [
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            "HTTP/1.1 2000 OK\r\n\r\n",
            "SSH-2.0-OpenSSH\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n",
        ] {
            assert!(head(bad).is_err(), "{bad}");
        }
    }
}
