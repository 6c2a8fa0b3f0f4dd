//! The gateway over real loopback sockets, in front of scripted upstream servers.

mod common;

use std::{collections::HashMap, time::Duration};

use common::*;
use kvroute::config::{Config, PolicyConfig, WorkerConfig};
use serde_json::json;

const SECOND: Duration = Duration::from_secs(1);

fn body(v: serde_json::Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

#[tokio::test]
async fn streamed_completion_is_relayed_byte_for_byte() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let req =
        body(json!({"prompt": "hello there", "stream": true, "max_tokens": 5, "delay_ms": 5}));
    let direct = request(up.addr, "POST", "/v1/completions", &req).await;
    let through = request(gw.addr, "POST", "/v1/completions", &req).await;
    assert_eq!(through.status, 200);
    assert_eq!(through.header("x-kvroute-worker"), Some("w0"));
    assert_eq!(through.header("content-type"), Some("text/event-stream"));
    assert!(direct.body.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(
        String::from_utf8(through.body).unwrap(),
        String::from_utf8(direct.body).unwrap()
    );
}

#[tokio::test]
async fn stream_events_reach_the_client_before_the_stream_ends() {
    // The upstream sends one event and then waits for the test: a buffering gateway would deadlock here.
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let req = body(json!({"prompt": "p", "stream": true, "max_tokens": 3, "gate": true}));
    let mut s = send(gw.addr, "POST", "/v1/completions", &req).await;
    let first = read_until(&mut s, b"tok0", 5 * SECOND).await;
    assert!(
        String::from_utf8_lossy(&first).contains("tok0"),
        "first event not relayed before the stream ended"
    );
    assert!(!String::from_utf8_lossy(&first).contains("tok1"));
    up.gate.notify_one();
    let rest = read_until(&mut s, b"[DONE]", 5 * SECOND).await;
    assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
}

#[tokio::test]
async fn time_to_first_byte_through_the_gateway_is_close_to_direct() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "prefix")).await;
    let req = body(json!({"prompt": "latency probe", "stream": true, "max_tokens": 1}));
    let ttfb = |addr| {
        let req = req.clone();
        async move {
            let t = tokio::time::Instant::now();
            let mut s = send(addr, "POST", "/v1/completions", &req).await;
            read_until(&mut s, b"data:", 5 * SECOND).await;
            t.elapsed()
        }
    };
    let (mut direct, mut through) = (Vec::new(), Vec::new());
    for _ in 0..25 {
        direct.push(ttfb(up.addr).await);
        through.push(ttfb(gw.addr).await);
    }
    direct.sort();
    through.sort();
    let (d, t) = (direct[12], through[12]);
    assert!(
        t < d + Duration::from_millis(25),
        "median TTFB direct {d:?}, through the gateway {t:?}"
    );
}

#[tokio::test]
async fn client_disconnect_mid_stream_aborts_upstream_and_releases_the_worker() {
    let mut up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "prefix")).await;
    let req =
        body(json!({"prompt": "long answer", "stream": true, "max_tokens": 1000, "delay_ms": 20}));
    let mut s = send(gw.addr, "POST", "/v1/completions", &req).await;
    let got = read_until(&mut s, b"tok2", 5 * SECOND).await;
    assert!(String::from_utf8_lossy(&got).contains("tok2"));
    assert_eq!(
        wait_metric(
            gw.addr,
            "kvroute_worker_inflight{worker=\"w0\"}",
            1.0,
            SECOND
        )
        .await,
        Some(1.0)
    );
    drop(s);
    assert!(
        up.saw_disconnect_within(2 * SECOND).await,
        "upstream kept streaming after the client left"
    );
    assert_eq!(
        wait_metric(
            gw.addr,
            "kvroute_worker_inflight{worker=\"w0\"}",
            0.0,
            2 * SECOND
        )
        .await,
        Some(0.0)
    );
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&m, "kvroute_client_disconnects_total{phase=\"streaming\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "kvroute_upstream_aborts_total{worker=\"w0\"}"),
        Some(1.0)
    );
}

