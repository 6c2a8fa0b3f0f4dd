//! What the benchmark reads from and does to the workers: their vLLM counters (in total and
//! worker by worker), a kvroute target's routing outcomes, the pool's KV capacity, and emptying
//! their prefix caches between arms.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde_json::Value;

use super::loadgen::{client, HttpClient};

/// Engine counters summed over workers, read from their Prometheus `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WorkerCounters {
    /// Requests the worker finished (`vllm:e2e_request_latency_seconds_count`).
    pub requests: f64,
    pub prefix_queries: f64,
    pub prefix_hits: f64,
    pub preemptions: f64,
    pub generation_tokens: f64,
    pub tokens_after_disconnect: f64,
    /// The worker's own time to first token, summed over the requests it finished, and their
    /// count (`vllm:time_to_first_token_seconds_sum` / `_count`): which worker a tail comes from.
    pub ttft_seconds: f64,
    pub ttft_count: f64,
}

impl WorkerCounters {
    pub fn since(&self, before: &Self) -> Self {
        Self {
            requests: self.requests - before.requests,
            prefix_queries: self.prefix_queries - before.prefix_queries,
            prefix_hits: self.prefix_hits - before.prefix_hits,
            preemptions: self.preemptions - before.preemptions,
            generation_tokens: self.generation_tokens - before.generation_tokens,
            tokens_after_disconnect: self.tokens_after_disconnect - before.tokens_after_disconnect,
            ttft_seconds: self.ttft_seconds - before.ttft_seconds,
            ttft_count: self.ttft_count - before.ttft_count,
        }
    }

    /// The worker's mean time to first token in seconds, `None` before any.
    pub fn mean_ttft(&self) -> Option<f64> {
        (self.ttft_count > 0.0).then(|| self.ttft_seconds / self.ttft_count)
    }

    pub fn hit_rate(&self) -> f64 {
        if self.prefix_queries > 0.0 {
            self.prefix_hits / self.prefix_queries
        } else {
            0.0
        }
    }

    /// Sums the named series of a Prometheus text exposition (any labels).
    pub fn add_exposition(&mut self, text: &str) {
        self.add_engine_exposition(text, None);
    }

    /// [`Self::add_exposition`] of one data-parallel engine's series (vLLM's `engine` label is
    /// its rank), with those of no engine counted for rank 0 (so the engines add up to the
    /// server); every engine's with `None`.
    pub fn add_engine_exposition(&mut self, text: &str, engine: Option<u32>) {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            let other_engine = engine.is_some_and(|rank| match crate::load::engine_of(line) {
                Some(e) => e != Some(rank),
                None => rank != 0,
            });
            if other_engine {
                continue;
            }
            let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
                continue;
            };
            match name {
                "vllm:e2e_request_latency_seconds_count" => self.requests += v,
                "vllm:prefix_cache_queries_total" => self.prefix_queries += v,
                "vllm:prefix_cache_hits_total" => self.prefix_hits += v,
                "vllm:num_preemptions_total" => self.preemptions += v,
                "vllm:generation_tokens_total" => self.generation_tokens += v,
                "kvroute_sim_tokens_after_disconnect_total" => self.tokens_after_disconnect += v,
                "vllm:time_to_first_token_seconds_sum" => self.ttft_seconds += v,
                "vllm:time_to_first_token_seconds_count" => self.ttft_count += v,
                _ => {}
            }
        }
    }

    fn add(&mut self, o: &Self) {
        self.requests += o.requests;
        self.prefix_queries += o.prefix_queries;
        self.prefix_hits += o.prefix_hits;
        self.preemptions += o.preemptions;
        self.generation_tokens += o.generation_tokens;
        self.tokens_after_disconnect += o.tokens_after_disconnect;
        self.ttft_seconds += o.ttft_seconds;
        self.ttft_count += o.ttft_count;
    }

    /// The sum over workers.
    pub fn total(each: &[Self]) -> Self {
        let mut t = Self::default();
        for c in each {
            t.add(c);
        }
        t
    }
}

