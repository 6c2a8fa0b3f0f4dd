//! `cache_aware` end to end: real HTTP over loopback to simulated vLLM workers.

mod common;

use std::{net::SocketAddr, time::Duration};

use common::{gateway, metric, metrics_text, request};
use kvroute::{
    config::{Config, WorkerConfig},
    sim::{self, SimConfig},
};
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

struct Sim {
    urls: Vec<String>,
    cancel: CancellationToken,
    _tasks: JoinSet<()>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn sim(workers: usize) -> Sim {
    sim_of(SimConfig {
        workers,
        port: 0,
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
}

async fn sim_of(cfg: SimConfig) -> Sim {
    let cancel = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let addrs = sim::spawn(&cfg, cfg.bind().await.unwrap(), &cancel, &mut tasks)
        .await
        .unwrap();
    Sim {
        urls: addrs.iter().map(|a| format!("http://{a}")).collect(),
        cancel,
        _tasks: tasks,
    }
}

fn config(sim: &Sim) -> Config {
    config_of(&sim.urls)
}

/// `cache_aware` in front of the workers at `urls`.
fn config_of(urls: &[String]) -> Config {
    Config {
        workers: urls.iter().cloned().map(WorkerConfig::from_url).collect(),
        ..Config::default()
    }
    .with_overrides(kvroute::config::Overrides {
        policy: Some("cache_aware".into()),
        ..Default::default()
    })
    .unwrap()
}

fn words(seed: usize, n: usize) -> String {
    (0..n)
        .map(|i| ["alpha", "beta", "gamma", "delta", "omega"][(seed * 7 + i * 3) % 5])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Conversation `c` after `turns` user turns, all behind one shared system prompt.
fn chat(c: usize, turns: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content": words(0, 600)})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": format!("conversation {c} turn {t}: {}", words(c + t, 40))}));
        if t + 1 < turns {
            messages.push(json!({"role": "assistant", "content": words(c * t, 20)}));
        }
    }
    json!({"model": "mistralai/Mistral-7B-Instruct-v0.3", "messages": messages, "max_tokens": 4})
        .to_string()
        .into_bytes()
}

