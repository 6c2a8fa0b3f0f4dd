//! Every gateway metric, in one registry, rendered in the Prometheus text format on `/metrics`.
//!
//! Label values come from bounded sets: routes are the matched route names, workers are the
//! configured pool, policies and outcomes are enums, status is the HTTP status code.

mod series;
pub mod sharded;

pub use series::{SeriesByArm, SeriesRef, WorkerSeries};

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Latency buckets from 1 ms to 5 min: TTFT of a warm prefix is milliseconds, a cold long prompt seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// Every metric; a clone (each worker holds one) is one reference count, not one per family.
#[derive(Clone)]
pub struct Metrics(std::sync::Arc<MetricSet>);

impl std::ops::Deref for Metrics {
    type Target = MetricSet;
    fn deref(&self) -> &MetricSet {
        &self.0
    }
}

pub struct MetricSet {
    registry: Registry,
    /// Live `Worker` objects per worker name: a name's series are removed when its count drops
    /// to zero (the worker left the pool and its last request ended), so churn does not grow
    /// `/metrics` without bound.
    worker_names: std::sync::Arc<parking_lot::Mutex<std::collections::HashMap<String, usize>>>,
    /// `route`, `policy`, `arm`, `worker` ("none" when no worker was picked), `status`.
    pub requests: sharded::CounterVec,
    /// `policy`, `arm`, `outcome` (preferred, spilled, least_conn_fallback, longest_match,
    /// hash_home, replicated, fallback).
    pub routing_decisions: sharded::CounterVec,
    /// `worker`.
    pub worker_inflight: sharded::GaugeVec,
    /// `worker`: 1 when the worker takes new requests (not down, draining or ejected).
    pub worker_healthy: IntGaugeVec,
    /// `worker`, `result` (ok, fail).
    pub health_checks: IntCounterVec,
    /// `source` (static, dns, kubernetes, reload), `result` (applied, rejected, error).
    pub discovery_updates: IntCounterVec,
    /// Workers in the current set.
    pub workers: prometheus::IntGauge,
    /// `result` (applied, rejected): config reloads.
    pub config_reloads: IntCounterVec,
    /// `policy`, `arm`, `worker`: from receiving the request to the worker's response headers.
    pub ttfb: sharded::HistogramVec,
    /// `policy`, `arm`, `worker`: from receiving the request to the end of the response body.
    pub duration: sharded::HistogramVec,
    /// `worker`, `kind` (connect, timeout, idle_timeout, body).
    pub upstream_errors: IntCounterVec,
    /// `phase` (waiting: before the worker's headers; streaming: during the body).
    pub client_disconnects: IntCounterVec,
    /// `worker`: upstream requests the gateway dropped because its client went away.
    pub upstream_aborts: IntCounterVec,
    /// `policy`, `arm`, `worker`: prompt tokens a cache-modelling policy expected the worker to
    /// hold, over the answers that reported `cached_tokens`.
    pub predicted_cached_tokens: sharded::CounterVec,
    /// `policy`, `arm`, `worker`: the `cached_tokens` those answers reported.
    pub reported_cached_tokens: sharded::CounterVec,
    /// `policy`, `arm`, `result` (close, over, under): each prediction against the report.
    pub cache_predictions: sharded::CounterVec,
    /// `policy`, `arm`: blocks held by the policy's prefix index.
    pub index_blocks: IntGaugeVec,
    /// `policy`, `arm`: bytes the prefix index has allocated.
    pub index_bytes: IntGaugeVec,
    /// `policy`, `arm`: blocks the prefix index dropped to stay within its cap.
    pub index_evictions: IntCounterVec,
    /// `policy`, `arm`: the moving share of recent prompts that began with something the policy
    /// knew, which `new_prompt_by_reuse` gates the home's credit on.
    pub reuse_share: GaugeVec,
    /// `policy`, `arm`: the moving share of recent requests past a prefix most workers hold that
    /// continued something private beyond it, which `fade_by_continuation` scales the fade by.
    pub continuing_share: GaugeVec,
    /// `policy`, `arm`: the moving share of prompts of which nothing was known that the worker
    /// reported holding in part, which `reuse_from_usage` bounds other replicas' credit by.
    pub unseen_reuse_share: GaugeVec,
    /// `worker`, `part` (base, per_prefill_token): the worker's engine step as timed from the
    /// bursts of this gateway's streams ([`crate::load::StepClock`]).
    pub step_seconds: GaugeVec,
    /// `worker`: its time per prefill token over the pool's median, as `price_by_speed` prices it
    /// ([`crate::load::StepClock::slowness`]).
    pub worker_slowness: GaugeVec,
    /// `worker`: uncached prompt tokens this gateway sent it that it has not started answering
    /// (set at scrape time): its prefill backlog as this replica made it.
    pub pending_prefill: GaugeVec,
    /// `worker`: of those, what its step clock counts as prefilled by the step under way (set at
    /// scrape time), which `cache_aware` with `step_prefill` takes off the backlog it prices.
    pub step_prefill_done: GaugeVec,
    /// `worker`: KV event batches applied (live and replayed).
    pub kv_event_batches: IntCounterVec,
    /// `worker`, `result` (replayed, dropped): sequence gaps in a worker's KV events.
    pub kv_event_gaps: IntCounterVec,
    /// `worker`: the worker's event sequence started over (it restarted).
    pub kv_event_restarts: IntCounterVec,
    /// `worker`: restarts the load polls saw (its counters started over).
    pub worker_restarts: IntCounterVec,
    /// `worker`: undecodable KV event messages.
    pub kv_event_errors: IntCounterVec,
    /// `worker`: blocks the worker holds, as its KV events say.
    pub kv_event_blocks: IntGaugeVec,
    /// `worker`: KV events of a hybrid model's cache groups other than the one followed.
    pub kv_event_other_groups: IntCounterVec,
    /// Requests tokenized for routing on KV events, by how, each series resolved once.
    pub tokenized: Tokenized,
    /// Encodings of a head's leftover new text skipped because enough were under way.
    pub tokenize_fills_skipped: IntCounter,
    /// `reason` (queue_full, wait_timeout, client_quota): requests refused for lack of room.
    pub shed: IntCounterVec,
    /// `result` (admitted, timed_out): how long requests waited in the admission queue.
    pub queue_wait: HistogramVec,
    /// Requests waiting in the admission queue (set at scrape time).
    pub queue_depth: prometheus::IntGauge,
    /// `client`: requests refused with 401 have no client; this counts accepted keys' requests.
    pub client_requests: IntCounterVec,
    /// `how` (remembered, found, unknown): requests for a stored response, by how its worker was
    /// known.
    pub responses_followed: IntCounterVec,
    /// Stored responses whose worker is remembered (set at scrape time).
    pub responses_remembered: prometheus::IntGauge,
    /// Peer replicas heard from within `peers.expire_seconds`.
    pub peers: prometheus::IntGauge,
    /// `worker`, `what` (requests, pending_prefill_tokens): what peer replicas said they have
    /// on the worker (set at scrape time, with peers configured).
    pub peer_load: GaugeVec,
    /// `kind` (sent, received, rejected): datagrams exchanged with peer replicas.
    pub peer_datagrams: IntCounterVec,
}

