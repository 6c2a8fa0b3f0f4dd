//! The load generator: seeded requests against any OpenAI-compatible URL, streamed, timed per event.
//!
//! Closed loop: `concurrency` clients, each sending its next request the moment the last one ends
//! (intended time = that moment), or after a seeded, exponentially distributed think time when
//! `think` is set (also before a client's first request, so clients do not start in step); with
//! `ramp_up`, the clients start evenly spread over that long instead of all at once. Open
//! loop: Poisson arrivals at `rate`, at most `concurrency` in flight; a request that waits for a
//! free slot is still timed from its scheduled arrival, and a conversation's later turns follow
//! the think time too. New requests stop at the end of the window; those in flight are awaited
//! (up to the request timeout).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::stats::Sample;
use super::workload::{unit, RequestSpec, Workload};
use crate::sim::engine::splitmix;

pub(super) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A share of clients that disconnect after `after_tokens` streamed tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cancel {
    pub fraction: f64,
    pub after_tokens: usize,
}

#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// Base URL, e.g. `http://127.0.0.1:8080` (no `/v1`); several, comma-separated, are sent
    /// requests in turn (gateway replicas behind a connection-level balancer).
    pub url: String,
    /// Model to ask for; the first of `/v1/models` when unset.
    pub model: Option<String>,
    pub workload: Workload,
    pub seed: u64,
    pub concurrency: usize,
    /// Open loop at this many requests/s; closed loop when unset.
    pub rate: Option<f64>,
    /// Mean wall-clock pause before a client's next request (a user reading the answer and
    /// typing): exponentially distributed, drawn from the seed and the request's index, so every
    /// target sees the same pauses. Zero: none.
    pub think: Duration,
    /// Closed loop: the clients start evenly spread over this long from the run's start (client
    /// k of C at k/C of it) rather than all at once, as load tools ramp up their users. A start
    /// in one instant puts every client in step, and a policy that keeps conversations on their
    /// workers keeps them in step until something breaks the groups up; a window that begins
    /// after the ramp measures the traffic's steady state instead. Zero: all at once.
    pub ramp_up: Duration,
    pub warmup: Duration,
    pub duration: Duration,
    pub cancel: Option<Cancel>,
    pub request_timeout: Duration,
    /// Send at most this many requests (then stop, even inside the window): the same stream,
    /// request for request, whatever the target's speed.
    pub max_requests: Option<u64>,
    /// Output lengths vary: request `i` asks for the workload's length times a factor drawn
    /// uniformly from `1 ± output_range` (a stream of its own, the same for every target), so
    /// requests started together do not all end in the same decode step. 0: fixed lengths.
    pub output_range: f64,
    /// The API the requests are sent through.
    pub api: Api,
    /// Send each request with this header naming its conversation (`<seed>-<conversation>`; an
    /// independent request is a conversation of its own), as a chat front end names its
    /// sessions: for routers that route by session (the production-stack router's `session`,
    /// vllm-router's `consistent_hash` and `sticky_least_loaded`). None: no such header.
    pub session_header: Option<http::HeaderName>,
}

/// The API a run's requests go through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Api {
    /// The workload's own: `/v1/completions` for a prompt, `/v1/chat/completions` for messages.
    #[default]
    Completions,
    /// `/v1/responses`: a chat's system message as `instructions`, its other messages as
    /// `input` items (the whole history each turn, as the chat resends it); a prompt as `input`.
    Responses,
}

impl Api {
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "completions" => Some(Self::Completions),
            "responses" => Some(Self::Responses),
            _ => None,
        }
    }
}

/// A completions or chat body as a Responses API request: the system message (the first, if
/// any) as `instructions`, the other messages (or the prompt) as `input`, `max_tokens` as
/// `max_output_tokens`; vLLM's `ignore_eos` kept.
fn as_responses(body: &Value) -> Value {
    let mut out = serde_json::json!({
        "model": body["model"],
        "max_output_tokens": body["max_tokens"],
        "stream": body["stream"],
        "ignore_eos": body["ignore_eos"],
    });
    match body["messages"].as_array() {
        Some(messages) => {
            let (system, rest) = match messages.split_first() {
                Some((first, rest)) if first["role"] == "system" => (Some(first), rest),
                _ => (None, &messages[..]),
            };
            if let Some(system) = system {
                out["instructions"] = system["content"].clone();
            }
            out["input"] = Value::from(rest.to_vec());
        }
        None => out["input"] = body["prompt"].clone(),
    }
    out
}

