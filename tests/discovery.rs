//! Discovery: DNS against a resolver the test controls (virtual time), and Kubernetes against a
//! fake API server on loopback serving list and watch of EndpointSlices.

mod common;

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
use tokio::sync::Mutex;
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
        data_parallel_size: None,
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

/// A fake Kubernetes API server: a store of EndpointSlices with a resourceVersion counter and an
/// event log, so a watch from any retained resourceVersion replays what happened since (as the
/// real API server does) and one from a compacted version gets 410 Gone. The test can refuse
/// watches (403), make them go silent, send bookmarks and drop live watches.
#[derive(Default)]
struct FakeApi {
    store: parking_lot::Mutex<Store>,
    /// Bumped on every change; live watches wait on it.
    changed: tokio::sync::Notify,
    lists: std::sync::atomic::AtomicU64,
    /// The query of every watch request, in order.
    watches: parking_lot::Mutex<Vec<BTreeMap<String, String>>>,
    authorization: Mutex<Option<String>>,
    forbid_watch: std::sync::atomic::AtomicBool,
    silent_watch: std::sync::atomic::AtomicBool,
    /// Watches are answered with an empty 200: closed before they carry anything.
    hang_up_watch: std::sync::atomic::AtomicBool,
    /// A watch from a compacted resourceVersion is refused with HTTP 410 (a live one just ends)
    /// instead of getting a 410 event in its stream.
    gone_as_status: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct Store {
    rv: u64,
    slices: BTreeMap<String, Value>,
    /// (resourceVersion, event), oldest first; versions up to `compacted` are gone.
    log: Vec<(u64, Value)>,
    compacted: u64,
    /// Live watches end when this moves, after sending what happened before the move: the
    /// resourceVersion each generation ended at.
    generation: u64,
    ended_at: BTreeMap<u64, u64>,
}

impl FakeApi {
    fn record(&self, kind: &str, mut object: Value) {
        let mut st = self.store.lock();
        st.rv += 1;
        let rv = st.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        object["apiVersion"] = json!("discovery.k8s.io/v1");
        object["kind"] = json!("EndpointSlice");
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        match kind {
            "DELETED" => {
                st.slices.remove(&name);
            }
            "BOOKMARK" => {}
            _ => {
                st.slices.insert(name, object.clone());
            }
        }
        st.log.push((rv, json!({"type": kind, "object": object})));
        drop(st);
        self.changed.notify_waiters();
    }

    /// Creates or replaces a slice (ADDED or MODIFIED to watchers).
    fn put(&self, slice: Value) {
        let name = slice["metadata"]["name"].as_str().unwrap().to_string();
        let exists = self.store.lock().slices.contains_key(&name);
        self.record(if exists { "MODIFIED" } else { "ADDED" }, slice);
    }

    /// Deletes a slice; watchers get its last state, as from the real API server.
    fn delete(&self, name: &str) {
        let last = self.store.lock().slices[name].clone();
        self.record("DELETED", last);
    }

    /// A bookmark: the current resourceVersion, no change.
    fn bookmark(&self) {
        self.record("BOOKMARK", json!({"metadata": {"name": ""}}));
    }

    /// Ends every live watch (the connection drops) once it has sent what happened so far.
    fn drop_watches(&self) {
        let mut st = self.store.lock();
        let (generation, rv) = (st.generation, st.rv);
        st.ended_at.insert(generation, rv);
        st.generation += 1;
        drop(st);
        self.changed.notify_waiters();
    }

    /// Changes a slice while forgetting the history at once, so no watch sees the change: only
    /// a list does.
    fn put_unseen(&self, mut object: Value) {
        let mut st = self.store.lock();
        st.rv += 1;
        object["metadata"]["resourceVersion"] = json!(st.rv.to_string());
        object["apiVersion"] = json!("discovery.k8s.io/v1");
        object["kind"] = json!("EndpointSlice");
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        st.slices.insert(name, object);
        st.compacted = st.rv;
        st.log.clear();
        drop(st);
        self.changed.notify_waiters();
    }

    /// Forgets the history: a watch from before now gets 410 Gone.
    fn compact(&self) {
        let mut st = self.store.lock();
        st.compacted = st.rv;
        st.log.clear();
    }

