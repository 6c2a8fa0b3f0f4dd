//! The worker's response body: decoded from its framing (`Content-Length`, chunks, or until
//! close) in the request's own task as the client reads it, the connection handed back to the
//! pool once the body has ended where its framing said.

use std::{
    io,
    pin::Pin,
    task::{ready, Context, Poll},
};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokio::net::TcpStream;

use super::{
    head::Head, invalid, make_room, read_some, spare, DrainedAt, MAX_LINE, MAX_READ_SIZE, READ_SIZE,
};
use crate::proxy::upstream::Home;

/// Where the body decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::proxy) enum Framing {
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
pub(in crate::proxy) enum Chunk {
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
    pub(in crate::proxy) fn new(
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
}