/// `GET {base}/metrics` as text; `None` (with a warning) when unreachable.
async fn metrics_text(client: &HttpClient, base: &str) -> Option<String> {
    match metrics_body(client, base).await {
        Ok(text) => text,
        Err(e) => {
            tracing::warn!(target_url = %base, "cannot scrape metrics: {e}");
            None
        }
    }
}

/// [`metrics_text`] without the warning, for a sampler that would repeat it every tick.
async fn metrics_body(
    client: &HttpClient,
    base: &str,
) -> Result<Option<String>, hyper_util::client::legacy::Error> {
    let Ok(uri) = format!("{}/metrics", base.trim_end_matches('/')).parse::<http::Uri>() else {
        return Ok(None);
    };
    let resp = client.get(uri).await?;
    Ok(match resp.into_body().collect().await {
        Ok(b) => Some(String::from_utf8_lossy(&b.to_bytes()).into_owned()),
        Err(_) => None,
    })
}

/// The engines each worker's series are read for: every rank of `engines`, or the whole server.
fn ranks(engines: Option<u32>) -> Vec<Option<u32>> {
    match engines {
        Some(n) => (0..n).map(Some).collect(),
        None => vec![None],
    }
}

/// Reads every worker's `/metrics` (base URLs), one entry per worker (zero when unreachable);
/// with `engines`, one entry per data-parallel engine of each, in worker then rank order.
pub async fn scrape_each(workers: &[String], engines: Option<u32>) -> Vec<WorkerCounters> {
    let client = client();
    let ranks = ranks(engines);
    let mut out = Vec::with_capacity(workers.len() * ranks.len());
    for w in workers {
        let text = metrics_text(&client, w).await;
        for &rank in &ranks {
            let mut c = WorkerCounters::default();
            if let Some(text) = &text {
                c.add_engine_exposition(text, rank);
            }
            out.push(c);
        }
    }
    out
}

/// A worker's load gauges sampled through a run's window: how full its KV cache and its queue got.
/// A tail that comes from one worker reads here as whether that worker ran out of KV cache
/// (usage at 100%, requests waiting for blocks) or only had a long queue with room to spare.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WorkerGauges {
    /// Samples taken; 0 when the worker's metrics were not read during the window.
    pub samples: u32,
    /// `vllm:kv_cache_usage_perc` (`gpu_cache_usage_perc` before vLLM 0.10), in [0, 1]: the
    /// sum over the samples and the highest.
    pub kv_usage_sum: f64,
    pub kv_usage_peak: f64,
    /// The most requests `vllm:num_requests_waiting` showed at once.
    pub waiting_peak: f64,
    /// Samples of a kvroute target's view of the worker (its replicas summed); 0 for a target
    /// that is not kvroute. Under a policy that does not price prefill the backlog reads 0.
    pub gateway_samples: u32,
    /// `kvroute_worker_pending_prefill_tokens`: the sum over those samples and the highest.
    pub pending_prefill_sum: f64,
    pub pending_prefill_peak: f64,
    /// `kvroute_worker_step_prefill_done_tokens`, summed over the samples: what the step clock
    /// counted done of that backlog.
    pub step_done_sum: f64,
    /// The step clock's fitted time per prefill token, in microseconds
    /// (`kvroute_worker_step_seconds{part="per_prefill_token"}`), each sample of each replica
    /// that had one: how steady the clock that `step_prefill` trusts stayed.
    pub step_per_token_us: Vec<f64>,
}

impl WorkerGauges {
    fn add(&mut self, p: &crate::load::Polled) {
        self.samples += 1;
        self.kv_usage_sum += p.kv_usage;
        self.kv_usage_peak = self.kv_usage_peak.max(p.kv_usage);
        self.waiting_peak = self.waiting_peak.max(p.waiting);
    }

