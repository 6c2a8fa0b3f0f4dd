//! Worker discovery: where the worker set comes from, and keeping the pool equal to it.
//!
//! A source yields complete worker lists; every list is applied with
//! [`crate::workers::Pool::reconcile`], which swaps the set atomically, keeps unchanged workers
//! (their in-flight counts and health) and drains departed ones. Because placement is rendezvous
//! hashing over worker names, a change moves only the prefixes of the workers that came or went.
//!
//! - `static`: the config's `workers` (re-applied on reload);
//! - `dns`: a name (a headless Service) re-resolved every interval; every address becomes a worker;
//! - `kubernetes`: list + watch of the Service's EndpointSlices (kube-rs's watcher); only Ready,
//!   non-terminating endpoints; a dropped watch resumes from its last resourceVersion and a
//!   `410 Gone` re-lists, so deletions missed meanwhile are seen. In a pod it talks HTTPS to the
//!   API server with the service account's CA and token.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
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
            let client = match kube_client(api_url, &ca_file, &token_file) {
                Ok(client) => client,
                Err(e) => {
                    tracing::error!(error = %e, "kubernetes discovery cannot start");
                    discovery_error(&up);
                    return;
                }
            };
            let target = SliceTarget {
                namespace,
                service,
                port_name,
                port,
                data_parallel_size,
            };
            // Validation keeps the timeout within [1 s, 1e6 s): it fits a u32 of seconds.
            let timeout = watch_timeout_seconds.max(1.0) as u32;
            kubernetes(&up, client, &target, &cancel, timeout).await;
        }
    }
}

/// A client of the Kubernetes API at `api_url`: HTTPS verified against the CA bundle in
/// `ca_file` (re-read by kube-rs when the file rotates), or plain HTTP to a `kubectl proxy`; with
/// the bearer token in `token_file` when that file exists, re-read on every call.
/// Unset `api_url`: the in-pod address from `KUBERNETES_SERVICE_HOST`/`_PORT`, else
/// `http://127.0.0.1:8001`.
fn kube_client(
    api_url: Option<String>,
    ca_file: &str,
    token_file: &str,
) -> Result<kube::Client, String> {
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
    let uri: http::Uri = base.parse().map_err(|e| format!("api_url {base}: {e}"))?;
    let mut config = kube::Config::new(uri);
    if base.starts_with("https://") {
        use rustls::pki_types::{pem::PemObject, CertificateDer};
        let certs = CertificateDer::pem_file_iter(ca_file)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("CA bundle {ca_file}: {e}"))?;
        if certs.is_empty() {
            return Err(format!("CA bundle {ca_file}: no certificate in it"));
        }
        config.root_cert = Some(certs.into_iter().map(|c| c.to_vec()).collect());
        config.root_cert_file = Some(ca_file.into());
    }
    let builder = kube::client::ClientBuilder::try_from(config).map_err(|e| error_chain(&e))?;
    Ok(builder
        .with_layer(&bearer_token(token_file.into()))
        .with_layer(&tower::limit::RateLimitLayer::new(
            API_CALLS_PER_SECOND,
            Duration::from_secs(1),
        ))
        .build())
}

/// At most this many API calls a second; more wait. Following one Service takes a list and a
/// watch every `watch_timeout_seconds`, and failed calls back off, but kube-rs re-watches at once
/// when a watch ends, even one the server closed before it carried anything; without this a
/// server (or a proxy in front of it) that hangs up on every watch would be asked again in a
/// tight loop.
const API_CALLS_PER_SECOND: u64 = 5;

/// Adds `Authorization: Bearer <token>` from `path`, read on every call (list and watch are a
/// few per watch timeout; projected tokens rotate) and trimmed as client-go does; no header when
/// the file cannot be read. kube-rs's own `token_file` sends the file's bytes untrimmed, so a
/// token file ending in a newline (what `echo` writes) would be an invalid header value.
fn bearer_token(
    path: std::path::PathBuf,
) -> tower::util::MapRequestLayer<
    impl Fn(http::Request<kube::client::Body>) -> http::Request<kube::client::Body> + Clone,
