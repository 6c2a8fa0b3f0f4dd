//! Admission control and client keys, over real HTTP: the per-worker cap with its bounded wait
//! queue (503 with Retry-After past it), client API keys (401) with per-client quotas (429), and
//! the gateway's own key replacing the client's on the way to workers.

mod common;

use std::time::Duration;

use common::*;
use kvroute::config::ClientKeyConfig;
use serde_json::json;

const SECOND: Duration = Duration::from_secs(1);

fn body(v: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&v).unwrap()
}

/// A `/v1/completions` request with the JSON body `v`.
async fn complete(addr: std::net::SocketAddr, v: serde_json::Value) -> RawResponse {
    request(addr, "POST", "/v1/completions", &body(v)).await
}

/// [`complete`] on its own task, for a request that will wait.
fn complete_later(
    addr: std::net::SocketAddr,
    v: serde_json::Value,
) -> tokio::task::JoinHandle<RawResponse> {
    tokio::spawn(complete(addr, v))
}

/// A streaming request that holds its worker's slot until the test drops the connection.
async fn hold(addr: std::net::SocketAddr, headers: &[(&str, &str)]) -> tokio::net::TcpStream {
    let mut s = send_with(
        addr,
        "POST",
        "/v1/completions",
        headers,
        &body(json!({"prompt": "held", "stream": true, "max_tokens": 2, "gate": true})),
    )
    .await;
    let head = read_until(&mut s, b"tok0", 5 * SECOND).await;
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s
}

#[tokio::test]
async fn a_queued_request_is_served_when_a_slot_frees() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "cache_aware");
    cfg.max_inflight_per_worker = 1;
    cfg.admission.queue_size = 4;
    cfg.admission.max_wait_seconds = 30.0;
    let gw = gateway(cfg).await;
    let held = hold(gw.addr, &[]).await;
    let addr = gw.addr;
    let queued = complete_later(addr, json!({"prompt": "b"}));
    assert_eq!(
        wait_metric(gw.addr, "kvroute_queue_depth", 1.0, 10 * SECOND).await,
        Some(1.0),
        "the second request waits in the queue"
    );
    assert!(!queued.is_finished());
    drop(held); // the client goes away: its slot frees
    let r = queued.await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&m, r#"kvroute_queue_wait_seconds_count{result="admitted"}"#),
        Some(1.0)
    );
    assert_eq!(metric(&m, "kvroute_queue_depth"), Some(0.0));
    assert_eq!(
        metric(&m, r#"kvroute_worker_inflight{worker="w0"}"#),
        Some(0.0)
    );
}

#[tokio::test]
async fn a_saturated_model_does_not_hold_up_another() {
    let (ua, ub) = (upstream("wa", &[]).await, upstream("wb", &[]).await);
    let mut cfg = config_for(&[&ua, &ub], "round_robin");
    cfg.workers[0].models = vec!["a".into()];
    cfg.workers[1].models = vec!["b".into()];
    cfg.max_inflight_per_worker = 1;
    cfg.admission.queue_size = 1;
    cfg.admission.max_wait_seconds = 30.0;
    let gw = gateway(cfg).await;
    let mut held = send_with(
        gw.addr,
        "POST",
        "/v1/completions",
        &[],
        &body(
            json!({"model": "a", "prompt": "held", "stream": true, "max_tokens": 2, "gate": true}),
        ),
    )
    .await;
    read_until(&mut held, b"tok0", 5 * SECOND).await;
    // Model a's line is now full: one waiter.
    let addr = gw.addr;
    let waiter = complete_later(addr, json!({"model": "a", "prompt": "w"}));
    wait_metric(gw.addr, "kvroute_queue_depth", 1.0, 10 * SECOND).await;
    // Model b's worker has room: served at once, neither queued behind a nor refused.
    let b = complete(gw.addr, json!({"model": "b", "prompt": "x"})).await;
    assert_eq!(b.status, 200, "{}", String::from_utf8_lossy(&b.body));
    assert_eq!(b.header("x-kvroute-worker"), Some("wb"));
    // Another request for a finds a full line.
    let a = complete(gw.addr, json!({"model": "a", "prompt": "y"})).await;
    assert_eq!(a.status, 503);
    drop(held);
    assert_eq!(waiter.await.unwrap().status, 200);
    let m = metrics_text(gw.addr).await;
    assert_eq!(metric(&m, "kvroute_queue_depth"), Some(0.0));
}