    /// The mean KV cache usage over the samples, `None` without any.
    pub fn kv_usage_mean(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.kv_usage_sum / f64::from(self.samples))
    }

    /// The gateway's mean pending prefill for the worker and the mean the step clock counted
    /// done of it, in tokens; `None` without a sample with some backlog.
    pub fn pending_prefill_mean(&self) -> Option<(f64, f64)> {
        let n = f64::from(self.gateway_samples);
        (self.gateway_samples > 0 && self.pending_prefill_peak > 0.0)
            .then(|| (self.pending_prefill_sum / n, self.step_done_sum / n))
    }

    /// The median and the lowest of the sampled fitted times per prefill token, in
    /// microseconds; `None` without a sample.
    pub fn step_per_token_spread(&self) -> Option<(f64, f64)> {
        let mut v = self.step_per_token_us.clone();
        v.sort_by(f64::total_cmp);
        Some((v.get(v.len() / 2).copied()?, v[0]))
    }
}

/// A kvroute target's view of one worker at one sample, its replicas' added up.
#[derive(Debug, Default, PartialEq)]
struct GatewayView {
    /// Its prefill backlog (`kvroute_worker_pending_prefill_tokens`) and what the step clock
    /// counted done of it (`kvroute_worker_step_prefill_done_tokens`), summed over replicas.
    pending: f64,
    done: f64,
    /// Each replica's fitted time per prefill token, in microseconds.
    per_token_us: Vec<f64>,
}

/// A kvroute target's per-worker view in one exposition, by worker name.
fn gateway_view(text: &str, out: &mut std::collections::HashMap<String, GatewayView>) {
    const PENDING: &str = "kvroute_worker_pending_prefill_tokens{";
    const DONE: &str = "kvroute_worker_step_prefill_done_tokens{";
    const STEP: &str = "kvroute_worker_step_seconds{";
    for line in text.lines() {
        let series = [PENDING, DONE, STEP]
            .into_iter()
            .position(|s| line.starts_with(s));
        let Some(series) = series else { continue };
        let (Some(worker), Some(v)) = (
            crate::load::label(line, "worker"),
            line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()),
        ) else {
            continue;
        };
        if series == 2 && crate::load::label(line, "part") != Some("per_prefill_token") {
            continue;
        }
        let entry = out.entry(worker.to_string()).or_default();
        match series {
            0 => entry.pending += v,
            1 => entry.done += v,
            _ => entry.per_token_us.push(v * 1e6),
        }
    }
}

/// Samples every worker's load gauges every `every` for `window` or until `stop` is cancelled,
/// one entry per worker (per data-parallel engine with `engines`, as [`scrape_each`]). A worker
/// that does not answer in time is skipped for that sample: a sample late by a slow scrape is
/// still a sample.
///
/// With `gateways` (a kvroute target's base URLs), each sample also reads the target's view of
/// each worker's prefill backlog, matched to the worker by its name, which the gateway gives
/// as the worker URL's `host:port` unless configured otherwise (so not per engine).
pub async fn watch_gauges(
    workers: Vec<String>,
    engines: Option<u32>,
    gateways: Vec<String>,
    every: Duration,
    window: Duration,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<WorkerGauges> {
    let client = client();
    let ranks = ranks(engines);
    let mut out = vec![WorkerGauges::default(); workers.len() * ranks.len()];
    if workers.is_empty() {
        return out;
    }
    let wait = every.max(Duration::from_millis(200));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let over = tokio::time::sleep(window);
    tokio::pin!(over);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return out,
            _ = &mut over => return out,
            _ = tick.tick() => {}
        }
        let texts = futures_util::future::join_all(workers.iter().map(|w| {
            let client = &client;
            async move { tokio::time::timeout(wait, metrics_body(client, w)).await }
        }))
        .await;
        for (i, text) in texts.into_iter().enumerate() {
            let Ok(Ok(Some(text))) = text else { continue };
            for (r, &rank) in ranks.iter().enumerate() {
                if let Some(p) = crate::load::parse_vllm_metrics(&text, rank) {
                    out[i * ranks.len() + r].add(&p);
                }
            }
        }
        if gateways.is_empty() || engines.is_some() {
            continue;
        }
        let mut backlog = std::collections::HashMap::new();
        for g in &gateways {
            let text = tokio::time::timeout(wait, metrics_body(&client, g)).await;
            if let Ok(Ok(Some(text))) = text {
                gateway_view(&text, &mut backlog);
            }
        }
        for (w, g) in workers.iter().zip(out.iter_mut()) {
            let name = w
                .parse::<http::Uri>()
                .ok()
                .and_then(|u| u.authority().map(|a| a.to_string()));
            if let Some(view) = name.and_then(|n| backlog.get(&n)) {
                g.gateway_samples += 1;
                g.pending_prefill_sum += view.pending;
                g.pending_prefill_peak = g.pending_prefill_peak.max(view.pending);
                g.step_done_sum += view.done;
                g.step_per_token_us.extend(&view.per_token_us);
            }
        }
    }
}

