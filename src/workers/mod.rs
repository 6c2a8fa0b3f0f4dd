//! Workers: one upstream vLLM server (name, URL, in-flight count, passive ejection) and the pool
//! of them, swapped atomically as a whole so a request always sees one consistent set
//! (`pool.rs`).

mod pool;

pub use pool::{Pool, WorkerSet};

use std::{
    borrow::Cow,
    sync::{
        atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering},
        Arc, Weak,
    },
    time::Duration,
};

use http::uri::{Authority, Scheme};
use tokio::time::Instant;
use xxhash_rust::xxh3::xxh3_64;

use crate::{
    admission::SlotFreed,
    config::{worker_name, WorkerConfig},
    error::ApiError,
    loop_copy::{Handle, Local},
    metrics::Metrics,
};

/// The fields every routing decision reads come first and the struct is cache-line aligned, so a
/// policy scanning a large pool touches one cache line per worker.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Worker {
    inflight: AtomicUsize,
    /// Milliseconds after `born` until which the worker is left out of routing.
    ejected_until_ms: AtomicU64,
    /// Hash of the name: the worker's identity in rendezvous hashing, equal on every replica.
    pub id_hash: u64,
    /// Why the worker takes no new requests, as bits: [`DOWN`] (marked down by active health
    /// checks) and [`DRAINING`] (configured, or set while the worker leaves the pool). One byte,
    /// so a policy scanning the pool tests both with one load.
    out: AtomicU8,
    /// Queue and cache signals beyond the in-flight count.
    pub load: crate::load::Load,
    /// What its KV cache holds and has written, to presume what it has evicted (read once a
    /// decision, for the chosen worker: outside the first cache line).
    pub kv: crate::load::KvClock,
    /// When its engine steps end, from this gateway's streams (read for every priced worker,
    /// written once a step).
    pub steps: crate::load::StepClock,
    /// Its requests at each poll, this gateway's and others', over many polls (read when a
    /// decision asks how far other replicas place prompts).
    pub traffic: crate::load::Traffic,
    /// Prompts sent to it that peer replicas are yet to be told of ([`crate::peers`]).
    pub peer_outbox: crate::peers::Outbox,
    pub name: String,
    pub scheme: Scheme,
    pub authority: Authority,
    /// The `Host` header sent to the worker (its host, and its port unless the scheme's
    /// default), made once rather than per request.
    pub host_header: http::HeaderValue,
    /// The worker's name as the `x-kvroute-worker` response header, when it can be one.
    pub name_header: Option<http::HeaderValue>,
    /// For one data-parallel rank of a server: the rank, which its requests name in
    /// `X-data-parallel-rank` (made once) and whose engine's series its load is read from.
    pub data_parallel_rank: Option<(u32, http::HeaderValue)>,
    /// Models served; empty means any.
    pub models: Vec<String>,
    inflight_gauge: crate::metrics::sharded::Gauge,
    born: Instant,
    /// 5xx answers in a row, for passive ejection.
    error_streak: AtomicU32,
    healthy_gauge: prometheus::IntGauge,
    pub(crate) metrics: Metrics,
    /// The pool's admission signal, told when a slot is released.
    freed: Arc<SlotFreed>,
    /// The blocks the worker holds, from its KV cache events, when it publishes them.
    pub events: Option<Arc<crate::kv_events::Feed>>,
    /// Stops following the events when the worker is dropped.
    _follow: Option<tokio_util::sync::DropGuard>,
    /// Its per-request series under each arm, resolved once.
    series: crate::metrics::SeriesByArm,
    /// For a worker of a `data_parallel_size: auto` entry: the entry's URL, under which the
    /// ranks its `/metrics` shows are reported to the pool ([`Pool::ranks_seen`]).
    pub ranks_of: Option<Box<str>>,
}

/// [`Worker`]'s `out` bit: marked down by active health checks.
const DOWN: u8 = 1;
/// [`Worker`]'s `out` bit: draining.
const DRAINING: u8 = 2;

/// Blocks remembered per worker from its events: beyond any GPU's KV cache (an 80 GB GPU holds
/// some 10^5 blocks of 16 tokens for a 7B model), about 64 MiB at most.
pub const EVENT_BLOCKS_PER_WORKER: usize = 1 << 20;

/// The `Host` header for requests to `uri`: its host, and its port unless the scheme's default.
fn host_header(uri: &http::Uri) -> Option<http::HeaderValue> {
    let host = uri.host()?;
    let default_port = match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    };
    match uri.port_u16() {
        Some(port) if port != default_port => {
            http::HeaderValue::from_str(&format!("{host}:{port}")).ok()
        }
        _ => http::HeaderValue::from_str(host).ok(),
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.metrics.worker_gone(&self.name);
    }
}