    fn rv(&self) -> u64 {
        self.store.lock().rv
    }

    fn lists(&self) -> u64 {
        self.lists.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn watch_count(&self) -> usize {
        self.watches.lock().len()
    }

    fn last_watch(&self) -> BTreeMap<String, String> {
        self.watches.lock().last().cloned().unwrap_or_default()
    }
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
    if matches!(q.get("watch").map(String::as_str), Some("1" | "true")) {
        api.watches.lock().push(q.clone());
        if api.forbid_watch.load(std::sync::atomic::Ordering::SeqCst) {
            return (
                axum::http::StatusCode::FORBIDDEN,
                axum::Json(json!({"kind": "Status", "code": 403, "reason": "Forbidden"})),
            )
                .into_response();
        }
        if api.hang_up_watch.load(std::sync::atomic::Ordering::SeqCst) {
            return axum::response::Response::new(Body::empty());
        }
        if api.silent_watch.load(std::sync::atomic::Ordering::SeqCst) {
            // Headers, then nothing, ever: a half-dead connection.
            let never = futures_util::stream::pending::<Result<String, std::io::Error>>();
            return axum::response::Response::new(Body::from_stream(never));
        }
        let from: u64 = q["resourceVersion"].parse().unwrap();
        let gone_as_status = api.gone_as_status.load(std::sync::atomic::Ordering::SeqCst);
        if gone_as_status && from < api.store.lock().compacted {
            return (
                axum::http::StatusCode::GONE,
                axum::Json(
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "reason": "Expired", "code": 410}),
                ),
            )
                .into_response();
        }
        let generation = api.store.lock().generation;
        let lines = futures_util::stream::unfold(
            (api, from, false),
            move |(api, mut at, gone)| async move {
                if gone {
                    return None;
                }
                let waker = api.clone();
                loop {
                    let changed = waker.changed.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    // What the watch sends next: nothing (it ends), a 410, an event, or wait.
                    let next: Option<Option<(u64, String, bool)>> = {
                        let st = api.store.lock();
                        let end = st.ended_at.get(&generation).copied().unwrap_or(u64::MAX);
                        if at >= end || (gone_as_status && at < st.compacted) {
                            Some(None)
                        } else if at < st.compacted {
                            let gone = json!({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}});
                            Some(Some((at, format!("{gone}\n"), true)))
                        } else {
                            st.log
                                .iter()
                                .find(|(rv, _)| *rv > at && *rv <= end)
                                .map(|(rv, ev)| Some((*rv, format!("{ev}\n"), false)))
                        }
                    };
                    match next {
                        Some(None) => return None,
                        Some(Some((rv, line, gone))) => {
                            at = rv;
                            return Some((Ok::<_, std::io::Error>(line), (api, at, gone)));
                        }
                        None => changed.await,
                    }
                }
            },
        );
        return axum::response::Response::new(Body::from_stream(lines));
    }
    api.lists.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let st = api.store.lock();
    let items: Vec<Value> = st.slices.values().cloned().collect();
    let rv = st.rv.to_string();
    drop(st);
    axum::Json(
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList", "metadata": {"resourceVersion": rv}, "items": items}),
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

async fn eventually(what: &str, cond: impl FnMut() -> bool) {
    eventually_within(Duration::from_secs(5), what, cond).await
}

async fn eventually_within(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
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
        watch_timeout_seconds: 290.0,
        data_parallel_size: None,
    })
}

/// Discovery config for the fake API served over plain HTTP (no CA, no token).
async fn plain_config(api: &Arc<FakeApi>) -> Config {
    kube_config(
        serve_plain(api.clone()).await,
        "/nonexistent/ca.crt".into(),
        "/nonexistent/token".into(),
    )
}

