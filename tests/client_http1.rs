//! HTTP/1.1 from clients on the real listener: kept-alive and pipelined requests, what the
//! gateway's own server leaves to hyper's on the same connection, and how connections close.

mod common;

use std::time::Duration;

use common::{config_for, gateway, upstream, RawResponse};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

const SECOND: Duration = Duration::from_secs(1);

/// Reads one response (framed by `Content-Length` or in chunks) from `r`.
async fn read_response(r: &mut BufReader<TcpStream>) -> RawResponse {
    tokio::time::timeout(5 * SECOND, async {
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let n = r.read_until(b'\n', &mut head).await.unwrap();
            assert!(n > 0, "closed before a whole head: {head:?}");
        }
        let mut resp = common::parse_response(&head);
        if let Some(len) = resp.header("content-length") {
            let mut body = vec![0u8; len.parse().unwrap()];
            r.read_exact(&mut body).await.unwrap();
            resp.body = body;
        } else if resp.header("transfer-encoding") == Some("chunked") {
            loop {
                let mut line = String::new();
                r.read_line(&mut line).await.unwrap();
                let size = usize::from_str_radix(line.trim(), 16).unwrap();
                let mut chunk = vec![0u8; size + 2];
                r.read_exact(&mut chunk).await.unwrap();
                if size == 0 {
                    break;
                }
                resp.body.extend_from_slice(&chunk[..size]);
            }
        }
        resp
    })
    .await
    .expect("a response within 5 s")
}

/// Whether the peer closes within `limit` without sending anything more.
async fn closes(r: &mut BufReader<TcpStream>, limit: Duration) -> bool {
    let mut rest = Vec::new();
    matches!(
        tokio::time::timeout(limit, r.read_to_end(&mut rest)).await,
        Ok(Ok(0))
    )
}

/// What the test worker answers a two-token completion of `prompt`.
fn text_for(prompt: &str) -> String {
    (0..2).map(|i| common::event_text(prompt, i)).collect()
}

fn completion(prompt: &str) -> String {
    let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": 2}}"#);
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

async fn connect(addr: std::net::SocketAddr) -> BufReader<TcpStream> {
    BufReader::new(TcpStream::connect(addr).await.unwrap())
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let mut c = connect(gw.addr).await;
    let burst = format!(
        "{}GET /health HTTP/1.1\r\nHost: gw\r\n\r\n{}",
        completion("first"),
        completion("second")
    );
    c.get_mut().write_all(burst.as_bytes()).await.unwrap();
    let first = read_response(&mut c).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.json()["text"], text_for("first"), "{}", first.json());
    assert_eq!(read_response(&mut c).await.status, 200);
    let third = read_response(&mut c).await;
    assert_eq!(third.json()["text"], text_for("second"), "{}", third.json());
    // Still open for more.
    c.get_mut()
        .write_all(completion("fourth").as_bytes())
        .await
        .unwrap();
    assert_eq!(
        read_response(&mut c).await.json()["text"],
        text_for("fourth")
    );
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 3);
}