#[tokio::test]
async fn client_disconnect_while_waiting_aborts_upstream_and_releases_the_worker() {
    let mut up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "least_conn")).await;
    let req = body(json!({"prompt": "slow", "max_tokens": 3, "delay_ms": 30_000}));
    let s = send(gw.addr, "POST", "/v1/completions", &req).await;
    assert_eq!(
        wait_metric(
            gw.addr,
            "kvroute_worker_inflight{worker=\"w0\"}",
            1.0,
            2 * SECOND
        )
        .await,
        Some(1.0)
    );
    drop(s);
    assert!(
        up.saw_disconnect_within(2 * SECOND).await,
        "upstream kept working after the client left"
    );
    assert_eq!(
        wait_metric(
            gw.addr,
            "kvroute_worker_inflight{worker=\"w0\"}",
            0.0,
            2 * SECOND
        )
        .await,
        Some(0.0)
    );
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&m, "kvroute_client_disconnects_total{phase=\"waiting\"}"),
        Some(1.0)
    );
}

#[tokio::test]
async fn finished_requests_are_not_counted_as_disconnects() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "prefix")).await;
    for stream in [true, false] {
        let r = request(
            gw.addr,
            "POST",
            "/v1/completions",
            &body(json!({"prompt": "x", "stream": stream})),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&m, "kvroute_worker_inflight{worker=\"w0\"}"),
        Some(0.0)
    );
    assert!(!m.contains("kvroute_client_disconnects_total{"), "{m}");
    assert_eq!(metric(&m, "kvroute_requests_total{arm=\"prefix\",policy=\"prefix\",route=\"completions\",status=\"200\",worker=\"w0\"}"), Some(2.0));
}

async fn served_by(addr: std::net::SocketAddr, path: &str, v: serde_json::Value) -> String {
    let r = request(addr, "POST", path, &body(v)).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.header("x-kvroute-worker").unwrap().to_owned()
}

/// A server running vLLM's data parallelism behind one API server is routed to rank by rank:
/// each rank a worker of its own, every request naming the rank the gateway chose in vLLM's
/// `X-data-parallel-rank` (replacing one the client named), while a worker without ranks passes
/// the client's header on untouched.
#[tokio::test]
async fn each_data_parallel_rank_is_a_worker_named_in_its_requests() {
    let up = upstream("dp", &[]).await;
    let mut config = config_for(&[&up], "round_robin");
    config.workers[0].name = None;
    config.workers[0].data_parallel_size = Some(kvroute::config::DataParallelSize::Fixed(2));
    let gw = gateway(config).await;
    let host = up.addr.to_string();
    let client_says = [("x-data-parallel-rank", "7")];
    let mut ranks: HashMap<String, usize> = HashMap::new();
    for _ in 0..6 {
        let req = body(json!({"prompt": "p"}));
        let r = request_with(gw.addr, "POST", "/v1/completions", &client_says, &req).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let rank = r.json()["data_parallel_rank"]
            .as_str()
            .expect("the worker was told a rank")
            .to_owned();
        assert_eq!(
            r.header("x-kvroute-worker"),
            Some(format!("{host}/dp{rank}").as_str())
        );
        *ranks.entry(rank).or_default() += 1;
    }
    assert_eq!(ranks, HashMap::from([("0".into(), 3), ("1".into(), 3)]));
    let m = metrics_text(gw.addr).await;
    for rank in 0..2 {
        let series = format!("kvroute_worker_healthy{{worker=\"{host}/dp{rank}\"}}");
        assert_eq!(metric(&m, &series), Some(1.0), "{m}");
    }

    let plain = gateway(config_for(&[&up], "round_robin")).await;
    let req = body(json!({"prompt": "p"}));
    let r = request_with(plain.addr, "POST", "/v1/completions", &client_says, &req).await;
    assert_eq!(r.json()["data_parallel_rank"], "7");
}