/// Serves the fake API over plain HTTP on loopback; returns its URL.
async fn serve_plain(api: Arc<FakeApi>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = fake_api(api);
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Starts discovery on `cfg`; returns the pool's holder and the token that stops it.
fn start(cfg: Config) -> (Arc<Upstreams>, CancellationToken) {
    let state = AppState::new(cfg).unwrap();
    let up = state.upstreams.clone();
    let cancel = CancellationToken::new();
    tokio::spawn(discovery::run(
        up.clone(),
        state.resolver.clone(),
        cancel.clone(),
    ));
    (up, cancel)
}

fn want(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[tokio::test]
async fn kubernetes_discovery_uses_ready_endpoints_and_resumes_watches() {
    let api = Arc::new(FakeApi::default());
    let cfg = plain_config(&api).await;
    scenario(api, cfg).await;
}

/// Pods that each run vLLM's data parallelism behind one API server: every rank of every ready
/// endpoint becomes a worker, with the rank that its requests will name and a pod's ranks gone
/// with the pod.
#[tokio::test]
async fn kubernetes_discovery_routes_to_each_data_parallel_rank_of_each_pod() {
    let api = Arc::new(FakeApi::default());
    api.put(slice(
        "vllm-a",
        &[
            ("127.0.0.51", Some(true), false),
            ("127.0.0.52", Some(true), false),
        ],
    ));
    let mut cfg = plain_config(&api).await;
    if let DiscoveryConfig::Kubernetes {
        data_parallel_size, ..
    } = &mut cfg.discovery
    {
        *data_parallel_size = Some(kvroute::config::DataParallelSize::Fixed(2));
    }
    let (up, cancel) = start(cfg);
    eventually("both pods' ranks", || names(&up).len() == 4).await;
    assert_eq!(
        names(&up),
        [
            "127.0.0.51:8000/dp0",
            "127.0.0.51:8000/dp1",
            "127.0.0.52:8000/dp0",
            "127.0.0.52:8000/dp1"
        ]
    );
    let ranks: Vec<Option<u32>> = up
        .pool
        .snapshot()
        .iter()
        .map(|w| w.data_parallel_rank.as_ref().map(|r| r.0))
        .collect();
    assert_eq!(ranks, [Some(0), Some(1), Some(0), Some(1)]);
    api.put(slice("vllm-a", &[("127.0.0.52", Some(true), false)]));
    eventually("the first pod's ranks gone", || names(&up).len() == 2).await;
    assert_eq!(names(&up), ["127.0.0.52:8000/dp0", "127.0.0.52:8000/dp1"]);
    cancel.cancel();
}

#[tokio::test]
async fn kubernetes_discovery_speaks_tls_with_the_ca_bundle_and_sends_the_token() {
    let api = Arc::new(FakeApi::default());
    let (api_url, pem) = serve_tls(fake_api(api.clone())).await;
    let dir = common::TempDir::new("kube");
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
}

#[tokio::test]
async fn kubernetes_discovery_refuses_a_server_its_ca_did_not_sign() {
    let api = Arc::new(FakeApi::default());
    let (api_url, _pem) = serve_tls(fake_api(api.clone())).await;
    let (_other_url, other_pem) = serve_tls(fake_api(Arc::new(FakeApi::default()))).await;
    let dir = common::TempDir::new("kube-bad");
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
}

/// Initial list, NotReady, a new slice, a dropped watch with changes while it was down (resumed
/// from the last resourceVersion: replayed, no re-list), a bookmark moving the resume point, a
/// 410 (re-list), and a terminating endpoint; the worker set is checked after each.
async fn scenario(api: Arc<FakeApi>, cfg: Config) {
    api.put(slice(
        "vllm-a",
        &[
            ("127.0.0.21", Some(true), false),
            ("127.0.0.22", None, false), // no `ready`: ready
            ("127.0.0.23", Some(false), false),
            ("127.0.0.24", Some(true), true), // terminating
        ],
    ));
    let (up, cancel) = start(cfg);
    eventually("the initial list", || {
        names(&up) == want(&["127.0.0.21:8000", "127.0.0.22:8000"])
    })
    .await;
    eventually("a watch", || api.watch_count() == 1).await;
    let first = api.last_watch();
    assert_eq!(first["resourceVersion"], api.rv().to_string());
    assert_eq!(first["timeoutSeconds"], "290");
    assert_eq!(first["allowWatchBookmarks"], "true");

    // A pod goes NotReady.
    api.put(slice(
        "vllm-a",
        &[
            ("127.0.0.21", Some(true), false),
            ("127.0.0.22", Some(false), false),
        ],
    ));
    eventually("the NotReady pod removed", || {
        names(&up) == want(&["127.0.0.21:8000"])
    })
    .await;

    // A second slice appears.
    api.put(slice("vllm-b", &[("127.0.0.25", Some(true), false)]));
    eventually("the new slice's pod added", || {
        names(&up) == want(&["127.0.0.21:8000", "127.0.0.25:8000"])
    })
    .await;

    // The watch drops; while it is down the second slice is deleted and the first one changes.
    // The new watch starts where the last one stopped and is replayed both; no re-list.
    let lists = api.lists();
    let seen = api.rv();
    api.drop_watches();
    api.delete("vllm-b");
    api.put(slice(
        "vllm-a",
        &[
            ("127.0.0.21", Some(true), false),
            ("127.0.0.26", Some(true), false),
        ],
    ));
    eventually("the set after the resumed watch", || {
        names(&up) == want(&["127.0.0.21:8000", "127.0.0.26:8000"])
    })
    .await;
    assert_eq!(api.watch_count(), 2);
    assert_eq!(api.last_watch()["resourceVersion"], seen.to_string());
    assert_eq!(api.lists(), lists, "a resumed watch does not list again");

    // A bookmark moves the resume point without a change: the next watch starts from it.
    api.bookmark();
    api.drop_watches();
    eventually("a third watch", || api.watch_count() == 3).await;
    assert_eq!(
        api.last_watch()["resourceVersion"],
        api.rv().to_string(),
        "resumed from the bookmark"
    );
    assert_eq!(api.lists(), lists);

    // History compacted and the watch dropped: the resume gets 410 Gone and lists again.
    api.put(slice("vllm-a", &[("127.0.0.26", Some(true), false)]));
    eventually("the change before compaction", || {
        names(&up) == want(&["127.0.0.26:8000"])
    })
    .await;
    api.drop_watches();
    api.compact();
    api.put(slice("vllm-c", &[("127.0.0.28", Some(true), false)]));
    api.compact();
    eventually("a re-list after 410", || api.lists() > lists).await;
    eventually("the set after the re-list", || {
        names(&up) == want(&["127.0.0.26:8000", "127.0.0.28:8000"])
    })
    .await;

    // A terminating endpoint is dropped.
    api.put(slice(
        "vllm-a",
        &[
            ("127.0.0.26", Some(true), true),
            ("127.0.0.29", Some(true), false),
        ],
    ));
    eventually("the terminating pod removed", || {
        names(&up) == want(&["127.0.0.28:8000", "127.0.0.29:8000"])
    })
    .await;
    cancel.cancel();
}

/// Lists one slice with the pod at `ip` while `fault` (one of the fake API's switches) is on,
/// and counts the watches discovery makes in the next 1.5 s: a bounded window, not a wait for
/// something to happen.
async fn watches_under_fault(
    api: &Arc<FakeApi>,
    fault: &std::sync::atomic::AtomicBool,
    ip: &str,
) -> (Arc<Upstreams>, CancellationToken, usize) {
    api.put(slice("vllm-a", &[(ip, Some(true), false)]));
    fault.store(true, std::sync::atomic::Ordering::SeqCst);
    let (up, cancel) = start(plain_config(api).await);
    let listed = want(&[&format!("{ip}:8000")]);
    eventually("the listed worker", || names(&up) == listed).await;
    let before = api.watch_count();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    (up, cancel, api.watch_count() - before)
}

/// Turns `fault` off and changes the slice to the pod at `ip`: the next watch must bring it.
async fn recovers(api: &FakeApi, up: &Upstreams, fault: &std::sync::atomic::AtomicBool, ip: &str) {
    fault.store(false, std::sync::atomic::Ordering::SeqCst);
    api.put(slice("vllm-a", &[(ip, Some(true), false)]));
    let changed = want(&[&format!("{ip}:8000")]);
    eventually_within(Duration::from_secs(15), "recovery", || names(up) == changed).await;
}

#[tokio::test]
async fn a_forbidden_watch_backs_off_and_keeps_the_listed_workers() {
    let api = Arc::new(FakeApi::default());
    let (up, cancel, attempts) = watches_under_fault(&api, &api.forbid_watch, "127.0.0.31").await;
    // Backoff 100, 200, 400, 800 ms...: about 5 attempts in 1.5 s; a tight loop makes thousands.
    assert!(
        (2..=8).contains(&attempts),
        "{attempts} watch attempts in 1.5 s"
    );
    assert_eq!(api.lists(), 1, "a refused watch does not list again");
    assert_eq!(names(&up), want(&["127.0.0.31:8000"]));
    let errors = "kvroute_discovery_updates_total{result=\"error\",source=\"kubernetes\"}";
    assert!(up.metrics.render().contains(errors));
    // Allowed again: the next attempt watches from the list's version and sees changes.
    recovers(&api, &up, &api.forbid_watch, "127.0.0.32").await;
    cancel.cancel();
}

#[tokio::test]
async fn a_server_that_hangs_up_on_every_watch_is_not_asked_in_a_tight_loop() {
    let api = Arc::new(FakeApi::default());
    let (up, cancel, watches) = watches_under_fault(&api, &api.hang_up_watch, "127.0.0.33").await;
    // At most 5 API calls a second: about 8 in 1.5 s; unlimited, it makes thousands.
    assert!((2..=12).contains(&watches), "{watches} watches in 1.5 s");
    assert_eq!(
        api.lists(),
        1,
        "an empty watch resumes; it does not list again"
    );
    // Watches carry events again: the next one sees the change.
    recovers(&api, &up, &api.hang_up_watch, "127.0.0.34").await;
    cancel.cancel();
}

/// The API server may refuse a watch from a compacted resourceVersion with HTTP 410 instead of
/// a 410 event inside it; discovery must list again rather than retry the stale version.
#[tokio::test]
async fn a_watch_refused_with_http_410_lists_again() {
    let api = Arc::new(FakeApi::default());
    api.put(slice("vllm-a", &[("127.0.0.35", Some(true), false)]));
    api.gone_as_status
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (up, cancel) = start(plain_config(&api).await);
    eventually("the listed worker", || {
        names(&up) == want(&["127.0.0.35:8000"])
    })
    .await;
    eventually("a watch", || api.watch_count() == 1).await;
    let lists = api.lists();
    // A change no watch will carry: the live watch ends, and its resume is refused with 410.
    api.put_unseen(slice("vllm-b", &[("127.0.0.36", Some(true), false)]));
    eventually("a re-list after the refused watch", || api.lists() > lists).await;
    eventually("the set after the re-list", || {
        names(&up) == want(&["127.0.0.35:8000", "127.0.0.36:8000"])
    })
    .await;
    cancel.cancel();
}

#[tokio::test]
async fn a_silent_watch_is_abandoned_after_its_timeout_and_resumed() {
    let api = Arc::new(FakeApi::default());
    api.put(slice("vllm-a", &[("127.0.0.41", Some(true), false)]));
    api.silent_watch
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let mut cfg = plain_config(&api).await;
    if let DiscoveryConfig::Kubernetes {
        watch_timeout_seconds,
        ..
    } = &mut cfg.discovery
    {
        *watch_timeout_seconds = 1.0;
    }
    let (up, cancel) = start(cfg);
    eventually("a watch", || api.watch_count() == 1).await;
    assert_eq!(api.last_watch()["timeoutSeconds"], "1");
    // The first watch never says anything; a change made now reaches the gateway only through
    // a new watch, which must come once nothing has been heard for the timeout and kube-rs's
    // 5 s margin (6 s after the watch began), and not before the server's own timeout.
    api.silent_watch
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let changed_at = tokio::time::Instant::now();
    api.put(slice("vllm-a", &[("127.0.0.42", Some(true), false)]));
    let deadline = changed_at + Duration::from_secs(10);
    while names(&up) != want(&["127.0.0.42:8000"]) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the silent watch was never abandoned"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waited = changed_at.elapsed();
    assert!(
        (Duration::from_secs(1)..Duration::from_secs(7)).contains(&waited),
        "abandoned {waited:?} after the change"
    );
    assert_eq!(api.lists(), 1, "resumed, not re-listed");
    assert_eq!(api.watch_count(), 2);
    cancel.cancel();
}
