//! The simulated worker over real loopback HTTP: vLLM's shapes, errors, cache reporting, abort on
//! disconnect, faults, and a stream relayed through the gateway.

mod common;

use std::time::Duration;

use common::{metric, metrics_text, read_until, request, request_with, send, wait_metric};
use kvroute::sim::{self, Faults, SimConfig};
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

const MODEL: &str = "mistralai/Mistral-7B-Instruct-v0.3";

struct Sim {
    addrs: Vec<std::net::SocketAddr>,
    cancel: CancellationToken,
    _tasks: JoinSet<()>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// `workers` simulated workers on free ports, modelled time 20x faster than the wall clock.
fn cfg(workers: usize) -> SimConfig {
    SimConfig {
        workers,
        port: 0,
        time_scale: 20.0,
        ..SimConfig::default()
    }
}

async fn start(cfg: SimConfig) -> Sim {
    let cancel = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let addrs = sim::spawn(&cfg, cfg.bind().await.unwrap(), &cancel, &mut tasks)
        .await
        .unwrap();
    Sim {
        addrs,
        cancel,
        _tasks: tasks,
    }
}

async fn one() -> Sim {
    start(cfg(1)).await
}

/// The `data:` payloads of an SSE body, checking the framing of every event.
fn sse_events(body: &[u8]) -> Vec<String> {
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(text.ends_with("\n\n"), "events end with a blank line");
    text.trim_end()
        .split("\n\n")
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data event: {e:?}"))
                .to_string()
        })
        .collect()
}

fn keys(v: &Value) -> Vec<&str> {
    v.as_object().unwrap().keys().map(String::as_str).collect()
}

#[tokio::test]
async fn completion_has_vllm_shape_and_fixed_length_with_ignore_eos() {
    let s = one().await;
    let body =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 7, "ignore_eos": true});
    let r = request(
        s.addrs[0],
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(
        keys(&v),
        [
            "id",
            "object",
            "created",
            "model",
            "choices",
            "service_tier",
            "system_fingerprint",
            "usage",
            "kv_transfer_params",
            "ec_transfer_params",
            "metrics"
        ]
    );
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL);
    let c = &v["choices"][0];
    assert_eq!(
        keys(c),
        [
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
            "token_ids",
            "prompt_logprobs",
            "prompt_token_ids",
            "routed_experts"
        ]
    );
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(
        v["usage"]["total_tokens"],
        v["usage"]["prompt_tokens"].as_u64().unwrap() + 7
    );
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        c["text"].as_str().unwrap().split(' ').count(),
        8,
        "7 one-word tokens"
    );
}

