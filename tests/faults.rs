//! What clients see when workers fail, and what the gateway does about it (real HTTP on loopback).

mod common;

use std::time::Duration;

use common::{
    config_for, gateway, metric, metrics_text, named_worker, read_until, request, send, upstream,
};
use serde_json::json;
use tokio::{io::AsyncReadExt, net::TcpListener};

fn body(v: serde_json::Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

async fn read_all(mut s: tokio::net::TcpStream) -> String {
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
        .await
        .expect("the response ends")
        .unwrap();
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test]
async fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let s = send(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "p", "stream": true, "max_tokens": 10, "die_after": 3})),
    )
    .await;
    let text = read_all(s).await;
    assert_eq!(text.matches("\"text\":\"tok").count(), 3, "{text}");
    let at = text.find("data: {\"error\"").expect("an error event");
    let event: serde_json::Value =
        serde_json::from_str(text[at + 6..].lines().next().unwrap()).unwrap();
    assert_eq!(event["error"]["code"], 502);
    assert!(text[at..].contains("data: [DONE]"));
    assert!(
        text.ends_with("0\r\n\r\n"),
        "a clean end of the chunked body: {text}"
    );
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(
            &m,
            r#"kvroute_upstream_errors_total{kind="body",worker="w0"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, r#"kvroute_worker_inflight{worker="w0"}"#),
        Some(0.0)
    );
}

#[tokio::test]
async fn a_silent_stream_ends_with_a_timeout_event() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "round_robin");
    cfg.timeouts.idle_stream_seconds = 0.3;
    let gw = gateway(cfg).await;
    let s = send(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "p", "stream": true, "max_tokens": 5, "gate": true})),
    )
    .await;
    let text = read_all(s).await;
    assert_eq!(text.matches("\"text\":\"tok").count(), 1, "{text}");
    assert!(text.contains("\"code\":504"), "{text}");
}

#[tokio::test]
async fn repeated_timeouts_eject_a_hung_worker() {
    // A worker that accepts connections and never answers.
    let hung = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hung_addr = hung.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hung.accept().await {
            held.push(s);
        }
    });
    let good = upstream("good", &[]).await;
    let mut cfg = config_for(&[&good], "round_robin");
    cfg.workers.insert(
        0,
        kvroute::config::WorkerConfig {
            name: Some("hung".into()),
            ..kvroute::config::WorkerConfig::from_url(format!("http://{hung_addr}"))
        },
    );
    cfg.timeouts.first_byte_seconds = 0.2;
    cfg.health.interval_seconds = 0.0;
    cfg.health.passive_failures = 2;
    cfg.eject_seconds = 60.0;
    let gw = gateway(cfg).await;
    let ask = || request(gw.addr, "POST", "/v1/completions", br#"{"prompt":"x"}"#);
    let mut statuses = Vec::new();
    for _ in 0..8 {
        let r = ask().await;
        let text = String::from_utf8_lossy(&r.body).into_owned();
        assert!(
            !text.contains(&hung_addr.to_string()),
            "no worker address in {text}"
        );
        statuses.push(r.status);
    }
    // Round-robin alternates (from whichever worker its round began at) until the second
    // timeout ejects the hung worker; then all succeed.
    let first = statuses.iter().position(|&s| s == 504);
    assert!(first.is_some_and(|f| f <= 1), "{statuses:?}");
    let mut want = [200; 8];
    for f in first.into_iter().flat_map(|f| [f, f + 2]) {
        want[f] = 504;
    }
    assert_eq!(statuses, want);
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&m, r#"kvroute_worker_healthy{worker="hung"}"#),
        Some(0.0)
    );
}