impl Worker {
    pub fn new(cfg: &WorkerConfig, metrics: &Metrics) -> Result<Self, String> {
        Self::in_pool(cfg, metrics, Arc::default(), None)
    }

    /// A worker whose released slots wake the requests waiting on `freed`, and whose KV cache
    /// events are followed from `events` (on the current runtime) when given.
    pub fn in_pool(
        cfg: &WorkerConfig,
        metrics: &Metrics,
        freed: Arc<SlotFreed>,
        events: Option<crate::kv_events::EventsFrom>,
    ) -> Result<Self, String> {
        let uri: http::Uri = cfg.url.parse().map_err(|e| format!("{}: {e}", cfg.url))?;
        let name = worker_name(cfg);
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("{}: no host", cfg.url))?;
        let host_header = host_header(&uri).ok_or_else(|| format!("{}: bad host", cfg.url))?;
        metrics.worker_born(&name);
        let (events, follow) = match (events, tokio::runtime::Handle::try_current()) {
            (Some(from), Ok(rt)) => {
                use crate::kv_events::{discover::discover, follow, EventsFrom};
                let feed = Arc::new(crate::kv_events::Feed::new(EVENT_BLOCKS_PER_WORKER));
                let stop = tokio_util::sync::CancellationToken::new();
                rt.spawn({
                    let (feed, stop, authority) =
                        (Arc::clone(&feed), stop.clone(), authority.clone());
                    async move {
                        let source = match from {
                            EventsFrom::At(source) => source,
                            EventsFrom::Ask { rank } => {
                                match discover(&authority, rank, &stop).await {
                                    Some(source) => source,
                                    None => return,
                                }
                            }
                        };
                        follow(source, &feed, stop).await
                    }
                });
                (Some(feed), Some(stop.drop_guard()))
            }
            _ => (None, None),
        };
        Ok(Self {
            events,
            _follow: follow,
            metrics: metrics.clone(),
            scheme: uri.scheme().cloned().unwrap_or(Scheme::HTTP),
            authority,
            host_header,
            name_header: http::HeaderValue::from_str(&name).ok(),
            data_parallel_rank: cfg
                .data_parallel_rank
                .map(|r| (r, http::HeaderValue::from(r))),
            models: cfg.models.clone(),
            id_hash: xxh3_64(name.as_bytes()),
            inflight_gauge: metrics.worker_inflight.with_label_values(&[&name]),
            healthy_gauge: metrics.worker_healthy.with_label_values(&[&name]),
            out: AtomicU8::new(if cfg.draining { DRAINING } else { 0 }),
            error_streak: AtomicU32::new(0),
            name,
            inflight: AtomicUsize::new(0),
            ejected_until_ms: AtomicU64::new(0),
            born: Instant::now(),
            load: crate::load::Load::default(),
            kv: crate::load::KvClock::default(),
            steps: crate::load::StepClock::default(),
            traffic: crate::load::Traffic::default(),
            peer_outbox: crate::peers::Outbox::default(),
            freed,
            series: Default::default(),
            ranks_of: cfg.detects_ranks().then(|| cfg.url.as_str().into()),
        })
    }

    /// What a load poll of the worker showed (`None`: the poll failed), of which as many as
    /// `local_inflight` requests may be this gateway's: to its load ([`crate::load::Load::store`]) and, for the
    /// requests it counted, to its traffic over many polls ([`crate::load::Traffic`]).
    pub fn polled(&self, p: Option<crate::load::Polled>, local_inflight: usize, peers: usize) {
        // Peers tell this gateway their placements as well as their load ([`crate::peers`]):
        // what it routes on is as much theirs as its own, and only the requests nobody told of
        // are other replicas' share.
        if let Some(untold) = self.load.store(p, local_inflight, peers) {
            self.traffic.polled(untold, (local_inflight + peers) as f64);
        }
    }

    /// The series this worker's requests update under the arm `arm` of policy `policy`, as a
    /// request holds them ([`Worker::series_at`] reads them).
    pub fn series(&self, policy: &'static str, arm: &str) -> crate::metrics::SeriesRef {
        self.series.pick(&self.metrics, policy, arm, &self.name)
    }

    pub fn series_at<'a>(
        &'a self,
        r: &'a crate::metrics::SeriesRef,
    ) -> &'a crate::metrics::WorkerSeries {
        self.series.at(r)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Usable unless draining, marked down by health checks, or recently ejected.
    pub fn is_usable(&self) -> bool {
        if self.out.load(Ordering::Relaxed) != 0 {
            return false;
        }
        // Read the clock only for a worker that was ever ejected: selection asks every worker.
        let until = self.ejected_until_ms.load(Ordering::Relaxed);
        until == 0 || self.now_ms() >= until
    }

    pub fn set_down(&self, down: bool) {
        let before = if down {
            self.out.fetch_or(DOWN, Ordering::Relaxed)
        } else {
            self.out.fetch_and(!DOWN, Ordering::Relaxed)
        };
        if (before & DOWN != 0) != down {
            tracing::warn!(worker = %self.name, down, "health check changed the worker's state");
        }
        self.publish_health();
    }

    pub fn set_draining(&self, draining: bool) {
        if draining {
            self.out.fetch_or(DRAINING, Ordering::Relaxed);
        } else {
            self.out.fetch_and(!DRAINING, Ordering::Relaxed);
        }
        self.publish_health();
    }

    pub fn is_draining(&self) -> bool {
        self.out.load(Ordering::Relaxed) & DRAINING != 0
    }

    /// Sets `kvroute_worker_healthy` from the current state.
    pub fn publish_health(&self) {
        self.healthy_gauge.set(i64::from(self.is_usable()));
    }

    /// Passive health: `threshold` 5xx answers in a row eject the worker for `eject`.
    pub fn record_status(&self, status: http::StatusCode, threshold: u32, eject: Duration) {
        if !status.is_server_error() {
            self.error_streak.store(0, Ordering::Relaxed);
            return;
        }
        if self.error_streak.fetch_add(1, Ordering::Relaxed) + 1 >= threshold {
            self.error_streak.store(0, Ordering::Relaxed);
            tracing::warn!(worker = %self.name, %status, "worker answered 5xx repeatedly; ejecting");
            self.eject_for(eject);
        }
    }

    /// Leaves the worker out of routing for `d` (passive ejection after a refused connection).
    pub fn eject_for(&self, d: Duration) {
        let until = self.now_ms() + d.as_millis() as u64;
        self.ejected_until_ms.fetch_max(until, Ordering::Relaxed);
        self.healthy_gauge.set(0);
    }

    pub fn serves(&self, model: Option<&str>) -> bool {
        match model {
            Some(m) if !self.models.is_empty() => self.models.iter().any(|x| x == m),
            _ => true,
        }
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// Like [`Worker::acquire`], unless `cap` (0: none) requests are already in flight.
    pub fn try_acquire(self: &Arc<Self>, cap: usize) -> Option<InflightGuard> {
        HeldWorker::from(self).try_acquire(cap)
    }

    /// Counts one request in flight on `self` until the guard drops.
    pub fn acquire(self: &Arc<Self>) -> InflightGuard {
        HeldWorker::from(self).acquire()
    }
}