#[tokio::test]
async fn chat_stream_has_role_chunk_finish_on_last_token_usage_chunk_and_done() {
    let s = one().await;
    let body = json!({"model": MODEL, "stream": true, "max_completion_tokens": 4,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
    let r = request(
        s.addrs[0],
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse_events(&r.body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // role chunk, 4 tokens (the last with finish_reason), usage chunk
    assert_eq!(chunks.len(), 6, "{events:?}");
    let id = &chunks[0]["id"];
    assert!(id.as_str().unwrap().starts_with("chatcmpl-"));
    assert!(chunks
        .iter()
        .all(|c| &c["id"] == id && c["object"] == "chat.completion.chunk"));
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    for c in &chunks[1..4] {
        assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
        assert!(c["choices"][0]["delta"]["content"].is_string());
        assert!(c.get("usage").is_none());
    }
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 4);
}

#[tokio::test]
async fn continuous_usage_stats_puts_usage_on_every_chunk() {
    let s = one().await;
    let body = json!({"prompt": "x", "stream": true, "max_tokens": 3,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
    let r = request(
        s.addrs[0],
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
    )
    .await;
    let events = sse_events(&r.body);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 4);
    for (i, c) in chunks[..3].iter().enumerate() {
        assert_eq!(c["usage"]["completion_tokens"], i + 1);
    }
}

#[tokio::test]
async fn bad_requests_get_vllm_statuses_and_error_bodies() {
    let s = one().await;
    let cases: &[(&str, Value, u16, &str)] = &[
        (
            "/v1/completions",
            json!({"prompt": "x y z", "max_tokens": 32767}),
            400,
            "maximum context length is 32768",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 40000}),
            400,
            "max_tokens=40000 cannot be greater than max_model_len=32768",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            400,
            "at least 1",
        ),
        ("/v1/completions", json!({"max_tokens": 3}), 400, "prompt"),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 2}),
            400,
            "n must be 1",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream_options": {"include_usage": true}}),
            400,
            "stream=True",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": -1}),
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 0}),
            400,
            "top_p must be in (0, 1]",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 4, "min_tokens": 5}),
            400,
            "min_tokens must be between 0 and max_tokens=4",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": ["end", 7]}),
            400,
            "stop must be a string or a list of strings",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": 7}),
            400,
            "stop must be a string or a list of strings",
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL}),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-9", "messages": []}),
            404,
            "The model `gpt-9` does not exist.",
        ),
    ];
    for (path, body, status, needle) in cases {
        let r = request(s.addrs[0], "POST", path, body.to_string().as_bytes()).await;
        assert_eq!(r.status, *status, "{body}");
        let e = &r.json()["error"];
        assert_eq!(e["code"], *status);
        assert_eq!(
            e["type"],
            if *status == 404 {
                "NotFoundError"
            } else {
                "BadRequestError"
            }
        );
        assert!(e["message"].as_str().unwrap().contains(needle), "{e}");
    }
    let r = request(s.addrs[0], "POST", "/v1/completions", b"{not json").await;
    assert_eq!(r.status, 400);
}

#[tokio::test]
async fn a_repeated_prompt_reports_cached_tokens_in_usage_and_metrics() {
    let s = one().await;
    let prompt = "The history of the Roman Empire spans many centuries and continents. ".repeat(8);
    let body = json!({"prompt": prompt, "max_tokens": 2}).to_string();
    let first = request(s.addrs[0], "POST", "/v1/completions", body.as_bytes())
        .await
        .json();
    let second = request(s.addrs[0], "POST", "/v1/completions", body.as_bytes())
        .await
        .json();
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(cached, (prompt_tokens - 1) / 16 * 16);
    let m = metrics_text(s.addrs[0]).await;
    let label = format!("{{engine=\"0\",model_name=\"{MODEL}\"}}");
    assert_eq!(
        metric(&m, &format!("vllm:prefix_cache_hits_total{label}")),
        Some(cached as f64)
    );
    assert_eq!(
        metric(&m, &format!("vllm:prefix_cache_queries_total{label}")),
        Some(2.0 * prompt_tokens as f64)
    );
    // The prompt tokens by where they came from, counted with each first token, as vLLM does.
    let source = |s: &str| {
        metric(
            &m,
            &format!(
                "vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"{MODEL}\",source=\"{s}\"}}"
            ),
        )
    };
    assert_eq!(
        source("local_compute"),
        Some((2 * prompt_tokens - cached) as f64)
    );
    // A prompt cached but for its last token has that token computed and counted as a hit too.
    let recomputed = u64::from(cached + 1 == prompt_tokens);
    assert_eq!(
        source("local_cache_hit"),
        Some((cached + recomputed) as f64)
    );
    assert_eq!(source("external_kv_transfer"), Some(0.0));
    assert_eq!(
        metric(&m, &format!("vllm:prompt_tokens_cached_total{label}")),
        Some(cached as f64)
    );
    assert!(m.contains("vllm:cache_config_info{block_size=\"16\""));
    for name in [
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ] {
        assert_eq!(metric(&m, &format!("{name}{label}")), Some(2.0), "{name}");
    }
    // Tokens per engine step: each request prefills its uncached prompt in one step (it fits
    // the step's budget), which gives its first token, then decodes one token a step.
    let completions: Vec<u64> = [&first, &second]
        .iter()
        .map(|r| r["usage"]["completion_tokens"].as_u64().unwrap())
        .collect();
    let computed = prompt_tokens + (prompt_tokens - cached) + completions.iter().sum::<u64>() - 2;
    assert_eq!(
        metric(&m, &format!("vllm:iteration_tokens_total_sum{label}")),
        Some(computed as f64)
    );
    assert_eq!(
        metric(&m, &format!("vllm:iteration_tokens_total_count{label}")),
        Some(completions.iter().sum::<u64>() as f64)
    );
}

