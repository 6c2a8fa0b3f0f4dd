//! `kvroute bench` end to end over loopback: the generator's intended-time latency against a real
//! (simulated) worker, and a short policy comparison on a small pool.

mod common;

use std::time::Duration;

use kvroute::bench::{self, loadgen::LoadSpec, workload::Workload};
use kvroute::sim::presets::{CostModel, EngineParams};
use kvroute::sim::SimConfig;

/// Written (held alone) by the tests whose assertions compare throughput, hit rates or timings
/// between arms; read (shared) by the file's other tests that run pools or load. The test
/// harness runs a file's tests in parallel on the same cores, and pools sharing two cores
/// measure each other's CPU load. (Seen with the file's other tests beside it and two busy loops
/// on a 2-core machine: `prefix` spilled 21% of its requests instead of ~5% and its hit rate fell
/// from ~90% to round-robin's ~70%. Measuring tests that only took turns among themselves still
/// failed so once in a clean-clone CI run, 73.5% against 68.0% with 21% spilled, with the other
/// tests running beside them.)
static POOLS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn small_engine(blocks: usize) -> EngineParams {
    EngineParams {
        model: "tiny".into(),
        max_model_len: 2048,
        num_gpu_blocks: blocks,
        block_size: 16,
        max_num_seqs: 64,
        max_num_batched_tokens: 2048,
        cost: CostModel {
            step_base_ms: 10.0,
            prefill_ms_per_token: 0.1,
            decode_ms_per_seq: 0.1,
            kv_read_ms_per_1k_tokens: 0.1,
        },
    }
}