/// The names [`scrape_each`]'s entries are reported under: each worker's URL, with `/dp<rank>`
/// for each of its engines when it has several.
pub fn scraped_names(workers: &[String], engines: Option<u32>) -> Vec<String> {
    match engines {
        Some(n) => workers
            .iter()
            .flat_map(|w| (0..n).map(move |r| format!("{w}/dp{r}")))
            .collect(),
        None => workers.to_vec(),
    }
}

/// What a kvroute target counted about its own routing, summed over its replicas; empty for a
/// target that is not kvroute.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GatewayCounters {
    /// Routing decisions by outcome (`kvroute_routing_decisions_total`, over policies and arms).
    pub outcomes: std::collections::BTreeMap<String, f64>,
    /// Cached prompt tokens the policies predicted, over answers that reported `cached_tokens`.
    pub predicted_cached: f64,
    /// The `cached_tokens` those answers reported.
    pub reported_cached: f64,
    /// Requests tokenized to route on KV events, by how (`kvroute_tokenized_requests_total`).
    pub tokenized: std::collections::BTreeMap<String, f64>,
}

impl GatewayCounters {
    pub fn since(&self, before: &Self) -> Self {
        let since = |now: &std::collections::BTreeMap<String, f64>,
                     then: &std::collections::BTreeMap<String, f64>| {
            let mut d = now.clone();
            for (k, n) in &mut d {
                *n -= then.get(k).copied().unwrap_or(0.0);
            }
            d
        };
        Self {
            outcomes: since(&self.outcomes, &before.outcomes),
            predicted_cached: self.predicted_cached - before.predicted_cached,
            reported_cached: self.reported_cached - before.reported_cached,
            tokenized: since(&self.tokenized, &before.tokenized),
        }
    }
}

/// The [`GatewayCounters`] of a kvroute target (base URLs, comma-separated for replicas).
pub async fn gateway_counters(targets: &str) -> GatewayCounters {
    let mut out = GatewayCounters::default();
    for target in targets.split(',') {
        let Some(text) = metrics_text(&client(), target).await else {
            continue;
        };
        add_gateway_counters(&text, &mut out);
    }
    out
}

fn add_gateway_counters(text: &str, out: &mut GatewayCounters) {
    for line in text.lines().filter(|l| l.starts_with("kvroute_")) {
        let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let label = |key: &str| {
            line.split(&format!("{key}=\""))
                .nth(1)
                .and_then(|r| r.split('"').next())
        };
        match name {
            "kvroute_routing_decisions_total" => {
                if let Some(o) = label("outcome") {
                    *out.outcomes.entry(o.to_owned()).or_default() += value;
                }
            }
            "kvroute_tokenized_requests_total" => {
                if let Some(how) = label("how") {
                    *out.tokenized.entry(how.to_owned()).or_default() += value;
                }
            }
            "kvroute_predicted_cached_tokens_total" => out.predicted_cached += value,
            "kvroute_reported_cached_tokens_total" => out.reported_cached += value,
            _ => {}
        }
    }
}

