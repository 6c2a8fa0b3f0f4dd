//! `kvroute bench`: seeded workloads, a load generator that times from intended send times,
//! window statistics, reports, and side-by-side comparison of routing policies on fresh simulated
//! pools.
//!
//! [`workload`] or [`trace`] (what to send) → [`loadgen`] (sending and timing) → [`stats`] (the
//! window) → [`report`] (table, JSON, SVG); [`workers`] reads the workers' counters and empties
//! their caches, [`external`] starts another router as an arm, and `pool` starts the pools and
//! gateways the arms run on. This file orchestrates: one run, a policy comparison, a sweep, and
//! the cache-hit limit.

pub mod cli;
pub mod external;
pub mod loadgen;
pub mod plot;
mod pool;
pub mod report;
pub mod stats;
pub mod trace;
pub mod workers;
pub mod workload;

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::sim::{self, kv, request as sim_request, tokenizer::SimTokenizer};
use loadgen::LoadSpec;
use report::{Run, WorkerReport};
use stats::{summarize, Sample};
use workload::Workload;

pub use pool::{start_on_existing, start_pool, start_pool_replicated, Exact, Pool, Target};

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Load(#[from] loadgen::LoadError),
    #[error(transparent)]
    Sim(#[from] sim::SimError),
    #[error("{0}")]
    Setup(String),
}

/// An arm named `POLICY+events` runs `POLICY` with its gateway following the workers' KV cache
/// events and tokenizing requests with the bench's `--tokenizer` (the exact cache state of issue
/// 13); the same policy without the suffix learns from the requests it routed only.
pub const EVENTS_SUFFIX: &str = "+events";

/// The model files a `+events` gateway tokenizes with (the workers' own).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerFiles {
    pub tokenizer_json: std::path::PathBuf,
    pub tokenizer_config: Option<std::path::PathBuf>,
}

/// Default SLO when a workload class names none: TTFT and TPOT in milliseconds.
pub const DEFAULT_SLO: (f64, f64) = (2000.0, 200.0);

/// One run against `spec.url`, reading `worker_metrics` before the window and after the run.
/// With `time_scale` k > 1 (simulated workers running k times faster than real time) every time is
/// reported in modelled time: latencies k times longer and rates k times lower than the wall clock
/// saw, so the figures read as the modelled GPUs would give them.
pub async fn run_once(
    label: &str,
    spec: &LoadSpec,
    worker_metrics: &[String],
    slo: (f64, f64),
    time_scale: f64,
) -> Result<(Run, Vec<Sample>), BenchError> {
    run_once_on_engines(label, spec, worker_metrics, None, slo, time_scale).await
}

