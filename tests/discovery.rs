//! Discovery: DNS against a resolver the test controls (virtual time), and Kubernetes against a
//! fake API server on loopback serving list and watch of EndpointSlices.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::routing::get;
use axum::Router;
use kvroute::config::{Config, DiscoveryConfig, HealthConfig};
use kvroute::discovery::{self, Resolve, ResolveFuture};
use kvroute::proxy::Upstreams;
use kvroute::routes::AppState;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Mutex};
use tokio_util::sync::CancellationToken;

fn names(up: &Upstreams) -> Vec<String> {
    up.pool.snapshot().iter().map(|w| w.name.clone()).collect()
}

fn config(discovery: DiscoveryConfig) -> Config {
    Config {
        workers: vec![],
        discovery,
        // No probes: the discovered addresses are not real servers.
        health: HealthConfig {
            interval_seconds: 0.0,
            ..HealthConfig::default()
        },
        ..Config::default()
    }
}

struct FakeDns(ArcSwap<Result<Vec<SocketAddr>, String>>);

impl Resolve for FakeDns {
    fn resolve<'a>(&'a self, _host: &'a str, _port: u16) -> ResolveFuture<'a> {
        let answer = self.0.load_full();
        Box::pin(async move {
            match &*answer {
                Ok(a) => Ok(a.clone()),
                Err(e) => Err(std::io::Error::other(e.clone())),
            }
        })
    }
}

fn addrs(list: &[&str]) -> Result<Vec<SocketAddr>, String> {
    Ok(list.iter().map(|a| a.parse().unwrap()).collect())
}

#[tokio::test(start_paused = true)]
async fn dns_discovery_follows_the_answers_and_survives_a_resolver_outage() {
    let cfg = config(DiscoveryConfig::Dns {
        host: "vllm.test".into(),
        port: 8000,
        interval_seconds: 1.0,
    });
    let state = AppState::new(cfg).unwrap();
    let up = state.upstreams.clone();
    let dns = Arc::new(FakeDns(ArcSwap::from_pointee(addrs(&[
        "127.0.0.12:8000",
        "127.0.0.11:8000",
    ]))));
    let cancel = CancellationToken::new();
    tokio::spawn(discovery::run(up.clone(), dns.clone(), cancel.clone()));
    // Each step waits 1.5 modelled intervals on the paused clock, so exactly one tick lands.
    let step = Duration::from_millis(1500);
    tokio::time::sleep(step).await;
    assert_eq!(names(&up), ["127.0.0.11:8000", "127.0.0.12:8000"]);
    let first = up.pool.snapshot()[0].clone();

    dns.0.store(Arc::new(addrs(&[
        "127.0.0.11:8000",
        "127.0.0.12:8000",
        "127.0.0.13:8000",
    ])));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(names(&up).len(), 3);
    assert!(
        Arc::ptr_eq(&up.pool.snapshot()[0], &first),
        "unchanged workers are kept"
    );

    dns.0.store(Arc::new(Err("SERVFAIL".into())));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(names(&up).len(), 3, "a resolver outage keeps the last set");

    dns.0.store(Arc::new(addrs(&["127.0.0.13:8000"])));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(names(&up), ["127.0.0.13:8000"]);
    assert!(first.is_draining(), "a vanished worker drains");
    let m = up.metrics.render();
    assert!(
        m.contains("kvroute_discovery_updates_total{result=\"error\",source=\"dns\"} 1"),
        "{m}"
    );
    cancel.cancel();
}

/// A fake Kubernetes API: list returns the current slices; a watch streams what the test sends.
#[derive(Default)]
struct FakeApi {
    slices: Mutex<BTreeMap<String, Value>>,
    rv: std::sync::atomic::AtomicU64,
    watch: Mutex<Option<mpsc::UnboundedSender<Value>>>,
    lists: std::sync::atomic::AtomicU64,
}

async fn endpointslices(
    State(api): State<Arc<FakeApi>>,
    Query(q): Query<BTreeMap<String, String>>,
) -> axum::response::Response {
    assert_eq!(q["labelSelector"], "kubernetes.io/service-name=vllm");
    let rv = api.rv.load(std::sync::atomic::Ordering::SeqCst).to_string();
    if q.get("watch").map(String::as_str) == Some("1") {
        let (tx, rx) = mpsc::unbounded_channel::<Value>();
        *api.watch.lock().await = Some(tx);
        let lines = futures_util::stream::unfold(rx, |mut rx| async move {
            let ev = rx.recv().await?;
            Some((Ok::<_, std::io::Error>(format!("{ev}\n")), rx))
        });
        return axum::response::Response::new(Body::from_stream(lines));
    }
    api.lists.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let items: Vec<Value> = api.slices.lock().await.values().cloned().collect();
    axum::Json(
        json!({"kind": "EndpointSliceList", "metadata": {"resourceVersion": rv}, "items": items}),
    )
    .into_response()
}