/// Empties every worker's prefix cache with `POST /reset_prefix_cache` (vLLM serves it with
/// `VLLM_SERVER_DEV_MODE=1`; the simulator always does), so an arm starts cold.
pub async fn reset_prefix_caches(workers: &[String]) -> Result<(), String> {
    let client = client();
    for w in workers {
        let url = format!("{}/reset_prefix_cache", w.trim_end_matches('/'));
        // Refused (`success: false`) while blocks are held, e.g. by requests still finishing.
        for attempt in 0.. {
            let req = http::Request::post(&url)
                .body(Full::new(Bytes::new()))
                .map_err(|e| format!("{url}: {e}"))?;
            let resp = client
                .request(req)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("{url}: {e}"))?
                .to_bytes();
            if !status.is_success() {
                return Err(format!(
                    "{url} answered {status} (a vLLM worker serves it only with VLLM_SERVER_DEV_MODE=1)"
                ));
            }
            let ok = serde_json::from_slice::<Value>(&body)
                .is_ok_and(|v| v["success"].as_bool() != Some(false));
            if ok {
                break;
            }
            if attempt == 50 {
                return Err(format!("{url}: the cache stayed in use for 10 s"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// The pool's KV capacity, `(blocks summed over workers and their engines, tokens per block)`,
/// from the `num_gpu_blocks` and `block_size` labels of each worker's `vllm:cache_config_info`
/// (one sample per data-parallel engine); `(0, 0)` when no worker exports it.
pub async fn cache_capacity(workers: &[String]) -> (usize, usize) {
    let client = client();
    let (mut blocks, mut block_size) = (0, 0);
    for w in workers {
        let Some(text) = metrics_text(&client, w).await else {
            continue;
        };
        let (b, size) = capacity_in(&text);
        blocks += b;
        if size > 0 {
            block_size = size;
        }
    }
    (blocks, block_size)
}

/// `(blocks, tokens per block)` of one worker's `/metrics`: every engine's
/// `vllm:cache_config_info` sample counted.
fn capacity_in(text: &str) -> (usize, usize) {
    let (mut blocks, mut block_size) = (0, 0);
    for line in text
        .lines()
        .filter(|l| l.starts_with("vllm:cache_config_info{"))
    {
        let label = |name| crate::load::label(line, name)?.parse::<usize>().ok();
        if let (Some(n), Some(b)) = (label("num_gpu_blocks"), label("block_size")) {
            blocks += n;
            block_size = b;
        }
    }
    (blocks, block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_data_parallel_engines_cache_counts_toward_a_workers_capacity() {
        let text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"300\"} 1.0\n\
            vllm:num_requests_running{engine=\"0\"} 0.0\n";
        assert_eq!(capacity_in(text), (400, 16));
        assert_eq!(capacity_in("vllm:num_requests_running 0\n"), (0, 0));
    }

    #[test]
    fn a_gateways_view_is_read_by_worker_its_backlog_summed_and_each_replicas_step_fit_kept() {
        let replica = |pending: f64, done: f64, per_token: f64| {
            format!(
                "# HELP kvroute_worker_pending_prefill_tokens x\n\
                 kvroute_worker_pending_prefill_tokens{{worker=\"127.0.0.1:9001\"}} {pending}\n\
                 kvroute_worker_pending_prefill_tokens{{worker=\"127.0.0.1:9002\"}} 7\n\
                 kvroute_worker_step_prefill_done_tokens{{worker=\"127.0.0.1:9001\"}} {done}\n\
                 kvroute_worker_step_seconds{{part=\"base\",worker=\"127.0.0.1:9001\"}} 0.02\n\
                 kvroute_worker_step_seconds{{part=\"per_prefill_token\",worker=\"127.0.0.1:9001\"}} {per_token}\n\
                 kvroute_worker_inflight{{worker=\"127.0.0.1:9001\"}} 99\n"
            )
        };
        let mut out = std::collections::HashMap::new();
        gateway_view(&replica(2048.0, 512.0, 75e-6), &mut out);
        gateway_view(&replica(1000.0, 0.5, 25e-6), &mut out);
        let seen = |w: &str| {
            let v = &out[w];
            (
                v.pending,
                v.done,
                v.per_token_us.iter().map(|t| t.round()).collect::<Vec<_>>(),
            )
        };
        assert_eq!(seen("127.0.0.1:9001"), (3048.0, 512.5, vec![75.0, 25.0]));
        // No step series for that worker: nothing counted done, no fit.
        assert_eq!(seen("127.0.0.1:9002"), (14.0, 0.0, vec![]));
        assert_eq!(out.len(), 2);
        let g = WorkerGauges {
            step_per_token_us: vec![75.0, 25.0, 76.0],
            ..Default::default()
        };
        assert_eq!(g.step_per_token_spread(), Some((75.0, 25.0)));
        assert_eq!(WorkerGauges::default().step_per_token_spread(), None);
    }

    #[test]
    fn a_gateways_counters_are_summed_over_labels_and_taken_since_a_start() {
        let text = |decisions: f64, heads: f64| {
            format!(
                "# HELP kvroute_routing_decisions_total x\n\
                 kvroute_routing_decisions_total{{arm=\"a\",outcome=\"exact_match\",policy=\"p\"}} {decisions}\n\
                 kvroute_routing_decisions_total{{arm=\"b\",outcome=\"exact_match\",policy=\"p\"}} 1\n\
                 kvroute_tokenized_requests_total{{how=\"head\"}} {heads}\n\
                 kvroute_tokenized_requests_total{{how=\"whole\"}} 7\n\
                 kvroute_predicted_cached_tokens_total{{arm=\"a\",policy=\"p\",worker=\"w\"}} 100\n\
                 kvroute_reported_cached_tokens_total{{arm=\"a\",policy=\"p\",worker=\"w\"}} 90\n"
            )
        };
        let (mut start, mut end) = (GatewayCounters::default(), GatewayCounters::default());
        add_gateway_counters(&text(2.0, 3.0), &mut start);
        add_gateway_counters(&text(10.0, 8.0), &mut end);
        assert_eq!(end.outcomes["exact_match"], 11.0);
        assert_eq!((end.tokenized["head"], end.tokenized["whole"]), (8.0, 7.0));
        assert_eq!((end.predicted_cached, end.reported_cached), (100.0, 90.0));
        let window = end.since(&start);
        assert_eq!(window.outcomes["exact_match"], 8.0);
        assert_eq!(
            (window.tokenized["head"], window.tokenized["whole"]),
            (5.0, 0.0)
        );
    }

    /// A data-parallel worker's engines are counted apart, each by its `engine` series, and
    /// named after the worker and the rank.
    #[test]
    fn a_data_parallel_workers_engines_are_counted_apart() {
        let text = "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 22208.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 31328.0\n\
            vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 25060.0\n\
            vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 35054.0\n\
            vllm:e2e_request_latency_seconds_count{engine=\"0\",model_name=\"m\"} 40.0\n\
            vllm:e2e_request_latency_seconds_count{engine=\"1\",model_name=\"m\"} 56.0\n\
            kvroute_sim_tokens_after_disconnect_total 3\n";
        let of = |engine| {
            let mut c = WorkerCounters::default();
            c.add_engine_exposition(text, engine);
            c
        };
        let (zero, one, all) = (of(Some(0)), of(Some(1)), of(None));
        assert_eq!((zero.requests, zero.prefix_hits), (40.0, 22208.0));
        assert_eq!((one.requests, one.prefix_queries), (56.0, 35054.0));
        assert_eq!(all.requests, 96.0);
        // A series of no engine counts once, for rank 0.
        assert_eq!(zero.tokens_after_disconnect, 3.0);
        assert_eq!(one.tokens_after_disconnect, 0.0);
        let urls = ["http://a:1".to_string(), "http://b:1".to_string()];
        assert_eq!(
            scraped_names(&urls, Some(2)),
            [
                "http://a:1/dp0",
                "http://a:1/dp1",
                "http://b:1/dp0",
                "http://b:1/dp1"
            ]
        );
        assert_eq!(scraped_names(&urls, None), urls);
    }
}