#[tokio::test]
async fn tokenize_detokenize_models_health_and_load() {
    let s = one().await;
    let a = s.addrs[0];
    let t = request(
        a,
        "POST",
        "/tokenize",
        br#"{"prompt": "hello there world"}"#,
    )
    .await
    .json();
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    assert_eq!(t["max_model_len"], 32768);
    let d = request(
        a,
        "POST",
        "/detokenize",
        json!({"tokens": t["tokens"]}).to_string().as_bytes(),
    )
    .await
    .json();
    assert_eq!(d["prompt"], "hello there world");
    let m = request(a, "GET", "/v1/models", b"").await.json();
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["owned_by"], "vllm");
    assert_eq!(request(a, "GET", "/health", b"").await.status, 200);
    assert_eq!(
        request(a, "GET", "/load", b"").await.json(),
        json!({"server_load": 0})
    );
}

#[tokio::test]
async fn a_preset_list_gives_each_worker_its_own_engine_of_one_model() {
    let s = start(SimConfig {
        preset: "l4-qwen2.5-7b,l40s-qwen2.5-7b".into(),
        ..cfg(3)
    })
    .await;
    let mut blocks = Vec::new();
    for &a in &s.addrs {
        let text = metrics_text(a).await;
        let info = text
            .lines()
            .find(|l| l.starts_with("vllm:cache_config_info{"))
            .unwrap_or_else(|| panic!("no cache_config_info in {text}"))
            .to_owned();
        let n = info.split("num_gpu_blocks=\"").nth(1).unwrap();
        blocks.push(n[..n.find('"').unwrap()].parse::<usize>().unwrap());
        let m = request(a, "GET", "/v1/models", b"").await.json();
        assert_eq!(m["data"][0]["id"], "Qwen/Qwen2.5-7B-Instruct");
    }
    // Worker i runs the (i mod 2)-th preset: the L4's cache, the L40S's, the L4's again.
    assert_eq!(blocks, [5400, 29000, 5400]);
    let cfg = SimConfig {
        preset: "l4-qwen2.5-7b,l40s-qwen2.5-7b".into(),
        workers: 4,
        ..SimConfig::default()
    };
    assert_eq!(cfg.pool_gpu_blocks().unwrap(), 2 * 5400 + 2 * 29000);
    // A pool serves one model: a list that mixes models is refused, as is an unknown name.
    for preset in ["l4-qwen2.5-7b,rtx4090-mistral-7b", "l4-qwen2.5-7b,nope"] {
        let bad = SimConfig {
            preset: preset.into(),
            ..cfg.clone()
        };
        assert!(bad.validate().is_err(), "{preset} accepted");
    }
}