/// [`run_once`], reporting each of every worker's `engines` data-parallel engines as a worker
/// (by its `engine` series) when given.
pub async fn run_once_on_engines(
    label: &str,
    spec: &LoadSpec,
    worker_metrics: &[String],
    engines: Option<u32>,
    slo: (f64, f64),
    time_scale: f64,
) -> Result<(Run, Vec<Sample>), BenchError> {
    // Counters at the start of the window, and after the run.
    let snapshot = move |urls: Vec<String>, target: String| async move {
        (
            workers::scrape_each(&urls, engines).await,
            workers::gateway_counters(&target).await,
        )
    };
    let (urls, target, warmup) = (worker_metrics.to_vec(), spec.url.clone(), spec.warmup);
    let before = if warmup.is_zero() {
        // No warm-up: read them before the first request rather than racing it.
        let now = snapshot(urls, target).await;
        tokio::spawn(async move { now })
    } else {
        tokio::spawn(async move {
            tokio::time::sleep(warmup).await;
            snapshot(urls, target).await
        })
    };
    // The workers' load gauges through the window, once a second of modelled time.
    let stop = CancellationToken::new();
    let gauges = {
        let (urls, stop) = (worker_metrics.to_vec(), stop.clone());
        let gateways: Vec<String> = spec.url.split(',').map(str::to_string).collect();
        let (warmup, window) = (spec.warmup, spec.duration);
        let every =
            Duration::from_secs_f64(1.0 / time_scale.max(1e-3)).max(Duration::from_millis(20));
        tokio::spawn(async move {
            // A run over before its warm-up (a short `--requests` stream) samples nothing.
            tokio::select! {
                _ = stop.cancelled() => return Vec::new(),
                _ = tokio::time::sleep(warmup) => {}
            }
            workers::watch_gauges(urls, engines, gateways, every, window, stop).await
        })
    };
    let samples = loadgen::run(spec).await;
    stop.cancel();
    let gauges = gauges.await.unwrap_or_default();
    let mut samples = samples?;
    for s in &mut samples {
        s.scale(time_scale);
    }
    let (workers_before, routing_before) = before.await.unwrap_or_default();
    let (workers_after, routing) = snapshot(worker_metrics.to_vec(), spec.url.clone()).await;
    let per_worker: Vec<WorkerReport> = workers::scraped_names(worker_metrics, engines)
        .into_iter()
        .zip(&workers_after)
        .enumerate()
        .map(|(i, (worker, after))| WorkerReport {
            worker,
            counters: after.since(&workers_before.get(i).cloned().unwrap_or_default()),
            gauges: gauges.get(i).cloned().unwrap_or_default(),
        })
        .collect();
    let each: Vec<_> = per_worker.iter().map(|w| w.counters.clone()).collect();
    let workers = (!worker_metrics.is_empty()).then(|| workers::WorkerCounters::total(&each));
    let routing = routing.since(&routing_before);
    let warmup = spec.warmup.as_secs_f64() * time_scale;
    let mut duration = spec.duration.as_secs_f64() * time_scale;
    if spec.max_requests.is_some() {
        // The stream ended before the window did: rates are over the time it took.
        let last = samples.iter().map(|s| s.done).fold(warmup, f64::max);
        duration = duration.min(last - warmup).max(f64::EPSILON);
    }
    let summary = summarize(&samples, warmup, duration, slo);
    let ttfts = samples
        .iter()
        .filter(|s| s.ok && !s.cancelled && s.intended >= warmup && s.intended < warmup + duration)
        .filter_map(Sample::ttft)
        .collect();
    Ok((
        Run {
            label: label.into(),
            summary,
            workers,
            per_worker,
            cached_tokens: (routing.predicted_cached > 0.0 || routing.reported_cached > 0.0)
                .then_some(report::CachedTokens {
                    predicted: routing.predicted_cached,
                    reported: routing.reported_cached,
                }),
            routing: routing.outcomes,
            replica_agreement: None,
            tokenized: routing.tokenized,
            ttfts,
        },
        samples,
    ))
}

/// The same seeded workload through one gateway per arm (policy name or config file), in turn,
/// each on a fresh simulated pool or on the existing pool with its caches emptied.
pub async fn compare(
    target: &Target,
    policies: &[String],
    spec: &LoadSpec,
    slo: (f64, f64),
) -> Result<(Vec<Run>, Option<f64>), BenchError> {
    compare_replicated(target, policies, spec, slo, 1).await
}

/// The order in which `compare` runs its `n` arms for `seed`: the given order rotated by the seed,
/// so runs over `n` consecutive seeds put every arm in every position once. Arms run one after
/// another on the same machine, and position alone moved results by 2-4% (the machine's state
/// drifts over a run: what ran before, page cache, thermal); a fixed order would hand that to the
/// same arm in every run. Results are still reported in the given order.
pub fn arm_order(n: usize, seed: u64) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    let shift = (seed % n as u64) as usize;
    (0..n).map(|i| (i + shift) % n).collect()
}

