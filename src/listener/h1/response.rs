//! An answer written to the client: its head, then its body framed by `Content-Length` or in
//! chunks, each batch of ready frames in one vectored write.

use std::{cell::RefCell, io, io::IoSlice, time::SystemTime};

use bytes::Bytes;
use http::{header, response::Parts, StatusCode};
use http_body::Body as _;
use tokio::net::TcpStream;

/// How the body is delimited on the wire.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Framing {
    /// `Content-Length`: this many bytes still to write.
    Length(u64),
    Chunked,
    /// No body may follow (204, 304).
    Bodiless,
}

/// The answer's head, with the framing it declares and whether the connection closes after it.
/// One pass over the answer's fields writes them and notes what framing and connection fields
/// they hold; what is missing is added after them.
pub(super) fn encode_head(
    parts: &Parts,
    body: &axum::body::Body,
    close: bool,
    out: &mut Vec<u8>,
) -> (Framing, bool) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(
        parts
            .status
            .canonical_reason()
            .unwrap_or("<none>")
            .as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
    let mut has = Has::default();
    for (name, value) in &parts.headers {
        if *name == header::CONTENT_LENGTH {
            has.length = Some(has.length.is_none().then(|| length(value)).flatten());
        } else if *name == header::TRANSFER_ENCODING {
            has.chunked = true;
        } else if *name == header::CONNECTION {
            has.connection = true;
            has.close |= value
                .as_bytes()
                .split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
        } else if *name == header::DATE {
            has.date = true;
        }
        field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    let bodiless = parts.status.is_informational()
        || parts.status == StatusCode::NO_CONTENT
        || parts.status == StatusCode::NOT_MODIFIED;
    // As hyper's server frames an answer: its own `Content-Length`, else chunks when it says
    // `Transfer-Encoding`, else the body's exact size, else chunks.
    let framing = match (bodiless, has.length, has.chunked) {
        (true, ..) => Framing::Bodiless,
        (false, Some(Some(n)), _) => Framing::Length(n),
        (false, _, true) => Framing::Chunked,
        (false, _, false) => match body.size_hint().exact() {
            Some(n) => {
                let mut digits = Digits::of(n);
                field(out, b"content-length", digits.as_mut());
                Framing::Length(n)
            }
            None => {
                field(out, b"transfer-encoding", b"chunked");
                Framing::Chunked
            }
        },
    };
    let close = close || has.close;
    if close && !has.connection {
        field(out, b"connection", b"close");
    }
    if !has.date {
        DATE.with(|d| field(out, b"date", d.borrow_mut().now()));
    }
    out.extend_from_slice(b"\r\n");
    (framing, close)
}

/// What framing and connection fields an answer's head holds.
#[derive(Default)]
struct Has {
    /// `Content-Length`, and its value when it is one number.
    length: Option<Option<u64>>,
    chunked: bool,
    connection: bool,
    close: bool,
    date: bool,
}

fn length(value: &http::HeaderValue) -> Option<u64> {
    std::str::from_utf8(value.as_bytes()).ok()?.parse().ok()
}

fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// A number in decimal, written without allocating.
struct Digits {
    buf: [u8; 20],
    at: usize,
}

impl Digits {
    fn of(mut n: u64) -> Self {
        let mut d = Self {
            buf: [0; 20],
            at: 20,
        };
        loop {
            d.at -= 1;
            d.buf[d.at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                return d;
            }
        }
    }
}

impl AsMut<[u8]> for Digits {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.at..]
    }
}

/// `Date` as HTTP writes it, formatted once a second per thread.
struct CachedDate {
    second: u64,
    text: [u8; 29],
}

thread_local! {
    static DATE: RefCell<CachedDate> = const { RefCell::new(CachedDate { second: u64::MAX, text: [0; 29] }) };
}