fn spec(workload: Workload) -> LoadSpec {
    LoadSpec {
        url: String::new(),
        model: None,
        workload,
        seed: 3,
        concurrency: 8,
        rate: None,
        think: Duration::ZERO,
        ramp_up: Duration::ZERO,
        warmup: Duration::from_millis(500),
        duration: Duration::from_millis(2000),
        cancel: None,
        request_timeout: Duration::from_secs(30),
        max_requests: None,
        output_range: 0.0,
        api: bench::loadgen::Api::Completions,
        session_header: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_loop_that_outruns_the_server_reports_the_wait_it_caused() {
    let _shared = POOLS.read().await;
    let sim = SimConfig {
        workers: 1,
        engine: Some(small_engine(2048)),
        ..SimConfig::default()
    };
    let pool = bench::start_pool(&sim, "round_robin").await.unwrap();
    // 40 req/s offered, one request in flight at a time, each ~10 steps of 10 ms: the queue grows.
    let load = LoadSpec {
        url: pool.gateway.clone(),
        rate: Some(40.0),
        concurrency: 1,
        warmup: Duration::ZERO,
        duration: Duration::from_millis(1000),
        ..spec(Workload::Random {
            input_tokens: 32,
            output_tokens: 10,
        })
    };
    let (run, samples) = bench::run_once("open", &load, &[], (1e9, 1e9), 1.0)
        .await
        .unwrap();
    let s = &run.summary;
    assert!(s.requests >= 20, "{} requests", s.requests);
    assert_eq!(s.errors, 0);
    assert!(s.max_send_lag > 0.2, "lag {}", s.max_send_lag);
    // Latency counts from the intended time, so the worst TTFT includes the worst lag.
    assert!(s.ttft.p99 >= s.max_send_lag * 0.9, "{s:?}");
    // And each sample's TTFT is at least its own send lag.
    for x in samples.iter().filter(|x| x.ok) {
        assert!(x.ttft().unwrap() >= x.sent - x.intended);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_shows_prefix_routing_beating_round_robin_when_caches_cannot_hold_every_prefix() {
    let _alone = POOLS.write().await;
    // 16 prefixes × 384 tokens = 384 blocks; each worker holds 300. Round-robin needs every prefix
    // on both workers and thrashes; prefix routing puts about half on each, which fits. (Each
    // prefix is ~1.4 KB, longer than the 1 KB the gateway's default key hashes: a key longer than
    // the shared prefix would make every request's key unique.)
    let sim = SimConfig {
        workers: 2,
        engine: Some(small_engine(300)),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    let load = spec(Workload::PrefixRepetition {
        prefixes: 16,
        prefix_tokens: 383,
        unique_tokens: 16,
        output_tokens: 8,
    });
    // `prefix` with its load bound loosened (3x the mean instead of 1.5x): the workers' names,
    // and so the rendezvous split of the 16 prefixes, change with their ports, and a 2:1 split
    // puts the busier worker near the default bound, where a loaded machine's timing jitter
    // turns affinity into spills (21-24% of requests in the failures seen). Spilling itself is
    // tested in `src/policy/prefix.rs`; this test is about the cache.
    let dir = std::env::temp_dir().join(format!("kvroute-bench-prefix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("prefix.yaml");
    std::fs::write(&prefix, "policy: {kind: prefix, load_factor: 3.0}\n").unwrap();
    let policies = [
        "round_robin".to_string(),
        prefix.to_string_lossy().into_owned(),
    ];
    let (runs, limit) = bench::compare(
        &bench::Target::Sim(Box::new(sim.clone())),
        &policies,
        &load,
        (1e9, 1e9),
    )
    .await
    .unwrap();
    assert_eq!(runs.len(), 2);
    let hit = |i: usize| runs[i].workers.as_ref().unwrap().hit_rate();
    for r in &runs {
        assert!(r.summary.requests > 20, "{}: {:?}", r.label, r.summary);
        assert_eq!(r.summary.errors, 0);
    }
    let table = bench::report::table(&runs);
    assert!(hit(1) > hit(0) + 0.10, "{table}");
    let limit = limit.unwrap();
    assert!(
        limit >= hit(1) * 0.9,
        "limit {limit} below prefix {}",
        hit(1)
    );
    assert!(table.contains("req/s vs round_robin"));
    assert_eq!(runs[1].label, "prefix");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_clients_are_counted_and_do_not_count_as_errors() {
    let _shared = POOLS.read().await;
    let sim = SimConfig {
        workers: 1,
        engine: Some(small_engine(2048)),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    let pool = bench::start_pool(&sim, "prefix").await.unwrap();
    let load = LoadSpec {
        url: pool.gateway.clone(),
        cancel: Some(bench::loadgen::Cancel {
            fraction: 0.5,
            after_tokens: 2,
        }),
        ..spec(Workload::Random {
            input_tokens: 32,
            output_tokens: 40,
        })
    };
    let (run, samples) = bench::run_once("c", &load, &pool.workers, (1e9, 1e9), 4.0)
        .await
        .unwrap();
    let s = &run.summary;
    assert!(s.cancelled > 0 && s.succeeded > 0, "{s:?}");
    assert_eq!(s.errors, 0);
    assert!(samples
        .iter()
        .filter(|x| x.cancelled)
        .all(|x| x.token_times.len() == 2));
    // The workers generated fewer tokens than 40 per request: the aborts reached them.
    let w = run.workers.as_ref().unwrap();
    let sent = samples.iter().filter(|x| x.intended >= 0.5 * 4.0).count() as f64;
    assert!(w.generation_tokens < sent * 40.0, "{w:?}");
}

/// The workers' KV cache usage and queue are sampled through the window, worker by worker: a
/// pool whose caches cannot hold the requests in flight shows them full with requests waiting
/// for blocks, and one with room shows them nearly empty and nothing waiting. A kvroute
/// target's view of each worker's prefill backlog is read beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_workers_kv_usage_and_queue_are_sampled_through_the_window() {
    let _alone = POOLS.write().await;
    // Four requests in flight per worker, each 200 prompt tokens and up to 60 more (13 to 17
    // blocks): 40 blocks hold two or three of them, 2,048 hold them all at 3% or so.
    let run_on = |blocks: usize, policy: &'static str| async move {
        let sim = SimConfig {
            workers: 2,
            engine: Some(EngineParams {
                max_model_len: 512,
                ..small_engine(blocks)
            }),
            time_scale: 4.0,
            ..SimConfig::default()
        };
        let pool = bench::start_pool(&sim, policy).await.unwrap();
        let load = LoadSpec {
            url: pool.gateway.clone(),
            ..spec(Workload::Random {
                input_tokens: 200,
                output_tokens: 60,
            })
        };
        let (run, _) = bench::run_once("g", &load, &pool.workers, (1e9, 1e9), 4.0)
            .await
            .unwrap();
        assert_eq!(run.summary.errors, 0);
        run
    };
    let tight = run_on(40, "round_robin").await;
    let table = bench::report::table(std::slice::from_ref(&tight));
    assert_eq!(tight.per_worker.len(), 2, "{table}");
    for w in &tight.per_worker {
        // A sample every 250 ms over a 2 s window.
        assert!((4..=10).contains(&w.gauges.samples), "{table}");
        assert!(w.gauges.kv_usage_peak >= 0.6, "{table}");
        assert!(w.gauges.waiting_peak >= 1.0, "{table}");
        let mean = w.gauges.kv_usage_mean().unwrap();
        assert!(mean > 0.3 && mean <= w.gauges.kv_usage_peak, "{table}");
    }
    assert!(table.contains("KV usage mean / peak per worker"), "{table}");
    let roomy = run_on(2048, "cache_aware").await;
    let table = bench::report::table(std::slice::from_ref(&roomy));
    for w in &roomy.per_worker {
        assert!(w.gauges.samples >= 4, "{table}");
        assert!(
            w.gauges.kv_usage_peak > 0.0 && w.gauges.kv_usage_peak < 0.1,
            "{table}"
        );
        assert_eq!(w.gauges.waiting_peak, 0.0, "{table}");
        // The gateway's view of the worker was read beside the worker's own.
        assert!(w.gauges.gateway_samples >= 4, "{table}");
    }
    // Round-robin prices no prefill, so it shows no backlog.
    assert!(tight
        .per_worker
        .iter()
        .all(|w| w.gauges.pending_prefill_mean().is_none()));
    assert!(roomy.kv_usage_peak().unwrap() < tight.kv_usage_peak().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_takes_config_files_and_sweep_finds_throughput_rising_with_concurrency() {
    let _alone = POOLS.write().await;
    let sim = SimConfig {
        workers: 2,
        engine: Some(small_engine(2048)),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    let load = LoadSpec {
        warmup: Duration::from_millis(300),
        duration: Duration::from_millis(1200),
        ..spec(Workload::Random {
            input_tokens: 64,
            output_tokens: 16,
        })
    };
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/config/least_conn.yaml").to_string();
    let (runs, _) = bench::compare(
        &bench::Target::Sim(Box::new(sim.clone())),
        &[file],
        &load,
        (1e9, 1e9),
    )
    .await
    .unwrap();
    assert_eq!(runs[0].label, "least_conn", "labelled by the file's stem");
    assert_eq!(runs[0].summary.errors, 0);
    assert!(runs[0].summary.requests > 10);

    let pool = bench::start_pool(&sim, "least_conn").await.unwrap();
    let load = LoadSpec {
        url: pool.gateway.clone(),
        ..load
    };
    let runs = bench::sweep(&load, &[1.0, 8.0], false, &[], (1e9, 1e9), 4.0)
        .await
        .unwrap();
    assert_eq!(runs[1].label, "C=8");
    assert!(
        runs[1].summary.req_per_s > 2.0 * runs[0].summary.req_per_s,
        "{}",
        bench::report::table(&runs)
    );
}

/// A running pool (here simulated, as tests/real_vllm.rs does with real vLLM): each arm starts on
/// emptied caches, runs exactly the requested number of requests, and the limit uses the pool's
/// own capacity and block size from `vllm:cache_config_info`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_on_a_running_pool_empties_its_caches_before_each_arm() {
    let _shared = POOLS.read().await;
    let sim = SimConfig {
        workers: 2,
        port: 0,
        engine: Some(small_engine(2048)),
        block_size: Some(32),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    let cancel = tokio_util::sync::CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let mut tasks = tokio::task::JoinSet::new();
    let urls: Vec<String> =
        kvroute::sim::spawn(&sim, sim.bind().await.unwrap(), &cancel, &mut tasks)
            .await
            .unwrap()
            .iter()
            .map(|a| format!("http://{a}"))
            .collect();
    assert_eq!(bench::workers::cache_capacity(&urls).await, (2048, 32));
    let load = LoadSpec {
        warmup: Duration::ZERO,
        duration: Duration::from_secs(60),
        max_requests: Some(40),
        concurrency: 1, // sequential, so the hit counts are exact run to run
        ..spec(Workload::PrefixRepetition {
            prefixes: 4,
            prefix_tokens: 383,
            unique_tokens: 16,
            output_tokens: 4,
        })
    };
    // The same arm twice on the same workers: without the reset the second would start warm.
    let arms = ["prefix".to_string(), "prefix".to_string()];
    let (runs, limit) = bench::compare(
        &bench::Target::Existing {
            workers: urls.clone(),
            time_scale: sim.time_scale,
            kv_events: Vec::new(),
            tokenizer: None,
            data_parallel_size: None,
        },
        &arms,
        &load,
        (1e9, 1e9),
    )
    .await
    .unwrap();
    let hits: Vec<f64> = runs
        .iter()
        .map(|r| r.workers.as_ref().unwrap().prefix_hits)
        .collect();
    for r in &runs {
        assert_eq!(r.summary.requests, 40, "{:?}", r.summary);
        assert_eq!(r.summary.errors, 0);
        // Reported worker by worker, and with the gateway's routing decisions.
        assert_eq!(r.per_worker.len(), 2);
        let served: f64 = r.per_worker.iter().map(|w| w.counters.requests).sum();
        assert_eq!(served, 40.0, "{:?}", r.per_worker);
        // Each worker's own TTFT histogram counted the requests it served, at a positive mean.
        for w in &r.per_worker {
            assert_eq!(w.counters.ttft_count, w.counters.requests, "{w:?}");
            if w.counters.requests > 0.0 {
                assert!(w.counters.mean_ttft().is_some_and(|t| t > 0.0), "{w:?}");
            }
        }
        assert_eq!(r.routing.values().sum::<f64>(), 40.0, "{:?}", r.routing);
    }
    assert!(hits[0] > 0.0, "{hits:?}");
    assert_eq!(
        hits[0], hits[1],
        "the second arm started on the first one's cache"
    );
    assert!(limit.is_some_and(|l| l > 0.5), "{limit:?}");
}

/// `--pool-data-parallel`: a kvroute arm in front of running workers that each run vLLM's data
/// parallelism routes to every rank of each, naming it in `X-data-parallel-rank`.
#[tokio::test]
async fn a_kvroute_arm_on_a_data_parallel_pool_routes_to_each_rank() {
    let _shared = POOLS.read().await;
    let up = common::upstream("dp", &[]).await;
    let exact = bench::Exact {
        data_parallel_size: Some(2),
        ..Default::default()
    };
    let pool = bench::start_on_existing(&[up.url()], "round_robin", 1, 1.0, &exact)
        .await
        .unwrap();
    let gateway: std::net::SocketAddr = pool.gateway.trim_start_matches("http://").parse().unwrap();
    let mut ranks = Vec::new();
    for _ in 0..4 {
        let body = serde_json::json!({"prompt": "p"}).to_string();
        let r = common::request(gateway, "POST", "/v1/completions", body.as_bytes()).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        ranks.push(r.json()["data_parallel_rank"].as_str().unwrap().to_owned());
    }
    ranks.sort();
    assert_eq!(ranks, ["0", "0", "1", "1"]);
}

/// A simulated pool whose workers each run two data-parallel engines (`--pool-data-parallel 2`
/// without `--pool`): a kvroute arm routes to each rank of each worker, and the arm's rows show
/// every engine apart, from its own `engine` series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_data_parallel_pool_is_reported_engine_by_engine() {
    let _shared = POOLS.read().await;
    let sim = SimConfig {
        workers: 2,
        port: 0,
        engine: Some(small_engine(2048)),
        time_scale: 4.0,
        data_parallel_size: 2,
        ..SimConfig::default()
    };
    let load = LoadSpec {
        warmup: Duration::ZERO,
        duration: Duration::from_secs(60),
        max_requests: Some(40),
        concurrency: 1,
        ..spec(Workload::PrefixRepetition {
            prefixes: 4,
            prefix_tokens: 64,
            unique_tokens: 16,
            output_tokens: 2,
        })
    };
    let arms = ["round_robin".to_string()];
    let (runs, limit) =
        bench::compare(&bench::Target::Sim(Box::new(sim)), &arms, &load, (1e9, 1e9))
            .await
            .unwrap();
    let run = &runs[0];
    assert_eq!(run.summary.requests, 40, "{:?}", run.summary);
    assert_eq!(run.summary.errors, 0);
    let mut names: Vec<&str> = run.per_worker.iter().map(|w| w.worker.as_str()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 4, "four engines, each its own row: {names:?}");
    for w in &run.per_worker {
        assert!(
            w.worker.ends_with("/dp0") || w.worker.ends_with("/dp1"),
            "{}",
            w.worker
        );
        assert_eq!(
            w.counters.requests, 10.0,
            "round-robin over four ranks: {w:?}"
        );
    }
    assert!(limit.is_some_and(|l| l > 0.0), "{limit:?}");
}

/// The simulator refuses to empty its cache while a request holds blocks, as vLLM does.
#[tokio::test]
async fn reset_prefix_cache_is_refused_while_a_request_runs() {
    let _shared = POOLS.read().await;
    let sim = SimConfig {
        workers: 1,
        port: 0,
        engine: Some(small_engine(2048)),
        ..SimConfig::default()
    };
    let pool = bench::start_pool(&sim, "round_robin").await.unwrap();
    let worker = pool.workers[0].clone();
    let addr: std::net::SocketAddr = worker.trim_start_matches("http://").parse().unwrap();
    let body = serde_json::json!({"model": "tiny", "prompt": "a b c", "max_tokens": 500,
                                  "ignore_eos": true, "stream": true});
    let mut running =
        common::send(addr, "POST", "/v1/completions", body.to_string().as_bytes()).await;
    let first = common::read_until(&mut running, b"data: {", Duration::from_secs(10)).await;
    assert!(String::from_utf8_lossy(&first).contains("data: {"));
    let busy = common::request(addr, "POST", "/reset_prefix_cache", b"").await;
    assert_eq!(busy.json(), serde_json::json!({"success": false}));
    drop(running); // the client leaves; the simulator aborts the request and frees its blocks
    bench::workers::reset_prefix_caches(&[worker])
        .await
        .unwrap();
}

/// Two small simulated workers behind a round-robin gateway, for conversations of a few turns.
async fn conversation_pool() -> bench::Pool {
    let sim = SimConfig {
        workers: 2,
        engine: Some(small_engine(2048)),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    bench::start_pool(&sim, "round_robin").await.unwrap()
}

/// The samples by request index.
fn indexed(
    samples: &[bench::stats::Sample],
) -> std::collections::HashMap<u64, &bench::stats::Sample> {
    samples.iter().map(|s| (s.index, s)).collect()
}

/// Multi-turn and chat: every conversation's turns go out in order, each after the previous one
/// ended, so no conversation's turns are spread over clients in lockstep with the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversation_turns_are_sent_in_order_each_after_the_previous_ended() {
    let _shared = POOLS.read().await;
    let pool = conversation_pool().await;
    let workload = Workload::Chat {
        turns: 4,
        system_tokens: 64,
        user_tokens: 8,
        output_tokens: 4,
    };
    let load = LoadSpec {
        url: pool.gateway.clone(),
        concurrency: 3,
        warmup: Duration::ZERO,
        max_requests: Some(36),
        duration: Duration::from_secs(60),
        ..spec(workload)
    };
    let samples = bench::loadgen::run(&load).await.unwrap();
    assert_eq!(samples.len(), 36);
    let by_index = indexed(&samples);
    let (mut followed, mut firsts) = (0, 0);
    for s in &samples {
        assert!(s.ok, "{:?}", s.error);
        if s.index % 4 == 0 {
            firsts += 1; // a conversation's first turn
            continue;
        }
        let prev = by_index[&(s.index - 1)];
        assert!(
            s.intended >= prev.done,
            "turn {} sent at {} before turn {} ended at {}",
            s.index,
            s.intended,
            prev.index,
            prev.done
        );
        followed += 1;
    }
    // The request budget may cut the last conversations short, never a turn's predecessor.
    assert_eq!(followed + firsts, 36);
    let whole = samples.iter().filter(|s| s.index % 4 == 3).count();
    assert!(
        whole >= 6,
        "only {whole} conversations reached their 4th turn"
    );
}

#[test]
fn think_times_are_exponential_around_their_mean_and_the_same_for_every_target() {
    let mean = Duration::from_millis(100);
    let draws: Vec<f64> = (0..20_000)
        .map(|i| bench::loadgen::think_time(7, i, mean).as_secs_f64())
        .collect();
    let avg = draws.iter().sum::<f64>() / draws.len() as f64;
    assert!((avg - 0.1).abs() < 0.005, "mean {avg}");
    // Exponential: about 1 - 1/e of the draws below the mean, about e^-3 above three means.
    let below = draws.iter().filter(|&&d| d < 0.1).count() as f64 / draws.len() as f64;
    let far = draws.iter().filter(|&&d| d > 0.3).count() as f64 / draws.len() as f64;
    assert!((below - 0.632).abs() < 0.02, "share below the mean {below}");
    assert!((far - 0.0498).abs() < 0.01, "share above three means {far}");
    assert!(
        draws.iter().all(|&d| d <= 2.0 + 1e-9),
        "a draw beyond 20 means"
    );
    // Drawn from the seed and the index alone: the same pause for every target.
    assert_eq!(
        bench::loadgen::think_time(7, 11, mean),
        bench::loadgen::think_time(7, 11, mean)
    );
    assert_ne!(
        bench::loadgen::think_time(7, 11, mean),
        bench::loadgen::think_time(8, 11, mean)
    );
    assert_eq!(
        bench::loadgen::think_time(7, 11, Duration::ZERO),
        Duration::ZERO
    );
}

/// With `ramp_up`, a closed loop's clients start evenly spread over it (client k of C at k/C of
/// it) instead of all at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ramp_up_starts_the_clients_spread_over_it() {
    let _shared = POOLS.read().await;
    let pool = conversation_pool().await;
    let ramp = Duration::from_millis(200);
    let load = LoadSpec {
        url: pool.gateway.clone(),
        concurrency: 4,
        ramp_up: ramp,
        warmup: Duration::ZERO,
        max_requests: Some(4),
        duration: Duration::from_secs(60),
        // 160 steps of at least 10 ms of modelled time at time scale 4: every request takes at
        // least 400 ms, longer than the ramp, so the four requests are the four clients' first.
        ..spec(Workload::Random {
            input_tokens: 16,
            output_tokens: 160,
        })
    };
    let samples = bench::loadgen::run(&load).await.unwrap();
    assert_eq!(samples.len(), 4);
    assert!(samples.iter().all(|s| s.ok), "{samples:?}");
    let mut starts: Vec<f64> = samples.iter().map(|s| s.intended).collect();
    starts.sort_by(f64::total_cmp);
    for (k, &at) in starts.iter().enumerate() {
        let slot = ramp.as_secs_f64() * k as f64 / 4.0;
        assert!(
            at >= slot - 1e-3,
            "start {k} of 4 went at {at:.3}s, before its place in the ramp ({slot:.3}s): {starts:?}"
        );
    }
    // Nor do they all wait for the ramp's end: the first goes before the last one's place.
    let last_slot = ramp.as_secs_f64() * 3.0 / 4.0;
    assert!(
        starts[0] < last_slot,
        "the first client waited until {:.3}s: {starts:?}",
        starts[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_think_before_each_request_so_they_do_not_start_in_step() {
    let _shared = POOLS.read().await;
    let pool = conversation_pool().await;
    let think = Duration::from_millis(150);
    let load = LoadSpec {
        url: pool.gateway.clone(),
        concurrency: 4,
        think,
        warmup: Duration::ZERO,
        max_requests: Some(24),
        duration: Duration::from_secs(60),
        ..spec(Workload::Chat {
            turns: 3,
            system_tokens: 64,
            user_tokens: 8,
            output_tokens: 4,
        })
    };
    let samples = bench::loadgen::run(&load).await.unwrap();
    assert_eq!(samples.len(), 24);
    let by_index = indexed(&samples);
    let mut waited = 0;
    for s in &samples {
        assert!(s.ok, "{:?}", s.error);
        let pause = bench::loadgen::think_time(load.seed, s.index, think).as_secs_f64();
        if s.index % 3 != 0 {
            // A later turn: sent no sooner than its own think time after the turn before ended.
            let prev = by_index[&(s.index - 1)];
            assert!(
                s.intended >= prev.done + pause,
                "turn {} sent {:.3}s after turn {} ended, its think time is {pause:.3}s",
                s.index,
                s.intended - prev.done,
                prev.index
            );
            waited += 1;
        }
    }
    assert!(waited >= 12, "{waited} later turns");
    // The four clients' first requests (conversations 0-3) each wait their own think time
    // from the start, rather than all going out at once.
    for conv in 0..4u64 {
        let first = by_index[&(conv * 3)];
        let pause = bench::loadgen::think_time(load.seed, conv * 3, think).as_secs_f64();
        assert!(
            first.intended >= pause,
            "conversation {conv} began at {:.3}s, before its think time {pause:.3}s",
            first.intended
        );
    }
    let starts: Vec<f64> = (0..4u64).map(|c| by_index[&(c * 3)].intended).collect();
    let spread = starts.iter().cloned().fold(f64::MIN, f64::max)
        - starts.iter().cloned().fold(f64::MAX, f64::min);
    assert!(
        spread > 0.01,
        "first requests within {spread:.4}s of each other"
    );
}

/// With `output_range`, each request asks for its own length, drawn the same for every target,
/// and the worker generates exactly that many tokens; the lengths spread around the workload's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_lengths_vary_around_the_workloads_with_output_range() {
    let _shared = POOLS.read().await;
    let pool = conversation_pool().await;
    let load = LoadSpec {
        url: pool.gateway.clone(),
        concurrency: 4,
        warmup: Duration::ZERO,
        max_requests: Some(24),
        duration: Duration::from_secs(60),
        output_range: 0.5,
        ..spec(Workload::PrefixRepetition {
            prefixes: 2,
            prefix_tokens: 32,
            unique_tokens: 8,
            output_tokens: 16,
        })
    };
    let samples = bench::loadgen::run(&load).await.unwrap();
    assert_eq!(samples.len(), 24);
    let mut lengths = std::collections::BTreeSet::new();
    for s in &samples {
        assert!(s.ok, "{:?}", s.error);
        let asked = load.request(s.index);
        assert_eq!(asked.body["max_tokens"], asked.output_tokens);
        assert!(
            (8..=24).contains(&asked.output_tokens),
            "{}",
            asked.output_tokens
        );
        assert_eq!(s.output_tokens, asked.output_tokens, "request {}", s.index);
        // The prompt is the workload's own: only the length moves.
        let fixed = load.workload.request(load.seed, s.index);
        assert_eq!(asked.body["prompt"], fixed.body["prompt"]);
        lengths.insert(s.output_tokens);
    }
    assert!(lengths.len() >= 6, "{lengths:?}");
    // Without it, every request asks for the workload's length.
    let fixed = LoadSpec {
        output_range: 0.0,
        ..load.clone()
    };
    assert!((0..24).all(|i| fixed.request(i).output_tokens == 16));
}

/// Serves `routes` on a loopback port, with `/v1/models` listing one model, for the load
/// generator to run against; returns the base URL.
async fn stand_in_target(routes: axum::Router) -> String {
    use axum::{routing::get, Json};
    let app = routes.route(
        "/v1/models",
        get(|| async { Json(serde_json::json!({"data": [{"id": "m"}]})) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// Other servers frame SSE differently; the load generator reads any conformant stream: CRLF line
/// ends, `data:` without a space, data over two lines, comments and `event:` lines.
#[tokio::test]
async fn the_load_generator_reads_any_conformant_event_stream() {
    let _shared = POOLS.read().await;
    use axum::{routing::post, Router};
    let stream = concat!(
        ": keep-alive comment\r\n\r\n",
        "event: message\r\ndata:{\"choices\":[{\"index\":0,\"text\":\" one\"}]}\r\n\r\n",
        "data: {\"choices\":[{\"index\":0,\r\ndata: \"text\":\" two\"}]}\r\n\r\n",
        "id: 3\ndata: {\"choices\":[{\"index\":0,\"text\":\" three\"}]}\n\n",
        "data:{\"choices\":[],\"usage\":{\"completion_tokens\":3}}\r\r",
        "data: [DONE]\r\n\r\n",
    );
    let url = stand_in_target(Router::new().route(
        "/v1/completions",
        post(move || async move { ([("content-type", "text/event-stream")], stream) }),
    ))
    .await;
    let load = LoadSpec {
        url,
        concurrency: 1,
        warmup: Duration::ZERO,
        max_requests: Some(3),
        ..spec(Workload::Random {
            input_tokens: 4,
            output_tokens: 3,
        })
    };
    let samples = bench::loadgen::run(&load).await.unwrap();
    assert_eq!(samples.len(), 3);
    for s in &samples {
        assert!(s.ok, "{:?}", s.error);
        assert_eq!(s.token_times.len(), 3, "three content events");
        assert_eq!(s.output_tokens, 3);
    }
}

/// With `session_header`, every request names its conversation: a chat's turns share one value,
/// the conversations each have their own, and independent requests are each a session of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_header_names_each_requests_conversation() {
    let _shared = POOLS.read().await;
    use axum::{http::HeaderMap, routing::post, Json, Router};
    use std::sync::Arc;
    type Seen = Arc<parking_lot::Mutex<Vec<(Option<String>, serde_json::Value)>>>;
    let seen: Seen = Arc::default();
    let answer = |seen: Seen| {
        move |headers: HeaderMap, Json(body): Json<serde_json::Value>| async move {
            let session = headers
                .get("x-session-id")
                .map(|v| v.to_str().unwrap().to_string());
            seen.lock().push((session, body));
            (
                [("content-type", "text/event-stream")],
                "data: {\"choices\":[{\"index\":0,\"text\":\" a\"}]}\n\ndata: [DONE]\n\n",
            )
        }
    };
    let url = stand_in_target(
        Router::new()
            .route("/v1/chat/completions", post(answer(seen.clone())))
            .route("/v1/completions", post(answer(seen.clone()))),
    )
    .await;
    // One client, so the request budget ends with the third conversation.
    let chat = LoadSpec {
        url,
        concurrency: 1,
        warmup: Duration::ZERO,
        max_requests: Some(9),
        session_header: Some(http::HeaderName::from_static("x-session-id")),
        ..spec(Workload::Chat {
            turns: 3,
            system_tokens: 16,
            user_tokens: 4,
            output_tokens: 1,
        })
    };
    let samples = bench::loadgen::run(&chat).await.unwrap();
    assert!(samples.iter().all(|s| s.ok), "{samples:?}");
    let mut sessions = std::collections::BTreeMap::<String, Vec<serde_json::Value>>::new();
    for (session, body) in seen.lock().drain(..) {
        let session = session.expect("every request names its session");
        sessions.entry(session).or_default().push(body);
    }
    // Seed 3, conversations 0, 1 and 2 of three turns each.
    assert_eq!(
        sessions.keys().collect::<Vec<_>>(),
        ["3-0", "3-1", "3-2"],
        "{sessions:?}"
    );
    let mut first_messages = std::collections::BTreeSet::new();
    for turns in sessions.values_mut() {
        // One session's requests are one conversation: turns 1, 2, 3, each resending the last.
        turns.sort_by_key(|b| b["messages"].as_array().unwrap().len());
        let lengths: Vec<usize> = turns
            .iter()
            .map(|b| b["messages"].as_array().unwrap().len())
            .collect();
        assert_eq!(lengths, [2, 4, 6]);
        for pair in turns.windows(2) {
            assert_eq!(pair[0]["messages"][1], pair[1]["messages"][1]);
        }
        first_messages.insert(turns[0]["messages"][1]["content"].to_string());
    }
    assert_eq!(first_messages.len(), 3, "three different conversations");
    // Independent requests: a session each. Without the option, no header.
    let random = LoadSpec {
        max_requests: Some(4),
        workload: Workload::Random {
            input_tokens: 4,
            output_tokens: 1,
        },
        ..chat.clone()
    };
    bench::loadgen::run(&random).await.unwrap();
    let plain = LoadSpec {
        session_header: None,
        ..random.clone()
    };
    bench::loadgen::run(&plain).await.unwrap();
    let seen = seen.lock();
    let named: std::collections::BTreeSet<_> =
        seen[..4].iter().map(|(s, _)| s.clone().unwrap()).collect();
    assert_eq!(named.len(), 4, "{named:?}");
    assert!(seen[4..].iter().all(|(s, _)| s.is_none()));
    assert_eq!(seen.len(), 8);
}

/// A Mooncake-format trace is replayed at its timestamps (sped up), request for request, and
/// requests that share hash ids share prompt blocks in the workers' caches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mooncake_trace_is_replayed_at_its_timestamps() {
    let _shared = POOLS.read().await;
    let sim = SimConfig {
        workers: 1,
        engine: Some(small_engine(2048)),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    let pool = bench::start_pool(&sim, "round_robin").await.unwrap();
    // Ten requests 100 ms apart (50 ms at speed-up 2); all share block 1, half also block 2.
    let lines: String = (0..10)
        .map(|k| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, {}]}}\n",
                1000 + 100 * k,
                2 + k % 2 * (10 + k)
            )
        })
        .collect();
    let mut trace = bench::trace::Trace::parse(&lines, "mooncake").unwrap();
    trace.speedup = 2.0;
    let load = LoadSpec {
        url: pool.gateway.clone(),
        warmup: Duration::ZERO,
        duration: Duration::from_secs(30),
        ..spec(Workload::Trace(trace))
    };
    let (run, samples) = bench::run_once("trace", &load, &pool.workers, (1e9, 1e9), 1.0)
        .await
        .unwrap();
    assert_eq!(samples.len(), 10, "the trace ends the run");
    for s in &samples {
        assert!(s.ok, "{:?}", s.error);
        let due = s.index as f64 * 0.05;
        assert!(
            (s.intended - due).abs() < 1e-9,
            "request {} intended at {}",
            s.index,
            s.intended
        );
        assert!(s.sent >= due, "request {} sent early", s.index);
    }
    // The shared first 512-token block is computed once; later requests find it cached.
    let w = run.workers.unwrap();
    assert!(w.prefix_hits >= 8.0 * 496.0, "{w:?}");
}

/// Another router as an arm: started from its command template in front of the fresh pool,
/// measured on the same load, stopped after. (kvroute's own binary stands in for it here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_router_arm_is_started_per_pool_and_measured_beside_the_policies() {
    let _shared = POOLS.read().await;
    let sim = SimConfig {
        workers: 2,
        engine: Some(small_engine(2048)),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    let load = LoadSpec {
        warmup: Duration::ZERO,
        max_requests: Some(30),
        duration: Duration::from_secs(60),
        ..spec(Workload::Random {
            input_tokens: 32,
            output_tokens: 4,
        })
    };
    let external = format!(
        "other={} serve --listen 127.0.0.1:{{port}} --policy least_conn --worker {{workers}}",
        env!("CARGO_BIN_EXE_kvroute")
    );
    let arms = ["round_robin".to_string(), external];
    let (runs, _) = bench::compare(
        &bench::Target::Sim(Box::new(sim.clone())),
        &arms,
        &load,
        (1e9, 1e9),
    )
    .await
    .unwrap();
    assert_eq!(runs[1].label, "other");
    for r in &runs {
        assert_eq!(
            (r.summary.requests, r.summary.errors),
            (30, 0),
            "{}",
            r.label
        );
        let served: f64 = r.per_worker.iter().map(|w| w.counters.requests).sum();
        assert_eq!(served, 30.0, "{}: every request reached the pool", r.label);
    }
    // The external process counted its own decisions: it really routed the load.
    assert_eq!(
        runs[1].routing.values().sum::<f64>(),
        30.0,
        "{:?}",
        runs[1].routing
    );
}

/// A router that cannot start fails its arm with what it printed, not a bare exit status.
#[tokio::test]
async fn an_external_arm_that_exits_reports_its_output() {
    let _shared = POOLS.read().await;
    let sim = SimConfig {
        workers: 1,
        engine: Some(small_engine(2048)),
        ..SimConfig::default()
    };
    // `ls` of a missing path prints why and exits non-zero, as a router with a bad flag would.
    let arm = "broken=ls /no-such-dir-for-kvroute-{port}".to_string();
    let err = bench::start_pool(&sim, &arm)
        .await
        .err()
        .expect("the arm fails");
    let msg = err.to_string();
    assert!(msg.contains("exited before it was ready"), "{msg}");
    assert!(
        msg.contains("no-such-dir-for-kvroute-"),
        "its output is quoted: {msg}"
    );
}

/// A `+events` arm follows the pool's KV cache events, tokenizing with the workers' own
/// tokenizer.json: with 2 gateway replicas its decisions are exact matches, its predicted cached
/// tokens are what the workers then report, and the replicas agree on where cached prefixes are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_events_arm_predicts_the_workers_cache_and_its_replicas_agree() {
    let _alone = POOLS.write().await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let sim = SimConfig {
        workers: 2,
        engine: Some(small_engine(4096)),
        time_scale: 4.0,
        kv_events: true,
        tokenizer: Some(root.join("tests/tokenize/tiny-tokenizer.json")),
        tokenizer_config: Some(root.join("tests/vllm/model/tokenizer_config.json")),
        ..SimConfig::default()
    };
    let load = LoadSpec {
        warmup: Duration::ZERO,
        max_requests: Some(64),
        duration: Duration::from_secs(60),
        ..spec(Workload::Chat {
            turns: 4,
            system_tokens: 256,
            user_tokens: 32,
            output_tokens: 4,
        })
    };
    let arms = ["cache_aware".to_string(), "cache_aware+events".to_string()];
    let (runs, limit) = bench::compare_replicated(
        &bench::Target::Sim(Box::new(sim)),
        &arms,
        &load,
        (1e9, 1e9),
        2,
    )
    .await
    .unwrap();
    assert!(limit.is_some_and(|l| l > 0.5), "{limit:?}");
    let events = &runs[1];
    assert_eq!(events.label, "cache_aware+events");
    assert_eq!((events.summary.requests, events.summary.errors), (64, 0));
    assert!(
        events.routing.get("exact_match").copied().unwrap_or(0.0) > 32.0,
        "{:?}",
        events.routing
    );
    let c = events.cached_tokens.expect("cached tokens counted");
    assert!(c.reported > 5_000.0, "{c:?}");
    // Within 10%: in this short closed loop each turn follows its predecessor's answer at once,
    // and the block that answer completed is published in the same engine step, so it races the
    // next turn's decision (one 16-token block of a ~400-token prompt; 0.95-0.97x here, 1.00x
    // on the bench in docs/measurements.md).
    assert!(
        (c.predicted / c.reported - 1.0).abs() <= 0.10,
        "predicted within 10% of reported: {c:?}"
    );
    for r in &runs {
        let a = r.replica_agreement.expect("replicas asked");
        assert!(a.probed == 64 && a.cached > 0, "{}: {a:?}", r.label);
    }
    let a = events.replica_agreement.unwrap();
    println!("events arm: cached tokens {c:?}, replicas {a:?}");
    assert!(
        a.agreed as f64 >= 0.95 * a.cached as f64,
        "replicas fed the same events agree: {a:?}"
    );
}

/// A kvroute arm's gateway runs on a thread of its own, as a gateway in its own process would,
/// not on the runtime of the simulated workers and the load generator. Here the test's runtime
/// (a single thread, which also runs the pool's workers) is held for as long as a client on
/// another thread waits for the gateway's `/metrics`: the gateway answers all the same. On the
/// bench's runtime it could not answer until the runtime was free, and the client's 5 s read
/// timeout would fail the test.
#[tokio::test(flavor = "current_thread")]
async fn a_bench_gateway_answers_while_the_benchs_runtime_is_held() {
    let _shared = POOLS.read().await;
    use std::io::{Read, Write};
    let sim = SimConfig {
        workers: 1,
        engine: Some(small_engine(2048)),
        ..SimConfig::default()
    };
    let pool = bench::start_pool(&sim, "round_robin").await.unwrap();
    let addr: std::net::SocketAddr = pool.gateway.trim_start_matches("http://").parse().unwrap();
    let client = std::thread::spawn(move || -> std::io::Result<String> {
        let mut conn = std::net::TcpStream::connect(addr)?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer)?;
        Ok(answer)
    });
    // Holds this runtime's only thread until the client is done.
    let answer = client
        .join()
        .unwrap()
        .expect("the gateway answered in time");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("kvroute_"), "{answer}");
}

/// The same chat conversations through the Responses API: every request answered with its full
/// length, and `cache_aware` keeps each conversation where its history is cached, where
/// round-robin moves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_through_the_responses_api_keeps_conversations_on_their_cache() {
    let _alone = POOLS.write().await;
    let sim = SimConfig {
        workers: 2,
        engine: Some(small_engine(2048)),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    let load = LoadSpec {
        api: bench::loadgen::Api::Responses,
        concurrency: 4,
        ..spec(Workload::Chat {
            turns: 6,
            system_tokens: 256,
            user_tokens: 48,
            output_tokens: 8,
        })
    };
    let policies = ["round_robin".to_string(), "cache_aware".to_string()];
    let (runs, _) = bench::compare(
        &bench::Target::Sim(Box::new(sim)),
        &policies,
        &load,
        (1e9, 1e9),
    )
    .await
    .unwrap();
    let table = bench::report::table(&runs);
    for r in &runs {
        assert!(r.summary.requests > 20, "{}: {:?}", r.label, r.summary);
        assert_eq!(r.summary.errors, 0, "{table}");
        let tokens = r.summary.output_tok_per_s * r.summary.window_seconds;
        assert_eq!(
            tokens.round() as usize,
            8 * r.summary.succeeded,
            "{}: {table}",
            r.label
        );
    }
    // Round-robin's hit rate here moves with timing (0.75-0.79 over eight local runs, 0.78 in a
    // CI run), `cache_aware`'s stays at 0.83: a fixed margin between them failed now and then.
    // What the name claims is checked directly: `cache_aware` routed nearly every turn to the
    // worker holding its longest match, and hit more than round-robin.
    let hit = |i: usize| runs[i].workers.as_ref().unwrap().hit_rate();
    assert!(hit(1) > hit(0), "{table}");
    let decided: f64 = runs[1].routing.values().sum();
    let followed = runs[1].routing.get("longest_match").copied().unwrap_or(0.0);
    assert!(followed >= 0.9 * decided, "{table}");
}