impl LoadSpec {
    /// Request `i` of this run's stream.
    pub fn request(&self, i: u64) -> RequestSpec {
        let mut req = self.workload.request(self.seed, i);
        if self.output_range > 0.0 && req.output_tokens > 0 {
            let u = unit(splitmix(self.seed ^ 0x0a7_1e46 ^ i));
            let factor = 1.0 - self.output_range + 2.0 * self.output_range * u;
            let n = ((req.output_tokens as f64 * factor).round() as usize).max(1);
            req.output_tokens = n;
            req.body["max_tokens"] = Value::from(n);
        }
        req
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("bad URL {0}")]
    Url(String),
    #[error("{url}: {detail}")]
    Target { url: String, detail: String },
}

pub(super) fn client() -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(c)
}

/// Runs the load and returns every sample (the window is applied by [`super::stats::summarize`]).
pub async fn run(spec: &LoadSpec) -> Result<Vec<Sample>, LoadError> {
    let bases: Vec<String> = spec
        .url
        .split(',')
        .map(|u| u.trim().trim_end_matches('/').to_string())
        .collect();
    for base in &bases {
        let _: http::Uri = base.parse().map_err(|_| LoadError::Url(base.clone()))?;
    }
    let client = client();
    let model = match &spec.model {
        Some(m) => m.clone(),
        None => first_model(&client, &bases[0]).await?,
    };
    let shared = Arc::new(Shared {
        client,
        bases,
        model,
        spec: spec.clone(),
        start: Instant::now(),
        next: AtomicU64::new(0),
        sent: AtomicU64::new(0),
    });
    let end = spec.warmup + spec.duration;
    // A conversation's turns go out in order from one client; independent requests are a
    // "conversation" of one turn each.
    let turns = spec.workload.turns().unwrap_or(1);
    let mut tasks = JoinSet::new();
    let timed = match &spec.workload {
        Workload::Trace(t) if t.is_timed() => Some(t.clone()),
        _ => None,
    };
    match (spec.rate, timed) {
        (None, None) => {
            let clients = spec.concurrency.max(1);
            for k in 0..clients {
                let sh = shared.clone();
                let starts = sh.start + spec.ramp_up.mul_f64(k as f64 / clients as f64);
                tasks.spawn(async move {
                    let mut out = Vec::new();
                    tokio::time::sleep_until(starts).await;
                    loop {
                        let conv = sh.next.fetch_add(1, Ordering::Relaxed);
                        if !sh.conversation(conv, turns, None, end, &mut out).await {
                            break;
                        }
                    }
                    out
                });
            }
        }
        (rate, trace) => {
            let slots = Arc::new(Semaphore::new(spec.concurrency.max(1)));
            let mut t = 0.0;
            let mut i = 0u64;
            loop {
                t = match &trace {
                    // A timed trace: each line at its own time, until the trace ends.
                    Some(tr) => match tr.send_time(i) {
                        Some(at) => at,
                        None => break,
                    },
                    // Exponential inter-arrival times from the seeded stream: a Poisson process.
                    None => {
                        t + -(1.0 - unit(splitmix(spec.seed ^ 0xa771 ^ i))).ln()
                            / rate.unwrap_or(1.0)
                    }
                };
                let sent = shared.sent.load(Ordering::Relaxed);
                if Duration::from_secs_f64(t) >= end || spec.max_requests.is_some_and(|n| sent >= n)
                {
                    break;
                }
                tokio::time::sleep_until(shared.start + Duration::from_secs_f64(t)).await;
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    break;
                };
                let sh = shared.clone();
                let intended = t;
                let idx = i;
                tasks.spawn(async move {
                    let mut out = Vec::new();
                    sh.conversation(idx, turns, Some(intended), end, &mut out)
                        .await;
                    drop(permit);
                    out
                });
                i += 1;
            }
        }
    }
    let mut samples: Vec<Sample> = tasks.join_all().await.into_iter().flatten().collect();
    samples.sort_by(|a, b| a.intended.total_cmp(&b.intended));
    Ok(samples)
}

pub(crate) async fn first_model(client: &HttpClient, base: &str) -> Result<String, LoadError> {
    let err = |detail: String| LoadError::Target {
        url: format!("{base}/v1/models"),
        detail,
    };
    let uri: http::Uri = format!("{base}/v1/models")
        .parse()
        .map_err(|_| LoadError::Url(base.into()))?;
    let resp = client.get(uri).await.map_err(|e| err(e.to_string()))?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| err(e.to_string()))?
        .to_bytes();
    let v: Value = serde_json::from_slice(&body).map_err(|e| err(e.to_string()))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| err("no model listed".into()))
}

/// The think time before request `i`: exponential with mean `mean`, from the seeded stream (a
/// stream of its own, so think times do not move the workload's draws). At most 20 means: the
/// tail of the exponential is cut where it would only idle a client for the rest of a window.
pub fn think_time(seed: u64, i: u64, mean: Duration) -> Duration {
    if mean.is_zero() {
        return Duration::ZERO;
    }
    let draw = -(1.0 - unit(splitmix(seed ^ 0x7417_c0de ^ i))).ln();
    mean.mul_f64(draw.min(20.0))
}

