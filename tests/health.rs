//! Health: active checks take a failing worker out and bring it back; passive 5xx ejection.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use common::{gateway, request, wait_metric};
use kvroute::config::{Config, HealthConfig, WorkerConfig};

#[derive(Default)]
struct Switches {
    healthy: AtomicBool,
    fail_requests: AtomicBool,
    hits: AtomicUsize,
}

async fn worker(name: &str) -> (Arc<Switches>, WorkerConfig) {
    let sw = Arc::new(Switches::default());
    sw.healthy.store(true, Ordering::SeqCst);
    let (h, c) = (sw.clone(), sw.clone());
    let app = Router::new()
        .route(
            "/health",
            get(move || {
                let ok = h.healthy.load(Ordering::SeqCst);
                async move {
                    if ok {
                        StatusCode::OK
                    } else {
                        StatusCode::SERVICE_UNAVAILABLE
                    }
                }
            }),
        )
        .route(
            "/v1/completions",
            post(move || {
                c.hits.fetch_add(1, Ordering::SeqCst);
                let fail = c.fail_requests.load(Ordering::SeqCst);
                async move {
                    if fail {
                        (StatusCode::INTERNAL_SERVER_ERROR, "{}")
                    } else {
                        (StatusCode::OK, r#"{"choices":[]}"#)
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let mut cfg = WorkerConfig::from_url(format!("http://{addr}"));
    cfg.name = Some(name.into());
    (sw, cfg)
}

/// `config` with the round-robin policy, so each worker's share of requests is predictable.
fn round_robin(config: Config) -> Config {
    config
        .with_overrides(kvroute::config::Overrides {
            policy: Some("round_robin".into()),
            ..Default::default()
        })
        .unwrap()
}

async fn completions(gw: SocketAddr, n: usize) {
    for i in 0..n {
        let body = format!(r#"{{"prompt": "request {i}", "max_tokens": 1}}"#);
        request(gw, "POST", "/v1/completions", body.as_bytes()).await;
    }
}

#[tokio::test]
async fn a_failing_worker_is_taken_out_within_the_threshold_and_comes_back() {
    let (a, wa) = worker("a").await;
    let (b, wb) = worker("b").await;
    let config = round_robin(Config {
        workers: vec![wa, wb],
        health: HealthConfig {
            interval_seconds: 0.05,
            unhealthy_threshold: 2,
            healthy_threshold: 1,
            ..HealthConfig::default()
        },
        ..Config::default()
    });
    let gw = gateway(config).await;
    let healthy_b = "kvroute_worker_healthy{worker=\"b\"}";
    let limit = Duration::from_secs(5);
    assert_eq!(wait_metric(gw.addr, healthy_b, 1.0, limit).await, Some(1.0));

    b.healthy.store(false, Ordering::SeqCst);
    assert_eq!(wait_metric(gw.addr, healthy_b, 0.0, limit).await, Some(0.0));
    let before = b.hits.load(Ordering::SeqCst);
    completions(gw.addr, 10).await;
    assert_eq!(
        b.hits.load(Ordering::SeqCst),
        before,
        "nothing sent to a down worker"
    );
    assert!(a.hits.load(Ordering::SeqCst) >= 10);
    let ready = request(gw.addr, "GET", "/ready", b"").await;
    assert_eq!(ready.status, 200, "one worker is still usable");

    b.healthy.store(true, Ordering::SeqCst);
    assert_eq!(wait_metric(gw.addr, healthy_b, 1.0, limit).await, Some(1.0));
    completions(gw.addr, 10).await;
    assert!(
        b.hits.load(Ordering::SeqCst) >= before + 4,
        "back in rotation"
    );
    gw.shutdown.cancel();
}

#[tokio::test]
async fn repeated_5xx_answers_eject_a_worker_passively() {
    let (a, wa) = worker("a").await;
    let (b, wb) = worker("b").await;
    b.fail_requests.store(true, Ordering::SeqCst);
    let config = round_robin(Config {
        workers: vec![wa, wb],
        health: HealthConfig {
            interval_seconds: 0.0,
            passive_failures: 3,
            ..HealthConfig::default()
        },
        eject_seconds: 600.0,
        ..Config::default()
    });
    let gw = gateway(config).await;
    completions(gw.addr, 20).await;
    assert_eq!(
        b.hits.load(Ordering::SeqCst),
        3,
        "ejected after its third 5xx in a row"
    );
    assert_eq!(a.hits.load(Ordering::SeqCst), 17);
    let m = common::metrics_text(gw.addr).await;
    assert_eq!(
        common::metric(&m, "kvroute_worker_healthy{worker=\"b\"}"),
        Some(0.0)
    );
    gw.shutdown.cancel();
}