/// Like [`compare`], with `replicas` kvroute gateways per arm in front of the same workers, sharing
/// nothing, and the requests sent to them in turn (so a conversation's turns alternate between
/// replicas: the hardest split for affinity). External arms run one instance. The arms run in
/// [`arm_order`] and are returned in the given order.
pub async fn compare_replicated(
    target: &Target,
    policies: &[String],
    spec: &LoadSpec,
    slo: (f64, f64),
    replicas: usize,
) -> Result<(Vec<Run>, Option<f64>), BenchError> {
    let mut runs: Vec<(usize, Run)> = Vec::new();
    let mut limit = None;
    for at in arm_order(policies.len(), spec.seed) {
        let (policy, replicas, suffix) = arm_replicas(&policies[at], replicas)?;
        let pool = match target {
            Target::Sim(sim_cfg) => start_pool_replicated(sim_cfg, policy, replicas).await?,
            Target::Existing {
                workers,
                kv_events,
                tokenizer,
                data_parallel_size,
                ..
            } => {
                let exact = Exact {
                    kv_events: kv_events.clone(),
                    tokenizer: tokenizer.clone(),
                    data_parallel_size: *data_parallel_size,
                };
                start_on_existing(workers, policy, replicas, target.time_scale(), &exact).await?
            }
        };
        let spec = LoadSpec {
            url: pool.gateway.clone(),
            ..spec.clone()
        };
        let k = target.time_scale();
        let label = match external::parse(policy) {
            Some((name, _)) => name.to_owned(),
            None => {
                std::path::Path::new(policy)
                    .file_stem()
                    .map_or(policy.to_owned(), |s| s.to_string_lossy().into_owned())
                    + suffix
            }
        };
        let engines = match target {
            Target::Existing {
                data_parallel_size, ..
            } => *data_parallel_size,
            Target::Sim(cfg) => cfg.data_parallel_ranks(),
        };
        let (mut run, samples) =
            run_once_on_engines(&label, &spec, &pool.workers, engines, slo, k).await?;
        if replicas > 1 && external::parse(policy).is_none() {
            let model = match &spec.model {
                Some(m) => m.clone(),
                None => loadgen::first_model(&loadgen::client(), &pool.workers[0]).await?,
            };
            run.replica_agreement = replica_agreement(&spec, &samples, &model).await;
        }
        if limit.is_none() {
            let ((blocks, block_size), tok) = match target {
                Target::Sim(sim_cfg) => {
                    let p = sim_cfg.engine_params()?;
                    (
                        (sim_cfg.pool_gpu_blocks()?, p.block_size),
                        sim_cfg.load_tokenizer()?,
                    )
                }
                Target::Existing {
                    workers, tokenizer, ..
                } => {
                    let tok = match tokenizer {
                        Some(f) => {
                            SimTokenizer::load(&f.tokenizer_json, f.tokenizer_config.as_deref())
                                .map_err(|e| BenchError::Setup(e.to_string()))?
                        }
                        None => SimTokenizer::Own,
                    };
                    (workers::cache_capacity(workers).await, tok)
                }
            };
            let warmup = spec.warmup.mul_f64(k);
            limit = (blocks > 0 && block_size > 0).then(|| {
                limit_hit_rate(
                    &spec.workload,
                    spec.seed,
                    &samples,
                    warmup,
                    (blocks, block_size),
                    &tok,
                )
            });
        }
        runs.push((at, run));
        drop(pool); // tear this pool down before the next arm's starts
    }
    runs.sort_by_key(|(at, _)| *at);
    Ok((runs.into_iter().map(|(_, run)| run).collect(), limit))
}

/// Most gateway replicas an arm may run.
pub const MAX_REPLICAS: usize = 16;