use axum::response::IntoResponse;

fn slice(name: &str, endpoints: &[(&str, Option<bool>, bool)]) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(ip, ready, terminating)| {
            let mut c = json!({"terminating": terminating});
            if let Some(r) = ready {
                c["ready"] = json!(r);
            }
            json!({"addresses": [ip], "conditions": c})
        })
        .collect();
    json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "vllm"}},
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        "endpoints": eps,
    })
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn watch_sender(api: &FakeApi) -> mpsc::UnboundedSender<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(tx) = api.watch.lock().await.clone() {
            if !tx.is_closed() {
                return tx;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no watch connection"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn kubernetes_discovery_uses_ready_endpoints_and_relists_after_a_dropped_watch() {
    let api = Arc::new(FakeApi::default());
    api.slices.lock().await.insert(
        "vllm-a".into(),
        slice(
            "vllm-a",
            &[
                ("127.0.0.21", Some(true), false),
                ("127.0.0.22", None, false), // no `ready`: ready
                ("127.0.0.23", Some(false), false),
                ("127.0.0.24", Some(true), true), // terminating
            ],
        ),
    );
    let app = Router::new()
        .route(
            "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices",
            get(endpointslices),
        )
        .with_state(api.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let state = AppState::new(config(DiscoveryConfig::Kubernetes {
        namespace: "ml".into(),
        service: "vllm".into(),
        port_name: Some("http".into()),
        port: None,
        api_url: Some(api_url),
    }))
    .unwrap();
    let up = state.upstreams.clone();
    let cancel = CancellationToken::new();
    tokio::spawn(discovery::run(
        up.clone(),
        state.resolver.clone(),
        cancel.clone(),
    ));

    let want = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    eventually("the initial list", || {
        names(&up) == want(&["127.0.0.21:8000", "127.0.0.22:8000"])
    })
    .await;

    // A pod goes NotReady.
    let tx = watch_sender(&api).await;
    tx.send(json!({"type": "MODIFIED", "object": slice("vllm-a", &[("127.0.0.21", Some(true), false), ("127.0.0.22", Some(false), false)])})).unwrap();
    eventually("the NotReady pod removed", || {
        names(&up) == want(&["127.0.0.21:8000"])
    })
    .await;

    // A second slice appears.
    tx.send(
        json!({"type": "ADDED", "object": slice("vllm-b", &[("127.0.0.25", Some(true), false)])}),
    )
    .unwrap();
    eventually("the new slice's pod added", || {
        names(&up) == want(&["127.0.0.21:8000", "127.0.0.25:8000"])
    })
    .await;

    // The watch drops; while it is down the second slice is deleted (no event reaches us) and
    // the first slice's pod starts terminating. The re-list must see both.
    {
        let mut slices = api.slices.lock().await;
        slices.insert(
            "vllm-a".into(),
            slice(
                "vllm-a",
                &[
                    ("127.0.0.21", Some(true), false),
                    ("127.0.0.26", Some(true), false),
                ],
            ),
        );
    }
    let lists_before = api.lists.load(std::sync::atomic::Ordering::SeqCst);
    api.watch.lock().await.take();
    drop(tx);
    eventually("a re-list after the dropped watch", || {
        api.lists.load(std::sync::atomic::Ordering::SeqCst) > lists_before
    })
    .await;
    eventually("the set after the re-list", || {
        names(&up) == want(&["127.0.0.21:8000", "127.0.0.26:8000"])
    })
    .await;

    // A 410 Gone on the new watch also re-lists.
    let tx = watch_sender(&api).await;
    let lists_before = api.lists.load(std::sync::atomic::Ordering::SeqCst);
    tx.send(
        json!({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}),
    )
    .unwrap();
    eventually("a re-list after 410", || {
        api.lists.load(std::sync::atomic::Ordering::SeqCst) > lists_before
    })
    .await;
    // A terminating endpoint is dropped.
    let tx = watch_sender(&api).await;
    tx.send(json!({"type": "MODIFIED", "object": slice("vllm-a", &[("127.0.0.21", Some(true), true), ("127.0.0.26", Some(true), false)])})).unwrap();
    eventually("the terminating pod removed", || {
        names(&up) == want(&["127.0.0.26:8000"])
    })
    .await;
    cancel.cancel();
}
