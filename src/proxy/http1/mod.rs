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
//!
//! `request.rs` writes the request, `head.rs` reads the answer's head and `body.rs` its body;
//! this file keeps the read buffers and limits they share.

mod body;
mod head;
mod request;

pub use body::UpstreamBody;
use body::{Chunk, Framing};
pub(super) use head::{read_head, DrainedAt};
#[cfg(test)]
pub(super) use request::encode_head;
pub(super) use request::write_request;

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::BytesMut;
use tokio::net::TcpStream;

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

#[cfg(test)]
mod tests {
    use bytes::Bytes;

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
}
