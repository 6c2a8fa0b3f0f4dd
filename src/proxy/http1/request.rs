//! The request to a worker: its head encoded and written with the body in one vectored write.

use std::io::{self, IoSlice};

use http::{header, HeaderValue, Method};
use tokio::{io::AsyncWriteExt, net::TcpStream};

use crate::proxy::{end_to_end, Outgoing};

/// Writes `req`'s head (with `host` as its `Host`, and `rank` as its `X-data-parallel-rank` when
/// given) and body. On failure, also says how many bytes had been written: none means the worker
/// never saw any of the request.
pub(in crate::proxy) async fn write_request(
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
pub(in crate::proxy) fn encode_head(
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