impl CachedDate {
    fn now(&mut self) -> &[u8] {
        let now = SystemTime::now();
        let second = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if second != self.second {
            let text = httpdate::fmt_http_date(now);
            if text.len() == self.text.len() {
                self.text.copy_from_slice(text.as_bytes());
                self.second = second;
            }
        }
        &self.text
    }
}

/// The most pieces one vectored write carries.
const MAX_PIECES: usize = 32;
/// Ready frames past this many bytes are written before more are taken.
pub(super) const FLUSH_AT: usize = 64 * 1024;

/// What is queued for the next write.
#[derive(Default)]
pub(super) struct Out {
    pieces: Vec<Piece>,
    bytes: usize,
}

enum Piece {
    Owned(Vec<u8>),
    Shared(Bytes),
    Static(&'static [u8]),
    /// A chunk's size line.
    Line([u8; 18], u8),
}

impl Piece {
    fn as_slice(&self) -> &[u8] {
        match self {
            Piece::Owned(v) => v,
            Piece::Shared(b) => b,
            Piece::Static(s) => s,
            Piece::Line(line, len) => &line[..*len as usize],
        }
    }
}

impl Out {
    pub(super) fn head(&mut self, head: Vec<u8>) {
        self.bytes += head.len();
        self.pieces.push(Piece::Owned(head));
    }

    /// Queues a frame's data; `false` when it overran the declared length (it is cut there).
    pub(super) fn data(&mut self, mut data: Bytes, framing: &mut Framing) -> bool {
        if data.is_empty() {
            return true;
        }
        match framing {
            Framing::Bodiless => false,
            Framing::Length(left) => {
                let fits = data.len() as u64 <= *left;
                data.truncate((*left).min(data.len() as u64) as usize);
                *left -= data.len() as u64;
                self.push(Piece::Shared(data));
                fits
            }
            Framing::Chunked => {
                self.push(Piece::Line(
                    chunk_line(data.len()),
                    chunk_line_len(data.len()),
                ));
                self.push(Piece::Shared(data));
                self.push(Piece::Static(b"\r\n"));
                true
            }
        }
    }

    /// Queues the body's end; `false` when it ended short of its declared length.
    pub(super) fn end(&mut self, framing: Framing) -> bool {
        match framing {
            Framing::Chunked => {
                self.push(Piece::Static(b"0\r\n\r\n"));
                true
            }
            Framing::Length(left) => left == 0,
            Framing::Bodiless => true,
        }
    }

    fn push(&mut self, piece: Piece) {
        let len = piece.as_slice().len();
        if len > 0 {
            self.bytes += len;
            self.pieces.push(piece);
        }
    }

    /// Whether the queue should be written before another frame is taken.
    pub(super) fn full(&self) -> bool {
        self.bytes >= FLUSH_AT || self.pieces.len() + 3 > MAX_PIECES
    }

