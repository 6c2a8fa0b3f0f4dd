//! The simulated worker's `/metrics`: vLLM's metric names and `engine`/`model_name` labels, plus the waste
//! counter vLLM lacks.
//!
//! Engine counters are mirrored into Prometheus counters after every step (by delta), gauges are
//! set from the engine's state, and finished requests feed the latency histograms. Latencies are
//! in modelled seconds: with `--time-scale 10` the histograms show what the modelled GPU would,
//! while clients see everything ten times sooner.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

use super::engine::{Counters, Timings};
use super::presets::EngineParams;

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for tokens per engine step.
const STEP_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0,
];

pub struct SimMetrics {
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    kv_usage: Gauge,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    preemptions: IntCounter,
    prompt_tokens: IntCounter,
    /// `local_compute`, `local_cache_hit`, `external_kv_transfer` (always 0 here).
    prompt_by_source: [IntCounter; 3],
    prompt_cached: IntCounter,
    generation_tokens: IntCounter,
    after_disconnect: IntCounter,
    aborted: IntCounter,
    queue_time: Histogram,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    step_tokens: Histogram,
}

impl SimMetrics {
    /// The series of data-parallel rank `rank`'s engine (`engine="<rank>"`), in `registry`,
    /// which the server's other ranks share: one exposition holds every engine's series, as
    /// vLLM's does. Rank 0 also registers the process's start time.
    pub fn of_rank(params: &EngineParams, rank: usize, registry: &Registry) -> Self {
        let registry = registry.clone();
        let engine = rank.to_string();
        let model = params.model.as_str();
        // vLLM (V1) labels every engine series with the engine index and the served model.
        let opts = |name: &str, help: &str| {
            Opts::new(name, help)
                .const_label("engine", engine.as_str())
                .const_label("model_name", model)
        };
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m.expect("static metric definition");
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric registered once");
                m
            }};
        }
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            let h = Histogram::with_opts(
                HistogramOpts::new(name, help)
                    .const_label("engine", engine.as_str())
                    .const_label("model_name", model)
                    .buckets(buckets.to_vec()),
            )
            .expect("static metric definition");
            registry
                .register(Box::new(h.clone()))
                .expect("metric registered once");
            h
        };
        let info = IntGauge::with_opts(
            Opts::new(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
            )
            .const_label("block_size", params.block_size.to_string())
            .const_label("num_gpu_blocks", params.num_gpu_blocks.to_string())
            .const_label("enable_prefix_caching", "True")
            .const_label("cache_dtype", "auto")
            .const_label("engine", engine.as_str()),
        )
        .expect("static metric definition");
        info.set(1);
        // vLLM with one API server shows its process's start time (prometheus_client's process
        // collector); a simulated worker's "process" starts with it, so a restarted one shows a
        // new time even in a process that hosts several.
        let started = Gauge::new(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
        )
        .expect("static metric definition");
        started.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        );
        // As vLLM: the cache's description once per engine, the process's start time once.
        registry
            .register(Box::new(info))
            .expect("metric registered once");
        if rank == 0 {
            registry
                .register(Box::new(started))
                .expect("metric registered once");
        }
        let by_source = reg!(IntCounterVec::new(
            opts(
                "vllm:prompt_tokens_by_source_total",
                "Number of prompt tokens by source."
            ),
            &["source"]
        ));
        let prompt_by_source = ["local_compute", "local_cache_hit", "external_kv_transfer"]
            .map(|source| by_source.with_label_values(&[source]));
        Self {
            prompt_by_source,
            prompt_cached: reg!(IntCounter::with_opts(opts(
                "vllm:prompt_tokens_cached_total",
                "Number of cached prompt tokens (local + external)."
            ))),
            running: reg!(IntGauge::with_opts(opts(
                "vllm:num_requests_running",
                "Number of requests in model execution batches."
            ))),
            waiting: reg!(IntGauge::with_opts(opts(
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed."
            ))),
            kv_usage: reg!(Gauge::with_opts(opts(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage."
            ))),
            prefix_queries: reg!(IntCounter::with_opts(opts(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens."
            ))),
            prefix_hits: reg!(IntCounter::with_opts(opts(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens."
            ))),
            preemptions: reg!(IntCounter::with_opts(opts(
                "vllm:num_preemptions_total",
                "Cumulative number of preemption from the engine."
            ))),
            prompt_tokens: reg!(IntCounter::with_opts(opts(
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed."
            ))),
            generation_tokens: reg!(IntCounter::with_opts(opts(
                "vllm:generation_tokens_total",
                "Number of generation tokens processed."
            ))),
            after_disconnect: reg!(IntCounter::with_opts(opts(
                "kvroute_sim_tokens_after_disconnect_total",
                "Tokens generated for requests whose client connection had already closed."
            ))),
            aborted: reg!(IntCounter::with_opts(opts(
                "kvroute_sim_aborted_requests_total",
                "Requests removed from the engine because their client disconnected."
            ))),
            queue_time: hist(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                REQUEST_BUCKETS,
            ),
            ttft: hist(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            itl: hist(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            ),
            e2e: hist(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                REQUEST_BUCKETS,
            ),
            step_tokens: hist(
                "vllm:iteration_tokens_total",
                "Tokens computed by each engine step, prefill and decode together.",
                STEP_TOKEN_BUCKETS,
            ),
            registry,
        }
    }

    /// Mirrors the engine's state after a step; `seen` is what was mirrored last time.
    pub fn update(
        &self,
        c: &Counters,
        seen: &mut Counters,
        running: usize,
        waiting: usize,
        kv_usage: f64,
    ) {
        self.running.set(running as i64);
        self.waiting.set(waiting as i64);
        self.kv_usage.set(kv_usage);
        let delta = |now: u64, before: u64| now.saturating_sub(before);
        self.prefix_queries
            .inc_by(delta(c.prefix_queries, seen.prefix_queries));
        self.prefix_hits
            .inc_by(delta(c.prefix_hits, seen.prefix_hits));
        self.preemptions
            .inc_by(delta(c.preemptions, seen.preemptions));
        self.prompt_tokens
            .inc_by(delta(c.prompt_tokens, seen.prompt_tokens));
        let [computed, cache_hit, _] = &self.prompt_by_source;
        computed.inc_by(delta(
            c.prompt_tokens - c.prompt_cached,
            seen.prompt_tokens - seen.prompt_cached,
        ));
        cache_hit.inc_by(delta(
            c.prompt_cached + c.prompt_recomputed,
            seen.prompt_cached + seen.prompt_recomputed,
        ));
        self.prompt_cached
            .inc_by(delta(c.prompt_cached, seen.prompt_cached));
        self.generation_tokens
            .inc_by(delta(c.generation_tokens, seen.generation_tokens));
        self.after_disconnect.inc_by(delta(
            c.generated_after_disconnect,
            seen.generated_after_disconnect,
        ));
        self.aborted.inc_by(delta(c.aborted, seen.aborted));
        *seen = c.clone();
    }

    pub fn observe_finished(&self, t: &Timings) {
        self.queue_time.observe(t.queue);
        self.ttft.observe(t.ttft);
        self.e2e.observe(t.e2e);
    }

    /// One engine step that computed `tokens` (none for a step with nothing scheduled). How
    /// many requests a worker prefills together shows here: a step's size is its prefill plus
    /// one token per request decoding.
    pub fn observe_step(&self, tokens: usize) {
        if tokens > 0 {
            self.step_tokens.observe(tokens as f64);
        }
    }

    pub fn observe_inter_token(&self, seconds: &[f64]) {
        for s in seconds {
            self.itl.observe(*s);
        }
    }

    /// Waiting and running requests and KV usage, as the engine last reported them (what vLLM's
    /// data-parallel coordinator collects from each engine).
    pub fn load(&self) -> (f64, f64, f64) {
        (
            self.waiting.get() as f64,
            self.running.get() as f64,
            self.kv_usage.get(),
        )
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding our own registry into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