/// `data_parallel_size: auto` reads a server's engines from its `/metrics` (vLLM's
/// `engine="<rank>"` labels): a simulated server of two engines becomes a worker per rank, whose
/// requests name their rank (a prompt the gateway keeps on one rank runs on that engine every
/// time, where vLLM's own balancer would alternate idle engines), while a server of one engine
/// stays one worker under its own name.
#[tokio::test]
async fn data_parallel_ranks_are_read_from_the_servers_metrics() {
    use kvroute::config::{DataParallelSize, WorkerConfig};
    let start = |engines: usize| async move {
        let cfg = kvroute::sim::SimConfig {
            workers: 1,
            port: 0,
            time_scale: 50.0,
            data_parallel_size: engines,
            ..Default::default()
        };
        let (sims, cancel, tasks) = start_sims(&cfg).await;
        (sims[0].addr, cancel.drop_guard(), tasks)
    };
    let (two, _stop_two, _two_tasks) = start(2).await;
    let (one, _stop_one, _one_tasks) = start(1).await;
    let mut config = Config {
        workers: [two, one]
            .iter()
            .map(|a| WorkerConfig {
                data_parallel_size: Some(DataParallelSize::Auto),
                ..WorkerConfig::from_url(format!("http://{a}"))
            })
            .collect(),
        ..Config::default()
    }
    .with_overrides(kvroute::config::Overrides {
        policy: Some("prefix".into()),
        ..Default::default()
    })
    .unwrap();
    config.load_signals.interval_seconds = 0.05;
    config.validate().unwrap();
    let gw = gateway(config).await;
    let found = wait_metric(gw.addr, "kvroute_workers", 3.0, Duration::from_secs(10)).await;
    assert_eq!(found, Some(3.0), "the two engines were never found");
    let m = metrics_text(gw.addr).await;
    let updates = "kvroute_discovery_updates_total{result=\"applied\",source=\"data_parallel\"}";
    assert_eq!(metric(&m, updates), Some(1.0), "{m}");

    // A prompt whose home is one of the two ranks (the prefix policy's hash decides).
    let rank_of = |worker: &str| worker.strip_prefix(&format!("{two}/dp")).map(str::to_owned);
    let mut home = None;
    for i in 0..50 {
        let prompt = format!("rank by rank {i} ").repeat(12);
        let body = json!({"prompt": prompt, "max_tokens": 1}).to_string();
        let d = request(
            gw.addr,
            "POST",
            "/debug/route/v1/completions",
            body.as_bytes(),
        )
        .await;
        assert_eq!(d.status, 200, "{}", String::from_utf8_lossy(&d.body));
        let worker = d.json()["worker"].as_str().unwrap().to_owned();
        assert!(
            worker == one.to_string() || rank_of(&worker).is_some(),
            "{worker} is neither the one-engine server nor a rank of the other"
        );
        if let Some(rank) = rank_of(&worker) {
            home = Some((body, worker, rank));
            break;
        }
    }
    let (body, worker, rank) = home.expect("no prompt of 50 was placed on a rank");
    let mut cached = Vec::new();
    for _ in 0..4 {
        let r = request(gw.addr, "POST", "/v1/completions", body.as_bytes()).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("x-kvroute-worker"), Some(worker.as_str()));
        cached.push(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
    }
    assert_eq!(cached[0], Some(0), "{cached:?}");
    assert!(cached[1..].iter().all(|c| c.unwrap_or(0) > 0), "{cached:?}");
    let m = metrics_text(two).await;
    let model = kvroute::sim::SimConfig::default()
        .engine_params()
        .unwrap()
        .model;
    let finished = |r: &str| {
        let series = format!(
            "vllm:e2e_request_latency_seconds_count{{engine=\"{r}\",model_name=\"{model}\"}}"
        );
        metric(&m, &series)
    };
    let other = if rank == "0" { "1" } else { "0" };
    assert_eq!(finished(&rank), Some(4.0), "{m}");
    assert_eq!(finished(other), Some(0.0), "{m}");
}

#[tokio::test]
async fn round_robin_spreads_evenly() {
    let ups = [
        upstream("a", &[]).await,
        upstream("b", &[]).await,
        upstream("c", &[]).await,
    ];
    let gw = gateway(config_for(&[&ups[0], &ups[1], &ups[2]], "round_robin")).await;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for _ in 0..30 {
        *counts
            .entry(served_by(gw.addr, "/v1/completions", json!({"prompt": "same prompt"})).await)
            .or_default() += 1;
    }
    assert_eq!(
        counts,
        HashMap::from([("a".into(), 10), ("b".into(), 10), ("c".into(), 10)])
    );
}

