//! Hot reload under load: policy and worker list change without dropping a request; a bad file
//! is rejected and the running config stays.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{request, wait_metric};
use kvroute::config::{Config, Overrides};
use kvroute::sim::{self, SimConfig};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

fn yaml(policy: &str, workers: &[String]) -> String {
    let list: Vec<String> = workers.iter().map(|w| format!("  - url: {w}\n")).collect();
    format!(
        "policy:\n  kind: {policy}\nhealth:\n  interval_seconds: 0\nworkers:\n{}",
        list.concat()
    )
}

async fn worker_of(gw: std::net::SocketAddr, prompt: &str) -> String {
    let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": 2}}"#);
    let r = request(gw, "POST", "/v1/completions", body.as_bytes()).await;
    assert_eq!(r.status, 200);
    r.header("x-kvroute-worker").unwrap().to_string()
}

/// Two simulated workers and a reloading gateway whose config file starts with `round_robin`.
struct Setup {
    gw: std::net::SocketAddr,
    addrs: Vec<std::net::SocketAddr>,
    urls: Vec<String>,
    path: std::path::PathBuf,
    _dir: common::TempDir,
    cancel: CancellationToken,
    _tasks: JoinSet<()>,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn setup(tag: &str) -> Setup {
    setup_on(tag, 1).await
}

/// [`setup`] with the gateway on `loops` event loops.
async fn setup_on(tag: &str, loops: usize) -> Setup {
    let cancel = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let sim_cfg = SimConfig {
        workers: 2,
        port: 0,
        time_scale: 20.0,
        ..SimConfig::default()
    };
    let addrs = sim::spawn(&sim_cfg, sim_cfg.bind().await.unwrap(), &cancel, &mut tasks)
        .await
        .unwrap();
    let urls: Vec<String> = addrs.iter().map(|a| format!("http://{a}")).collect();
    let dir = common::TempDir::new(tag);
    let path = dir.join("kvroute.yaml");
    std::fs::write(&path, yaml("round_robin", &urls)).unwrap();
    let gw = serve_file(&path, loops, &cancel).await;
    Setup {
        gw,
        addrs,
        urls,
        path,
        _dir: dir,
        cancel,
        _tasks: tasks,
    }
}

/// A gateway on `loops` event loops that follows the config file at `path` until `cancel`.
async fn serve_file(
    path: &std::path::Path,
    loops: usize,
    cancel: &CancellationToken,
) -> std::net::SocketAddr {
    let config = Config::load(Some(path), Overrides::default()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gw = listener.local_addr().unwrap();
    let poll = Duration::from_millis(20);
    let source = kvroute::reload::Source::new(path.to_owned(), Overrides::default(), poll);
    tokio::spawn(kvroute::server::serve_reloading(
        listener,
        None,
        loops,
        config,
        Some(source),
        None,
        cancel.clone(),
    ));
    gw
}

/// Waits until `/metrics` no longer shows `worker`, failing after five seconds.
async fn until_metrics_drop(gw: std::net::SocketAddr, worker: &str) -> String {
    let gone = format!("worker=\"{worker}\"");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = common::metrics_text(gw).await;
        if !m.contains(&gone) {
            return m;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{worker}'s series stayed after it left the list:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_and_workers_reload_under_load_without_dropping_a_request() {
    let s = setup("reload").await;
    let (gw, addrs, urls, path) = (s.gw, &s.addrs, &s.urls, &s.path);

    // Round-robin: the same prompt alternates.
    let a = worker_of(gw, "same prompt").await;
    let b = worker_of(gw, "same prompt").await;
    assert_ne!(a, b);

    // Load: 6 clients streaming back to back, each response checked whole.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let mut load = JoinSet::new();
    for c in 0..6 {
        let (stop, done) = (stop.clone(), done.clone());
        load.spawn(async move {
            let mut bad = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let body =
                    format!(r#"{{"prompt": "client {c}", "max_tokens": 16, "stream": true}}"#);
                let r = request(gw, "POST", "/v1/completions", body.as_bytes()).await;
                let text = String::from_utf8_lossy(&r.body).to_string();
                if r.status != 200 || !text.trim_end().ends_with("data: [DONE]") {
                    bad.push((r.status, text));
                }
                done.fetch_add(1, Ordering::SeqCst);
            }
            bad
        });
    }
    let wait_done = |n: usize| {
        let done = done.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while done.load(Ordering::SeqCst) < n {
                assert!(tokio::time::Instant::now() < deadline, "load stalled");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    wait_done(12).await;

    let applied = "kvroute_config_reloads_total{result=\"applied\"}";
    let limit = Duration::from_secs(5);
    std::fs::write(path, yaml("prefix", urls)).unwrap();
    assert_eq!(wait_metric(gw, applied, 1.0, limit).await, Some(1.0));
    let n = done.load(Ordering::SeqCst);
    wait_done(n + 12).await;

    // A broken file is rejected; the prefix policy stays.
    std::fs::write(path, "policy: {kind: nonsense}\n").unwrap();
    let rejected = "kvroute_config_reloads_total{result=\"rejected\"}";
    assert_eq!(wait_metric(gw, rejected, 1.0, limit).await, Some(1.0));
    let n = done.load(Ordering::SeqCst);
    wait_done(n + 12).await;

    // Shrinking the static list to one worker moves everything there.
    std::fs::write(path, yaml("prefix", &urls[..1])).unwrap();
    assert_eq!(wait_metric(gw, applied, 2.0, limit).await, Some(2.0));
    let n = done.load(Ordering::SeqCst);
    wait_done(n + 12).await;

    stop.store(true, Ordering::SeqCst);
    let bad: Vec<_> = load.join_all().await.into_iter().flatten().collect();
    assert!(bad.is_empty(), "requests failed across reloads: {bad:?}");
    assert!(done.load(Ordering::SeqCst) >= 48);

    let only = addrs[0].to_string();
    for p in ["x", "y", "z", "same prompt"] {
        assert_eq!(worker_of(gw, p).await, only);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_reloading_to_prefix_the_same_prompt_sticks_to_one_worker() {
    let s = setup("reload2").await;
    let (gw, urls, path) = (s.gw, &s.urls, &s.path);
    std::fs::write(path, yaml("prefix", urls)).unwrap();
    let applied = "kvroute_config_reloads_total{result=\"applied\"}";
    assert_eq!(
        wait_metric(gw, applied, 1.0, Duration::from_secs(5)).await,
        Some(1.0)
    );
    let first = worker_of(gw, "a long shared system prompt").await;
    for _ in 0..5 {
        assert_eq!(worker_of(gw, "a long shared system prompt").await, first);
    }
    let m = common::metrics_text(gw).await;
    assert!(
        m.contains("kvroute_routing_decisions_total{arm=\"prefix\",outcome=\"preferred\",policy=\"prefix\"} 6"),
        "{m}"
    );
}

/// Each event loop holds the worker set through a handle of its own (`loop_copy`), which must not
/// keep a worker that left the list: its series leave `/metrics` once its last request ended,
/// though the loops serve no request after the reload to let go of the old set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_taken_out_leaves_metrics_though_no_request_follows() {
    let s = setup_on("reload3", 2).await;
    let (gw, urls, path) = (s.gw, &s.urls, &s.path);
    // Each request comes on a connection of its own, and the two loops are handed connections in
    // turn: both loops route to both workers.
    let mut seen = std::collections::HashSet::new();
    for i in 0..8 {
        seen.insert(worker_of(gw, &format!("prompt {i}")).await);
    }
    assert_eq!(seen.len(), 2, "round-robin used both workers: {seen:?}");
    let first = worker_of(gw, "one more").await;
    let second = seen.iter().find(|w| **w != first).unwrap().clone();
    let gone = format!("worker=\"{second}\"");
    assert!(common::metrics_text(gw).await.contains(&gone));

    // Keep only the worker that served the last request.
    let keep = urls
        .iter()
        .find(|u| u.ends_with(first.as_str()))
        .expect("a worker without a name is named by its address");
    std::fs::write(path, yaml("round_robin", std::slice::from_ref(keep))).unwrap();
    let applied = "kvroute_config_reloads_total{result=\"applied\"}";
    let limit = Duration::from_secs(5);
    assert_eq!(wait_metric(gw, applied, 1.0, limit).await, Some(1.0));
    // Scrapes go through the router, not the routing path: nothing here refreshes a loop's handle.
    let m = until_metrics_drop(gw, &second).await;
    assert!(m.contains(&format!("worker=\"{first}\"")), "{m}");
}

/// A request holds its own worker, not the set it was routed among: a worker taken out of the
/// list leaves `/metrics` while a stream to another, routed among the old list, still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_taken_out_leaves_metrics_while_a_stream_to_another_runs() {
    let ups = [
        common::upstream("a", &[]).await,
        common::upstream("b", &[]).await,
    ];
    let urls: Vec<String> = ups.iter().map(|u| u.url()).collect();
    let dir = common::TempDir::new("reload4");
    let path = dir.join("kvroute.yaml");
    std::fs::write(&path, yaml("round_robin", &urls)).unwrap();
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let gw = serve_file(&path, 2, &cancel).await;
    let stream = br#"{"prompt": "held", "stream": true, "max_tokens": 2, "gate": true}"#;
    let mut held = common::send(gw, "POST", "/v1/completions", stream).await;
    let head = common::read_until(&mut held, b"tok0", Duration::from_secs(5)).await;
    let head = common::parse_response(&head);
    assert_eq!(head.status, 200);
    let kept = head.header("x-kvroute-worker").unwrap().to_string();
    // Round-robin sends the next request to the other worker.
    let other = worker_of(gw, "the other").await;
    assert_ne!(other, kept);

    let keep = urls.iter().find(|u| u.ends_with(kept.as_str())).unwrap();
    std::fs::write(&path, yaml("round_robin", std::slice::from_ref(keep))).unwrap();
    let applied = "kvroute_config_reloads_total{result=\"applied\"}";
    assert_eq!(
        wait_metric(gw, applied, 1.0, Duration::from_secs(5)).await,
        Some(1.0)
    );
    let m = until_metrics_drop(gw, &other).await;
    let inflight = format!("kvroute_worker_inflight{{worker=\"{kept}\"}}");
    assert_eq!(
        common::metric(&m, &inflight),
        Some(1.0),
        "the stream still runs"
    );

    ups.iter().for_each(|u| u.gate.notify_waiters());
    let rest = common::read_until(&mut held, b"[DONE]", Duration::from_secs(5)).await;
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("data: [DONE]"), "{text}");
}
