//! Test helpers: a scripted upstream on 127.0.0.1:0 that streams SSE slowly and reports when its
//! client goes away, the gateway on 127.0.0.1:0, and a raw HTTP/1.1 client over a socket.
#![allow(dead_code)]

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    extract::{Request, State},
    response::{IntoResponse, Response},
    routing::{any, get},
    Json, Router,
};
use futures_util::StreamExt as _;
use kvroute::config::{Config, WorkerConfig};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{mpsc, Notify},
};
use tokio_util::sync::CancellationToken;

/// How the scripted upstream behaves; set per request by fields in the JSON body:
/// `max_tokens` = events, `delay_ms` between events (or before a non-streaming answer), `gate`
/// = wait after the first event until the test opens the gate, `die_after` = break the
/// connection after that many events (a worker killed mid-stream).
pub struct Upstream {
    pub addr: SocketAddr,
    pub name: String,
    pub requests: Arc<AtomicUsize>,
    /// One message per request whose client went away before the response ended.
    pub disconnects: mpsc::UnboundedReceiver<()>,
    pub gate: Arc<Notify>,
    _stop: tokio_util::sync::DropGuard,
}

#[derive(Clone)]
struct UpState {
    name: String,
    requests: Arc<AtomicUsize>,
    disconnects: mpsc::UnboundedSender<()>,
    gate: Arc<Notify>,
    models: Vec<String>,
}

/// Sends on drop unless disarmed: how the upstream notices its request was abandoned.
struct AbandonAlarm(Option<mpsc::UnboundedSender<()>>);
impl Drop for AbandonAlarm {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// The deterministic text of event `i` of a request for `prompt`.
pub fn event_text(prompt: &str, i: usize) -> String {
    format!("tok{i}-{}", prompt.len() % 97)
}

pub async fn upstream(name: &str, models: &[&str]) -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let state = UpState {
        name: name.to_owned(),
        requests: Arc::new(AtomicUsize::new(0)),
        disconnects: tx,
        gate: Arc::new(Notify::new()),
        models: models.iter().map(|s| s.to_string()).collect(),
    };
    // vLLM's serving routes outside `/v1/` answer as the others do; its operator routes (and
    // `/health`) are not served, as before.
    let app = [
        "/v1/{*rest}",
        "/v2/{*rest}",
        "/inference/{*rest}",
        "/tokenize",
        "/detokenize",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/invocations",
        "/reset_prefix_cache",
    ]
    .into_iter()
    .fold(Router::new(), |r, path| r.route(path, any(generate)))
    .route("/v1/models", get(models_handler))
    .with_state(state.clone());
    let stop = serve_until_dropped(listener, app);
    Upstream {
        addr,
        name: name.to_owned(),
        requests: state.requests,
        disconnects: rx,
        gate: state.gate,
        _stop: stop,
    }
}

/// Serves `app` on `listener` in a task of its own until the guard is dropped.
pub fn serve_until_dropped(listener: TcpListener, app: Router) -> tokio_util::sync::DropGuard {
    let stop = CancellationToken::new();
    let token = stop.clone();
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(token.cancelled_owned())
            .await
            .unwrap();
    });
    stop.drop_guard()
}

async fn models_handler(State(s): State<UpState>) -> Json<serde_json::Value> {
    let data: Vec<_> = s
        .models
        .iter()
        .map(|m| serde_json::json!({"id": m, "object": "model"}))
        .collect();
    Json(serde_json::json!({"object": "list", "data": data}))
}