#[tokio::test]
async fn prefix_is_sticky_per_key_and_spreads_across_keys() {
    let ups = [
        upstream("a", &[]).await,
        upstream("b", &[]).await,
        upstream("c", &[]).await,
    ];
    let gw = gateway(config_for(&[&ups[0], &ups[1], &ups[2]], "prefix")).await;
    let mut placement: HashMap<usize, String> = HashMap::new();
    for round in 0..3 {
        for conv in 0..30 {
            let system = format!(
                "You are assistant number {conv}. {}",
                "Follow the house style. ".repeat(60)
            );
            let chat = json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question {round}")}]});
            let w = served_by(gw.addr, "/v1/chat/completions", chat).await;
            assert_eq!(
                placement.entry(conv).or_insert_with(|| w.clone()),
                &w,
                "conversation {conv} moved"
            );
        }
    }
    let used: std::collections::HashSet<_> = placement.values().collect();
    assert_eq!(used.len(), 3, "30 prefixes all landed on {used:?}");
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(
            &m,
            "kvroute_routing_decisions_total{arm=\"prefix\",outcome=\"preferred\",policy=\"prefix\"}"
        ),
        Some(90.0)
    );
}

#[tokio::test]
async fn least_conn_follows_load() {
    let ups = [
        upstream("a", &[]).await,
        upstream("b", &[]).await,
        upstream("c", &[]).await,
    ];
    let gw = gateway(config_for(&[&ups[0], &ups[1], &ups[2]], "least_conn")).await;
    // Three long streams held open: each must land on a different, idle worker.
    let long = body(json!({"prompt": "p", "stream": true, "max_tokens": 1000, "delay_ms": 50}));
    let mut held = Vec::new();
    let mut workers = std::collections::HashSet::new();
    for _ in 0..3 {
        let mut s = send(gw.addr, "POST", "/v1/completions", &long).await;
        let head = read_until(&mut s, b"tok0", 5 * SECOND).await;
        let w = parse_response(&head)
            .header("x-kvroute-worker")
            .unwrap()
            .to_owned();
        workers.insert(w);
        held.push(s);
    }
    assert_eq!(workers.len(), 3);
    // Release the stream on one worker: the next request goes there.
    let freed = held.remove(1);
    drop(freed);
    let loads_zero = |m: &str| {
        ["a", "b", "c"]
            .iter()
            .find(|w| metric(m, &format!("kvroute_worker_inflight{{worker=\"{w}\"}}")) == Some(0.0))
            .map(|w| w.to_string())
    };
    let mut idle = None;
    for _ in 0..200 {
        idle = loads_zero(&metrics_text(gw.addr).await);
        if idle.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let idle = idle.expect("a worker became idle");
    assert_eq!(
        served_by(gw.addr, "/v1/completions", json!({"prompt": "q"})).await,
        idle
    );
}

#[tokio::test]
async fn bad_requests_get_openai_style_errors() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "prefix");
    cfg.body_limit_bytes = 1024;
    let gw = gateway(cfg).await;
    let cases: [(&str, &str, Vec<u8>, u16); 6] = [
        ("POST", "/v1/completions", b"{not json".to_vec(), 400),
        ("POST", "/v1/completions", body(json!({"model": "m"})), 400),
        (
            "POST",
            "/v1/chat/completions",
            body(json!({"messages": "hi"})),
            400,
        ),
        (
            "POST",
            "/v1/completions",
            body(json!({"prompt": "x".repeat(2000)})),
            413,
        ),
        ("GET", "/nope", Vec::new(), 404),
        ("GET", "/v1/completions", Vec::new(), 405),
    ];
    for (method, path, b, status) in cases {
        let r = request(gw.addr, method, path, &b).await;
        assert_eq!(
            r.status,
            status,
            "{method} {path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v = r.json();
        assert_eq!(v["error"]["code"], status, "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    assert_eq!(
        up.requests.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "bad requests reached the worker"
    );
}

/// The completion routes skip the router's layers (`src/dispatch.rs`); what those layers check
/// is still checked, with the same answer as on a path the router serves.
#[tokio::test]
async fn a_second_host_header_is_refused_on_the_direct_routes_as_on_the_others() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "round_robin")).await;
    let prompt = body(json!({"prompt": "p", "max_tokens": 1}));
    for (method, path, b) in [
        ("POST", "/v1/completions", &prompt),
        ("POST", "/v1/chat/completions", &prompt),
        ("GET", "/v1/models", &Vec::new()),
    ] {
        let r = request_with(gw.addr, method, path, &[("host", "other.example")], b).await;
        assert_eq!(r.status, 400, "{method} {path}");
        assert_eq!(
            r.json()["error"]["message"],
            "more than one Host header",
            "{method} {path}"
        );
    }
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
    // With one, the direct route proxies as before.
    let r = request(gw.addr, "POST", "/v1/completions", &prompt).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