/// An arm's own replica count: `ARM@N` runs `ARM` with `N` gateway replicas whatever
/// `--replicas` says, so one run can set one gateway beside several. Returns the arm without
/// the suffix, its replica count, and the suffix for its label. External arms run one instance.
pub fn arm_replicas(arm: &str, default: usize) -> Result<(&str, usize, &str), BenchError> {
    if external::parse(arm).is_some() {
        return Ok((arm, default, ""));
    }
    match arm.rsplit_once('@') {
        Some((base, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            match n.parse::<usize>() {
                Ok(r) if (1..=MAX_REPLICAS).contains(&r) => Ok((base, r, &arm[base.len()..])),
                _ => Err(BenchError::Setup(format!(
                    "`{arm}`: an arm's replicas must be 1 to {MAX_REPLICAS}"
                ))),
            }
        }
        _ => Ok((arm, default, "")),
    }
}

/// Whether any of `arms` follows the workers' KV events, so a simulated pool must publish them:
/// `POLICY+events`, with or without a replica count after it (`cache_aware+events@2`).
pub fn wants_events(arms: &[String]) -> bool {
    arms.iter()
        // An external arm is another router's command line, whatever it ends with.
        .filter(|a| external::parse(a).is_none())
        .any(|a| arm_replicas(a, 1).is_ok_and(|(policy, ..)| policy.ends_with(EVENTS_SUFFIX)))
}

/// Requests the replica-agreement check asks about: the last of the window.
const AGREEMENT_PROBES: usize = 200;

/// Whether a pool's gateway replicas would route the same requests to the same workers: after
/// the run, with the workers idle, each replica is asked (`/debug/route`, which changes nothing)
/// where the window's last [`AGREEMENT_PROBES`] requests would go. Counted over the requests
/// some replica expects cached tokens for, since a prefix no one holds can go anywhere. `None`
/// for one gateway or a target that cannot answer (another router, a rotating policy).
async fn replica_agreement(
    spec: &LoadSpec,
    samples: &[Sample],
    model: &str,
) -> Option<report::Agreement> {
    use http_body_util::{BodyExt, Full};
    let gateways: Vec<&str> = spec.url.split(',').collect();
    if gateways.len() < 2 {
        return None;
    }
    // Load signals are polled (default every second): let the idle workers' last poll land on
    // every replica, so the answers differ by what each knows of the caches only.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let client = loadgen::client();
    let mut probes: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    probes.sort_by(|a, b| b.intended.total_cmp(&a.intended));
    probes.truncate(AGREEMENT_PROBES);
    let mut out = report::Agreement::default();
    for s in probes {
        let req = spec.request(s.index);
        let mut body = req.body;
        body["model"] = serde_json::Value::from(model);
        let path = if req.chat {
            "/debug/route/v1/chat/completions"
        } else {
            "/debug/route/v1/completions"
        };
        let mut answers = Vec::with_capacity(gateways.len());
        for g in &gateways {
            let r = http::Request::post(format!("{}{path}", g.trim_end_matches('/')))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(bytes::Bytes::from(body.to_string())))
                .ok()?;
            let resp = client.request(r).await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let b = resp.into_body().collect().await.ok()?.to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&b).ok()?;
            answers.push((
                v["worker"].as_str().unwrap_or_default().to_owned(),
                v["predicted_cached_tokens"].as_u64().unwrap_or(0),
            ));
        }
        out.probed += 1;
        if answers.iter().any(|(_, cached)| *cached > 0) {
            out.cached += 1;
            if answers.iter().all(|(w, _)| *w == answers[0].0) {
                out.agreed += 1;
            }
        }
    }
    Some(out)
}

/// Concurrency (or, with `rates`, open-loop rate) sweep against `spec.url`.
pub async fn sweep(
    spec: &LoadSpec,
    points: &[f64],
    open_loop: bool,
    worker_metrics: &[String],
    slo: (f64, f64),
    time_scale: f64,
) -> Result<Vec<Run>, BenchError> {
    let mut runs = Vec::new();
    for &p in points {
        let spec = if open_loop {
            LoadSpec {
                rate: Some(p),
                ..spec.clone()
            }
        } else {
            LoadSpec {
                concurrency: p as usize,
                rate: None,
                ..spec.clone()
            }
        };
        let label = if open_loop {
            format!("rate={p}")
        } else {
            format!("C={p}")
        };
        runs.push(
            run_once(&label, &spec, worker_metrics, slo, time_scale)
                .await?
                .0,
        );
    }
    Ok(runs)
}

