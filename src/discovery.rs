//! Worker discovery: where the worker set comes from, and keeping the pool equal to it.
//!
//! A source yields complete worker lists; every list is applied with
//! [`crate::workers::Pool::reconcile`], which swaps the set atomically, keeps unchanged workers
//! (their in-flight counts and health) and drains departed ones. Because placement is rendezvous
//! hashing over worker names, a change moves only the prefixes of the workers that came or went.
//!
//! - `static`: the config's `workers` (re-applied on reload);
//! - `dns`: a name (a headless Service) re-resolved every interval; every address becomes a worker;
//! - `kubernetes`: list + watch of the Service's EndpointSlices; only Ready, non-terminating
//!   endpoints; a dropped watch or a `410 Gone` re-lists, so deletions missed meanwhile are seen.
//!   In a pod it talks HTTPS to the API server with the service account's CA and token.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::config::{DataParallelSize, DiscoveryConfig, WorkerConfig};
use crate::proxy::{error_chain, Upstreams};

/// Applies one complete list from `source` and counts it.
pub fn apply(up: &Upstreams, source: &str, workers: &[WorkerConfig]) {
    match up.pool.reconcile(workers, &up.metrics) {
        Ok((0, 0)) => {}
        Ok((added, removed)) => {
            tracing::info!(
                source,
                added,
                removed,
                total = workers.len(),
                "worker set changed"
            );
            up.metrics
                .discovery_updates
                .with_label_values(&[source, "applied"])
                .inc();
        }
        Err(e) => {
            tracing::warn!(source, error = %e, "discovered worker list rejected");
            up.metrics
                .discovery_updates
                .with_label_values(&[source, "rejected"])
                .inc();
        }
    }
}

pub type ResolveFuture<'a> = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send + 'a>>;

/// Name resolution, swappable so tests control the answers.
pub trait Resolve: Send + Sync + 'static {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a>;
}

/// The system resolver (what a pod's `/etc/resolv.conf` says).
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a> {
        Box::pin(async move { Ok(tokio::net::lookup_host((host, port)).await?.collect()) })
    }
}

/// The worker list for a set of resolved addresses: sorted, deduplicated, named `ip:port`, each
/// with `data_parallel_size` engines behind it when set.
pub fn workers_from_addrs(
    mut addrs: Vec<SocketAddr>,
    data_parallel_size: Option<DataParallelSize>,
) -> Vec<WorkerConfig> {
    addrs.sort();
    addrs.dedup();
    addrs
        .into_iter()
        .map(|a| WorkerConfig {
            data_parallel_size,
            ..WorkerConfig::from_url(format!("http://{a}"))
        })
        .collect()
}

/// Runs the configured discovery until `cancel` fires (returns at once for `static`).
pub async fn run(up: Arc<Upstreams>, resolver: Arc<dyn Resolve>, cancel: CancellationToken) {
    match up.config.discovery.clone() {
        DiscoveryConfig::Static => {}
        DiscoveryConfig::Dns {
            host,
            port,
            interval_seconds,
            data_parallel_size,
        } => {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(interval_seconds));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match resolver.resolve(&host, port).await {
                    Ok(addrs) => apply(&up, "dns", &workers_from_addrs(addrs, data_parallel_size)),
                    Err(e) => {
                        // Keep the last known set: a resolver outage is not an empty pool.
                        tracing::warn!(%host, error = %e, "DNS discovery failed; keeping the current workers");
                        up.metrics
                            .discovery_updates
                            .with_label_values(&["dns", "error"])
                            .inc();
                    }
                }
            }
        }
        DiscoveryConfig::Kubernetes {
            namespace,
            service,
            port_name,
            port,
            api_url,
            ca_file,
            token_file,
            watch_timeout_seconds,
            data_parallel_size,
        } => {
            let api = match KubeApi::new(api_url, &ca_file, token_file) {
                Ok(api) => api,
                Err(e) => {
                    tracing::error!(error = %e, "kubernetes discovery cannot start");
                    up.metrics
                        .discovery_updates
                        .with_label_values(&["kubernetes", "error"])
                        .inc();
                    return;
                }
            };
            let target = SliceTarget {
                api: api.base.clone(),
                namespace,
                service,
                port_name,
                port,
                data_parallel_size,
            };
            let timeout = Duration::from_secs_f64(watch_timeout_seconds);
            kubernetes(&up, &api, &target, &cancel, timeout).await;
        }
    }
}

type TlsClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The Kubernetes API: HTTPS with the configured CA (or plain HTTP to a `kubectl proxy`), with
/// the service account's bearer token.
pub struct KubeApi {
    base: String,
    client: TlsClient,
    token_file: String,
}

impl KubeApi {
    pub fn new(api_url: Option<String>, ca_file: &str, token_file: String) -> Result<Self, String> {
        let base = api_url.unwrap_or_else(|| {
            match (
                std::env::var("KUBERNETES_SERVICE_HOST"),
                std::env::var("KUBERNETES_SERVICE_PORT"),
            ) {
                (Ok(h), Ok(p)) if h.contains(':') => format!("https://[{h}]:{p}"),
                (Ok(h), Ok(p)) => format!("https://{h}:{p}"),
                _ => "http://127.0.0.1:8001".into(),
            }
        });
        let mut roots = rustls::RootCertStore::empty();
        if base.starts_with("https://") {
            use rustls::pki_types::{pem::PemObject, CertificateDer};
            let certs = CertificateDer::pem_file_iter(ca_file)
                .map_err(|e| format!("CA bundle {ca_file}: {e}"))?;
            for cert in certs {
                let cert = cert.map_err(|e| format!("CA bundle {ca_file}: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("CA bundle {ca_file}: {e}"))?;
            }
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            base,
            client: Client::builder(TokioExecutor::new()).build(connector),
            token_file,
        })
    }

    async fn get(&self, url: &str) -> Result<hyper::body::Incoming, GetError> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| GetError::Other(format!("{url}: {e}")))?;
        let mut req = http::Request::get(uri);
        if let Ok(token) = tokio::fs::read_to_string(&self.token_file).await {
            req = req.header(
                http::header::AUTHORIZATION,
                format!("Bearer {}", token.trim()),
            );
        }
        let req = req
            .body(Full::new(Bytes::new()))
            .map_err(|e| GetError::Other(e.to_string()))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| GetError::Other(error_chain(&e)))?;
        if !resp.status().is_success() {
            return Err(GetError::Status(resp.status().as_u16()));
        }
        Ok(resp.into_body())
    }
}

/// A failed API call: an HTTP status (410 Gone matters to a watch) or anything else.
#[derive(Debug)]
enum GetError {
    Status(u16),
    Other(String),
}

impl std::fmt::Display for GetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GetError::Status(s) => write!(f, "HTTP {s}"),
            GetError::Other(e) => f.write_str(e),
        }
    }
}

/// Which EndpointSlices to watch and which port to use.
pub struct SliceTarget {
    pub api: String,
    pub namespace: String,
    pub service: String,
    pub port_name: Option<String>,
    pub port: Option<u16>,
    /// The data-parallel engines behind each endpoint's API server, if any.
    pub data_parallel_size: Option<DataParallelSize>,
}

impl SliceTarget {
    fn url(&self) -> String {
        format!(
            "{}/apis/discovery.k8s.io/v1/namespaces/{}/endpointslices?labelSelector=kubernetes.io%2Fservice-name%3D{}",
            self.api.trim_end_matches('/'),
            self.namespace,
            self.service
        )
    }

    /// A watch from `rv` that the server ends after `timeout`, with bookmarks.
    fn watch_url(&self, rv: &str, timeout: Duration) -> String {
        format!(
            "{}&watch=1&allowWatchBookmarks=true&timeoutSeconds={}&resourceVersion={rv}",
            self.url(),
            timeout.as_secs().max(1)
        )
    }