#[tokio::test]
async fn a_closed_connection_leaves_the_batch_and_frees_its_blocks() {
    let s = one().await;
    let a = s.addrs[0];
    let label = format!("{{engine=\"0\",model_name=\"{MODEL}\"}}");
    let body = json!({"prompt": "tell me a long story", "stream": true, "max_tokens": 5000, "ignore_eos": true});
    let mut conn = send(a, "POST", "/v1/completions", body.to_string().as_bytes()).await;
    let got = read_until(&mut conn, b"\"text\"", Duration::from_secs(10)).await;
    assert!(got.starts_with(b"HTTP/1.1 200"));
    assert_eq!(
        metric(
            &metrics_text(a).await,
            &format!("vllm:num_requests_running{label}")
        ),
        Some(1.0)
    );
    drop(conn);
    let aborted = wait_metric(
        a,
        &format!("kvroute_sim_aborted_requests_total{label}"),
        1.0,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(aborted, Some(1.0));
    let m = metrics_text(a).await;
    assert_eq!(
        metric(&m, &format!("vllm:num_requests_running{label}")),
        Some(0.0)
    );
    assert_eq!(
        metric(&m, &format!("vllm:kv_cache_usage_perc{label}")),
        Some(0.0)
    );
    let generated = metric(&m, &format!("vllm:generation_tokens_total{label}")).unwrap();
    assert!(generated < 5000.0, "stopped early: {generated}");
}

#[tokio::test]
async fn without_abort_on_disconnect_the_waste_is_counted() {
    let s = start(SimConfig {
        abort_on_disconnect: false,
        ..cfg(1)
    })
    .await;
    let a = s.addrs[0];
    let label = format!("{{engine=\"0\",model_name=\"{MODEL}\"}}");
    let body = json!({"prompt": "x", "stream": true, "max_tokens": 300, "ignore_eos": true});
    let mut conn = send(a, "POST", "/v1/completions", body.to_string().as_bytes()).await;
    read_until(&mut conn, b"\"text\"", Duration::from_secs(10)).await;
    drop(conn);
    // The request runs to its end; every token after the close counts as waste.
    wait_metric(
        a,
        &format!("vllm:generation_tokens_total{label}"),
        300.0,
        Duration::from_secs(20),
    )
    .await;
    let waste = metric(
        &metrics_text(a).await,
        &format!("kvroute_sim_tokens_after_disconnect_total{label}"),
    )
    .unwrap();
    assert!(waste > 200.0, "{waste}\n{}", metrics_text(a).await);
}

#[tokio::test]
async fn faults_error_rate_drop_mid_stream_and_hang() {
    let s = start(SimConfig {
        faults: Faults {
            error_rate: 1.0,
            ..Faults::default()
        },
        fault_worker: Some(0),
        ..cfg(3)
    })
    .await;
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    let r = request(s.addrs[0], "POST", "/v1/completions", body.as_bytes()).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["type"], "InternalServerError");
    assert_eq!(
        request(s.addrs[1], "POST", "/v1/completions", body.as_bytes())
            .await
            .status,
        200
    );

    let drop = start(SimConfig {
        faults: Faults {
            drop_after_tokens: Some(3),
            ..Faults::default()
        },
        ..cfg(1)
    })
    .await;
    let body =
        json!({"prompt": "x", "max_tokens": 50, "stream": true, "ignore_eos": true}).to_string();
    let mut conn = send(drop.addrs[0], "POST", "/v1/completions", body.as_bytes()).await;
    let raw = read_until(&mut conn, b"[DONE]", Duration::from_secs(10)).await;
    let text = String::from_utf8_lossy(&raw);
    assert_eq!(text.matches("data: {").count(), 3, "{text}");
    assert!(!text.contains("[DONE]"));

    let hang = start(SimConfig {
        faults: Faults {
            hang: true,
            ..Faults::default()
        },
        ..cfg(1)
    })
    .await;
    let mut conn = send(hang.addrs[0], "GET", "/health", b"").await;
    let got = read_until(&mut conn, b"HTTP/1.1", Duration::from_millis(300)).await;
    assert!(got.is_empty(), "a hung worker answers nothing");
}