/// `kvroute_tokenized_requests_total`'s series (`how`).
pub struct Tokenized {
    pub whole: IntCounter,
    pub head: IntCounter,
    pub untokenized: IntCounter,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)
                .expect("static metric definition");
            registry
                .register(Box::new(c.clone()))
                .expect("metric registered once");
            c
        };
        // The series every proxied request updates, in per-loop shards (see [`sharded`]).
        let per_request = |c: Box<dyn prometheus::core::Collector>| {
            registry.register(c).expect("metric registered once");
        };
        let sharded_counter = |name: &str, help: &str, labels: &[&str]| {
            let c = sharded::CounterVec::counters(name, help, labels);
            per_request(Box::new(c.clone()));
            c
        };
        let histogram = |name: &str, help: &str| {
            let h = sharded::HistogramVec::histograms(
                name,
                help,
                &["policy", "arm", "worker"],
                LATENCY_BUCKETS,
            );
            per_request(Box::new(h.clone()));
            h
        };
        let worker_inflight = sharded::GaugeVec::gauges(
            "kvroute_worker_inflight",
            "Requests in flight to a worker through this gateway.",
            &["worker"],
        );
        per_request(Box::new(worker_inflight.clone()));
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g =
                IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition");
            registry
                .register(Box::new(g.clone()))
                .expect("metric registered once");
            g
        };
        let float_gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = GaugeVec::new(Opts::new(name, help), labels).expect("static metric definition");
            registry
                .register(Box::new(g.clone()))
                .expect("metric registered once");
            g
        };
        let workers = prometheus::IntGauge::new("kvroute_workers", "Workers in the current set.")
            .expect("static metric definition");
        registry
            .register(Box::new(workers.clone()))
            .expect("metric registered once");
        let queue_wait = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_queue_wait_seconds",
                "Time requests spent in the admission queue, by result (admitted, timed_out).",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["result"],
        )
        .expect("static metric definition");
        registry
            .register(Box::new(queue_wait.clone()))
            .expect("metric registered once");
        let queue_depth = prometheus::IntGauge::new(
            "kvroute_queue_depth",
            "Requests waiting for an in-flight slot (the signal to scale the pool on).",
        )
        .expect("static metric definition");
        registry
            .register(Box::new(queue_depth.clone()))
            .expect("metric registered once");
        let responses_remembered = prometheus::IntGauge::new(
            "kvroute_responses_remembered",
            "Stored Responses API responses whose worker this gateway remembers.",
        )
        .expect("static metric definition");
        registry
            .register(Box::new(responses_remembered.clone()))
            .expect("metric registered once");
        let peers = prometheus::IntGauge::new(
            "kvroute_peers",
            "Peer replicas heard from within peers.expire_seconds: the replicas whose requests in flight on each worker this gateway prices as its own.",
        )
        .expect("static metric definition");
        registry
            .register(Box::new(peers.clone()))
            .expect("metric registered once");
        Self(std::sync::Arc::new(MetricSet {
            peers,
            peer_load: float_gauge(
                "kvroute_worker_peer_load",
                "What peer replicas last said they have on a worker, summed over them: requests in flight (what=requests) and prompt tokens not yet answered (what=pending_prefill_tokens). Priced as this gateway's own by cache_aware. Shown with peers configured.",
                &["worker", "what"],
            ),
            peer_datagrams: counter(
                "kvroute_peer_datagrams_total",
                "Datagrams of load exchanged with peer replicas, by kind: sent (one per peer address), received, rejected (not a peer datagram, or stale).",
                &["kind"],
            ),
            responses_followed: counter(
                "kvroute_responses_followed_total",
                "Requests for a stored Responses API response (previous_response_id, /v1/responses/{id}), by how its worker was known: remembered, found (asked of every worker), unknown (no worker had it; sent to the least-loaded worker).",
                &["how"],
            ),
            responses_remembered,
            shed: counter(
                "kvroute_shed_total",
                "Requests refused for lack of room, by reason (queue_full, wait_timeout: 503; client_quota: 429).",
                &["reason"],
            ),
            queue_wait,
            queue_depth,
            client_requests: counter(
                "kvroute_client_requests_total",
                "Requests that presented a valid client key, by the key's name.",
                &["client"],
            ),
            worker_healthy: gauge(
                "kvroute_worker_healthy",
                "1 when the worker takes new requests (not down, draining or ejected), else 0.",
                &["worker"],
            ),
            health_checks: counter(
                "kvroute_health_checks_total",
                "Active health checks, by worker and result (ok, fail).",
                &["worker", "result"],
            ),
            discovery_updates: counter(
                "kvroute_discovery_updates_total",
                "Worker-set updates, by source (static, dns, kubernetes, reload, data_parallel) and result.",
                &["source", "result"],
            ),
            workers,
            config_reloads: counter(
                "kvroute_config_reloads_total",
                "Config reloads, by result (applied, rejected).",
                &["result"],
            ),
            requests: sharded_counter(
                "kvroute_requests_total",
                "Requests answered, by route, policy, A/B arm, worker and HTTP status.",
                &["route", "policy", "arm", "worker", "status"],
            ),
            routing_decisions: sharded_counter(
                "kvroute_routing_decisions_total",
                "Routing decisions, by policy, A/B arm and outcome (preferred, spilled, least_conn_fallback, longest_match, hash_home, replicated, fallback).",
                &["policy", "arm", "outcome"],
            ),
            worker_inflight,
            ttfb: histogram(
                "kvroute_time_to_first_byte_seconds",
                "From the request's arrival to the worker's response headers.",
            ),
            duration: histogram(
                "kvroute_request_duration_seconds",
                "From the request's arrival to the end of the response body.",
            ),
            upstream_errors: counter(
                "kvroute_upstream_errors_total",
                "Failed upstream requests, by worker and kind (connect, timeout, idle_timeout, body).",
                &["worker", "kind"],
            ),
            client_disconnects: counter(
                "kvroute_client_disconnects_total",
                "Clients that went away before their response ended, by phase (waiting, streaming).",
                &["phase"],
            ),
            upstream_aborts: counter(
                "kvroute_upstream_aborts_total",
                "Upstream requests dropped by the gateway because their client went away.",
                &["worker"],
            ),
            predicted_cached_tokens: sharded_counter(
                "kvroute_predicted_cached_tokens_total",
                "Prompt tokens the policy expected the worker to have cached, over answers that reported cached_tokens.",
                &["policy", "arm", "worker"],
            ),
            reported_cached_tokens: sharded_counter(
                "kvroute_reported_cached_tokens_total",
                "Cached prompt tokens the workers reported (usage.prompt_tokens_details.cached_tokens) for those answers.",
                &["policy", "arm", "worker"],
            ),
            cache_predictions: sharded_counter(
                "kvroute_cache_predictions_total",
                "Cache predictions against the worker's report: close (within a tenth of the prompt), over, under.",
                &["policy", "arm", "result"],
            ),
            index_blocks: gauge(
                "kvroute_index_blocks",
                "Blocks held by the policy's prefix index.",
                &["policy", "arm"],
            ),
            index_bytes: gauge(
                "kvroute_index_bytes",
                "Bytes allocated by the policy's prefix index (kept under its index_max_bytes).",
                &["policy", "arm"],
            ),
            index_evictions: counter(
                "kvroute_index_evictions_total",
                "Blocks the prefix index dropped to stay within its memory cap.",
                &["policy", "arm"],
            ),
            reuse_share: float_gauge(
                "kvroute_routing_reuse_share",
                "Moving share (about the last 64 requests) of prompts that began with a prefix some worker was known to hold; below 0.5, the home's credit for prompts of which nothing is known fades with it (new_prompt_by_reuse).",
                &["policy", "arm"],
            ),
            continuing_share: float_gauge(
                "kvroute_routing_continuing_share",
                "Moving share (about the last 64) of requests past a prefix most workers hold that continued something private beyond it (a conversation's next turn); with other replicas, the fade of hot_pending_weight back to the home scales with min(1, 2 x share) (fade_by_continuation).",
                &["policy", "arm"],
            ),
            unseen_reuse_share: float_gauge(
                "kvroute_routing_unseen_reuse_share",
                "Moving share (about the last 64) of prompts of which nothing was known that the worker they went to reported having cached at least a routing block of; with other replicas, the home's credit for such prompts comes back by no more than min(1, 2 x share) (reuse_from_usage).",
                &["policy", "arm"],
            ),
            step_seconds: float_gauge(
                "kvroute_worker_step_seconds",
                "A worker's engine step as timed from the bursts of the gateway's streams from it: base (a step with no prefill) and per_prefill_token; shown once fitted.",
                &["worker", "part"],
            ),
            worker_slowness: float_gauge(
                "kvroute_worker_slowness",
                "A worker's fitted time per prefill token over the median of the pool's fitted workers (a GPU three times as fast as the median shows 0.33); 1 while it has no fit over a full window of steps, or within 1.25x of the median. Beside other replicas' requests (more than a quarter of the pool's), the fit is of its steps against the prefill its own counters show (vllm:prompt_tokens_by_source_total{source=\"local_compute\"}, or vllm:prompt_tokens_total less vllm:prefix_cache_hits_total). cache_aware prices each worker in its own time by it (price_by_speed).",
                &["worker"],
            ),
            pending_prefill: float_gauge(
                "kvroute_worker_pending_prefill_tokens",
                "Prompt tokens, less those predicted cached, of this gateway's requests to a worker that have not had their first token: the worker's prefill backlog as this replica sent it. Counted for requests routed by cache_aware (the policy that prices it); 0 under other policies.",
                &["worker"],
            ),
            step_prefill_done: float_gauge(
                "kvroute_worker_step_prefill_done_tokens",
                "Of kvroute_worker_pending_prefill_tokens, what the worker's step clock counts as prefilled by the step under way (its fitted time per prefill token since the step's base time): the part cache_aware with step_prefill takes off the backlog it prices. 0 while the step is not fitted.",
                &["worker"],
            ),
            kv_event_batches: counter(
                "kvroute_kv_event_batches_total",
                "KV cache event batches applied from a worker's publisher (live and replayed).",
                &["worker"],
            ),
            kv_event_gaps: counter(
                "kvroute_kv_event_gaps_total",
                "Gaps in a worker's KV event sequence, by result (replayed: filled from its replay socket; dropped: its blocks were dropped and rebuilt).",
                &["worker", "result"],
            ),
            kv_event_restarts: counter(
                "kvroute_kv_event_restarts_total",
                "Times a worker's KV event sequence started over (the worker restarted; its blocks were cleared).",
                &["worker"],
            ),
            worker_restarts: counter(
                "kvroute_worker_restarts_total",
                "Times a worker's polled metrics showed it had restarted (its process start time changed or its prompt token counter fell): its KV cache is empty, and what it was sent before no longer counts as cached.",
                &["worker"],
            ),
            kv_event_errors: counter(
                "kvroute_kv_event_errors_total",
                "KV event messages from a worker that could not be decoded, and events in them that could not be read (such an event is skipped, the rest of its message applied).",
                &["worker"],
            ),
            kv_event_blocks: gauge(
                "kvroute_kv_event_blocks",
                "Blocks a worker holds in its KV cache, as its events say.",
                &["worker"],
            ),
            kv_event_other_groups: counter(
                "kvroute_kv_event_other_group_events_total",
                "KV events of a worker's cache groups other than the full-attention one followed (a hybrid model's sliding-window or Mamba groups publish the same block hashes), left out.",
                &["worker"],
            ),
            tokenized: {
                let by_how = counter(
                    "kvroute_tokenized_requests_total",
                    "Requests tokenized to route on KV events, by how: whole (every token id), head (only as far as any worker's events reach, the rest estimated), untokenized (the tokenizer could not take it).",
                    &["how"],
                );
                Tokenized {
                    whole: by_how.with_label_values(&["whole"]),
                    head: by_how.with_label_values(&["head"]),
                    untokenized: by_how.with_label_values(&["untokenized"]),
                }
            },
            tokenize_fills_skipped: {
                let c = IntCounter::new(
                    "kvroute_tokenize_fills_skipped_total",
                    "Chat text left by a head that was not encoded for the piece cache, because enough such encodings were under way.",
                )
                .expect("static metric definition");
                registry
                    .register(Box::new(c.clone()))
                    .expect("metric registered once");
                c
            },
            registry,
            worker_names: Default::default(),
        }))
    }

    /// A `Worker` named `name` was made.
    pub fn worker_born(&self, name: &str) {
        let mut names = self.worker_names.lock();
        *names.entry(name.to_owned()).or_default() += 1;
    }

    /// A `Worker` named `name` was dropped; the last one takes the name's series with it.
    pub fn worker_gone(&self, name: &str) {
        let mut names = self.worker_names.lock();
        let Some(n) = names.get_mut(name) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        names.remove(name);
        drop(names);
        let by_worker = std::collections::HashMap::from([("worker", name)]);
        self.requests.remove_matching(&by_worker);
        forget(&self.health_checks, &by_worker);
        forget(&self.upstream_errors, &by_worker);
        forget(&self.upstream_aborts, &by_worker);
        self.predicted_cached_tokens.remove_matching(&by_worker);
        self.reported_cached_tokens.remove_matching(&by_worker);
        self.ttfb.remove_matching(&by_worker);
        self.duration.remove_matching(&by_worker);
        forget(&self.kv_event_gaps, &by_worker);
        forget(&self.step_seconds, &by_worker);
        self.worker_slowness.remove_label_values(&[name]).ok();
        self.pending_prefill.remove_label_values(&[name]).ok();
        forget(&self.peer_load, &by_worker);
        self.step_prefill_done.remove_label_values(&[name]).ok();
        self.worker_inflight.remove_label_values(&[name]);
        self.worker_healthy.remove_label_values(&[name]).ok();
        self.kv_event_batches.remove_label_values(&[name]).ok();
        self.kv_event_restarts.remove_label_values(&[name]).ok();
        self.worker_restarts.remove_label_values(&[name]).ok();
        self.kv_event_errors.remove_label_values(&[name]).ok();
        self.kv_event_blocks.remove_label_values(&[name]).ok();
        self.kv_event_other_groups.remove_label_values(&[name]).ok();
    }

    /// Publishes a worker's KV event feed (called at scrape time).
    pub fn publish_feed(&self, worker: &str, feed: &crate::kv_events::Feed) {
        use std::sync::atomic::Ordering::Relaxed;
        let up = |c: prometheus::IntCounter, now: u64| c.inc_by(now.saturating_sub(c.get()));
        let s = &feed.stats;
        up(
            self.kv_event_batches.with_label_values(&[worker]),
            s.batches.load(Relaxed),
        );
        up(
            self.kv_event_gaps.with_label_values(&[worker, "replayed"]),
            s.replays_ok.load(Relaxed),
        );
        up(
            self.kv_event_gaps.with_label_values(&[worker, "dropped"]),
            s.replays_failed.load(Relaxed),
        );
        up(
            self.kv_event_restarts.with_label_values(&[worker]),
            s.restarts.load(Relaxed),
        );
        up(
            self.kv_event_errors.with_label_values(&[worker]),
            s.decode_errors.load(Relaxed) + s.malformed_events.load(Relaxed),
        );
        let (held, other_groups) = {
            let blocks = feed.blocks();
            (blocks.len(), blocks.other_groups)
        };
        self.kv_event_blocks
            .with_label_values(&[worker])
            .set(held as i64);
        up(
            self.kv_event_other_groups.with_label_values(&[worker]),
            other_groups,
        );
    }

    /// Publishes a worker's fitted step (called at scrape time): microseconds in, seconds out,
    /// and its slowness beside the pool's median. A fit that is no longer known (its steps
    /// stopped varying) is taken down, not left stale.
    pub fn publish_steps(&self, worker: &str, fit: Option<(f64, f64)>, slowness: f64) {
        self.worker_slowness
            .with_label_values(&[worker])
            .set(slowness);
        for (part, us) in [
            ("base", fit.map(|f| f.0)),
            ("per_prefill_token", fit.map(|f| f.1)),
        ] {
            match us {
                Some(us) => self
                    .step_seconds
                    .with_label_values(&[worker, part])
                    .set(us / 1e6),
                None => {
                    self.step_seconds.remove_label_values(&[worker, part]).ok();
                }
            }
        }
    }

    /// Publishes a worker's prefill backlog as this gateway sent it, and what the step under way
    /// is counted to have done of it (called at scrape time).
    pub fn publish_prefill(&self, worker: &str, pending: u64, done: f64) {
        self.pending_prefill
            .with_label_values(&[worker])
            .set(pending as f64);
        self.step_prefill_done
            .with_label_values(&[worker])
            .set(done);
    }

    /// Publishes what peer replicas said they have on a worker (called at scrape time).
    pub fn publish_peer_load(&self, worker: &str, requests: u32, pending: u64) {
        self.peer_load
            .with_label_values(&[worker, "requests"])
            .set(f64::from(requests));
        self.peer_load
            .with_label_values(&[worker, "pending_prefill_tokens"])
            .set(pending as f64);
    }

    /// Publishes a prefix index's figures (called at scrape time).
    pub fn publish_index(&self, policy: &str, arm: &str, stats: crate::index::IndexStats) {
        let labels = [policy, arm];
        self.index_blocks
            .with_label_values(&labels)
            .set(stats.blocks as i64);
        self.index_bytes
            .with_label_values(&labels)
            .set(stats.bytes as i64);
        let evictions = self.index_evictions.with_label_values(&labels);
        evictions.inc_by(stats.evictions.saturating_sub(evictions.get()));
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding into a Vec cannot fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// Removes every series of `vec` whose labels include all of `labels`.
fn forget<T: prometheus::core::MetricVecBuilder>(
    vec: &prometheus::core::MetricVec<T>,
    labels: &std::collections::HashMap<&str, &str>,
) {
    use prometheus::core::Collector;
    for family in vec.collect() {
        for m in family.get_metric() {
            let pairs: std::collections::HashMap<&str, &str> = m
                .get_label()
                .iter()
                .map(|p| (p.name(), p.value()))
                .collect();
            if labels.iter().all(|(k, v)| pairs.get(k) == Some(v)) {
                vec.remove(&pairs).ok();
            }
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