/// HTTP/1.0, a chunked body, `Expect: 100-continue` and a head past 64 KiB are served by hyper,
/// from the bytes already read; the connection goes on being served after each.
#[tokio::test]
async fn requests_left_to_hyper_are_served_and_their_connection_goes_on() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let body = r#"{"prompt": "chunked", "max_tokens": 2}"#;
    let chunked = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    let big_head = format!(
        "GET /health HTTP/1.1\r\nHost: gw\r\nX-Padding: {}\r\n\r\n",
        "p".repeat(70 * 1024)
    );
    for (what, first) in [
        ("chunked", chunked),
        ("a 70 KiB head", big_head),
        (
            "HTTP/1.0 with keep-alive",
            "GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n".to_string(),
        ),
    ] {
        let mut c = connect(gw.addr).await;
        // After a normal request, so the connection starts on the gateway's own server.
        c.get_mut()
            .write_all(completion("before").as_bytes())
            .await
            .unwrap();
        assert_eq!(read_response(&mut c).await.status, 200, "{what}");
        c.get_mut().write_all(first.as_bytes()).await.unwrap();
        let resp = read_response(&mut c).await;
        assert_eq!(
            resp.status,
            200,
            "{what}: {}",
            String::from_utf8_lossy(&resp.body)
        );
        if what == "chunked" {
            assert_eq!(resp.json()["text"], text_for("chunked"));
        }
        c.get_mut()
            .write_all(completion("after").as_bytes())
            .await
            .unwrap();
        let after = read_response(&mut c).await;
        assert_eq!(after.json()["text"], text_for("after"), "{what}");
    }

    let mut c = connect(gw.addr).await;
    let body = r#"{"prompt": "continue", "max_tokens": 2}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    c.get_mut().write_all(head.as_bytes()).await.unwrap();
    let mut line = String::new();
    tokio::time::timeout(5 * SECOND, c.read_line(&mut line))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(line, "HTTP/1.1 100 Continue\r\n");
    line.clear();
    c.read_line(&mut line).await.unwrap();
    assert_eq!(line, "\r\n");
    c.get_mut().write_all(body.as_bytes()).await.unwrap();
    assert_eq!(
        read_response(&mut c).await.json()["text"],
        text_for("continue")
    );
}

#[tokio::test]
async fn a_malformed_head_gets_400_and_the_connection_closes() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let mut c = connect(gw.addr).await;
    c.get_mut()
        .write_all(b"GET /health HTTP/1.1\r\nHost: gw\r\nBad Header Line\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_response(&mut c).await.status, 400);
    assert!(closes(&mut c, 5 * SECOND).await);
}

#[tokio::test]
async fn connection_close_is_answered_in_kind_and_the_connection_closes() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let mut c = connect(gw.addr).await;
    c.get_mut()
        .write_all(b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let resp = read_response(&mut c).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("connection"), Some("close"));
    assert!(resp.header("date").is_some_and(|d| d.ends_with(" GMT")));
    assert!(closes(&mut c, 5 * SECOND).await);
}

/// A body too large for the limit is answered 413 without being read; the connection, whose
/// next bytes would be the rest of that body, closes after the answer.
#[tokio::test]
async fn a_body_left_unread_closes_its_connection_after_the_answer() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "round_robin");
    cfg.body_limit_bytes = 1024;
    let gw = gateway(cfg).await;
    let mut c = connect(gw.addr).await;
    c.get_mut()
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"prompt\": \"",
        )
        .await
        .unwrap();
    let resp = read_response(&mut c).await;
    assert_eq!(resp.status, 413);
    assert_eq!(resp.header("connection"), Some("close"));
    assert!(closes(&mut c, 5 * SECOND).await);
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// At shutdown a kept-alive connection waiting for its next request is closed at once, and the
/// server ends.
#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_at_shutdown() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let mut c = connect(gw.addr).await;
    c.get_mut()
        .write_all(completion("one").as_bytes())
        .await
        .unwrap();
    assert_eq!(read_response(&mut c).await.status, 200);
    gw.shutdown.cancel();
    assert!(closes(&mut c, 5 * SECOND).await, "kept open at shutdown");
    tokio::time::timeout(5 * SECOND, gw.task)
        .await
        .expect("the server ends")
        .unwrap()
        .unwrap();
}

/// A client that closes its side in the same moment as it sends its request (the close arriving
/// with the request's bytes) is seen to have left: the worker's request is aborted.
#[tokio::test]
async fn a_close_that_arrives_with_the_request_aborts_it_at_the_worker() {
    let mut up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let body = r#"{"prompt": "slow", "max_tokens": 3, "delay_ms": 30000}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut c = TcpStream::connect(gw.addr).await.unwrap();
    // Both go out before the gateway's task runs again (this test's runtime has one thread and
    // neither call waits on loopback), so the gateway's first read finds the request and the
    // close together: the close must be seen although that read left nothing to read.
    c.write_all(req.as_bytes()).await.unwrap();
    c.shutdown().await.unwrap();
    assert!(
        up.saw_disconnect_within(5 * SECOND).await,
        "the worker kept generating for a client that had left"
    );
}
