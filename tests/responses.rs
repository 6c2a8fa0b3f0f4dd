//! The Responses API through the gateway, over real loopback sockets, against workers that store
//! responses as vLLM does with `VLLM_ENABLE_RESPONSES_API_STORE=1`: in their own memory, so a
//! stored response is known to the worker that made it alone and every other worker answers 404.

mod common;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

use axum::{
    body::Bytes,
    extract::{Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use common::*;
use kvroute::config::{Config, WorkerConfig};
use parking_lot::Mutex;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A worker that stores every response it makes, by id, in its own memory.
struct StoringWorker {
    addr: SocketAddr,
    name: String,
    /// Requests that reached `POST /v1/responses`.
    creates: Arc<AtomicUsize>,
    _stop: tokio_util::sync::DropGuard,
}

#[derive(Clone)]
struct Store {
    name: String,
    made: Arc<AtomicUsize>,
    creates: Arc<AtomicUsize>,
    stored: Arc<Mutex<HashMap<String, serde_json::Value>>>,
}

impl StoringWorker {
    async fn start(name: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let store = Store {
            name: name.to_owned(),
            made: Arc::default(),
            creates: Arc::default(),
            stored: Arc::default(),
        };
        let creates = Arc::clone(&store.creates);
        let app = Router::new()
            .route("/v1/responses", post(create))
            .route("/v1/responses/{id}", get(retrieve))
            .route("/v1/responses/{id}/cancel", post(cancel))
            .route("/health", get(|| async { "ok" }))
            .with_state(store);
        Self {
            addr,
            name: name.to_owned(),
            creates,
            _stop: serve_until_dropped(listener, app),
        }
    }

    fn worker_config(&self) -> WorkerConfig {
        WorkerConfig {
            name: Some(self.name.clone()),
            ..WorkerConfig::from_url(format!("http://{}", self.addr))
        }
    }
}

fn not_found(id: &str) -> Response {
    let error = json!({"error": {"message": format!("Response with id '{id}' not found."),
        "type": "invalid_request_error", "code": 404}});
    (StatusCode::NOT_FOUND, Json(error)).into_response()
}

async fn create(State(s): State<Store>, body: Bytes) -> Response {
    s.creates.fetch_add(1, Ordering::SeqCst);
    let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
    if let Some(prev) = req["previous_response_id"].as_str() {
        if !s.stored.lock().contains_key(prev) {
            return not_found(prev);
        }
    }
    let id = format!("resp_{}{}", s.name, s.made.fetch_add(1, Ordering::SeqCst));
    let response = json!({
        "id": id, "object": "response", "status": "completed", "worker": s.name,
        "previous_response_id": req["previous_response_id"],
        "output": [{"type": "message", "id": format!("msg_{id}"), "role": "assistant",
            "content": [{"type": "output_text", "text": "noted", "annotations": []}]}],
        "usage": {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 1, "total_tokens": 41}
    });
    s.stored.lock().insert(id.clone(), response.clone());
    if !req["stream"].as_bool().unwrap_or(false) {
        return Json(response).into_response();
    }
    // As vLLM streams: the created event first, one delta, the completed event.
    let events = [
        (
            "response.created",
            json!({"response": {"id": id, "status": "in_progress"},
            "sequence_number": 0, "type": "response.created"}),
        ),
        (
            "response.output_text.delta",
            json!({"delta": "noted", "sequence_number": 1,
            "type": "response.output_text.delta"}),
        ),
        (
            "response.completed",
            json!({"response": response, "sequence_number": 2,
            "type": "response.completed"}),
        ),
    ];
    let chunks = events.map(|(kind, data)| {
        Ok::<_, std::io::Error>(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")))
    });
    (
        [("content-type", "text/event-stream")],
        axum::body::Body::from_stream(futures_util::stream::iter(chunks)),
    )
        .into_response()
}

async fn retrieve(State(s): State<Store>, Path(id): Path<String>) -> Response {
    match s.stored.lock().get(&id) {
        Some(r) => Json(r.clone()).into_response(),
        None => not_found(&id),
    }
}

/// A finished response cannot be cancelled: vLLM's 400, from the worker that holds it.
async fn cancel(State(s): State<Store>, Path(id): Path<String>) -> Response {
    if !s.stored.lock().contains_key(&id) {
        return not_found(&id);
    }
    let error = json!({"error": {"message": "Cannot cancel a synchronous response.",
        "type": "invalid_request_error", "param": "response_id", "code": 400}});
    (StatusCode::BAD_REQUEST, Json(error)).into_response()
}

async fn pool(n: usize) -> Vec<StoringWorker> {
    let mut workers = Vec::new();
    for i in 0..n {
        workers.push(StoringWorker::start(&format!("w{i}")).await);
    }
    workers
}

/// A gateway in front of `workers` with `policy`.
async fn gateway_for(workers: &[StoringWorker], policy: &str) -> Gateway {
    let cfg = Config {
        workers: workers.iter().map(StoringWorker::worker_config).collect(),
        ..Config::default()
    }
    .with_overrides(kvroute::config::Overrides {
        policy: Some(policy.into()),
        ..Default::default()
    })
    .unwrap();
    gateway(cfg).await
}

fn body(v: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&v).unwrap()
}

/// Sends a turn; returns the answer's response id and the worker that answered.
async fn turn(addr: SocketAddr, previous: Option<&str>, stream: bool) -> (String, String) {
    let mut req = json!({"model": "m", "input": "and then?", "stream": stream});
    if let Some(prev) = previous {
        req["previous_response_id"] = json!(prev);
    }
    let r = request(addr, "POST", "/v1/responses", &body(req)).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let worker = r.header("x-kvroute-worker").unwrap().to_owned();
    let text = String::from_utf8(r.body).unwrap();
    let id = if stream {
        let created = text.lines().find(|l| l.starts_with("data: ")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&created["data: ".len()..]).unwrap();
        v["response"]["id"].as_str().unwrap().to_owned()
    } else {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["worker"], worker.as_str());
        v["id"].as_str().unwrap().to_owned()
    };
    (id, worker)
}

#[tokio::test]
async fn a_conversation_chained_by_previous_response_id_stays_on_the_worker_that_stored_it() {
    let workers = pool(3).await;
    // Round-robin would send every turn to the next worker, where the previous response is not.
    let gw = gateway_for(&workers, "round_robin").await;
    for stream in [false, true] {
        let (mut id, home) = turn(gw.addr, None, stream).await;
        for _ in 0..6 {
            let (next, worker) = turn(gw.addr, Some(&id), stream).await;
            assert_eq!(
                worker, home,
                "a turn left the worker holding its conversation"
            );
            id = next;
        }
        // Retrieving and cancelling it go there too (a finished one cannot be cancelled: the
        // holder's 400, where any other worker would say 404).
        let r = request(gw.addr, "GET", &format!("/v1/responses/{id}"), b"").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-kvroute-worker"), Some(home.as_str()));
        assert_eq!(r.json()["id"], id.as_str());
        let r = request(gw.addr, "POST", &format!("/v1/responses/{id}/cancel"), b"").await;
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("x-kvroute-worker"), Some(home.as_str()));
    }
    let text = metrics_text(gw.addr).await;
    assert_eq!(
        metric(
            &text,
            r#"kvroute_responses_followed_total{how="remembered"}"#
        ),
        Some(16.0),
        "every follow-up found its worker remembered:\n{text}"
    );
    assert_eq!(
        metric(&text, r#"kvroute_responses_followed_total{how="found"}"#),
        None
    );
    assert_eq!(metric(&text, "kvroute_responses_remembered"), Some(14.0));
    // Fresh responses were routed by the arm's policy, and counted under their own route.
    assert!(
        text.lines()
            .any(|l| l.starts_with("kvroute_requests_total{")
                && l.contains(r#"route="responses""#)
                && l.contains(r#"policy="round_robin""#)),
        "{text}"
    );
}

#[tokio::test]
async fn a_replica_that_never_saw_a_response_finds_the_worker_that_holds_it() {
    let workers = pool(4).await;
    let a = gateway_for(&workers, "round_robin").await;
    let b = gateway_for(&workers, "round_robin").await;
    let (first, home) = turn(a.addr, None, false).await;
    // Replica B has never seen it: it asks every worker, then remembers.
    let (second, worker) = turn(b.addr, Some(&first), false).await;
    assert_eq!(worker, home);
    let (_, worker) = turn(b.addr, Some(&second), true).await;
    assert_eq!(worker, home);
    let r = request(b.addr, "GET", &format!("/v1/responses/{first}"), b"").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvroute-worker"), Some(home.as_str()));
    let text = metrics_text(b.addr).await;
    assert_eq!(
        metric(&text, r#"kvroute_responses_followed_total{how="found"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"kvroute_responses_followed_total{how="remembered"}"#
        ),
        Some(2.0),
        "{text}"
    );
    // Only the workers asked to continue it made responses: the lookups made none.
    let creates: usize = workers
        .iter()
        .map(|w| w.creates.load(Ordering::SeqCst))
        .sum();
    assert_eq!(creates, 3);
}

#[tokio::test]
async fn a_response_no_worker_holds_gets_the_workers_own_404() {
    let workers = pool(2).await;
    let gw = gateway_for(&workers, "cache_aware").await;
    let r = request(
        gw.addr,
        "POST",
        "/v1/responses",
        &body(json!({"model": "m", "input": "x", "previous_response_id": "resp_gone"})),
    )
    .await;
    assert_eq!(r.status, 404);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("resp_gone"),
        "the worker's own answer"
    );
    let r = request(gw.addr, "GET", "/v1/responses/resp_gone", b"").await;
    assert_eq!(r.status, 404);
    let text = metrics_text(gw.addr).await;
    assert_eq!(
        metric(&text, r#"kvroute_responses_followed_total{how="unknown"}"#),
        Some(2.0),
        "{text}"
    );
}

#[tokio::test]
async fn responses_requests_with_bad_input_get_a_400_before_any_worker() {
    let workers = pool(2).await;
    let gw = gateway_for(&workers, "cache_aware").await;
    for bad in [
        &br#"{"model":"m"}"#[..],
        br#"{"model":"m","input":7}"#,
        br#"{"model":"m","input":[]}"#,
        br#"{"model":"m","input":"x","instructions":["no"]}"#,
        br#"{"model":"m","input":"x""#,
    ] {
        let r = request(gw.addr, "POST", "/v1/responses", bad).await;
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(bad));
        assert!(r.json()["error"]["message"].is_string());
    }
    let creates: usize = workers
        .iter()
        .map(|w| w.creates.load(Ordering::SeqCst))
        .sum();
    assert_eq!(creates, 0);
}

/// Conversations that send their whole history each turn (no stored responses) are routed on
/// their prefix: each conversation's turns stay on one worker, where round-robin moves them.
#[tokio::test]
async fn responses_conversations_without_a_store_follow_their_prefix() {
    let workers = pool(3).await;
    let gw = gateway_for(&workers, "cache_aware").await;
    let mut homes = std::collections::BTreeSet::new();
    for c in 0..6 {
        let mut input = vec![json!({"role": "user",
            "content": [{"type": "input_text", "text": format!("conversation {c}: {}", "context ".repeat(200))}]})];
        let mut seen = Vec::new();
        for t in 0..4 {
            let r = request(
                gw.addr,
                "POST",
                "/v1/responses",
                &body(json!({"model": "m", "input": input})),
            )
            .await;
            assert_eq!(r.status, 200);
            seen.push(r.header("x-kvroute-worker").unwrap().to_owned());
            let output = r.json()["output"].as_array().unwrap().clone();
            input.extend(output);
            input.push(json!({"role": "user", "content": format!("turn {t}")}));
        }
        assert!(
            seen.iter().all(|w| *w == seen[0]),
            "conversation {c} moved: {seen:?}"
        );
        homes.insert(seen[0].clone());
    }
    assert!(
        homes.len() > 1,
        "every conversation on one worker: {homes:?}"
    );
    let text = metrics_text(gw.addr).await;
    assert!(
        text.lines()
            .any(|l| l.contains(r#"outcome="longest_match""#) && !l.ends_with(" 0")),
        "later turns matched their earlier ones:\n{text}"
    );
}

/// The gateway in front of two simulated vLLM workers with the store on: a conversation chained
/// by `previous_response_id` through round-robin stays on its worker, and each turn finds the
/// earlier ones in that worker's cache.
#[tokio::test]
async fn chained_turns_through_the_gateway_hit_the_simulated_workers_cache() {
    let sim_cfg = kvroute::sim::SimConfig {
        workers: 2,
        port: 0,
        time_scale: 20.0,
        responses_store: true,
        ..Default::default()
    };
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let mut tasks = tokio::task::JoinSet::new();
    let addrs = kvroute::sim::spawn(&sim_cfg, sim_cfg.bind().await.unwrap(), &cancel, &mut tasks)
        .await
        .unwrap();
    let cfg = Config {
        workers: addrs
            .iter()
            .map(|a| WorkerConfig::from_url(format!("http://{a}")))
            .collect(),
        ..Config::default()
    }
    .with_overrides(kvroute::config::Overrides {
        policy: Some("round_robin".into()),
        ..Default::default()
    })
    .unwrap();
    let gw = gateway(cfg).await;
    let story = "A river town grew at the only ford for a hundred miles. ".repeat(30);
    let mut previous: Option<String> = None;
    let mut home = None;
    for t in 0..4 {
        let mut req = json!({"instructions": "Answer in one line.",
            "input": if t == 0 { story.clone() } else { format!("Turn {t}: go on.") },
            "max_output_tokens": 8, "stream": t % 2 == 1});
        if let Some(p) = &previous {
            req["previous_response_id"] = json!(p);
        }
        let r = request(gw.addr, "POST", "/v1/responses", &body(req)).await;
        assert_eq!(
            r.status,
            200,
            "turn {t}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let worker = r.header("x-kvroute-worker").unwrap().to_owned();
        assert_eq!(*home.get_or_insert(worker.clone()), worker, "turn {t}");
        let text = String::from_utf8(r.body).unwrap();
        let response: serde_json::Value = if t % 2 == 1 {
            let completed = text
                .split("\n\n")
                .find(|e| e.starts_with("event: response.completed"))
                .unwrap();
            serde_json::from_str::<serde_json::Value>(completed.split_once("data: ").unwrap().1)
                .unwrap()["response"]
                .clone()
        } else {
            serde_json::from_str(&text).unwrap()
        };
        if t > 0 {
            let usage = &response["usage"];
            let (input, cached) = (
                usage["input_tokens"].as_u64().unwrap(),
                usage["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap(),
            );
            assert!(cached * 10 >= input * 8, "turn {t}: {usage}");
        }
        previous = Some(response["id"].as_str().unwrap().to_owned());
    }
}

/// A response whose worker is gone cannot be continued elsewhere: the client gets the gateway's
/// error for that worker, and no other worker is asked to continue what it does not hold.
#[tokio::test]
async fn a_response_whose_worker_is_gone_gets_an_error_not_another_worker() {
    let mut workers = pool(2).await;
    let gw = gateway_for(&workers, "round_robin").await;
    let (id, home) = turn(gw.addr, None, false).await;
    let at = workers.iter().position(|w| w.name == home).unwrap();
    let gone = workers.remove(at);
    drop(gone);
    let before = workers[0].creates.load(Ordering::SeqCst);
    for _ in 0..3 {
        let req = json!({"model": "m", "input": "more", "previous_response_id": id});
        let r = request(gw.addr, "POST", "/v1/responses", &body(req)).await;
        assert!(
            [502, 503].contains(&r.status),
            "{} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
        assert!(r.json()["error"]["message"].is_string());
    }
    assert_eq!(workers[0].creates.load(Ordering::SeqCst), before);
}