#[tokio::test]
async fn unknown_model_is_404_when_workers_list_their_models() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "prefix");
    cfg.workers[0].models = vec!["llama".into()];
    let gw = gateway(cfg).await;
    let r = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"model": "qwen", "prompt": "x"})),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["param"], "model");
    let ok = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"model": "llama", "prompt": "x"})),
    )
    .await;
    assert_eq!(ok.status, 200);
}

/// A port on which nothing listens: bind, note it, close.
async fn dead_url() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    format!("http://{}", l.local_addr().unwrap())
}

#[tokio::test]
async fn refused_connections_retry_on_another_worker() {
    let up = upstream("live", &[]).await;
    let cfg = Config {
        workers: vec![
            WorkerConfig {
                name: Some("dead".into()),
                ..WorkerConfig::from_url(dead_url().await)
            },
            up.worker_config(),
        ],
        policy: PolicyConfig::RoundRobin,
        ..Config::default()
    };
    let gw = gateway(cfg).await;
    for _ in 0..4 {
        assert_eq!(
            served_by(gw.addr, "/v1/completions", json!({"prompt": "x"})).await,
            "live"
        );
    }
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(
            &m,
            "kvroute_upstream_errors_total{kind=\"connect\",worker=\"dead\"}"
        ),
        Some(1.0),
        "ejected after one refusal"
    );
}

#[tokio::test]
async fn all_workers_refusing_gives_502_then_503() {
    let cfg = Config {
        workers: vec![
            WorkerConfig::from_url(dead_url().await),
            WorkerConfig::from_url(dead_url().await),
        ],
        ..Config::default()
    };
    let gw = gateway(cfg).await;
    let first = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "x"})),
    )
    .await;
    assert_eq!(first.status, 502);
    assert_eq!(first.json()["error"]["code"], 502);
    let then = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "x"})),
    )
    .await;
    assert_eq!(then.status, 503);
    assert_eq!(request(gw.addr, "GET", "/ready", b"").await.status, 503);
    assert_eq!(request(gw.addr, "GET", "/health", b"").await.status, 200);
}

#[tokio::test]
async fn slow_worker_gives_504() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "prefix");
    cfg.timeouts.first_byte_seconds = 0.2;
    let gw = gateway(cfg).await;
    let r = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "x", "delay_ms": 5000})),
    )
    .await;
    assert_eq!(r.status, 504);
    assert_eq!(r.json()["error"]["code"], 504);
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(
            &m,
            "kvroute_upstream_errors_total{kind=\"timeout\",worker=\"w0\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn saturated_pool_without_a_queue_gives_503_with_retry_after() {
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "prefix");
    cfg.max_inflight_per_worker = 1;
    let gw = gateway(cfg).await;
    let mut held = send(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "a", "stream": true, "max_tokens": 1000, "delay_ms": 50})),
    )
    .await;
    read_until(&mut held, b"tok0", 5 * SECOND).await;
    let r = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "b"})),
    )
    .await;
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["type"], "ServiceUnavailableError");
}

#[tokio::test]
async fn models_are_merged_without_duplicates() {
    let a = upstream("a", &["m1", "m2"]).await;
    let b = upstream("b", &["m1", "m3"]).await;
    let gw = gateway(config_for(&[&a, &b], "prefix")).await;
    let r = request(gw.addr, "GET", "/v1/models", b"").await;
    assert_eq!(r.status, 200);
    let mut ids: Vec<String> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    assert_eq!(ids, ["m1", "m2", "m3"]);
}

#[tokio::test]
async fn other_v1_paths_pass_through() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "prefix")).await;
    let r = request(
        gw.addr,
        "POST",
        "/v1/embeddings?x=1",
        &body(json!({"input": "hi"})),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["path"], "/v1/embeddings");
    assert_eq!(r.header("x-kvroute-worker"), Some("w0"));
}