/// A worker that a request holds until it ends.
///
/// Holding a worker through its own `Arc` writes the worker's reference count twice a request,
/// and with an event loop per core that count's cache line moves between cores on most requests
/// ([`crate::loop_copy`]). A worker of the set a request was routed among is held instead through
/// its event loop's handle on that worker ([`LoopSet::hold`]), a count only that loop writes.
#[derive(Clone, Debug)]
pub struct HeldWorker(Handle<Worker>);

impl HeldWorker {
    /// Holds `worker` through `set`'s handle on it when it is in `set`, on its own otherwise.
    pub fn of(set: &LoopSet, worker: &Arc<Worker>) -> Self {
        match set.set.iter().position(|w| Arc::ptr_eq(w, worker)) {
            Some(i) => set.hold(i),
            None => Self::from(worker),
        }
    }

    pub fn arc(&self) -> &Arc<Worker> {
        &self.0
    }

    /// Like [`HeldWorker::acquire`], unless `cap` (0: none) requests are already in flight.
    pub fn try_acquire(self, cap: usize) -> Option<InflightGuard> {
        if cap > 0 {
            self.inflight
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    (n < cap).then_some(n + 1)
                })
                .ok()?;
        } else {
            self.inflight.fetch_add(1, Ordering::Relaxed);
        }
        self.inflight_gauge.inc();
        crate::peers::changed();
        Some(InflightGuard { worker: self })
    }

    /// Counts one request in flight on the worker until the guard drops.
    pub fn acquire(self) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.inflight_gauge.inc();
        crate::peers::changed();
        InflightGuard { worker: self }
    }
}