struct Shared {
    client: HttpClient,
    bases: Vec<String>,
    model: String,
    spec: LoadSpec,
    start: Instant,
    /// The next conversation (or independent request) to start.
    next: AtomicU64,
    /// Requests sent so far, against `spec.max_requests`.
    sent: AtomicU64,
}

impl Shared {
    /// Sends the turns of conversation `conv` (requests `conv × turns ..`), each when the one
    /// before it has ended; the first at `first_intended` (open loop) or now. Returns false once
    /// the window or the request budget is spent.
    async fn conversation(
        &self,
        conv: u64,
        turns: u64,
        first_intended: Option<f64>,
        end: Duration,
        out: &mut Vec<Sample>,
    ) -> bool {
        for (t, i) in (conv * turns..(conv + 1) * turns).enumerate() {
            let intended = match first_intended {
                Some(at) if t == 0 => at,
                _ => {
                    let pause = think_time(self.spec.seed, i, self.spec.think);
                    if !pause.is_zero() {
                        if self.now() + pause.as_secs_f64() >= end.as_secs_f64() {
                            return false;
                        }
                        tokio::time::sleep(pause).await;
                    }
                    self.now()
                }
            };
            if intended >= end.as_secs_f64() {
                return false;
            }
            let n = self.sent.fetch_add(1, Ordering::Relaxed);
            if self.spec.max_requests.is_some_and(|max| n >= max) {
                return false;
            }
            out.push(self.one(i, intended).await);
        }
        true
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Sends request `i` and times it; never fails (an error is a sample with `ok: false`).
    async fn one(&self, i: u64, intended: f64) -> Sample {
        let req = self.spec.request(i);
        let cancel_after = self.spec.cancel.and_then(|c| {
            (unit(splitmix(self.spec.seed ^ 0xcafe ^ i)) < c.fraction).then_some(c.after_tokens)
        });
        let mut s = Sample {
            index: i,
            class: req.class.clone(),
            intended,
            sent: self.now(),
            slo: req.slo,
            ..Sample::default()
        };
        let outcome = tokio::time::timeout(
            self.spec.request_timeout,
            self.stream(&req, cancel_after, &mut s),
        )
        .await;
        match outcome {
            Ok(Ok(())) => s.ok = true,
            Ok(Err(e)) => s.error = Some(e),
            Err(_) => s.error = Some("timeout".into()),
        }
        s.done = self.now();
        s
    }

    /// Sends `req` and reads its stream into `s`.
    async fn stream(
        &self,
        req: &RequestSpec,
        cancel_after: Option<usize>,
        s: &mut Sample,
    ) -> Result<(), String> {
        let resp = self
            .client
            .request(self.http_request(req, s.index)?)
            .await
            .map_err(|e| format!("send: {e}"))?;
        let status = resp.status();
        let body = resp.into_body();
        if !status.is_success() {
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            return Err(format!(
                "HTTP {}: {}",
                status.as_u16(),
                text.chars().take(200).collect::<String>()
            ));
        }
        self.read_events(body, cancel_after, s).await
    }

    /// Request `index`'s body as a streamed request to the API the spec names, sent to its
    /// share of the targets.
    fn http_request(
        &self,
        req: &RequestSpec,
        index: u64,
    ) -> Result<http::Request<Full<Bytes>>, String> {
        let mut body = req.body.clone();
        body["model"] = Value::from(self.model.as_str());
        body["stream"] = Value::Bool(true);
        // Fixed output lengths, so every policy and target generates the same amount.
        body["ignore_eos"] = Value::Bool(true);
        let (path, body) = match (self.spec.api, req.chat) {
            (Api::Responses, _) => ("/v1/responses", as_responses(&body)),
            (Api::Completions, chat) => {
                body["stream_options"] = serde_json::json!({"include_usage": true});
                let path = if chat {
                    "/v1/chat/completions"
                } else {
                    "/v1/completions"
                };
                (path, body)
            }
        };
        let base = &self.bases[(index as usize) % self.bases.len()];
        let mut http_req = http::Request::post(format!("{base}{path}"))
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(name) = &self.spec.session_header {
            let turns = self.spec.workload.turns().unwrap_or(1);
            let session = format!("{}-{}", self.spec.seed, index / turns);
            http_req = http_req.header(name, session);
        }
        http_req
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())
    }