    /// The usable endpoints of one EndpointSlice object.
    pub fn endpoints(&self, slice: &Value) -> Vec<SocketAddr> {
        let Some(port) = slice["ports"].as_array().and_then(|ports| {
            ports.iter().find_map(|p| {
                let by_name = self
                    .port_name
                    .as_deref()
                    .is_some_and(|n| p["name"].as_str() == Some(n));
                let by_number = self
                    .port
                    .is_some_and(|n| p["port"].as_u64() == Some(u64::from(n)));
                (by_name || by_number).then(|| p["port"].as_u64()).flatten()
            })
        }) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for ep in slice["endpoints"].as_array().into_iter().flatten() {
            let c = &ep["conditions"];
            // A missing `ready` means ready (Kubernetes API semantics); terminating means leaving.
            let ready = c["ready"].as_bool().unwrap_or(true);
            let terminating = c["terminating"].as_bool().unwrap_or(false);
            if !ready || terminating {
                continue;
            }
            for a in ep["addresses"].as_array().into_iter().flatten() {
                if let Some(ip) = a.as_str().and_then(|s| s.parse().ok()) {
                    out.push(SocketAddr::new(ip, port as u16));
                }
            }
        }
        out
    }
}

/// Slice name → its usable endpoints.
type Slices = BTreeMap<String, Vec<SocketAddr>>;

fn workers_of(slices: &Slices, target: &SliceTarget) -> Vec<WorkerConfig> {
    workers_from_addrs(
        slices.values().flatten().copied().collect(),
        target.data_parallel_size,
    )
}

/// Exponential backoff between failed API calls: 100 ms doubling to 10 s, reset by success.
struct Backoff(Duration);

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(10);

    fn new() -> Self {
        Self(Self::FIRST)
    }

    fn reset(&mut self) {
        self.0 = Self::FIRST;
    }

    /// The delay to wait now; the next one is twice as long.
    fn next(&mut self) -> Duration {
        let d = self.0;
        self.0 = (self.0 * 2).min(Self::MAX);
        d
    }
}

/// How a watch ended.
#[derive(Debug)]
enum WatchEnd {
    /// The server closed it (its `timeoutSeconds` ran out, or it went away): resume from the
    /// last resourceVersion seen. `events` counts the events it carried.
    Closed { events: usize },
    /// Nothing ended it within `timeoutSeconds` and a grace period: a half-dead connection.
    Silent,
    /// 410 Gone: the resourceVersion is too old to resume from; list again.
    Expired,
    /// Refused (e.g. 403: RBAC allows list but not watch), or broken: retry after a backoff.
    Failed(String),
}

/// List once, then watch from the list's resourceVersion; every watch event, bookmarks
/// included, moves the resume point, so a watch that ends resumes where it stopped instead of
/// listing again. Only 410 Gone re-lists. Failed calls back off (100 ms doubling to 10 s).
async fn kubernetes(
    up: &Upstreams,
    api: &KubeApi,
    target: &SliceTarget,
    cancel: &CancellationToken,
    watch_timeout: Duration,
) {
    let mut backoff = Backoff::new();
    let mut listed: Option<(Slices, String)> = None;
    loop {
        let (slices, rv) = match &mut listed {
            Some(x) => x,
            None => {
                let r = tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = list(api, target) => r,
                };
                match r {
                    Ok(x) => {
                        apply(up, "kubernetes", &workers_of(&x.0, target));
                        listed.insert(x)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "EndpointSlice list failed; keeping the current workers");
                        discovery_error(up);
                        if pause(cancel, backoff.next()).await {
                            return;
                        }
                        continue;
                    }
                }
            }
        };
        let end = tokio::select! {
            _ = cancel.cancelled() => return,
            end = watch(up, api, target, slices, rv, watch_timeout) => end,
        };
        match end {
            WatchEnd::Closed { events } if events > 0 => backoff.reset(),
            WatchEnd::Closed { .. } => {
                // Closed before it carried anything: do not spin on a server that hangs up.
                if pause(cancel, backoff.next()).await {
                    return;
                }
            }
            WatchEnd::Silent => {
                tracing::info!("EndpointSlice watch went silent past its timeout; resuming");
            }
            WatchEnd::Expired => {
                tracing::info!("EndpointSlice watch expired (410 Gone); listing again");
                listed = None;
            }
            WatchEnd::Failed(e) => {
                let wait = backoff.next();
                tracing::warn!(error = %e, retry_in = ?wait, "EndpointSlice watch failed; keeping the current workers");
                discovery_error(up);
                if pause(cancel, wait).await {
                    return;
                }
            }
        }
    }
}