#[tokio::test]
async fn the_in_flight_cap_holds_for_each_worker() {
    let (a, b) = (upstream("a", &[]).await, upstream("b", &[]).await);
    let mut cfg = config_for(&[&a, &b], "prefix");
    cfg.max_inflight_per_worker = 1;
    let gw = gateway(cfg).await;
    // The same prompt twice: prefix routing prefers one worker for both, and the cap must send
    // the second elsewhere instead of over the cap.
    let held = |_| async {
        let mut s = send(
            gw.addr,
            "POST",
            "/v1/completions",
            &body(json!({"prompt": "same prompt", "stream": true, "max_tokens": 3, "gate": true})),
        )
        .await;
        let head = read_until(&mut s, b"tok0", Duration::from_secs(5)).await;
        let head = String::from_utf8_lossy(&head).to_string();
        let worker = head
            .lines()
            .find_map(|l| l.strip_prefix("x-kvroute-worker: "))
            .unwrap()
            .to_owned();
        (s, worker)
    };
    let (_s1, w1) = held(0).await;
    let (_s2, w2) = held(1).await;
    assert_ne!(w1, w2);
    let r = request(
        gw.addr,
        "POST",
        "/v1/completions",
        br#"{"prompt":"same prompt"}"#,
    )
    .await;
    assert_eq!(r.status, 503);
    let m = metrics_text(gw.addr).await;
    for w in ["a", "b"] {
        assert_eq!(
            metric(&m, &format!(r#"kvroute_worker_inflight{{worker="{w}"}}"#)),
            Some(1.0)
        );
    }
}

#[tokio::test]
async fn malformed_requests_are_refused_before_routing() {
    use tokio::io::AsyncWriteExt;
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let raw = |req: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let text = read_all(s).await;
        text[9..12].parse::<u16>().unwrap()
    };
    for path in [
        "/v1/../metrics",
        "/v1/%2e%2e/x",
        "/v1/./models",
        "/v1/%2E/models",
    ] {
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let req: &'static str = Box::leak(req.into_boxed_str());
        assert_eq!(raw(req).await, 400, "{path}");
    }
    assert_eq!(
        raw("GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n").await,
        400
    );
    assert_eq!(
        raw("GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n").await,
        400
    );
    assert_eq!(
        raw("GET /v1/models HTTP/1.0\r\n\r\n").await,
        200,
        "HTTP/1.0 needs no Host"
    );
    assert_eq!(
        raw("GET /v1/models HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await,
        200
    );
    // None of the refused paths reached the worker (its `/v1/*` handler counts every request).
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_descriptors_is_the_gateways_503_not_the_workers_fault() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let up = upstream("w0", &[]).await;
    // The gateway binary with a small descriptor limit, in front of a healthy worker; no health
    // checks or load polls, so no pooled connection to the worker exists to be reused.
    let dir = common::TempDir::new("fd");
    let cfg = dir.join("gw.yaml");
    std::fs::write(
        &cfg,
        format!(
            "listen: 127.0.0.1:0\nworkers: [{{url: \"{}\", name: w0}}]\npolicy: {{kind: round_robin}}\nhealth: {{interval_seconds: 0}}\nload_signals: {{interval_seconds: 0}}\n",
            up.url()
        ),
    )
    .unwrap();
    let script = format!(
        "ulimit -n 48 && exec {} serve --config {}",
        env!("CARGO_BIN_EXE_kvroute"),
        cfg.display()
    );
    let mut child = tokio::process::Command::new("sh")
        .args(["-c", &script])
        .env_remove("KVROUTE_POLICY")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(10), out.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let addr: std::net::SocketAddr = line.rsplit("http://").next().unwrap().parse().unwrap();
    let mut first = tokio::net::TcpStream::connect(addr).await.unwrap();
    // Hold kept-alive connections until one is not answered: the gateway cannot accept more,
    // every descriptor is in use.
    let mut idle = Vec::new();
    for _ in 0..64 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let answered = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
        idle.push(s);
        if answered.is_err() {
            break;
        }
    }
    let req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n{\"prompt\":\"x\"}";
    first.write_all(req.as_bytes()).await.unwrap();
    let head = read_until(&mut first, b"\r\n\r\n", Duration::from_secs(10)).await;
    let head = String::from_utf8_lossy(&head).into_owned();
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
    // With descriptors free again, the worker was never blamed.
    drop(idle);
    drop(first);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m =
            String::from_utf8_lossy(&request(addr, "GET", "/metrics", b"").await.body).into_owned();
        if m.contains("kvroute_upstream_errors_total") || tokio::time::Instant::now() > deadline {
            break m;
        }
    };
    assert_eq!(
        metric(
            &m,
            r#"kvroute_upstream_errors_total{kind="gateway_fd_exhausted",worker="w0"}"#
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, r#"kvroute_worker_healthy{worker="w0"}"#),
        Some(1.0)
    );
    assert_eq!(
        request(addr, "POST", "/v1/completions", br#"{"prompt":"x"}"#)
            .await
            .status,
        200
    );
}

/// A worker that accepts connections and never answers; the listener's address.
async fn hung_worker() -> std::net::SocketAddr {
    let hung = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hung.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hung.accept().await {
            held.push(s);
        }
    });
    addr
}

/// The fault matrix: for each way a worker fails, what the client sees, and that nothing is
/// left behind (the worker's in-flight count back to 0, an abandoned upstream stream aborted,
/// the healthy worker still serving). Run with `--nocapture` for the table. Running out of
/// descriptors, the fifth row, needs its own process: see the test above.
#[tokio::test]
async fn fault_matrix_what_the_client_sees_and_nothing_leaks() {
    let stream = |extra: serde_json::Value| {
        let mut v = json!({"prompt": "p", "stream": true, "max_tokens": 10});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body(v)
    };
    struct Row {
        fault: &'static str,
        seen: String,
    }
    let mut rows = Vec::new();
    // (fault, request body, expected status, expected final SSE error code)
    let cases: [(&str, Vec<u8>, u16, Option<u16>); 4] = [
        (
            "killed mid-stream",
            stream(json!({"die_after": 3})),
            200,
            Some(502),
        ),
        (
            "hangs after the headers",
            stream(json!({"gate": true})),
            200,
            Some(504),
        ),
        (
            "answers 500",
            body(json!({"prompt": "p", "fail_status": 500})),
            500,
            None,
        ),
        (
            "hangs before the headers",
            body(json!({"prompt": "p"})),
            504,
            None,
        ),
    ];
    for (fault, req, status, sse_error) in cases {
        let mut up = upstream("w0", &[]).await;
        let mut cfg = config_for(&[&up], "round_robin");
        cfg.timeouts.idle_stream_seconds = 0.3;
        cfg.timeouts.first_byte_seconds = 0.3;
        cfg.health.interval_seconds = 0.0;
        if fault == "hangs before the headers" {
            cfg.workers[0] = named_worker("w0", format!("http://{}", hung_worker().await));
        }
        let gw = gateway(cfg).await;
        let text = read_all(send(gw.addr, "POST", "/v1/completions", &req).await).await;
        let got: u16 = text[9..12].parse().unwrap();
        assert_eq!(got, status, "{fault}: {text}");
        let final_error = text.find("data: {\"error\"").map(|at| {
            let event: serde_json::Value =
                serde_json::from_str(text[at + 6..].lines().next().unwrap()).unwrap();
            assert!(text[at..].contains("data: [DONE]"), "{fault}: {text}");
            event["error"]["code"].as_u64().unwrap() as u16
        });
        assert_eq!(final_error, sse_error, "{fault}: {text}");
        if fault == "hangs after the headers" {
            // The gateway gave up on the stream: the worker must see it abandoned.
            tokio::time::timeout(Duration::from_secs(5), up.disconnects.recv())
                .await
                .expect("the upstream stream is aborted")
                .unwrap();
        }
        let m = metrics_text(gw.addr).await;
        assert_eq!(
            metric(&m, r#"kvroute_worker_inflight{worker="w0"}"#),
            Some(0.0),
            "{fault}: nothing left in flight"
        );
        rows.push(Row {
            fault,
            seen: match final_error {
                Some(code) => format!("{status}, then a final SSE error event {code} and [DONE]"),
                None => format!("{status} with an OpenAI-style JSON error"),
            },
        });
    }
    // Refused: the only worker's port is bound but not listening, so connections to it are reset
    // and no other test's listener can take the port over while this one runs.
    let closed = tokio::net::TcpSocket::new_v4().unwrap();
    closed.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    let mut cfg = config_for(&[], "round_robin");
    cfg.workers = vec![named_worker("w0", url)];
    let gw = gateway(cfg).await;
    let r = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "p"})),
    )
    .await;
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["error"]["code"], 502);
    let again = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "p"})),
    )
    .await;
    assert_eq!(again.status, 503, "the refusing worker is ejected");
    rows.push(Row {
        fault: "refuses connections",
        seen: "502, then 503 while it is ejected".into(),
    });
    println!("| worker fault | the client sees |\n|---|---|");
    for r in rows {
        println!("| {} | {} |", r.fault, r.seen);
    }
}