> {
    tower::util::MapRequestLayer::new(move |mut req: http::Request<kube::client::Body>| {
        let token = std::fs::read_to_string(&path).ok();
        let value =
            token.and_then(|t| http::HeaderValue::try_from(format!("Bearer {}", t.trim())).ok());
        if let Some(mut value) = value {
            value.set_sensitive(true);
            req.headers_mut().insert(http::header::AUTHORIZATION, value);
        }
        req
    })
}

/// Which EndpointSlices to watch and which port to use.
struct SliceTarget {
    namespace: String,
    service: String,
    port_name: Option<String>,
    port: Option<u16>,
    /// The data-parallel engines behind each endpoint's API server, if any.
    data_parallel_size: Option<DataParallelSize>,
}

impl SliceTarget {
    /// The usable endpoints of one EndpointSlice: Ready (a missing `ready` means ready, as the
    /// Kubernetes API says) and not terminating, on the named (or numbered) port.
    fn endpoints(&self, slice: &EndpointSlice) -> Vec<SocketAddr> {
        let Some(port) = slice.ports.iter().flatten().find_map(|p| {
            let by_name = self
                .port_name
                .as_deref()
                .is_some_and(|n| p.name.as_deref() == Some(n));
            let by_number = self.port.is_some_and(|n| p.port == Some(i32::from(n)));
            (by_name || by_number)
                .then_some(p.port)
                .flatten()
                .and_then(|p| u16::try_from(p).ok())
        }) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for ep in &slice.endpoints {
            let c = ep.conditions.as_ref();
            let ready = c.and_then(|c| c.ready).unwrap_or(true);
            let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
            if !ready || terminating {
                continue;
            }
            out.extend(
                ep.addresses
                    .iter()
                    .filter_map(|a| a.parse().ok())
                    .map(|ip| SocketAddr::new(ip, port)),
            );
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

/// The pause after a failed API call: 100 ms doubling to 10 s, reset by the next success.
/// (kube-rs's default starts at 800 ms, which leaves a gateway that just started without workers
/// for longer than a transient error warrants.)
struct Backoff(Duration);

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(10);

    fn new() -> Self {
        Self(Self::FIRST)
    }
}

impl Iterator for Backoff {
    type Item = Duration;

    /// The delay to wait now; the next one is twice as long. Never gives up.
    fn next(&mut self) -> Option<Duration> {
        let d = self.0;
        self.0 = (self.0 * 2).min(Self::MAX);
        Some(d)
    }
}

impl kube::runtime::utils::Backoff for Backoff {
    fn reset(&mut self) {
        self.0 = Self::FIRST;
    }
}

/// Follows the Service's EndpointSlices with kube-rs's watcher: a list, then watches with
/// bookmarks, each resumed from the last resourceVersion seen when it ends (the server's
/// `timeoutSeconds`, a dropped connection, or nothing heard for `timeout` + 5 s); only 410 Gone
/// lists again. Every change applies the whole set; a re-list replaces it once complete, so
/// slices deleted while the watch was down go too. Failed calls keep the current workers, count
/// as errors and back off.
async fn kubernetes(
    up: &Upstreams,
    client: kube::Client,
    target: &SliceTarget,
    cancel: &CancellationToken,
    timeout_seconds: u32,
) {
    use futures_util::StreamExt;
    use kube::runtime::watcher::{self, Event};
    use kube::ResourceExt;

    let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &target.namespace);
    let config = watcher::Config::default()
        .labels(&format!("kubernetes.io/service-name={}", target.service))
        .timeout(timeout_seconds);
    let follow = || {
        Box::pin(kube::runtime::utils::StreamBackoff::new(
            watcher::watcher(api.clone(), config.clone()),
            Backoff::new(),
        ))
    };
    let mut events = follow();
    let mut slices = Slices::new();
    // The slices of a list in progress; they replace `slices` when it is complete.
    let mut listing: Option<Slices> = None;
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.next() => event,
        };
        match event {
            // The backoff never gives up, so the stream never ends.
            None => return,
            Some(Ok(Event::Init)) => listing = Some(Slices::new()),
            Some(Ok(Event::InitApply(slice))) => {
                let listing = listing.get_or_insert_with(Slices::new);
                listing.insert(slice.name_any(), target.endpoints(&slice));
            }
            Some(Ok(Event::InitDone)) => {
                slices = listing.take().unwrap_or_default();
                apply(up, "kubernetes", &workers_of(&slices, target));
            }
            Some(Ok(Event::Apply(slice))) => {
                slices.insert(slice.name_any(), target.endpoints(&slice));
                apply(up, "kubernetes", &workers_of(&slices, target));
            }
            Some(Ok(Event::Delete(slice))) => {
                slices.remove(&slice.name_any());
                apply(up, "kubernetes", &workers_of(&slices, target));
            }
            Some(Err(e)) => {
                tracing::warn!(error = %error_chain(&e), "EndpointSlice list or watch failed; keeping the current workers");
                discovery_error(up);
                if gone_at_watch_start(&e) {
                    // kube-rs re-lists on a 410 sent inside a watch, but retries a watch refused
                    // with HTTP 410 from the same stale resourceVersion for ever: a new watcher
                    // lists again, as client-go does.
                    tracing::info!("EndpointSlice watch refused with 410 Gone; listing again");
                    events = follow();
                    listing = None;
                }
            }
        }
    }
}