#[tokio::test]
async fn a_stream_relayed_by_the_gateway_matches_the_workers_direct_answer() {
    let s = start(cfg(2)).await;
    let config = kvroute::config::Config {
        workers: s
            .addrs
            .iter()
            .map(|a| kvroute::config::WorkerConfig::from_url(format!("http://{a}")))
            .collect(),
        ..Default::default()
    };
    let gw = common::gateway(config).await;
    let messages = json!([{"role": "user", "content": "Count to ten."}]);
    let streamed =
        json!({"model": MODEL, "messages": messages, "max_tokens": 40, "seed": 42, "stream": true});
    let r = request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        streamed.to_string().as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200);
    let worker = r.header("x-kvroute-worker").unwrap().to_string();
    let mut text = String::new();
    for e in sse_events(&r.body) {
        if e != "[DONE]" {
            let v: Value = serde_json::from_str(&e).unwrap();
            text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        }
    }
    let direct = json!({"model": MODEL, "messages": messages, "max_tokens": 40, "seed": 42});
    let addr = s.addrs.iter().find(|a| a.to_string() == worker).unwrap();
    let d = request(
        *addr,
        "POST",
        "/v1/chat/completions",
        direct.to_string().as_bytes(),
    )
    .await
    .json();
    assert_eq!(
        text,
        d["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert!(!text.is_empty());
    gw.shutdown.cancel();
}

/// A host busy with other work wakes the engine loop late between steps (here a task that holds
/// the test's only thread for 3 ms at a time, 60 ms of model time at this scale, against steps of
/// about 20 ms). A GPU would not wait for the host, so neither does the modelled engine: the
/// worker's own inter-token latencies add up to exactly the steps the cost model prices, decode
/// step by decode step, not to the time the loop took to wake.
#[tokio::test]
async fn a_host_that_wakes_the_engine_late_does_not_slow_the_modelled_engine() {
    let s = one().await;
    let hog = tokio::spawn(async {
        loop {
            std::thread::sleep(Duration::from_millis(3));
            tokio::task::yield_now().await;
        }
    });
    let tokens = 40;
    let body = json!({
        "prompt": "Tell me about the history of the Roman Empire.",
        "max_tokens": tokens,
        "ignore_eos": true,
    })
    .to_string();
    let answer = request(s.addrs[0], "POST", "/v1/completions", body.as_bytes())
        .await
        .json();
    hog.abort();
    assert_eq!(answer["usage"]["completion_tokens"], tokens);
    let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize;

    // The first token comes from the prefill step; each later one from a step decoding this one
    // sequence, whose context has grown by one token each time.
    let cost = (sim::presets::find(sim::presets::DEFAULT_PRESET)
        .unwrap()
        .params)()
    .cost;
    let decode_ms: f64 = (1..tokens as usize)
        .map(|j| cost.step_ms(0, 1, prompt + j))
        .sum();
    let m = metrics_text(s.addrs[0]).await;
    let label = format!("{{engine=\"0\",model_name=\"{MODEL}\"}}");
    let itl_ms =
        1000.0 * metric(&m, &format!("vllm:inter_token_latency_seconds_sum{label}")).unwrap();
    assert_eq!(
        metric(
            &m,
            &format!("vllm:inter_token_latency_seconds_count{label}")
        ),
        Some((tokens - 1) as f64)
    );
    assert!(
        (itl_ms - decode_ms).abs() < 1e-6 * decode_ms,
        "inter-token latencies add up to {itl_ms:.3} ms of model time, the steps to {decode_ms:.3} ms"
    );
}

/// `POST /v1/responses` with `body`.
async fn respond_to(addr: std::net::SocketAddr, body: &Value) -> common::RawResponse {
    request(addr, "POST", "/v1/responses", body.to_string().as_bytes()).await
}

/// The `(event, data)` pairs of a Responses API stream (`event: T` and `data: {json}`).
fn responses_events(body: &[u8]) -> Vec<(String, Value)> {
    String::from_utf8(body.to_vec())
        .unwrap()
        .trim_end()
        .split("\n\n")
        .map(|e| {
            let (kind, data) = e.split_once('\n').expect("event and data lines");
            let kind = kind
                .strip_prefix("event: ")
                .expect("an event line")
                .to_owned();
            let data: Value =
                serde_json::from_str(data.strip_prefix("data: ").expect("a data line")).unwrap();
            assert_eq!(data["type"], kind.as_str(), "the data names its event");
            (kind, data)
        })
        .collect()
}

#[tokio::test]
async fn responses_api_answers_and_streams_in_vllms_order_and_keeps_nothing_by_default() {
    let s = one().await;
    let body = json!({"model": MODEL, "instructions": "Be brief.", "input": "Hello there",
        "max_output_tokens": 5});
    let r = respond_to(s.addrs[0], &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(v["object"], "response");
    assert_eq!(v["instructions"], "Be brief.");
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["role"], "assistant");
    assert!(!v["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .is_empty());
    let usage = &v["usage"];
    assert_eq!(usage["output_tokens"].as_u64(), Some(5));
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["input_tokens"].as_u64().unwrap() + 5)
    );
    // Five tokens asked, five made: cut at the limit, as vLLM says it.
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = respond_to(s.addrs[0], &streamed).await;
    assert_eq!(r.status, 200);
    let events = responses_events(&r.body);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    let deltas = vec!["response.output_text.delta"; 5];
    let want: Vec<&str> = [
        &[
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ][..],
        &deltas,
        &[
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ],
    ]
    .concat();
    assert_eq!(kinds, want);
    for (i, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"].as_u64(), Some(i as u64));
    }
    let text: String = events
        .iter()
        .filter_map(|(_, d)| d["delta"].as_str())
        .collect();
    let completed = &events.last().unwrap().1["response"];
    assert_eq!(completed["output"][0]["content"][0]["text"], text.as_str());
    assert_eq!(completed["id"], events[0].1["response"]["id"]);
    assert_eq!(completed["usage"]["output_tokens"].as_u64(), Some(5));

    // Without the store (vLLM's default) nothing is kept: continuing or asking is a 404.
    let id = v["id"].as_str().unwrap();
    let next = json!({"model": MODEL, "input": "More", "previous_response_id": id});
    let r = respond_to(s.addrs[0], &next).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["param"], "response_id");
    let r = request(s.addrs[0], "GET", &format!("/v1/responses/{id}"), b"").await;
    assert_eq!(r.status, 404);
    // Tools are not simulated: said, not ignored.
    let tool = json!({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c",
        "output": "x"}]});
    let r = respond_to(s.addrs[0], &tool).await;
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("function_call_output"));
}