/// The prefix-cache hit rate one cache with `total_blocks` would reach on the same request
/// stream: every request sent is replayed in order through a single paged cache (with the
/// simulator's tokenizer and block size), and the window's requests are counted. An upper bound
/// for any router in front of workers whose caches add up to that capacity (it ignores the
/// blocks that concurrent requests pin, which only lowers what is reachable).
pub fn limit_hit_rate(
    w: &Workload,
    seed: u64,
    samples: &[Sample],
    warmup: Duration,
    (total_blocks, block_size): (usize, usize),
    tok: &SimTokenizer,
) -> f64 {
    let warm = warmup.as_secs_f64();
    let mut order: Vec<&Sample> = samples.iter().collect();
    order.sort_by(|a, b| {
        a.intended
            .total_cmp(&b.intended)
            .then(a.index.cmp(&b.index))
    });
    let mut cache = kv::KvCache::new(total_blocks, block_size);
    let (mut queries, mut hits) = (0usize, 0usize);
    for s in order {
        let req = w.request(seed, s.index);
        let tokens = if req.chat {
            let messages: Vec<sim_request::Message> =
                serde_json::from_value(req.body["messages"].clone()).unwrap_or_default();
            sim_request::chat_tokens(&messages, &Default::default(), tok).unwrap_or_default()
        } else {
            tok.prompt(req.body["prompt"].as_str().unwrap_or_default())
                .unwrap_or_default()
        };
        if tokens.is_empty() {
            continue;
        }
        let mut hashes = Vec::new();
        cache.extend_hashes(&mut hashes, &tokens);
        let usable = (tokens.len() - 1) / block_size;
        let hit = cache.match_prefix(&hashes[..usable.min(hashes.len())]);
        if s.intended >= warm {
            queries += tokens.len();
            hits += hit.len() * block_size;
        }
        cache.touch(&hit);
        let need = tokens.len().div_ceil(block_size) - hit.len();
        let Some(new) = cache.allocate(need) else {
            cache.free(&hit);
            continue;
        };
        let blocks: Vec<u32> = hit.iter().copied().chain(new).collect();
        let full = hashes.len().min(blocks.len());
        cache.register(&blocks[..full], &hashes[..full], None, &tokens);
        cache.free(&blocks);
    }
    if queries == 0 {
        0.0
    } else {
        hits as f64 / queries as f64
    }
}

/// What `compare` prints under its table.
pub fn limit_line(limit: Option<f64>, runs: &[Run]) -> String {
    let Some(l) = limit else {
        return String::new();
    };
    let best = runs
        .iter()
        .filter_map(|r| r.workers.as_ref().map(|w| (r.label.as_str(), w.hit_rate())))
        .fold(("-", 0.0), |a, b| if b.1 > a.1 { b } else { a });
    format!(
        "limit: one cache with the pool's total KV capacity would hit {:.1}% of prompt tokens on \
         this stream; best policy here: {} at {:.1}%\n",
        l * 100.0,
        best.0,
        best.1 * 100.0
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn over_as_many_seeds_as_arms_every_arm_runs_in_every_position_once() {
        for n in 1..6 {
            let mut seen = vec![vec![0; n]; n]; // [arm][position]
            for seed in 7..7 + n as u64 {
                let order = super::arm_order(n, seed);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "a permutation");
                for (position, arm) in order.into_iter().enumerate() {
                    seen[arm][position] += 1;
                }
            }
            assert!(seen.iter().flatten().all(|&c| c == 1), "{n}: {seen:?}");
        }
    }

    #[test]
    fn an_arm_may_set_its_own_replicas() {
        use super::arm_replicas;
        let ok = |arm| arm_replicas(arm, 3).unwrap();
        assert_eq!(ok("cache_aware"), ("cache_aware", 3, ""));
        assert_eq!(ok("cache_aware@1"), ("cache_aware", 1, "@1"));
        assert_eq!(ok("cache_aware+events@2"), ("cache_aware+events", 2, "@2"));
        assert_eq!(ok("/tmp/a@b.yaml"), ("/tmp/a@b.yaml", 3, ""), "not a count");
        assert_eq!(
            ok("smg=smg launch --port {port}@2"),
            ("smg=smg launch --port {port}@2", 3, "")
        );
        for bad in [
            "cache_aware@0",
            "cache_aware@17",
            "cache_aware@99999999999999999999",
        ] {
            assert!(arm_replicas(bad, 1).is_err(), "{bad}");
        }
    }

    /// A pool is started with KV events when any arm follows them, whether or not the arm sets
    /// its own replicas: `cache_aware+events@2` alone once started a pool without events.
    #[test]
    fn an_events_arm_with_replicas_asks_for_events() {
        use super::wants_events;
        let arms = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(wants_events(&arms(&[
            "cache_aware@2",
            "cache_aware+events@2"
        ])));
        assert!(wants_events(&arms(&["cache_aware+events"])));
        assert!(!wants_events(&arms(&["cache_aware@2", "round_robin"])));
        assert!(
            !wants_events(&arms(&["x=router --policy a+events"])),
            "an external arm"
        );
    }
}