    pub(super) fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Writes everything queued and empties the queue.
    pub(super) async fn write(&mut self, tcp: &TcpStream) -> io::Result<()> {
        let mut written = Ok(());
        for batch in self.pieces.chunks(MAX_PIECES) {
            let mut slices = [IoSlice::new(&[]); MAX_PIECES];
            for (slice, piece) in slices.iter_mut().zip(batch) {
                *slice = IoSlice::new(piece.as_slice());
            }
            written = write_all(tcp, &mut slices[..batch.len()]).await;
            if written.is_err() {
                break;
            }
        }
        self.pieces.clear();
        self.bytes = 0;
        written
    }
}

async fn write_all(tcp: &TcpStream, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        match tcp.try_write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            // Only this answer writes to the client: the socket's one writer slot serves.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::future::poll_fn(|cx| tcp.poll_write_ready(cx)).await?
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `len` in hex and CRLF, as a chunk opens.
fn chunk_line(len: usize) -> [u8; 18] {
    let mut line = [0u8; 18];
    let digits = hex_digits(len);
    for (i, slot) in line.iter_mut().take(digits).enumerate() {
        let shift = 4 * (digits - 1 - i);
        *slot = b"0123456789abcdef"[(len >> shift) & 0xf];
    }
    line[digits] = b'\r';
    line[digits + 1] = b'\n';
    line
}

fn chunk_line_len(len: usize) -> u8 {
    hex_digits(len) as u8 + 2
}

fn hex_digits(len: usize) -> usize {
    (usize::BITS as usize - len.leading_zeros() as usize)
        .div_ceil(4)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_lines_are_hex_with_crlf() {
        for (len, want) in [
            (1usize, "1\r\n"),
            (15, "f\r\n"),
            (16, "10\r\n"),
            (13_000, "32c8\r\n"),
        ] {
            let line = chunk_line(len);
            assert_eq!(&line[..chunk_line_len(len) as usize], want.as_bytes());
        }
    }

    #[test]
    fn heads_say_how_their_bodies_end() {
        let encode = |resp: http::Response<axum::body::Body>, close| {
            let (parts, body) = resp.into_parts();
            let mut out = Vec::new();
            let (framing, close) = encode_head(&parts, &body, close, &mut out);
            (String::from_utf8(out).unwrap(), framing, close)
        };
        let (head, framing, close) =
            encode(http::Response::new(axum::body::Body::from("hello")), false);
        assert!(
            head.starts_with("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ndate: "),
            "{head}"
        );
        assert!(head.ends_with(" GMT\r\n\r\n"), "{head}");
        assert_eq!((framing, close), (Framing::Length(5), false));

        let stream =
            axum::body::Body::from_stream(futures_util::stream::iter([Ok::<_, io::Error>(
                Bytes::from_static(b"x"),
            )]));
        let (head, framing, close) = encode(
            http::Response::builder()
                .status(503)
                .header("date", "then")
                .body(stream)
                .unwrap(),
            true,
        );
        assert_eq!(
            head,
            "HTTP/1.1 503 Service Unavailable\r\ndate: then\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        );
        assert_eq!((framing, close), (Framing::Chunked, true));

        let (head, framing, close) = encode(
            http::Response::builder()
                .status(204)
                .header("connection", "close")
                .header("date", "then")
                .body(axum::body::Body::empty())
                .unwrap(),
            false,
        );
        assert_eq!(
            head,
            "HTTP/1.1 204 No Content\r\nconnection: close\r\ndate: then\r\n\r\n"
        );
        assert_eq!((framing, close), (Framing::Bodiless, true));
    }

    #[tokio::test]
    async fn a_queue_longer_than_one_vectored_write_is_written_whole_and_in_order() {
        use tokio::io::AsyncReadExt;
        let (mut client, tcp) = super::super::socket_pair().await;
        let mut out = Out::default();
        out.head(b"HEAD\r\n".to_vec());
        let mut framing = Framing::Chunked;
        let mut want = b"HEAD\r\n".to_vec();
        for i in 0..40 {
            let data = format!("event {i};");
            want.extend_from_slice(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes());
            assert!(out.data(Bytes::from(data), &mut framing));
        }
        assert!(out.end(framing));
        want.extend_from_slice(b"0\r\n\r\n");
        assert!(out.pieces.len() > MAX_PIECES);
        out.write(&tcp).await.unwrap();
        assert!(out.is_empty());
        drop(tcp);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&want)
        );
    }

    #[test]
    fn a_body_longer_than_its_length_is_cut() {
        let mut out = Out::default();
        let mut framing = Framing::Length(3);
        assert!(!out.data(Bytes::from_static(b"hello"), &mut framing));
        assert_eq!(framing, Framing::Length(0));
        assert_eq!(out.bytes, 3);
        assert!(out.end(framing));
        let mut short = Framing::Length(3);
        assert!(out.data(Bytes::from_static(b"he"), &mut short));
        assert!(!out.end(short));
    }
}