#[tokio::test]
async fn with_the_store_a_continued_response_prefills_only_its_new_turn() {
    let s = start(SimConfig {
        responses_store: true,
        ..cfg(2)
    })
    .await;
    let long = "The history of the city begins with a river crossing. ".repeat(40);
    let first = json!({"model": MODEL, "instructions": "Be brief.", "input": long,
        "max_output_tokens": 4});
    let r = respond_to(s.addrs[0], &first).await;
    let v = r.json();
    let id = v["id"].as_str().unwrap().to_owned();
    let first_input = v["usage"]["input_tokens"].as_u64().unwrap();
    // The continuation's prompt is the stored conversation and the new input; the worker has it
    // cached up to the end of the first prompt (whole blocks). Instructions do not carry over
    // (vLLM drops the stored system message, as OpenAI's API does), so they are sent again.
    let next = json!({"model": MODEL, "instructions": "Be brief.", "input": "And then?",
        "previous_response_id": id, "max_output_tokens": 4, "stream": true});
    let r = respond_to(s.addrs[0], &next).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let events = responses_events(&r.body);
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["previous_response_id"], id.as_str());
    let usage = &done["usage"];
    assert!(
        usage["input_tokens"].as_u64().unwrap() > first_input,
        "{usage}"
    );
    let cached = usage["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        // Every whole 16-token block of the first prompt, and nothing past it.
        cached + 16 > first_input && cached <= first_input,
        "{usage}, first {first_input}"
    );
    // Stored where it was made, and only there.
    let continued = done["id"].as_str().unwrap();
    for (addr, status) in [(s.addrs[0], 200), (s.addrs[1], 404)] {
        let r = request(addr, "GET", &format!("/v1/responses/{continued}"), b"").await;
        assert_eq!(r.status, status);
    }
    let r = request(
        s.addrs[0],
        "POST",
        &format!("/v1/responses/{continued}/cancel"),
        b"",
    )
    .await;
    assert_eq!(r.status, 400, "a finished response cannot be cancelled");
    // `store: false` keeps nothing, even with the store on.
    let unkept = json!({"model": MODEL, "input": "x", "store": false, "max_output_tokens": 2});
    let r = respond_to(s.addrs[0], &unkept).await;
    let unkept_id = r.json()["id"].as_str().unwrap().to_owned();
    let r = request(
        s.addrs[0],
        "GET",
        &format!("/v1/responses/{unkept_id}"),
        b"",
    )
    .await;
    assert_eq!(r.status, 404);
}