#[tokio::test]
async fn vllms_serving_routes_outside_v1_pass_through_and_its_operator_routes_do_not() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "prefix")).await;
    let b = body(json!({"prompt": "hi"}));
    let paths = [
        "/tokenize",
        "/detokenize",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/invocations",
        "/v2/rerank",
        "/inference/v1/generate",
    ];
    for path in paths {
        let r = request(gw.addr, "POST", path, &b).await;
        assert_eq!(
            r.status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.json()["path"], path);
        assert_eq!(r.header("x-kvroute-worker"), Some("w0"), "{path}");
    }
    let seen = up.requests.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(seen, paths.len());
    // The worker serves this one, but on one worker of a pool it would reset that one alone.
    let r = request(gw.addr, "POST", "/reset_prefix_cache", b"").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "NotFoundError");
    assert_eq!(up.requests.load(std::sync::atomic::Ordering::SeqCst), seen);
}

#[tokio::test]
async fn a_passed_through_request_goes_to_a_worker_that_serves_its_model() {
    let a = upstream("a", &[]).await;
    let b = upstream("b", &[]).await;
    let mut cfg = config_for(&[&a, &b], "prefix");
    cfg.workers[0].models = vec!["chat-model".into()];
    cfg.workers[1].models = vec!["embed-model".into()];
    let gw = gateway(cfg).await;
    for (path, model, worker) in [
        ("/v1/embeddings", "embed-model", "b"),
        ("/pooling", "embed-model", "b"),
        ("/tokenize", "chat-model", "a"),
        ("/v1/embeddings", "chat-model", "a"),
    ] {
        for _ in 0..3 {
            let r = request(
                gw.addr,
                "POST",
                path,
                &body(json!({"model": model, "input": "x"})),
            )
            .await;
            assert_eq!(r.status, 200, "{path} {model}");
            assert_eq!(r.header("x-kvroute-worker"), Some(worker), "{path} {model}");
        }
    }
    let before = a.requests.load(std::sync::atomic::Ordering::SeqCst)
        + b.requests.load(std::sync::atomic::Ordering::SeqCst);
    let r = request(
        gw.addr,
        "POST",
        "/v1/embeddings",
        &body(json!({"model": "other", "input": "x"})),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["param"], "model");
    let after = a.requests.load(std::sync::atomic::Ordering::SeqCst)
        + b.requests.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        after, before,
        "a request for a model no worker serves reached one"
    );
    // A body that is not a JSON object names no model: it goes through as before, to either.
    for (content_type, b) in [
        (
            "multipart/form-data; boundary=x",
            &b"--x\r\nmodel: other\r\n--x--\r\n"[..],
        ),
        ("application/json", &b"[\"model\", \"other\"]"[..]),
        ("application/json", &b"{\"model\": 7"[..]),
    ] {
        let r = request_with(
            gw.addr,
            "POST",
            "/v1/audio/transcriptions",
            &[("content-type", content_type)],
            b,
        )
        .await;
        assert_eq!(
            r.status,
            200,
            "{content_type}: {}",
            String::from_utf8_lossy(b)
        );
    }
}

