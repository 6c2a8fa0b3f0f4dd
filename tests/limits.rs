//! Client limits on the real listener: slow headers, slow bodies, the connection cap.

mod common;

use std::time::Duration;

use common::{config_for, gateway, metric, request, upstream};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// Reads until the peer closes or `limit` passes; returns what was read and whether it closed.
async fn read_to_close(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    let closed = tokio::time::timeout(limit, s.read_to_end(&mut out))
        .await
        .is_ok();
    (out, closed)
}

/// `n` kept-alive connections, each answered once, so each holds a place under the cap.
async fn hold_connections(addr: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
        held.push(s);
    }
    held
}

#[tokio::test]
async fn headers_that_trickle_in_are_cut_off_while_others_are_served() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "round_robin");
    cfg.limits.header_read_timeout_seconds = 0.3;
    let gw = gateway(cfg).await;
    let mut slow = Vec::new();
    for _ in 0..50 {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHo").await.unwrap();
        slow.push(s);
    }
    // Meanwhile a normal client is served.
    assert_eq!(request(gw.addr, "GET", "/health", b"").await.status, 200);
    for mut s in slow {
        let (_, closed) = read_to_close(&mut s, Duration::from_secs(5)).await;
        assert!(
            closed,
            "a slow-header connection was kept past the deadline"
        );
    }
}

/// A connection that never sends a byte is closed at the header deadline too: the protocol is
/// told before hyper's own header timer starts, and that wait has the same deadline.
#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_at_the_header_deadline() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "round_robin");
    cfg.limits.header_read_timeout_seconds = 0.3;
    let gw = gateway(cfg).await;
    let mut silent = TcpStream::connect(gw.addr).await.unwrap();
    let (got, closed) = read_to_close(&mut silent, Duration::from_secs(5)).await;
    assert!(closed && got.is_empty(), "kept open: {got:?}");
}

/// HTTP/2 with prior knowledge (h2c) is still served beside HTTP/1 on the same port: the
/// protocol is told from the first bytes, peeked, not read.
#[tokio::test]
async fn http2_with_prior_knowledge_is_served() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!("http://{}/v1/completions", gw.addr))
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"prompt": "over h2", "max_tokens": 3}"#,
        )))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["worker"], "w0", "{v}");
    assert_eq!(v["path"], "/v1/completions", "{v}");
    // And HTTP/1 beside it.
    assert_eq!(request(gw.addr, "GET", "/health", b"").await.status, 200);
}

#[tokio::test]
async fn a_body_that_never_finishes_gets_408() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "round_robin");
    cfg.limits.body_read_timeout_seconds = 0.3;
    let gw = gateway(cfg).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
    )
    .await
    .unwrap();
    let mut head = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut head))
        .await
        .expect("an answer before the body is complete")
        .unwrap();
    assert_eq!(&head, b"HTTP/1.1 408");
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn past_the_connection_cap_new_clients_wait_until_one_leaves() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "round_robin");
    cfg.limits.max_connections = 4;
    let gw = gateway(cfg).await;
    // Four kept-alive connections, each answered once: the cap is full.
    let mut held = hold_connections(gw.addr, 4).await;
    let mut fifth = TcpStream::connect(gw.addr).await.unwrap();
    fifth
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_to_close(&mut fifth, Duration::from_millis(300)).await;
    assert!(got.is_empty(), "served past the cap");
    drop(held.pop());
    let (got, closed) = read_to_close(&mut fifth, Duration::from_secs(5)).await;
    assert!(
        closed && got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
}

/// `kvroute serve`'s shape: one acceptor handing connections in turn to three event loops, each
/// a thread of its own. Every loop answers, a scrape adds up what each loop counted, the one
/// connection cap holds, and all stop on shutdown.
#[tokio::test]
async fn event_loops_count_into_one_scrape_share_the_connection_cap_and_stop_together() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "cache_aware");
    cfg.limits.max_connections = 4;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = kvroute::routes::AppState::new(cfg).unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(kvroute::server::serve_state_on(
        listener,
        3,
        state,
        Duration::from_secs(5),
        shutdown.clone(),
    ));
    // Fresh connections go to the loops in turn: every one answered, streams too.
    for i in 0..30 {
        let stream = i % 2 == 0;
        let body = format!(r#"{{"prompt": "p{i}", "stream": {stream}}}"#);
        let r = request(addr, "POST", "/v1/completions", body.as_bytes()).await;
        assert_eq!(r.status, 200);
    }
    // Each loop counted its requests in a shard of its own; a scrape adds them all up.
    let m = request(addr, "GET", "/metrics", b"").await;
    let m = String::from_utf8_lossy(&m.body);
    let labels = r#"arm="cache_aware",policy="cache_aware""#;
    for series in [
        format!(
            r#"kvroute_requests_total{{{labels},route="completions",status="200",worker="w0"}}"#
        ),
        format!(r#"kvroute_time_to_first_byte_seconds_count{{{labels},worker="w0"}}"#),
        format!(r#"kvroute_time_to_first_byte_seconds_bucket{{{labels},worker="w0",le="+Inf"}}"#),
    ] {
        assert_eq!(metric(&m, &series), Some(30.0), "{series} in\n{m}");
    }
    // Four held connections fill the cap, whichever loops serve them.
    let mut held = hold_connections(addr, 4).await;
    let mut fifth = TcpStream::connect(addr).await.unwrap();
    fifth
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_to_close(&mut fifth, Duration::from_millis(300)).await;
    assert!(
        got.is_empty(),
        "served past the cap: {}",
        String::from_utf8_lossy(&got)
    );
    drop(held.pop());
    let (got, closed) = read_to_close(&mut fifth, Duration::from_secs(5)).await;
    assert!(closed && got.starts_with(b"HTTP/1.1 200"));
    // Shutdown: idle kept-alive connections are closed, every loop ends.
    shutdown.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(10), server).await;
    assert!(
        matches!(ended, Ok(Ok(Ok(())))),
        "every loop stopped: {ended:?}"
    );
    drop(held);
}