    /// Reads a stream's events into `s` (each content event's time, the output tokens) until
    /// it ends, or until `cancel_after` content events when the client cancels.
    async fn read_events(
        &self,
        body: hyper::body::Incoming,
        cancel_after: Option<usize>,
        s: &mut Sample,
    ) -> Result<(), String> {
        // Any conformant stream: CRLF or CR line ends, `data:` with or without a space, data over
        // several lines, comments and `event:` lines (a maintained parser, not ours).
        let mut events = sse_stream::SseStream::new(body);
        let mut content_events = 0usize;
        let ended = |s: &Sample, content_events: usize| {
            if content_events == 0 && s.output_tokens == 0 {
                Err("stream ended without output".to_string())
            } else {
                Ok(())
            }
        };
        while let Some(event) = events.next().await {
            let event = event.map_err(|e| format!("body: {e}"))?;
            let now = self.now();
            let Some(payload) = event.data else {
                continue; // a comment or a block without data
            };
            if payload == "[DONE]" {
                return ended(s, content_events);
            }
            let v: Value = serde_json::from_str(&payload).map_err(|e| format!("event: {e}"))?;
            match said(&v, s)? {
                Said::End => return ended(s, content_events),
                Said::Text => {
                    content_events += 1;
                    s.token_times.push(now);
                    if s.output_tokens < content_events {
                        s.output_tokens = content_events;
                    }
                    if cancel_after.is_some_and(|k| content_events >= k) {
                        s.cancelled = true;
                        return Ok(()); // dropping the body closes the connection
                    }
                }
                Said::Nothing => {}
            }
        }
        Err("stream ended before [DONE]".into())
    }
}

/// What one event of a stream says.
enum Said {
    /// Generated text (a completions or chat chunk, or a Responses text delta).
    Text,
    /// The Responses stream's last event: completed or incomplete (it sends no `[DONE]`).
    End,
    /// Nothing to count: a role delta, usage alone, another Responses event.
    Nothing,
}

/// What event `v` says, in the shape of completions, chat or the Responses API; its usage, when
/// it carries any, is noted in `s`. An error event is an `Err`.
fn said(v: &Value, s: &mut Sample) -> Result<Said, String> {
    if let Some(e) = v.get("error") {
        return Err(format!("error event: {e}"));
    }
    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
        s.output_tokens = n as usize;
    }
    match v["type"].as_str() {
        Some("response.completed" | "response.incomplete") => {
            if let Some(n) = v["response"]["usage"]["output_tokens"].as_u64() {
                s.output_tokens = n as usize;
            }
            return Ok(Said::End);
        }
        Some(failed @ ("response.failed" | "error")) => {
            return Err(format!("{failed} event: {v}"));
        }
        _ => {}
    }
    let choice = &v["choices"][0];
    let text = choice["text"]
        .as_str()
        .or(choice["delta"]["content"].as_str())
        .or(v["delta"]
            .as_str()
            .filter(|_| v["type"] == "response.output_text.delta"));
    Ok(if text.is_some_and(|t| !t.is_empty()) {
        Said::Text
    } else {
        Said::Nothing
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn says(v: Value) -> (Result<&'static str, String>, usize) {
        let mut s = Sample::default();
        let said = said(&v, &mut s).map(|x| match x {
            Said::Text => "text",
            Said::End => "end",
            Said::Nothing => "nothing",
        });
        (said, s.output_tokens)
    }

    #[test]
    fn each_apis_events_are_told_apart() {
        // Completions and chat chunks with text, and the ones without.
        assert_eq!(says(json!({"choices": [{"text": "a"}]})), (Ok("text"), 0));
        assert_eq!(
            says(json!({"choices": [{"delta": {"content": "a"}}]})),
            (Ok("text"), 0)
        );
        assert_eq!(
            says(json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]})),
            (Ok("nothing"), 0)
        );
        // The final usage chunk: no choices, its count kept.
        assert_eq!(
            says(json!({"choices": [], "usage": {"completion_tokens": 7}})),
            (Ok("nothing"), 7)
        );
        // The Responses API: text deltas by type, and its last event carrying the usage.
        assert_eq!(
            says(json!({"type": "response.output_text.delta", "delta": "a"})),
            (Ok("text"), 0)
        );
        assert_eq!(
            says(json!({"type": "response.reasoning_text.delta", "delta": "a"})),
            (Ok("nothing"), 0)
        );
        for last in ["response.completed", "response.incomplete"] {
            assert_eq!(
                says(json!({"type": last, "response": {"usage": {"output_tokens": 9}}})),
                (Ok("end"), 9)
            );
        }
    }

    #[test]
    fn error_events_fail_the_request() {
        for v in [
            json!({"error": {"message": "boom"}}),
            json!({"type": "response.failed", "response": {}}),
            json!({"type": "error", "message": "boom"}),
        ] {
            assert!(says(v.clone()).0.is_err(), "{v}");
        }
    }
}