#[tokio::test]
async fn metrics_exposition_lists_every_metric() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "prefix")).await;
    request(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "x", "stream": true})),
    )
    .await;
    let r = request(gw.addr, "GET", "/metrics", b"").await;
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let text = String::from_utf8(r.body).unwrap();
    for name in [
        "kvroute_requests_total",
        "kvroute_routing_decisions_total",
        "kvroute_worker_inflight",
        "kvroute_time_to_first_byte_seconds_bucket",
        "kvroute_request_duration_seconds_count",
    ] {
        assert!(
            text.contains(&format!("{name}{{")),
            "{name} missing from:\n{text}"
        );
    }
    assert_eq!(
        metric(
            &text,
            "kvroute_time_to_first_byte_seconds_count{arm=\"prefix\",policy=\"prefix\",worker=\"w0\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_stream_finish() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "prefix")).await;
    let mut s = send(
        gw.addr,
        "POST",
        "/v1/completions",
        &body(json!({"prompt": "p", "stream": true, "max_tokens": 5, "gate": true})),
    )
    .await;
    read_until(&mut s, b"tok0", 5 * SECOND).await;
    gw.shutdown.cancel();
    // New connections are refused once the listener is closed.
    let mut refused = false;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(gw.addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "still accepting after shutdown");
    up.gate.notify_one();
    let rest = read_until(&mut s, b"[DONE]", 5 * SECOND).await;
    assert!(
        String::from_utf8_lossy(&rest).contains("tok4"),
        "stream cut at shutdown"
    );
    tokio::time::timeout(5 * SECOND, gw.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// A worker that answers every request with a small JSON body and counts the connections it
/// accepts; with `keep_alive` false it closes each connection after one answer.
async fn counting_worker(
    keep_alive: bool,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::{atomic::AtomicUsize, Arc};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(
                        http_body_util::Full::new(bytes::Bytes::from_static(b"{\"ok\":true}")),
                    ))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(keep_alive)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, accepted)
}

#[tokio::test]
async fn requests_one_after_another_reuse_a_keep_alive_connection_to_the_worker() {
    use std::sync::atomic::Ordering;
    for keep_alive in [true, false] {
        let (addr, accepted) = counting_worker(keep_alive).await;
        let mut config = Config {
            workers: vec![WorkerConfig::from_url(format!("http://{addr}"))],
            ..Config::default()
        };
        // Only proxied requests reach the worker: no health checks, no load polls.
        config.health.interval_seconds = 0.0;
        config.load_signals.interval_seconds = 0.0;
        let gw = gateway(config).await;
        let req = body(json!({"prompt": "p", "max_tokens": 1}));
        for i in 0..20 {
            let r = request(gw.addr, "POST", "/v1/completions", &req).await;
            assert_eq!(r.status, 200, "request {i}, keep-alive {keep_alive}");
            assert_eq!(r.body, b"{\"ok\":true}");
        }
        let opened = accepted.load(Ordering::SeqCst);
        if keep_alive {
            // One, or two if a check raced the first answer's end.
            assert!(opened <= 2, "{opened} connections for 20 requests");
        } else {
            // A worker that closes after each answer costs no request, only connections.
            assert_eq!(opened, 20);
        }
    }
}

/// A worker that answers every request on each connection with `answer`, as written; its
/// address. Requests are read whole (head and `Content-Length` body) before each answer.
async fn scripted_worker(answer: &'static str) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let whole = |buf: &[u8]| {
                        let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                        (buf.len() >= end + length).then_some(end + length)
                    };
                    let used = loop {
                        if let Some(n) = whole(&buf) {
                            break n;
                        }
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    buf.drain(..used);
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn the_workers_hop_by_hop_fields_stay_behind_and_its_end_to_end_ones_reach_the_client() {
    let worker = scripted_worker(concat!(
        "HTTP/1.1 200 OK\r\n",
        "Connection: keep-alive, X-Private\r\n",
        "X-Private: secret\r\n",
        "Keep-Alive: timeout=5\r\n",
        "Proxy-Connection: keep-alive\r\n",
        "Upgrade: h2c\r\n",
        "Content-Type: application/json\r\n",
        "X-Kept: a\r\n",
        "X-Kept: b\r\n",
        "Transfer-Encoding: chunked\r\n",
        "\r\n",
        "b\r\n{\"usage\":1}\r\n0\r\n\r\n",
    ))
    .await;
    let mut cfg = config_for(&[], "round_robin");
    cfg.health.interval_seconds = 0.0;
    cfg.workers = vec![named_worker("w0", format!("http://{worker}"))];
    let gw = gateway(cfg).await;
    for _ in 0..2 {
        let r = request(
            gw.addr,
            "POST",
            "/v1/completions",
            &body(json!({"prompt": "p"})),
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, b"{\"usage\":1}");
        let names: Vec<&str> = r.headers.iter().map(|(k, _)| k.as_str()).collect();
        for gone in ["x-private", "keep-alive", "proxy-connection", "upgrade"] {
            assert!(
                !names.contains(&gone),
                "{gone} reached the client: {names:?}"
            );
        }
        // The gateway's own framing and connection fields, not the worker's.
        assert!(r
            .header("connection")
            .is_none_or(|v| v != "keep-alive, X-Private"));
        let kept: Vec<&str> = r
            .headers
            .iter()
            .filter(|(k, _)| k == "x-kept")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(kept, ["a", "b"]);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.header("x-kvroute-worker"), Some("w0"));
    }
}
