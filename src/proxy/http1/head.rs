//! The worker's response head: read off the connection (past interim answers), parsed, and
//! its body's framing and the connection's reuse read from it.

use std::{io, mem::MaybeUninit, task::Poll};

use bytes::BytesMut;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use tokio::net::TcpStream;

use super::{invalid, make_room, read_some, Chunk, Framing, MAX_HEAD, MAX_HEADERS, READ_SIZE};
use crate::proxy::{is_hop_by_hop, names_no_other_field, tokens};

/// A parsed response head, and how its body is framed.
#[derive(Debug)]
pub(in crate::proxy) struct Head {
    pub status: StatusCode,
    /// The end-to-end fields, which become the client's: without the hop-by-hop ones and those
    /// `Connection` names (RFC 9110 §7.6.1), which describe the worker's connection alone.
    pub headers: HeaderMap,
    pub framing: Framing,
    /// The connection may carry another request once this body has ended.
    pub keep_alive: bool,
}

/// The last time a connection's socket was seen holding nothing unread. Whatever is read after
/// it, the worker wrote after it, so the worker's idle timer (started by its last write) cannot
/// have started earlier: measured from here, the pool's idle estimate errs long, even when a
/// slow client left the end of an answer unread in the socket for a while.
pub(in crate::proxy) type DrainedAt = tokio::time::Instant;

/// Reads the response head to `req_method` from `io` into `buf` (which keeps what follows it),
/// passing over interim (1xx) responses. `Ok(None)`: the worker closed the connection before
/// sending a byte of an answer.
pub(in crate::proxy) async fn read_head(
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
        // The connection is this request's alone: its one reader slot serves (see
        // `listener::h1::read_ready`).
        std::future::poll_fn(|cx| io.poll_read_ready(cx)).await?;
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

/// Parses one head off the front of `buf`; `None` until it is complete.
pub(in crate::proxy) fn parse_head(
    buf: &mut BytesMut,
    req_method: &Method,
) -> io::Result<Option<Head>> {
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
    // What frames the body and whether the connection stays, read in the same pass that leaves
    // the hop-by-hop fields out of the map.
    let mut seen = Framed::default();
    // Each field's name and value, as ranges of the head.
    let fields = spans[..count].iter().map(|&(name_at, name_len, at, n)| {
        let (name_at, at) = (name_at as usize, at as usize);
        (name_at..name_at + name_len as usize, at..at + n as usize)
    });
    for (name, value) in fields.clone() {
        let raw = &head[value.clone()];
        let name =
            HeaderName::from_bytes(&head[name]).map_err(|_| invalid("malformed header name"))?;
        if name == header::CONTENT_LENGTH {
            seen.length(raw);
        } else if is_hop_by_hop(&name) {
            seen.hop(&name, raw);
            continue;
        }
        let value = HeaderValue::from_maybe_shared(head.slice(value))
            .map_err(|_| invalid("malformed header value"))?;
        headers.append(name, value);
    }
    if seen.names_others {
        // `Connection` names fields of its own to remove with it: rare, so read again here.
        for (name, value) in fields {
            let raw = &head[value];
            if !head[name].eq_ignore_ascii_case(b"connection") || !raw.is_ascii() {
                continue;
            }
            for token in tokens(raw).filter(|t| !names_no_other_field(t)) {
                if let Ok(named) = HeaderName::from_bytes(token) {
                    headers.remove(named);
                }
            }
        }
    }
    let framing = framing(status, req_method, &seen)?;
    let says_close = seen.close
        // Both framings at once is how requests are smuggled: the connection ends with this one.
        || (seen.coding.is_some() && seen.has_length);
    let keep_alive = match version {
        Version::HTTP_11 => !says_close,
        _ => seen.keep_alive && !says_close,
    } && !matches!(framing, Framing::Close);
    Ok(Some(Head {
        status,
        headers,
        framing,
        keep_alive,
    }))
}

/// What a response head's fields say of its body's framing and of the connection.
struct Framed {
    /// `Transfer-Encoding` was there: whether the last coding it lists is `chunked` (`false`
    /// also when it lists none).
    coding: Option<bool>,
    /// `Content-Length` was there, valid or not.
    has_length: bool,
    /// The length its values agree on, or what is wrong with them.
    length: Result<Option<u64>, &'static str>,
    /// `Connection` lists `close`, `keep-alive`, or a field of the response's own to remove.
    close: bool,
    keep_alive: bool,
    names_others: bool,
}

impl Default for Framed {
    fn default() -> Self {
        Self {
            coding: None,
            has_length: false,
            length: Ok(None),
            close: false,
            keep_alive: false,
            names_others: false,
        }
    }
}

impl Framed {
    /// A `Content-Length` field: a list of equal decimal lengths.
    fn length(&mut self, raw: &[u8]) {
        self.has_length = true;
        for part in raw.split(|&b| b == b',') {
            let Ok(before) = self.length else {
                return;
            };
            self.length = match (parse_length(part.trim_ascii()), before) {
                (Err(e), _) => Err(e),
                (Ok(n), Some(b)) if n != b => Err("conflicting content-length values"),
                (Ok(n), _) => Ok(Some(n)),
            };
        }
    }

    /// A hop-by-hop field: what `Transfer-Encoding` and `Connection` say.
    fn hop(&mut self, name: &HeaderName, raw: &[u8]) {
        if name == header::TRANSFER_ENCODING {
            let was = self.coding.unwrap_or(false);
            // Only a value of visible ASCII counts, as one that reads as text.
            let last = raw.is_ascii().then(|| tokens(raw).next_back()).flatten();
            self.coding = Some(last.map_or(was, |t| t.eq_ignore_ascii_case(b"chunked")));
        } else if name == header::CONNECTION {
            for token in tokens(raw) {
                if token.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    self.keep_alive = true;
                } else if !names_no_other_field(token) {
                    self.names_others |= raw.is_ascii();
                }
            }
        }
    }
}