fn discovery_error(up: &Upstreams) {
    up.metrics
        .discovery_updates
        .with_label_values(&["kubernetes", "error"])
        .inc();
}

/// Sleeps for `d`; true when cancelled meanwhile.
async fn pause(cancel: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

async fn list(api: &KubeApi, t: &SliceTarget) -> Result<(Slices, String), String> {
    let body = api.get(&t.url()).await.map_err(|e| e.to_string())?;
    let bytes = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    let rv = v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let slices = v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s["metadata"]["name"].as_str()?.to_string(), t.endpoints(s))))
        .collect();
    Ok((slices, rv))
}

/// The grace a watch gets past its server-side `timeoutSeconds` before it counts as silent.
fn watch_grace(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_secs(15))
}

/// Follows one watch from `rv`, applying each event and moving `rv` with it.
async fn watch(
    up: &Upstreams,
    api: &KubeApi,
    t: &SliceTarget,
    slices: &mut Slices,
    rv: &mut String,
    timeout: Duration,
) -> WatchEnd {
    let mut events = 0;
    let followed = tokio::time::timeout(
        timeout + watch_grace(timeout),
        follow(up, api, t, slices, rv, timeout, &mut events),
    )
    .await;
    match followed {
        Err(_) => WatchEnd::Silent,
        Ok(Ok(())) => WatchEnd::Closed { events },
        Ok(Err(end)) => end,
    }
}

async fn follow(
    up: &Upstreams,
    api: &KubeApi,
    t: &SliceTarget,
    slices: &mut Slices,
    rv: &mut String,
    timeout: Duration,
    events: &mut usize,
) -> Result<(), WatchEnd> {
    let mut body = match api.get(&t.watch_url(rv, timeout)).await {
        Ok(b) => b,
        Err(GetError::Status(410)) => return Err(WatchEnd::Expired),
        Err(e) => return Err(WatchEnd::Failed(e.to_string())),
    };
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| WatchEnd::Failed(e.to_string()))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buf.extend_from_slice(data);
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let ev: Value =
                serde_json::from_slice(&line).map_err(|e| WatchEnd::Failed(e.to_string()))?;
            let obj = &ev["object"];
            let kind = ev["type"].as_str().unwrap_or_default();
            if kind == "ERROR" {
                return Err(if obj["code"].as_u64() == Some(410) {
                    WatchEnd::Expired
                } else {
                    WatchEnd::Failed(format!("watch error event: {obj}"))
                });
            }
            *events += 1;
            if let Some(v) = obj["metadata"]["resourceVersion"].as_str() {
                v.clone_into(rv);
            }
            let name = obj["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            match kind {
                "ADDED" | "MODIFIED" => {
                    slices.insert(name, t.endpoints(obj));
                }
                "DELETED" => {
                    slices.remove(&name);
                }
                "BOOKMARK" => continue,
                other => return Err(WatchEnd::Failed(format!("unknown watch event {other:?}"))),
            }
            apply(up, "kubernetes", &workers_of(slices, t));
        }
    }
    Ok(())
}