impl std::ops::Deref for HeldWorker {
    type Target = Worker;

    fn deref(&self) -> &Worker {
        &self.0
    }
}

/// A handle of its own (outside any event loop's), for a worker held outside a routed set.
impl From<&Arc<Worker>> for HeldWorker {
    fn from(w: &Arc<Worker>) -> Self {
        HeldWorker(Arc::new(Arc::clone(w)))
    }
}

/// A worker set as one event loop's requests hold it ([`crate::loop_copy`]), with that loop's
/// handle on each of its workers, held weakly as the set is: a request holds its worker alone,
/// so a worker taken out of the set is released when its own last request ends, however long
/// the requests to the others that were routed among the same set last.
pub struct LoopSet {
    set: Arc<WorkerSet>,
    each: Box<[parking_lot::Mutex<Weak<Arc<Worker>>>]>,
}

impl LoopSet {
    /// `self[i]`, through this loop's handle on it.
    pub fn hold(&self, i: usize) -> HeldWorker {
        let mut held = self.each[i].lock();
        if let Some(handle) = held.upgrade() {
            return HeldWorker(handle);
        }
        let handle = Arc::new(Arc::clone(&self.set[i]));
        *held = Arc::downgrade(&handle);
        HeldWorker(handle)
    }
}

impl From<Arc<WorkerSet>> for LoopSet {
    fn from(set: Arc<WorkerSet>) -> Self {
        let each = set.iter().map(|_| Default::default()).collect();
        Self { set, each }
    }
}

impl Local<WorkerSet> for LoopSet {
    fn shared(&self) -> &Arc<WorkerSet> {
        &self.set
    }
}

impl std::ops::Deref for LoopSet {
    type Target = [Arc<Worker>];

    fn deref(&self) -> &[Arc<Worker>] {
        &self.set
    }
}

/// Holds one in-flight slot on a worker; releasing happens exactly once, on drop.
#[derive(Debug)]
pub struct InflightGuard {
    worker: HeldWorker,
}

impl InflightGuard {
    pub fn worker(&self) -> &Arc<Worker> {
        self.worker.arc()
    }

    /// The worker, as the request holds it.
    pub fn held(&self) -> &HeldWorker {
        &self.worker
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.worker.inflight.fetch_sub(1, Ordering::Release);
        self.worker.inflight_gauge.dec();
        self.worker.freed.released(&self.worker.models);
        crate::peers::changed();
    }
}

/// The workers of `all` that serve `model`; 404 when a model is named and none of them serves it.
pub fn eligible<'a>(
    all: &'a [Arc<Worker>],
    model: Option<&str>,
) -> Result<Cow<'a, [Arc<Worker>]>, ApiError> {
    if all.iter().all(|w| w.serves(model)) {
        return Ok(Cow::Borrowed(all));
    }
    let some: Vec<_> = all.iter().filter(|w| w.serves(model)).cloned().collect();
    if some.is_empty() {
        return Err(ApiError::ModelNotFound(
            model.unwrap_or_default().to_owned(),
        ));
    }
    Ok(Cow::Owned(some))
}

#[cfg(test)]
pub(crate) fn test_workers(n: usize) -> Vec<Arc<Worker>> {
    let metrics = Metrics::new();
    (0..n)
        .map(|i| {
            Arc::new(
                Worker::new(
                    &WorkerConfig::from_url(format!("http://127.0.0.1:{}", 10000 + i)),
                    &metrics,
                )
                .unwrap(),
            )
        })
        .collect()
}

/// The config entries of workers at `urls`.
#[cfg(test)]
pub(crate) fn test_configs(urls: &[&str]) -> Vec<WorkerConfig> {
    urls.iter().map(|u| WorkerConfig::from_url(*u)).collect()
}