async fn generate(State(s): State<UpState>, req: Request) -> Response {
    // How many requests reached this upstream before this one: the order the gateway let them in.
    let arrival = s.requests.fetch_add(1, Ordering::SeqCst);
    let path = req.uri().path().to_owned();
    let authorization = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let rank = req
        .headers()
        .get("x-data-parallel-rank")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = axum::body::to_bytes(req.into_body(), 1 << 24)
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let n = v["max_tokens"].as_u64().unwrap_or(3) as usize;
    let delay = Duration::from_millis(v["delay_ms"].as_u64().unwrap_or(0));
    let prompt = v["prompt"].as_str().unwrap_or("").to_owned();
    let gated = v["gate"].as_bool().unwrap_or(false);
    let die_after = v["die_after"].as_u64().map(|d| d as usize);
    if let Some(code) = v["fail_status"].as_u64() {
        let status = axum::http::StatusCode::from_u16(code as u16).unwrap();
        let error = serde_json::json!({"error": {"message": "worker failed", "code": code}});
        return (status, Json(error)).into_response();
    }
    let mut alarm = AbandonAlarm(Some(s.disconnects.clone()));
    if !v["stream"].as_bool().unwrap_or(false) {
        tokio::time::sleep(delay).await;
        alarm.0 = None;
        let text: String = (0..n).map(|i| event_text(&prompt, i)).collect();
        return (
            [("x-upstream", s.name.clone())],
            Json(serde_json::json!({
                "text": text, "path": path, "worker": s.name, "authorization": authorization,
                "arrival": arrival, "data_parallel_rank": rank
            })),
        )
            .into_response();
    }
    let gate = s.gate.clone();
    let stream = async_stream(n, delay, prompt, gated, gate, alarm);
    let stream = futures_util::StreamExt::enumerate(stream).map(move |(i, item)| match die_after {
        Some(d) if i >= d => Err(std::io::Error::other("worker killed")),
        _ => item,
    });
    (
        [
            ("content-type", "text/event-stream"),
            ("x-upstream", s.name.as_str()),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

fn async_stream(
    n: usize,
    delay: Duration,
    prompt: String,
    gated: bool,
    gate: Arc<Notify>,
    alarm: AbandonAlarm,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    futures_util::stream::unfold((0usize, alarm), move |(i, mut alarm)| {
        let gate = gate.clone();
        let prompt = prompt.clone();
        async move {
            if i > n {
                return None;
            }
            if i > 0 {
                if gated && i == 1 {
                    gate.notified().await;
                }
                tokio::time::sleep(delay).await;
            }
            let chunk = if i == n {
                alarm.0 = None;
                "data: [DONE]\n\n".to_string()
            } else {
                format!(
                    "data: {{\"choices\":[{{\"index\":0,\"text\":\"{}\"}}]}}\n\n",
                    event_text(&prompt, i)
                )
            };
            Some((Ok(Bytes::from(chunk)), (i + 1, alarm)))
        }
    })
}

impl Upstream {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn worker_config(&self) -> WorkerConfig {
        named_worker(&self.name, self.url())
    }

    /// Waits (bounded) for the upstream to see one abandoned request.
    pub async fn saw_disconnect_within(&mut self, limit: Duration) -> bool {
        matches!(
            tokio::time::timeout(limit, self.disconnects.recv()).await,
            Ok(Some(()))
        )
    }
}

/// A worker entry for `url` under `name` (the `worker` label its series carry).
pub fn named_worker(name: &str, url: String) -> WorkerConfig {
    WorkerConfig {
        name: Some(name.to_owned()),
        ..WorkerConfig::from_url(url)
    }
}

pub struct Gateway {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

pub async fn gateway(config: Config) -> Gateway {
    config.validate().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(kvroute::server::serve(listener, config, shutdown.clone()));
    Gateway {
        addr,
        shutdown,
        task,
    }
}

pub fn config_for(workers: &[&Upstream], policy: &str) -> Config {
    Config {
        workers: workers.iter().map(|u| u.worker_config()).collect(),
        ..Config::default()
    }
    .with_overrides(kvroute::config::Overrides {
        policy: Some(policy.into()),
        ..Default::default()
    })
    .unwrap()
}

/// The `tokens` of a worker's `/tokenize` answer (vLLM's or the simulator's).
pub fn token_ids(answer: &RawResponse) -> Vec<u32> {
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    answer.json()["tokens"]
        .as_array()
        .expect("a tokens array")
        .iter()
        .map(|v| v.as_u64().expect("a token id") as u32)
        .collect()
}

/// A response read whole over a raw HTTP/1.1 connection.
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Opens a connection and sends one request; the caller reads from the stream.
pub async fn send(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> TcpStream {
    send_with(addr, method, path, &[], body).await
}

/// [`send`] with extra request headers.
pub async fn send_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s
}

/// Reads from `s` until `needle` has been seen in what was read, or EOF; returns everything read.
pub async fn read_until(s: &mut TcpStream, needle: &[u8], limit: Duration) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let _ = tokio::time::timeout(limit, async {
        loop {
            let n = s.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            if got.windows(needle.len().max(1)).any(|w| w == needle) {
                break;
            }
        }
    })
    .await;
    got
}

/// One whole request and response (with `connection: close`, so EOF ends the body).
pub async fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> RawResponse {
    request_with(addr, method, path, &[], body).await
}

/// A `cache_aware` gateway's config for one server at `url` running `ranks` data-parallel
/// engines, following their KV events: from `given` (rank 0's endpoints; each rank's are on its
/// ports plus the rank), or asked of the server (`/kv_event_sources`) when `None`; requests
/// tokenized with `tokenizer_json` for `model`. No load polling, unless the ranks are `auto`:
/// then the server's `/metrics` is read every 0.1 s, which is where its engines are found.
pub fn data_parallel_events_config(
    url: String,
    ranks: kvroute::config::DataParallelSize,
    given: Option<&kvroute::kv_events::EventSource>,
    model: &str,
    tokenizer_json: std::path::PathBuf,
) -> Config {
    let mut config = Config {
        workers: vec![WorkerConfig {
            kv_events: given.map(|s| s.endpoint.clone()),
            kv_events_replay: given.and_then(|s| s.replay.clone()),
            data_parallel_size: Some(ranks),
            ..WorkerConfig::from_url(url)
        }],
        tokenizers: vec![kvroute::config::TokenizerConfig {
            model: model.to_owned(),
            tokenizer_json,
            tokenizer_config: None,
            chat_template: None,
            default_chat_template_kwargs: Default::default(),
        }],
        ..Config::default()
    }
    .with_overrides(kvroute::config::Overrides {
        policy: Some("cache_aware".into()),
        ..Default::default()
    })
    .unwrap();
    config.kv_events.discover = given.is_none();
    config.load_signals.interval_seconds = match ranks {
        kvroute::config::DataParallelSize::Auto => 0.1,
        kvroute::config::DataParallelSize::Fixed(_) => 0.0,
    };
    config
}

/// Asks the gateway at `gw` where `body` (a `/v1/completions` request) would go, through
/// `/debug/route`, until the answer names `worker` with at least `min_cached` predicted cached
/// tokens (KV events arrive asynchronously); panics with the last answer after `limit`.
pub async fn until_routed_to(
    gw: SocketAddr,
    body: &serde_json::Value,
    worker: &str,
    min_cached: u64,
    limit: Duration,
) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let path = "/debug/route/v1/completions";
        let d = request(gw, "POST", path, body.to_string().as_bytes()).await;
        assert_eq!(d.status, 200, "{}", String::from_utf8_lossy(&d.body));
        let d = d.json();
        let predicted = d["predicted_cached_tokens"].as_u64().unwrap_or(0);
        if d["worker"] == worker && predicted >= min_cached {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{worker}'s blocks never arrived: {d}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`request`] with extra request headers.
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> RawResponse {
    let mut s = send_with(addr, method, path, headers, body).await;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut raw))
        .await
        .expect("response within 20 s")
        .unwrap();
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> RawResponse {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    RawResponse {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(std::str::from_utf8(&data[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[eol + 2 + size + 2..];
    }
    out
}

/// The value of a metric line (exact name with labels) in a Prometheus text exposition.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// POSTs every body to `path` at once and waits for all the answers, each of which must be 200.
pub async fn post_together(addr: SocketAddr, path: &'static str, bodies: Vec<String>) {
    let mut set = tokio::task::JoinSet::new();
    for body in bodies {
        set.spawn(async move {
            let r = request(addr, "POST", path, body.as_bytes()).await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

/// A part (`base`, `per_prefill_token`) of the first worker's fitted step,
/// `kvroute_worker_step_seconds`, when shown.
pub fn step_fit(text: &str, part: &str) -> Option<f64> {
    let start = format!("kvroute_worker_step_seconds{{part=\"{part}\"");
    text.lines()
        .find(|l| l.starts_with(&start))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Sends waves of prompts (`send(wave)`) through the gateway at `addr` until it publishes a step
/// fit, at least 8 waves and at most `max`; returns its `/metrics` as last read. A fit needs 8
/// windows of steps whose prefill varies, and how a wave's prompts fall into a worker's steps
/// depends on how busy the machine is, so no fixed count of waves is sure to give one.
pub async fn waves_until_step_fit<F, Fut>(addr: SocketAddr, max: u64, mut send: F) -> String
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut text = String::new();
    for wave in 0..max {
        send(wave).await;
        text = metrics_text(addr).await;
        if wave >= 7 && step_fit(&text, "per_prefill_token").is_some() {
            break;
        }
    }
    text
}

pub async fn metrics_text(addr: SocketAddr) -> String {
    String::from_utf8(request(addr, "GET", "/metrics", b"").await.body).unwrap()
}

/// Polls `/metrics` until `series` equals `want` (bounded); returns the last value seen.
pub async fn wait_metric(
    addr: SocketAddr,
    series: &str,
    want: f64,
    limit: Duration,
) -> Option<f64> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let v = metric(&metrics_text(addr).await, series);
        if v == Some(want) || tokio::time::Instant::now() > deadline {
            return v;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A directory of the test's own under the system's temporary directory, removed with everything
/// in it when dropped (also when the test fails), so test runs leave nothing behind.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvroute-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `kvroute` process of the test's, killed when dropped, pass or fail.
pub struct Process(pub std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `kvroute ARGS` and returns it with the first line it prints (a URL or the listening
/// line).
pub fn kvroute_process(args: &[&str]) -> (Process, String) {
    use std::{
        io::{BufRead, BufReader},
        process::{Command, Stdio},
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .env_remove("KVROUTE_POLICY")
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    (Process(child), first.trim().to_owned())
}

/// One simulated worker in a process of its own, on `port` (0: any free one), at 20x speed;
/// with its URL.
pub fn sim_process(port: u16) -> (Process, String) {
    kvroute_process(&[
        "sim",
        "--workers",
        "1",
        "--port",
        &port.to_string(),
        "--time-scale",
        "20",
    ])
}

/// Simulated workers of `cfg`, started on this runtime; they run until the token is cancelled
/// (or the task set dropped).
pub async fn start_sims(
    cfg: &kvroute::sim::SimConfig,
) -> (
    Vec<kvroute::sim::SimWorker>,
    tokio_util::sync::CancellationToken,
    tokio::task::JoinSet<()>,
) {
    let cancel = tokio_util::sync::CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    let sims = kvroute::sim::start(cfg, cfg.bind().await.unwrap(), &cancel, &mut tasks)
        .await
        .unwrap();
    (sims, cancel, tasks)
}