#[tokio::test]
async fn a_full_queue_and_a_long_wait_give_503_with_retry_after() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "round_robin");
    cfg.max_inflight_per_worker = 1;
    cfg.admission.queue_size = 1;
    cfg.admission.max_wait_seconds = 0.3;
    let gw = gateway(cfg).await;
    let _held = hold(gw.addr, &[]).await;
    // One waiter fills the queue; it times out after 0.3 s.
    let addr = gw.addr;
    let waiter = complete_later(addr, json!({"prompt": "w"}));
    wait_metric(gw.addr, "kvroute_queue_depth", 1.0, 10 * SECOND).await;
    let full = complete(gw.addr, json!({"prompt": "x"})).await;
    assert_eq!(full.status, 503);
    assert_eq!(full.header("retry-after"), Some("1"));
    assert!(full.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no place is left in the wait queue"));
    let timed_out = waiter.await.unwrap();
    assert_eq!(timed_out.status, 503);
    assert_eq!(timed_out.header("retry-after"), Some("1"));
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&m, r#"kvroute_shed_total{reason="queue_full"}"#),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, r#"kvroute_shed_total{reason="wait_timeout"}"#),
        Some(1.0)
    );
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn waiters_are_admitted_in_arrival_order() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "least_conn");
    cfg.max_inflight_per_worker = 1;
    cfg.admission.queue_size = 8;
    cfg.admission.max_wait_seconds = 30.0;
    let gw = gateway(cfg).await;
    let held = hold(gw.addr, &[]).await;
    // Three waiters, queued one after another; each holds its slot until told to go.
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..3u64 {
        let (addr, done) = (gw.addr, done_tx.clone());
        tokio::spawn(async move {
            let r = complete(addr, json!({"prompt": format!("p{i}"), "delay_ms": 20})).await;
            done.send((i, r.status, r.json()["arrival"].as_u64()))
                .unwrap();
        });
        wait_metric(gw.addr, "kvroute_queue_depth", (i + 1) as f64, 10 * SECOND).await;
    }
    drop(held);
    // Ordered by when each reached the worker (the held request was the first), not by when
    // each client read its answer: a client may read late on a busy machine.
    let mut order = Vec::new();
    for _ in 0..3 {
        let (i, status, arrival) = tokio::time::timeout(20 * SECOND, done_rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status, 200);
        order.push((arrival.expect("the upstream numbers its requests"), i));
    }
    order.sort();
    let admitted: Vec<u64> = order.iter().map(|&(_, i)| i).collect();
    assert_eq!(admitted, [0, 1, 2], "arrivals at the worker: {order:?}");
}

fn keyed_config(up: &Upstream, max_inflight: usize) -> kvroute::config::Config {
    let mut cfg = config_for(&[up], "prefix");
    cfg.auth.client_keys = vec![
        ClientKeyConfig {
            name: "team-a".into(),
            key: Some("sk-team-a".into()),
            key_env: None,
            max_inflight,
        },
        ClientKeyConfig {
            name: "team-b".into(),
            key: None,
            key_env: Some("KVROUTE_TEST_TEAM_B_KEY".into()),
            max_inflight: 0,
        },
    ];
    cfg
}