/// A server running two data-parallel engines (`data_parallel_size: 2`, as vLLM's
/// `--data-parallel-size 2`) keeps a KV cache and a set of `/metrics` series per rank: a request
/// that names its rank in `X-data-parallel-rank` runs there, reuses only what that rank cached,
/// and a rank the server does not have is refused with vLLM's 400; one that names no rank (or
/// not an integer, which vLLM ignores) is placed by the balancer, which sends requests to idle
/// engines in turn.
#[tokio::test]
async fn a_data_parallel_server_keeps_each_ranks_cache_and_series_apart() {
    let s = start(SimConfig {
        data_parallel_size: 2,
        ..cfg(1)
    })
    .await;
    let addr = s.addrs[0];
    let prompt = "Rank by rank, every engine keeps a cache of its own. ".repeat(8);
    let body = json!({"prompt": prompt, "max_tokens": 2}).to_string();
    let on = |rank: &'static str| {
        let body = body.clone();
        async move {
            let headers = [("x-data-parallel-rank", rank)];
            request_with(addr, "POST", "/v1/completions", &headers, body.as_bytes()).await
        }
    };
    let cached = |r: &Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let first = on("1").await.json();
    let again = on("1").await.json();
    let elsewhere = on("0").await.json();
    assert_eq!(cached(&first), Some(0));
    let reused = cached(&again).unwrap();
    assert!(reused > 0, "rank 1 reuses its own blocks: {again}");
    assert_eq!(cached(&elsewhere), Some(0), "rank 0 has a cache of its own");

    let missing = on("2").await;
    assert_eq!(missing.status, 400);
    let message = missing.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("out of range"), "{message}");

    for i in 0..4 {
        let body = json!({"prompt": format!("balanced {i}"), "max_tokens": 1}).to_string();
        let r = request(addr, "POST", "/v1/completions", body.as_bytes()).await;
        assert_eq!(r.status, 200);
    }
    let unranked = json!({"prompt": "no rank here", "max_tokens": 1}).to_string();
    let headers = [("x-data-parallel-rank", "one")];
    let r = request_with(
        addr,
        "POST",
        "/v1/completions",
        &headers,
        unranked.as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "a rank that is not a number is ignored");

    let m = metrics_text(addr).await;
    let series = |name: &str, rank: u32| {
        metric(
            &m,
            &format!("{name}{{engine=\"{rank}\",model_name=\"{MODEL}\"}}"),
        )
    };
    assert_eq!(
        series("vllm:prefix_cache_hits_total", 1),
        Some(reused as f64)
    );
    assert_eq!(series("vllm:prefix_cache_hits_total", 0), Some(0.0));
    // Named: two on rank 1, one on rank 0; then five placed by the balancer, in turn from rank 0.
    let finished = "vllm:e2e_request_latency_seconds_count";
    assert_eq!(series(finished, 0), Some(4.0), "{m}");
    assert_eq!(series(finished, 1), Some(4.0), "{m}");
    // As vLLM: the cache's description once per engine, the process's start time once.
    for rank in 0..2 {
        let info = format!("vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"{rank}\",");
        assert!(m.contains(&info), "{info} in {m}");
    }
    assert_eq!(m.matches("vllm:cache_config_info{").count(), 2, "{m}");
    assert_eq!(m.matches("\nprocess_start_time_seconds ").count(), 1, "{m}");
}

/// A server of one engine refuses a rank other than 0 as vLLM does (its ranks are checked
/// against the data-parallel size, 1 here), and serves rank 0.
#[tokio::test]
async fn a_single_engine_server_refuses_any_rank_but_zero() {
    let s = one().await;
    let body = json!({"prompt": "which rank", "max_tokens": 1}).to_string();
    for (rank, status) in [("0", 200), ("1", 400)] {
        let headers = [("x-data-parallel-rank", rank)];
        let r = request_with(
            s.addrs[0],
            "POST",
            "/v1/completions",
            &headers,
            body.as_bytes(),
        )
        .await;
        assert_eq!(
            r.status,
            status,
            "rank {rank}: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
}