/// A pool of workers at `urls`, counted in `metrics`.
#[cfg(test)]
pub(crate) fn test_pool(urls: &[&str], metrics: &Metrics) -> Pool {
    Pool::from_config(&test_configs(urls), metrics, &Default::default()).expect("a valid pool")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loop_copy::LoopCopy;

    #[test]
    fn guard_releases_exactly_once() {
        let w = test_workers(1).remove(0);
        let g1 = w.acquire();
        let g2 = w.acquire();
        assert_eq!(w.inflight(), 2);
        drop(g1);
        assert_eq!(w.inflight(), 1);
        drop(g2);
        assert_eq!(w.inflight(), 0);
        assert_eq!(w.inflight_gauge.get(), 0);
    }

    #[test]
    fn a_request_holds_its_worker_through_its_loops_handle_and_that_worker_alone() {
        let pool = Pool::new(test_workers(2));
        let copy = LoopCopy::default();
        let set = pool.snapshot_in(&copy);
        let (first, second) = (Arc::downgrade(&set[0]), Arc::clone(&set[1]));
        let slots: Vec<_> = (0..3)
            .map(|_| HeldWorker::of(&set, &second).acquire())
            .collect();
        // The pool's set, the loop's handle and this test: three requests added one count.
        assert_eq!(Arc::strong_count(&second), 3);
        assert!(Arc::ptr_eq(&slots[0].held().0, &slots[2].held().0));
        assert_eq!(second.inflight(), 3);

        // Both workers leave the pool; the loop is done routing among the old set.
        pool.replace(test_workers(1));
        drop(set);
        assert!(
            first.upgrade().is_none(),
            "a departed worker goes though requests routed among its set still run"
        );
        let weak = Arc::downgrade(&second);
        drop(second);
        assert!(weak.upgrade().is_some(), "held by its requests' slots");
        assert_eq!(slots[2].worker().inflight(), 3);
        drop(slots);
        assert!(weak.upgrade().is_none(), "released with its last slot");

        // A worker outside the set is held on its own.
        let set = pool.snapshot_in(&copy);
        let outside = test_workers(1).remove(0);
        let slot = HeldWorker::of(&set, &outside).acquire();
        assert!(Arc::ptr_eq(slot.worker(), &outside));
        assert_eq!(Arc::strong_count(&outside), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn ejection_expires() {
        let w = test_workers(1).remove(0);
        w.eject_for(Duration::from_secs(5));
        assert!(!w.is_usable());
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(w.is_usable());
    }

    #[test]
    fn model_filter() {
        let metrics = Metrics::new();
        let mk = |url: &str, models: &[&str]| {
            Arc::new(
                Worker::new(
                    &WorkerConfig {
                        models: models.iter().map(|s| s.to_string()).collect(),
                        ..WorkerConfig::from_url(url)
                    },
                    &metrics,
                )
                .unwrap(),
            )
        };
        let all = vec![
            mk("http://a:1", &["llama"]),
            mk("http://b:1", &["qwen"]),
            mk("http://c:1", &[]),
        ];
        let names = |m| {
            eligible(&all, m)
                .unwrap()
                .iter()
                .map(|w| w.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(Some("qwen")), ["b:1", "c:1"]);
        assert_eq!(names(None).len(), 3);
        let only_named = vec![mk("http://a:1", &["llama"])];
        assert!(matches!(
            eligible(&only_named, Some("qwen")),
            Err(ApiError::ModelNotFound(_))
        ));
    }
}

#[cfg(test)]
mod series_tests {
    use super::*;

    #[test]
    fn a_departed_workers_series_go_when_its_last_request_ends() {
        let metrics = Metrics::new();
        let pool = test_pool(&["http://a:1", "http://b:1"], &metrics);
        for w in ["a:1", "b:1"] {
            metrics
                .requests
                .with_label_values(&["completions", "prefix", "prefix", w, "200"])
                .inc();
        }
        let in_flight = pool.snapshot()[1].acquire();
        pool.reconcile(&test_configs(&["http://a:1"]), &metrics)
            .unwrap();
        assert!(
            metrics.render().contains(r#"worker="b:1""#),
            "kept while a request runs"
        );
        drop(in_flight);
        let text = metrics.render();
        assert!(!text.contains(r#"worker="b:1""#), "{text}");
        assert!(text.contains(r#"worker="a:1""#));
    }

    #[test]
    fn each_arm_has_its_series_and_the_first_arms_are_read_through_the_worker() {
        use crate::metrics::SeriesRef;
        let w = test_workers(1).remove(0);
        let first = w.series("prefix", "a");
        let other = w.series("round_robin", "b");
        assert!(matches!(first, SeriesRef::First));
        let SeriesRef::Other(b) = &other else {
            panic!("a second arm's series is held by its own count");
        };
        assert_eq!(&*b.arm, "b");
        assert_eq!(&*w.series_at(&first).arm, "a");
        assert_eq!(w.series_at(&first).policy, "prefix");
        // The same arm again is the same series.
        assert!(matches!(w.series("prefix", "a"), SeriesRef::First));
        let SeriesRef::Other(again) = w.series("round_robin", "b") else {
            panic!("the second arm's series again");
        };
        assert!(Arc::ptr_eq(b, &again));
    }
}