#[tokio::test]
async fn client_keys_are_required_on_proxied_paths_only() {
    std::env::set_var("KVROUTE_TEST_TEAM_B_KEY", "sk-team-b");
    let up = upstream("w0", &[]).await;
    let gw = gateway(keyed_config(&up, 0)).await;
    let prompt = body(json!({"prompt": "hi"}));
    let none = request(gw.addr, "POST", "/v1/completions", &prompt).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.json()["error"]["type"], "AuthenticationError");
    let wrong = request_with(
        gw.addr,
        "POST",
        "/v1/completions",
        &[("authorization", "Bearer sk-team-c")],
        &prompt,
    )
    .await;
    assert_eq!(wrong.status, 401);
    for key in ["Bearer sk-team-a", "Bearer sk-team-b"] {
        let ok = request_with(
            gw.addr,
            "POST",
            "/v1/completions",
            &[("authorization", key)],
            &prompt,
        )
        .await;
        assert_eq!(ok.status, 200);
        // Without a worker key, the client's own header goes through.
        assert_eq!(ok.json()["authorization"], key);
    }
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 2);
    // vLLM's serving routes outside `/v1/` need a key too (vLLM itself guards only `/v1`,
    // `/v2` and `/inference`, and `/invocations` serves completions).
    for path in ["/invocations", "/tokenize", "/pooling", "/v2/rerank"] {
        let none = request(gw.addr, "POST", path, &prompt).await;
        assert_eq!(none.status, 401, "{path}");
        let ok = request_with(
            gw.addr,
            "POST",
            path,
            &[("authorization", "Bearer sk-team-a")],
            &prompt,
        )
        .await;
        assert_eq!(ok.status, 200, "{path}");
    }
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 6);
    // Health and metrics stay open to probes and scrapers.
    assert_eq!(request(gw.addr, "GET", "/health", b"").await.status, 200);
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&m, r#"kvroute_client_requests_total{client="team-a"}"#),
        Some(5.0)
    );
}

#[tokio::test]
async fn the_worker_key_replaces_the_clients() {
    std::env::set_var("KVROUTE_TEST_TEAM_B_KEY", "sk-team-b");
    std::env::set_var("KVROUTE_TEST_WORKER_KEY", "sk-worker");
    let up = upstream("w0", &[]).await;
    let mut cfg = keyed_config(&up, 0);
    cfg.auth.worker_key_env = Some("KVROUTE_TEST_WORKER_KEY".into());
    let gw = gateway(cfg).await;
    let r = request_with(
        gw.addr,
        "POST",
        "/v1/completions",
        &[("authorization", "Bearer sk-team-a")],
        &body(json!({"prompt": "hi"})),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["authorization"], "Bearer sk-worker");
}

#[tokio::test]
async fn a_clients_quota_gives_429_until_its_stream_ends() {
    std::env::set_var("KVROUTE_TEST_TEAM_B_KEY", "sk-team-b");
    let up = upstream("w0", &[]).await;
    let gw = gateway(keyed_config(&up, 1)).await;
    let a = [("authorization", "Bearer sk-team-a")];
    let mut held = hold(gw.addr, &a).await;
    let prompt = body(json!({"prompt": "again"}));
    let over = request_with(gw.addr, "POST", "/v1/completions", &a, &prompt).await;
    assert_eq!(over.status, 429);
    assert_eq!(over.header("retry-after"), Some("1"));
    assert_eq!(over.json()["error"]["type"], "RateLimitError");
    // Another client is not held back by team-a's quota.
    let b = request_with(
        gw.addr,
        "POST",
        "/v1/completions",
        &[("authorization", "Bearer sk-team-b")],
        &prompt,
    )
    .await;
    assert_eq!(b.status, 200);
    // The held stream runs to its end: the place is given back with it.
    up.gate.notify_waiters();
    read_until(&mut held, b"[DONE]", 5 * SECOND).await;
    let mut status = 0;
    for _ in 0..100 {
        status = request_with(gw.addr, "POST", "/v1/completions", &a, &prompt)
            .await
            .status;
        if status == 200 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(status, 200);
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&m, r#"kvroute_shed_total{reason="client_quota"}"#),
        Some(1.0)
    );
}
