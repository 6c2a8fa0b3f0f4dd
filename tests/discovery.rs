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
    authorization: Mutex<Option<String>>,
}

async fn endpointslices(
    State(api): State<Arc<FakeApi>>,
    Query(q): Query<BTreeMap<String, String>>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    *api.authorization.lock().await = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
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

/// The fake API's router.
fn fake_api(api: Arc<FakeApi>) -> Router {
    Router::new()
        .route(
            "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices",
            get(endpointslices),
        )
        .with_state(api)
}

/// Serves the fake API over HTTPS with a fresh self-signed certificate; returns the URL and the
/// certificate's PEM (the CA bundle a client must trust).
async fn serve_tls(app: Router) -> (String, String) {
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let pem = certified.cert.pem();
    let key = rustls::pki_types::PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der());
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![certified.cert.der().clone()], key.into())
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (url, pem)
}

fn kube_config(api_url: String, ca_file: String, token_file: String) -> Config {
    config(DiscoveryConfig::Kubernetes {
        namespace: "ml".into(),
        service: "vllm".into(),
        port_name: Some("http".into()),
        port: None,
        api_url: Some(api_url),
        ca_file,
        token_file,
    })
}

#[tokio::test]
async fn kubernetes_discovery_uses_ready_endpoints_and_relists_after_a_dropped_watch() {
    let api = Arc::new(FakeApi::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_url = format!("http://{}", listener.local_addr().unwrap());
    let app = fake_api(api.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let cfg = kube_config(
        api_url,
        "/nonexistent/ca.crt".into(),
        "/nonexistent/token".into(),
    );
    scenario(api, cfg).await;
}

#[tokio::test]
async fn kubernetes_discovery_speaks_tls_with_the_ca_bundle_and_sends_the_token() {
    let api = Arc::new(FakeApi::default());
    let (api_url, pem) = serve_tls(fake_api(api.clone())).await;
    let dir = std::env::temp_dir().join(format!("kvroute-kube-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, token) = (dir.join("ca.crt"), dir.join("token"));
    std::fs::write(&ca, pem).unwrap();
    std::fs::write(&token, "sa-token-123\n").unwrap();
    let cfg = kube_config(
        api_url,
        ca.to_string_lossy().into_owned(),
        token.to_string_lossy().into_owned(),
    );
    scenario(api.clone(), cfg).await;
    assert_eq!(
        api.authorization.lock().await.as_deref(),
        Some("Bearer sa-token-123")
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn kubernetes_discovery_refuses_a_server_its_ca_did_not_sign() {
    let api = Arc::new(FakeApi::default());
    let (api_url, _pem) = serve_tls(fake_api(api.clone())).await;
    let (_other_url, other_pem) = serve_tls(fake_api(Arc::new(FakeApi::default()))).await;
    let dir = std::env::temp_dir().join(format!("kvroute-kube-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.crt");
    std::fs::write(&ca, other_pem).unwrap();
    let state = AppState::new(kube_config(
        api_url,
        ca.to_string_lossy().into_owned(),
        "/nonexistent/token".into(),
    ))
    .unwrap();
    let up = state.upstreams.clone();
    let cancel = CancellationToken::new();
    tokio::spawn(discovery::run(
        up.clone(),
        state.resolver.clone(),
        cancel.clone(),
    ));
    let errors = "kvroute_discovery_updates_total{result=\"error\",source=\"kubernetes\"}";
    eventually("a failed TLS list", || up.metrics.render().contains(errors)).await;
    assert_eq!(
        api.lists.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "no request got through"
    );
    assert!(names(&up).is_empty());
    cancel.cancel();
    let _ = std::fs::remove_dir_all(dir);
}

/// Initial list, NotReady, a new slice, a dropped watch with a deletion while it was down, a 410,
/// and a terminating endpoint; the worker set is checked after each.
async fn scenario(api: Arc<FakeApi>, cfg: Config) {
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
    let state = AppState::new(cfg).unwrap();
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