async fn send(addr: SocketAddr, body: &[u8]) -> (String, Value) {
    let r = request(addr, "POST", "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    (r.header("x-kvroute-worker").unwrap().to_owned(), r.json())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_behind_one_system_prompt_stay_with_their_worker() {
    let pool = sim(4).await;
    let gw = gateway(config(&pool)).await;
    let mut homes = Vec::new();
    for c in 0..8 {
        homes.push(send(gw.addr, &chat(c, 1)).await.0);
    }
    for turns in 2..=4 {
        for (c, home) in homes.iter().enumerate() {
            let (worker, answer) = send(gw.addr, &chat(c, turns)).await;
            assert_eq!(&worker, home, "conversation {c}, turn {turns}");
            let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert!(cached > 600, "turn {turns} reuses the history: {cached}");
        }
    }
    let text = metrics_text(gw.addr).await;
    let decisions = |o: &str| {
        metric(
            &text,
            &format!(r#"kvroute_routing_decisions_total{{arm="cache_aware",outcome="{o}",policy="cache_aware"}}"#),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(decisions("longest_match"), 31.0, "{text}"); // all but the very first request
                                                            // The predictions were checked against the workers' reports, and were mostly right.
    let sum = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let (predicted, reported) = (
        sum("kvroute_predicted_cached_tokens_total{"),
        sum("kvroute_reported_cached_tokens_total{"),
    );
    assert!(reported > 20_000.0, "{reported}");
    assert!(
        (predicted / reported - 1.0).abs() < 0.25,
        "{predicted} vs {reported}"
    );
    let close = metric(
        &text,
        r#"kvroute_cache_predictions_total{arm="cache_aware",policy="cache_aware",result="close"}"#,
    )
    .unwrap_or(0.0);
    assert!(close >= 24.0, "{text}");
    let blocks = metric(
        &text,
        r#"kvroute_index_blocks{arm="cache_aware",policy="cache_aware"}"#,
    )
    .unwrap();
    let bytes = metric(
        &text,
        r#"kvroute_index_bytes{arm="cache_aware",policy="cache_aware"}"#,
    )
    .unwrap();
    assert!(
        blocks > 50.0 && bytes <= (64 << 20) as f64,
        "{blocks} {bytes}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_index_cap_holds_under_many_prompts() {
    let pool = sim(2).await;
    let mut cfg = config(&pool);
    if let kvroute::config::PolicyConfig::CacheAware(p) = &mut cfg.policy {
        p.index_max_bytes = 16 << 10;
    }
    let gw = gateway(cfg).await;
    for c in 0..60 {
        send(gw.addr, &chat(100 + c, 1)).await;
    }
    let text = metrics_text(gw.addr).await;
    let series = |m: &str| format!(r#"{m}{{arm="cache_aware",policy="cache_aware"}}"#);
    let bytes = metric(&text, &series("kvroute_index_bytes")).unwrap();
    let evicted = metric(&text, &series("kvroute_index_evictions_total")).unwrap();
    assert!(bytes <= (16 << 10) as f64, "{bytes}");
    assert!(evicted > 0.0, "{text}");
}

/// With `new_prompt_by_reuse`, `/metrics` shows the share of recent prompts that began with
/// something known: it falls while prompts are all new and rises when they continue earlier ones.
/// Without the flag there is no such share, and no series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reuse_share_is_exported_while_new_prompt_by_reuse_is_on() {
    let pool = sim(2).await;
    let series = r#"kvroute_routing_reuse_share{arm="cache_aware",policy="cache_aware"}"#;
    let mut cfg = config(&pool);
    if let kvroute::config::PolicyConfig::CacheAware(p) = &mut cfg.policy {
        p.new_prompt_by_reuse = false;
    }
    let off = gateway(cfg.clone()).await;
    send(off.addr, &chat(0, 1)).await;
    let text = metrics_text(off.addr).await;
    assert_eq!(metric(&text, series), None, "{text}");

    if let kvroute::config::PolicyConfig::CacheAware(p) = &mut cfg.policy {
        p.new_prompt_by_reuse = true;
    }
    let on = gateway(cfg).await;
    // Conversations whose prompts differ from their first byte: nothing shared between them.
    let own = |c: usize, turns: usize| -> Vec<u8> {
        let mut messages =
            vec![json!({"role": "system", "content": format!("assistant {c}: {}", words(c, 300))})];
        for t in 0..turns {
            messages.push(json!({"role": "user", "content": words(c + t, 40)}));
            if t + 1 < turns {
                messages.push(json!({"role": "assistant", "content": words(c * t, 20)}));
            }
        }
        json!({"model": "mistralai/Mistral-7B-Instruct-v0.3", "messages": messages, "max_tokens": 4})
            .to_string()
            .into_bytes()
    };
    // 40 first turns, nothing known of any: the share falls from 1 by 1/64 each, to about 0.53.
    // Then their second turns, each beginning with its first: it climbs back, to about 0.75.
    for (turns, expected) in [(1, 0.45..0.6), (2, 0.7..0.8)] {
        for c in 0..40 {
            send(on.addr, &own(200 + c, turns)).await;
        }
        let share = metric(&metrics_text(on.addr).await, series).unwrap();
        assert!(
            expected.contains(&share),
            "share {share} after {turns}-turn prompts"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_continuation_share_is_exported_while_fade_by_continuation_is_on() {
    let pool = sim(2).await;
    let series = r#"kvroute_routing_continuing_share{arm="cache_aware",policy="cache_aware"}"#;
    let mut cfg = config(&pool);
    let on = gateway(cfg.clone()).await;
    send(on.addr, &chat(0, 1)).await;
    // It starts at 1 and moves only with requests past a prefix most workers hold.
    let share = metric(&metrics_text(on.addr).await, series);
    assert!(share.is_some_and(|s| (0.0..=1.0).contains(&s)), "{share:?}");
    if let kvroute::config::PolicyConfig::CacheAware(p) = &mut cfg.policy {
        p.fade_by_continuation = false;
    }
    let off = gateway(cfg).await;
    send(off.addr, &chat(0, 1)).await;
    assert_eq!(metric(&metrics_text(off.addr).await, series), None);
}

/// A second gateway in front of one worker: prompts it has never seen that the first sent there
/// come back from the worker cached, so its share of new prompts the worker held stays at 1;
/// prompts nobody sent before pull it down, 1/64 a prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_share_of_new_prompts_the_worker_held_is_learnt_from_cached_tokens() {
    let pool = sim(1).await;
    let series = r#"kvroute_routing_unseen_reuse_share{arm="cache_aware",policy="cache_aware"}"#;
    let cfg = config(&pool);
    let (first, second) = (gateway(cfg.clone()).await, gateway(cfg.clone()).await);
    let prompt = |c: usize| -> Vec<u8> {
        let messages = vec![
            json!({"role": "system", "content": format!("assistant {c}: {}", words(c, 300))}),
            json!({"role": "user", "content": words(c + 1, 40)}),
        ];
        json!({"model": "mistralai/Mistral-7B-Instruct-v0.3", "messages": messages, "max_tokens": 4})
            .to_string()
            .into_bytes()
    };
    for c in 0..20 {
        send(first.addr, &prompt(300 + c)).await;
    }
    for c in 0..20 {
        let (_, answer) = send(second.addr, &prompt(300 + c)).await;
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        assert!(cached.is_some_and(|t| t > 64), "{answer}");
    }
    let share = metric(&metrics_text(second.addr).await, series);
    assert_eq!(share, Some(1.0));
    for c in 0..40 {
        send(second.addr, &prompt(400 + c)).await;
    }
    // 40 samples of 0: (63/64)^40, about 0.53.
    let share = metric(&metrics_text(second.addr).await, series).unwrap();
    assert!((0.45..0.6).contains(&share), "share {share}");
    let mut cfg = cfg;
    if let kvroute::config::PolicyConfig::CacheAware(p) = &mut cfg.policy {
        p.reuse_from_usage = false;
    }
    let off = gateway(cfg).await;
    send(off.addr, &prompt(500)).await;
    assert_eq!(metric(&metrics_text(off.addr).await, series), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_signals_are_polled_from_the_workers_metrics() {
    let pool = sim(2).await;
    let mut cfg = config(&pool);
    cfg.load_signals.interval_seconds = 0.05;
    let state = kvroute::routes::AppState::new(cfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stop = CancellationToken::new();
    let up = state.upstreams.clone();
    let task = tokio::spawn(kvroute::server::serve_state(
        listener,
        state,
        Duration::from_secs(1),
        stop.clone(),
    ));
    // The simulator serves vLLM's gauges: once polled, a worker's queue reads from them.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let workers = up.pool.snapshot();
    while workers.iter().any(|w| w.load.kv_usage().is_none()) {
        assert!(tokio::time::Instant::now() < deadline, "never polled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// A worker's count of requests beyond this gateway's own (other replicas') is what it had when
/// polled less this gateway's requests there. One of this gateway's requests that ends while the
/// poll is out is still in the worker's count; read after the poll came back, this gateway's
/// count would have dropped, and a lone gateway would take its own request for another
/// replica's. A worker that counts a request this gateway never sent does show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_ends_while_the_poll_is_out_is_not_taken_for_another_replicas() {
    use axum::{extract::State, routing::get, Router};
    use tokio::sync::{mpsc, Mutex};
    type Answers = std::sync::Arc<(mpsc::Sender<()>, Mutex<mpsc::Receiver<u32>>)>;
    // A worker whose /metrics tells the test it was asked and answers the running count the
    // test then gives it.
    async fn metrics(State(s): State<Answers>) -> String {
        let _ = s.0.try_send(());
        let running = s.1.lock().await.recv().await.unwrap_or(0);
        format!("vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n")
    }
    let (asked_tx, mut asked) = mpsc::channel(1);
    let (answer, answer_rx) = mpsc::channel(1);
    let state: Answers = std::sync::Arc::new((asked_tx, Mutex::new(answer_rx)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(state);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let mut cfg = config_of(&[format!("http://{addr}")]);
    cfg.load_signals.interval_seconds = 0.01;
    let state = kvroute::routes::AppState::new(cfg).unwrap();
    let up = state.upstreams.clone();
    let worker = up.pool.snapshot()[0].clone();
    // One request of this gateway's in flight as the poll goes out, ended before it comes back:
    // the worker counted it.
    let ours = kvroute::workers::HeldWorker::from(&worker).acquire();
    let stop = CancellationToken::new();
    let poller = tokio::spawn(kvroute::load::run(up, stop.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    asked.recv().await.unwrap();
    drop(ours);
    answer.send(1).await.unwrap();
    // The next poll waits for its answer, so what the first one stored stays.
    asked.recv().await.unwrap();
    assert_eq!(worker.load.kv_usage(), Some(0.1));
    assert_eq!(
        worker.load.queued(0),
        0,
        "its own request taken for another's"
    );
    // Now the worker counts one request, and this gateway has none there.
    answer.send(1).await.unwrap();
    while worker.load.queued(0) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "another's request never seen"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(worker.load.queued(0), 1);
    stop.cancel();
    drop(answer);
    poller.await.unwrap();
}

/// The prefill backlog the gateway prices is exported per worker: a request the worker has not
/// started answering counts its prompt there until its first token, then nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_workers_pending_prefill_is_exported_until_its_first_token() {
    // The worker looks at each request 1.5 s after it arrives: until then it is all prefill.
    let pool = sim_of(SimConfig {
        workers: 1,
        faults: sim::Faults {
            added_latency_ms: 1500,
            ..Default::default()
        },
        ..SimConfig::default()
    })
    .await;
    let gw = gateway(config(&pool)).await;
    let name = pool.urls[0].trim_start_matches("http://");
    let pending = format!("kvroute_worker_pending_prefill_tokens{{worker=\"{name}\"}}");
    let done = format!("kvroute_worker_step_prefill_done_tokens{{worker=\"{name}\"}}");
    let text = metrics_text(gw.addr).await;
    assert_eq!(metric(&text, &pending), Some(0.0), "{text}");
    // 2,000 bytes: 500 tokens at the 4 bytes a token the gateway starts from.
    let body = json!({"prompt": "abcd".repeat(500), "max_tokens": 4, "stream": true}).to_string();
    let mut s = common::send(gw.addr, "POST", "/v1/completions", body.as_bytes()).await;
    let seen = common::wait_metric(gw.addr, &pending, 500.0, Duration::from_secs(1)).await;
    assert_eq!(seen, Some(500.0));
    // No step fitted on one request: nothing of it is counted done by a step.
    assert_eq!(metric(&metrics_text(gw.addr).await, &done), Some(0.0));
    let answer = common::read_until(&mut s, b"[DONE]", Duration::from_secs(10)).await;
    assert!(String::from_utf8_lossy(&answer).contains("[DONE]"));
    let after = common::wait_metric(gw.addr, &pending, 0.0, Duration::from_secs(5)).await;
    assert_eq!(after, Some(0.0));
}

/// `/debug/route` says where a request would go and why, and changes nothing: asking about a
/// new conversation many times neither records it in the index nor moves where it would go, and
/// the request itself then goes where the answer said. A rotating policy says it cannot tell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_route_tells_where_a_request_would_go_without_routing_it() {
    let pool = sim(4).await;
    let gw = gateway(config(&pool)).await;
    for c in 0..4 {
        send(gw.addr, &chat(c, 1)).await;
    }
    let index_blocks = |text: &str| {
        metric(
            text,
            r#"kvroute_index_blocks{arm="cache_aware",policy="cache_aware"}"#,
        )
        .unwrap()
    };
    let before = index_blocks(&metrics_text(gw.addr).await);
    let ask = |body: Vec<u8>| async move {
        let r = request(gw.addr, "POST", "/debug/route/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r.json()
    };
    // The second turn of conversation 2: it is held where its first turn went.
    let answer = ask(chat(2, 2)).await;
    assert_eq!(answer["policy"], "cache_aware");
    assert_eq!(answer["outcome"], "longest_match", "{answer}");
    assert!(
        answer["predicted_cached_tokens"].as_u64().unwrap() > 600,
        "{answer}"
    );
    // A conversation nobody has seen: asked five times, the same answer, nothing learnt.
    let first = ask(chat(50, 1)).await;
    for _ in 0..4 {
        assert_eq!(ask(chat(50, 1)).await["worker"], first["worker"]);
    }
    assert_eq!(index_blocks(&metrics_text(gw.addr).await), before);
    let (worker, _) = send(gw.addr, &chat(50, 1)).await;
    assert_eq!(first["worker"], worker.as_str());
    // Bad input is refused as on the real route.
    let r = request(gw.addr, "POST", "/debug/route/v1/chat/completions", b"{").await;
    assert_eq!(r.status, 400);

    let mut rr = config(&pool);
    rr.policy = kvroute::config::PolicyConfig::RoundRobin;
    let gw = gateway(rr).await;
    let r = request(
        gw.addr,
        "POST",
        "/debug/route/v1/chat/completions",
        &chat(1, 1),
    )
    .await;
    assert_eq!(r.status, 501, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], 501);
}

/// A simulated worker whose KV cache holds `blocks` blocks of 16 tokens.
async fn small_cache_sim(blocks: usize) -> Sim {
    let defaults = SimConfig::default();
    let mut engine = (sim::presets::find(&defaults.preset).unwrap().params)();
    engine.num_gpu_blocks = blocks * engine.block_size / 16;
    engine.block_size = 16;
    engine.max_model_len = blocks * 16;
    sim_of(SimConfig {
        workers: 1,
        port: 0,
        time_scale: 20.0,
        engine: Some(engine),
        ..defaults
    })
    .await
}

/// A prompt of about `tokens` tokens that shares nothing with a prompt of another seed.
fn long_prompt(seed: usize, tokens: usize) -> Vec<u8> {
    let text: String = (0..tokens).map(|i| format!("w{seed}x{i} ")).collect();
    json!({"model": "mistralai/Mistral-7B-Instruct-v0.3", "prompt": text, "max_tokens": 2})
        .to_string()
        .into_bytes()
}

/// The gateway of `cfg` (one worker) in this process on 127.0.0.1:0, with that worker, so a test
/// can read what the gateway knows of it; cancel the token and await the task to stop it.
async fn serve_one_worker(
    cfg: Config,
) -> (
    SocketAddr,
    std::sync::Arc<kvroute::workers::Worker>,
    CancellationToken,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let state = kvroute::routes::AppState::new(cfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let worker = state.upstreams.pool.snapshot()[0].clone();
    let task = tokio::spawn(kvroute::server::serve_state(
        listener,
        state,
        Duration::from_secs(1),
        stop.clone(),
    ));
    (addr, worker, stop, task)
}

/// What the gateway predicts it would find cached of `body`, and what the worker then reports.
async fn predicted_then_reported(addr: SocketAddr, body: &[u8]) -> (u64, u64) {
    let r = request(addr, "POST", "/debug/route/v1/completions", body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let predicted = r.json()["predicted_cached_tokens"].as_u64().unwrap();
    let r = request(addr, "POST", "/v1/completions", body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let reported = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (predicted, reported)
}

/// With `evict_by_capacity` (the default), a prompt the worker has since evicted (more than its
/// KV cache's worth of other prompts went there after it) is no longer predicted as cached;
/// what it still holds is. Without it, the index predicts the evicted prompt in full: the
/// over-prediction an index blind to evictions makes once caches overflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_the_worker_has_evicted_is_not_predicted_as_cached() {
    for evict in [true, false] {
        // 4,096 tokens of KV; each prompt about 1,500 tokens.
        let pool = small_cache_sim(256).await;
        let mut cfg = config(&pool);
        cfg.load_signals.interval_seconds = 0.02;
        if let kvroute::config::PolicyConfig::CacheAware(p) = &mut cfg.policy {
            p.evict_by_capacity = evict;
        }
        let (addr, worker, stop, task) = serve_one_worker(cfg).await;
        // Once polled, the gateway knows the worker's KV capacity.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while worker.kv.capacity().is_none() {
            assert!(tokio::time::Instant::now() < deadline, "never polled");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(worker.kv.capacity(), Some(4096));
        let first = long_prompt(0, 1500);
        let (_, reported) = predicted_then_reported(addr, &first).await;
        assert_eq!(reported, 0);
        // Held: both sides agree it is cached.
        let (predicted, reported) = predicted_then_reported(addr, &first).await;
        assert!(
            predicted > 1000 && reported > 1000,
            "{predicted} {reported}"
        );
        // Four other prompts, 6,000 tokens: more than the cache holds.
        for seed in 1..=4 {
            predicted_then_reported(addr, &long_prompt(seed, 1500)).await;
        }
        let (predicted, reported) = predicted_then_reported(addr, &first).await;
        assert!(reported < 100, "the worker evicted it: {reported}");
        if evict {
            assert!(
                predicted < 100,
                "predicted {predicted}, reported {reported}"
            );
            // The last prompt is still there, and still predicted.
            let (predicted, reported) = predicted_then_reported(addr, &long_prompt(4, 1500)).await;
            assert!(
                predicted > 1000 && reported > 1000,
                "{predicted} {reported}"
            );
        } else {
            assert!(predicted > 1000, "blind to evictions: {predicted}");
        }
        stop.cancel();
        task.await.unwrap().unwrap();
    }
}

/// A worker that restarts comes back with an empty KV cache. The gateway's load poll sees its
/// counters start over: what it was sent before is no longer predicted as cached there (the
/// worker reports nothing cached either), what it is sent afterwards is, and the restart is
/// counted. A real process, killed and started again on the same port, as a crashed pod is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_workers_earlier_prompts_are_not_predicted_as_cached() {
    let (process, url) = common::sim_process(0);
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let mut cfg = config_of(std::slice::from_ref(&url));
    cfg.load_signals.interval_seconds = 0.02;
    let (addr, worker, stop, task) = serve_one_worker(cfg).await;
    let (a, b) = (long_prompt(0, 1500), long_prompt(1, 1500));
    predicted_then_reported(addr, &a).await;
    predicted_then_reported(addr, &b).await;
    let (predicted, reported) = predicted_then_reported(addr, &a).await;
    assert!(
        predicted > 1000 && reported > 1000,
        "{predicted} {reported}"
    );
    // Until a poll has seen the worker's prompt counter, a restart could not show.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while worker.kv.polled_prompt_tokens() < 3000.0 {
        assert!(tokio::time::Instant::now() < deadline, "never polled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(worker.kv.restarts().count(), 0);
    drop(process); // SIGKILL
    let (_again, again_url) = common::sim_process(port);
    assert_eq!(again_url, url);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while worker.kv.restarts().count() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the restart was not seen"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let series = format!(
        "kvroute_worker_restarts_total{{worker=\"{}\"}}",
        worker.name
    );
    assert_eq!(metric(&metrics_text(addr).await, &series), Some(1.0));
    // Looked up before anything is sent to it again: nothing of `a` is predicted.
    let (predicted, reported) = predicted_then_reported(addr, &a).await;
    assert_eq!((predicted, reported), (0, 0));
    // Nor of `b`, and what it has been sent since the restart is predicted again.
    let (predicted, reported) = predicted_then_reported(addr, &b).await;
    assert_eq!((predicted, reported), (0, 0));
    let (predicted, reported) = predicted_then_reported(addr, &a).await;
    assert!(
        predicted > 1000 && reported > 1000,
        "{predicted} {reported}"
    );
    assert_eq!(worker.kv.restarts().count(), 1, "one restart");
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// Wave `wave` of `size` streamed completions sent together, of 40 to 40 + `spread` words, each
/// its own from the first word, so that the workers' steps carry different amounts of prefill.
async fn stream_wave(addr: SocketAddr, wave: usize, size: usize, spread: usize) {
    let bodies = (0..size).map(|i| {
        let n = 40 + ((wave * size + i) * 37) % spread;
        json!({
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "prompt": format!("request {wave} {i}: {}", words(wave + i, n)),
            "max_tokens": 6,
            "stream": true,
        })
        .to_string()
    });
    common::post_together(addr, "/v1/completions", bodies.collect()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_engine_step_is_timed_from_the_bursts_of_its_streams() {
    // One simulated L4 at 4x: a step is 40 ms of model time plus 0.38 ms per prefill token (and
    // a little per sequence), so about 10 ms and 0.095 ms of the wall clock.
    let pool = sim_of(SimConfig {
        workers: 1,
        port: 0,
        preset: "l4-qwen2.5-7b".into(),
        time_scale: 4.0,
        ..SimConfig::default()
    })
    .await;
    let gw = gateway(config(&pool)).await;
    let fit = common::step_fit;
    assert_eq!(fit(&metrics_text(gw.addr).await, "base"), None);
    let text = common::waves_until_step_fit(gw.addr, 32, |wave| {
        stream_wave(gw.addr, wave as usize, 4, 260)
    })
    .await;
    let base = fit(&text, "base").expect("a fitted step");
    let per_token = fit(&text, "per_prefill_token").expect("a fitted step");
    assert!((0.005..0.02).contains(&base), "step base {base} s");
    assert!(
        (0.00003..0.0003).contains(&per_token),
        "step per prefill token {per_token} s"
    );
}

/// A simulated L4 and L40S at `time_scale`, and a `cache_aware` config for them that places
/// without the speed rating (so that both are sent streams to time, whatever their speed) and
/// polls every 50 ms (so that the ratings, the median of the last 64 polls, settle in seconds).
async fn unlike_gpus(time_scale: f64) -> (Sim, Config) {
    let pool = sim_of(SimConfig {
        workers: 2,
        port: 0,
        preset: "l4-qwen2.5-7b,l40s-qwen2.5-7b".into(),
        time_scale,
        ..SimConfig::default()
    })
    .await;
    let mut cfg = config(&pool);
    cfg.policy = kvroute::config::PolicyConfig::CacheAware(kvroute::config::CacheAwareParams {
        price_by_speed: false,
        ..Default::default()
    });
    cfg.load_signals.interval_seconds = 0.05;
    (pool, cfg)
}

/// A worker's slowness beside the pool's median in the metrics `text`, as the last load poll
/// rated it.
fn slowness(text: &str, url: &str) -> Option<f64> {
    let port = url.rsplit(':').next().unwrap();
    text.lines()
        .find(|l| l.starts_with("kvroute_worker_slowness{") && l.contains(port))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_on_unlike_gpus_are_rated_by_their_fitted_steps() {
    // A simulated L4 beside an L40S serving the same model, at 4x: per prefill token the L40S
    // takes about a third of the L4's time (0.13 against 0.38 ms of model time).
    let (pool, cfg) = unlike_gpus(4.0).await;
    let gw = gateway(cfg).await;
    // Waves of eight until the polls have rated them apart by about their ratio (a few polls
    // after both workers' steps are fitted, the first readings a little off at times); at most
    // 200 waves.
    let mut rated = (None, None);
    for wave in 0..200 {
        stream_wave(gw.addr, wave, 8, 400).await;
        let text = metrics_text(gw.addr).await;
        rated = (
            slowness(&text, &pool.urls[0]),
            slowness(&text, &pool.urls[1]),
        );
        if let (Some(l4), Some(l40s)) = rated {
            if (2.0..4.0).contains(&(l4 / l40s)) {
                break;
            }
        }
    }
    let (Some(l4), Some(l40s)) = rated else {
        panic!("not rated: {rated:?}");
    };
    // The median of two is their mean: the L4 above it, the L40S below, about 2.9 times apart.
    assert!(l4 > 1.0 && l40s < 1.0, "L4 {l4}, L40S {l40s}");
    assert!((2.0..4.0).contains(&(l4 / l40s)), "L4 {l4}, L40S {l40s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_on_unlike_gpus_are_rated_beside_another_replica() {
    // The L4 and the L40S again (at 8x), now behind two gateways sharing nothing, each sending
    // half the streams: each one's polls show the other's requests on the workers, and its own
    // streams' bursts time steps that also prefill the other's prompts. Each rates the workers
    // by the prefill the workers' own counters show done over its polls.
    let (pool, cfg) = unlike_gpus(8.0).await;
    let (a, b) = (gateway(cfg.clone()).await, gateway(cfg).await);
    let rated = |text: &str| (slowness(text, &pool.urls[0]), slowness(text, &pool.urls[1]));
    let apart = |r: (Option<f64>, Option<f64>)| matches!(r, (Some(l4), Some(l40s)) if (2.0..4.0).contains(&(l4 / l40s)));
    // Six clients on each gateway, one stream after another, so that both keep requests in
    // flight on both workers (as replicas under load do), until both gateways have rated the
    // workers apart by about their ratio (the first readings can be a little off); at most 90 s.
    let stop = CancellationToken::new();
    let mut clients = JoinSet::new();
    for (addr, from) in [(a.addr, 0), (b.addr, 1_000_000)] {
        for c in 0..6 {
            let stop = stop.clone();
            clients.spawn(async move {
                let mut k = from + c * 10_000;
                while !stop.is_cancelled() {
                    stream_wave(addr, k, 1, 400).await;
                    k += 1;
                }
            });
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let (mut by_a, mut by_b) = ((None, None), (None, None));
    while tokio::time::Instant::now() < deadline {
        by_a = rated(&metrics_text(a.addr).await);
        by_b = rated(&metrics_text(b.addr).await);
        if apart(by_a) && apart(by_b) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    while clients.join_next().await.is_some() {}
    for (gateway, r) in [("a", by_a), ("b", by_b)] {
        let (Some(l4), Some(l40s)) = r else {
            panic!("gateway {gateway}: not rated: {r:?}");
        };
        assert!(
            l4 > 1.0 && l40s < 1.0,
            "gateway {gateway}: L4 {l4}, L40S {l40s}"
        );
        assert!(
            (2.0..4.0).contains(&(l4 / l40s)),
            "gateway {gateway}: L4 {l4}, L40S {l40s}"
        );
    }
}