fn parse_length(part: &[u8]) -> Result<u64, &'static str> {
    if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
        return Err("malformed content-length");
    }
    std::str::from_utf8(part)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or("malformed content-length")
}

/// How the body of a response is delimited (RFC 9112 §6.3).
fn framing(status: StatusCode, method: &Method, seen: &Framed) -> io::Result<Framing> {
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
    if let Some(chunked) = seen.coding {
        return Ok(if chunked {
            Framing::Chunked(Chunk::Size)
        } else {
            Framing::Close
        });
    }
    let length = seen.length.map_err(invalid)?;
    Ok(length.map_or(Framing::Close, Framing::Length))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> io::Result<Option<Head>> {
        parse_head(&mut BytesMut::from(text), &Method::POST)
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
    fn a_head_keeps_its_end_to_end_fields_and_leaves_the_hop_by_hop_ones() {
        let h = head(concat!(
            "HTTP/1.1 200 OK\r\n",
            "Connection: keep-alive, X-Private\r\n",
            "x-private: secret\r\n",
            "connection:  x-other \r\n",
            "Keep-Alive: timeout=5\r\n",
            "x-other: 1\r\n",
            "content-type: text/event-stream\r\n",
            "Transfer-Encoding: chunked\r\n",
            "Trailer: x-t\r\n",
            "Proxy-Authenticate: Basic\r\n",
            "Upgrade: h2c\r\n",
            "x-kept: a\r\n",
            "x-kept: b\r\n",
            "\r\n",
        ))
        .unwrap()
        .unwrap();
        let mut kept: Vec<(&str, &str)> = h
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
            .collect();
        kept.sort_unstable();
        assert_eq!(
            kept,
            [
                ("content-type", "text/event-stream"),
                ("x-kept", "a"),
                ("x-kept", "b")
            ]
        );
        // What the left-out fields said still frames the body and keeps the connection.
        assert_eq!(
            (h.framing, h.keep_alive),
            (Framing::Chunked(Chunk::Size), true)
        );
        // `Content-Length` is end to end: it stays, as does a field `Connection` does not name.
        let h = head("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\nx-a: 1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.headers.len(), 2);
        assert_eq!(h.headers["content-length"], "2");
        assert_eq!((h.framing, h.keep_alive), (Framing::Length(2), false));
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
            // The last coding listed decides, over every `Transfer-Encoding` field.
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: gzip\r\n\r\n",
                Framing::Close,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip,\r\ntransfer-encoding: , Chunked\r\n\r\n",
                chunked,
                true,
            ),
            // A list of equal lengths is one length.
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\ncontent-length: 5\r\n\r\n",
                Framing::Length(5),
                true,
            ),
            // A bad length does not matter where the length does not frame the body.
            (
                "HTTP/1.1 304 Not Modified\r\ncontent-length: x\r\n\r\n",
                Framing::Length(0),
                true,
            ),
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
            "HTTP/1.1 200 OK\r\ncontent-length: 3, 4\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 3,\r\n\r\n",
            "HTTP/1.1 2000 OK\r\n\r\n",
            "SSH-2.0-OpenSSH\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n",
        ] {
            assert!(head(bad).is_err(), "{bad}");
        }
    }
}