/// A watch refused with HTTP 410 Gone: its resourceVersion is older than the server keeps.
fn gone_at_watch_start(e: &kube::runtime::watcher::Error) -> bool {
    matches!(e, kube::runtime::watcher::Error::WatchStartFailed(kube::Error::Api(status)) if status.code == 410)
}

fn discovery_error(up: &Upstreams) {
    up.metrics
        .discovery_updates
        .with_label_values(&["kubernetes", "error"])
        .inc();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(port_name: Option<&str>, port: Option<u16>) -> SliceTarget {
        SliceTarget {
            namespace: "ml".into(),
            service: "vllm".into(),
            port_name: port_name.map(str::to_string),
            port,
            data_parallel_size: None,
        }
    }

    /// A slice as the API server sends it, decoded as the watcher decodes it.
    fn slice(v: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(v).expect("an EndpointSlice")
    }

    #[test]
    fn endpoints_are_the_ready_addresses_on_the_named_or_numbered_port() {
        let s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "vllm-a"},
            "addressType": "IPv6",
            "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["fd00::1"], "conditions": {"ready": true}},
                {"addresses": ["fd00::2"]},
                {"addresses": ["fd00::3"], "conditions": {"ready": false}},
                {"addresses": ["fd00::4"], "conditions": {"ready": true, "terminating": true}},
                {"addresses": ["not-an-ip"], "conditions": {"ready": true}},
            ],
        }));
        let want: Vec<SocketAddr> = vec![
            "[fd00::1]:8000".parse().unwrap(),
            "[fd00::2]:8000".parse().unwrap(),
        ];
        assert_eq!(target(Some("http"), None).endpoints(&s), want);
        assert_eq!(target(None, Some(8000)).endpoints(&s), want);
        let metrics = target(None, Some(9090)).endpoints(&s);
        assert_eq!(metrics[0], "[fd00::1]:9090".parse().unwrap());
        assert!(
            target(Some("grpc"), None).endpoints(&s).is_empty(),
            "no such port"
        );
        assert!(
            target(None, Some(8001)).endpoints(&s).is_empty(),
            "no such port"
        );
    }

    #[test]
    fn a_slice_without_ports_or_with_a_port_out_of_range_gives_no_endpoints() {
        let no_ports = slice(serde_json::json!({
            "metadata": {"name": "a"},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"]}],
        }));
        assert!(target(Some("http"), None).endpoints(&no_ports).is_empty());
        let bad_port = slice(serde_json::json!({
            "metadata": {"name": "b"},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 70000}],
            "endpoints": [{"addresses": ["10.0.0.1"]}],
        }));
        assert!(target(Some("http"), None).endpoints(&bad_port).is_empty());
    }
}
