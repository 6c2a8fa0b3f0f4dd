//! Soak: the release-shaped gateway process in front of two simulated-worker processes, under
//! mixed streaming load with 30% of requests cancelled by their client, while one worker is
//! killed and restarted twice. Every request must be accounted for (completed, cancelled or
//! errored, none hung), the gateway and the workers must end with nothing in flight, and the
//! gateway's resident memory and open file descriptors must stay flat after warm-up.
//!
//! `KVROUTE_SOAK_SECONDS` sets the length (default 40 s, what CI runs); the figures in the
//! README come from `KVROUTE_SOAK_SECONDS=600 cargo test --release --test soak -- --nocapture`.

mod common;

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{io::AsyncReadExt, time::Instant};

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// Resident set size and open descriptors of process `pid`.
fn rss_and_fds(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    (kib * 1024, fds)
}

#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    /// Of `cancelled`: left before any byte of the answer (the gateway may not have read the
    /// request yet when the connection closed, and then never sees it).
    cancelled_early: AtomicU64,
    errored: AtomicU64,
    hung: AtomicU64,
    refused: AtomicU64,
}

/// One request, start to end; how it ended goes into `t`.
async fn one(gw: SocketAddr, n: u64, t: &Tally) {
    // xorshift on the request number: which shape, and whether the client walks away.
    let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    let stream = x % 10 < 8;
    let cancel = (x >> 8) % 10 < 3;
    let prompt = format!(
        "system prompt {} shared by many; user {} asks question {}",
        x % 8,
        n % 97,
        n
    );
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": 8 + (x >> 16) % 48, "stream": stream,
    });
    t.sent.fetch_add(1, Ordering::Relaxed);
    let Ok(mut s) = tokio::net::TcpStream::connect(gw).await else {
        t.refused.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let body = serde_json::to_vec(&body).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {gw}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    use tokio::io::AsyncWriteExt;
    if s.write_all(head.as_bytes()).await.is_err() || s.write_all(&body).await.is_err() {
        t.refused.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    if cancel && !stream {
        // Walk away while the answer is being generated (it takes tens of milliseconds).
        let early = tokio::time::timeout(Duration::from_millis(5), s.read(&mut buf)).await;
        match early {
            Err(_) => {
                t.cancelled.fetch_add(1, Ordering::Relaxed);
                t.cancelled_early.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Ok(Ok(k)) => got.extend_from_slice(&buf[..k]),
            Ok(Err(_)) => {}
        }
    }
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(k) => got.extend_from_slice(&buf[..k]),
            }
            // Walk away after the first event.
            if cancel
                && stream
                && got.starts_with(b"HTTP/1.1 200")
                && got.windows(5).any(|w| w == b"data:")
            {
                return true;
            }
        }
    })
    .await;
    match read {
        Err(_) => {
            t.hung.fetch_add(1, Ordering::Relaxed);
        }
        Ok(true) => {
            t.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        Ok(false) => {
            let ok = got.starts_with(b"HTTP/1.1 200")
                && !got.windows(9).any(|w| w == b"\"error\":")
                && (!stream || got.windows(12).any(|w| w == b"data: [DONE]"));
            let c = if ok { &t.completed } else { &t.errored };
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn sum_series(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_cancellations_and_worker_restarts_leaks_nothing() {
    let seconds: u64 = std::env::var("KVROUTE_SOAK_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let total = Duration::from_secs(seconds);
    let (_w0, url0) = common::sim_process(0);
    let (w1, url1) = common::sim_process(0);
    let port1 = addr_of(&url1).port();
    let dir = common::TempDir::new("soak");
    let cfg = dir.join("kvroute.yaml");
    std::fs::write(
        &cfg,
        format!(
            "listen: 127.0.0.1:0\npolicy: {{kind: cache_aware, index_max_bytes: 4194304}}\nworkers:\n  - {{url: {url0}, name: w0}}\n  - {{url: {url1}, name: w1}}\neject_seconds: 1\nhealth: {{interval_seconds: 0.5, healthy_threshold: 1}}\n"
        ),
    )
    .unwrap();
    let (gw_proc, line) = common::kvroute_process(&["serve", "--config", cfg.to_str().unwrap()]);
    let gw = addr_of(line.rsplit(' ').next().unwrap());
    let pid = gw_proc.0.id();

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..32)
        .map(|_| {
            let (tally, stop, next) = (tally.clone(), stop.clone(), next.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    one(gw, n, &tally).await;
                }
            })
        })
        .collect();

    // Samples every tenth of the run; worker w1 is killed and restarted at 1/3 and 2/3.
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut w1 = Some(w1);
    for tick in 1..=10u32 {
        tokio::time::sleep_until(start + total * tick / 10).await;
        samples.push(rss_and_fds(pid));
        if tick == 3 || tick == 6 {
            drop(w1.take()); // SIGKILL: streams on it break mid-way
                             // Down for a moment, as a crashed pod is, then back on the same port.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (again, url) = common::sim_process(port1);
            assert_eq!(addr_of(&url).port(), port1);
            w1 = Some(again);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let load_seconds = start.elapsed().as_secs_f64();

    // Nothing in flight anywhere once the clients are done.
    for w in ["w0", "w1"] {
        let series = format!("kvroute_worker_inflight{{worker=\"{w}\"}}");
        let v = common::wait_metric(gw, &series, 0.0, Duration::from_secs(10)).await;
        assert_eq!(v, Some(0.0), "{series}");
    }
    for url in [&url0, &format!("http://127.0.0.1:{port1}")] {
        let running = "vllm:num_requests_running";
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = common::metrics_text(addr_of(url)).await;
            let v = sum_series(&m, running);
            if v == 0.0 {
                break;
            }
            assert!(Instant::now() < deadline, "{url} still runs {v} requests");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (sent, completed, cancelled, errored, hung, refused) = (
        get(&tally.sent),
        get(&tally.completed),
        get(&tally.cancelled),
        get(&tally.errored),
        get(&tally.hung),
        get(&tally.refused),
    );
    let m = common::metrics_text(gw).await;
    let answered = sum_series(&m, "kvroute_requests_total{");
    // A client that leaves before the answer's headers is counted there instead.
    let left_waiting = sum_series(&m, "kvroute_client_disconnects_total{phase=\"waiting\"}");
    let end = rss_and_fds(pid);
    let index = sum_series(&m, "kvroute_index_bytes{");
    let warm = samples[1];
    let late_rss = samples[5..].iter().map(|s| s.0).max().unwrap();
    let early_rss = samples[1..5].iter().map(|s| s.0).max().unwrap();
    println!(
        "soak {load_seconds:.0} s: {sent} requests, {completed} completed, {cancelled} cancelled, {errored} errored, {hung} hung, {refused} refused; gateway answered {answered}, saw {left_waiting} leave before an answer"
    );
    println!(
        "gateway RSS MiB by tenth: {:?}; fds: {:?}; after load: {:.1} MiB, {} fds; prefix index {:.1} MiB (its cap 4)",
        samples
            .iter()
            .map(|s| (s.0 as f64 / 1048576.0 * 10.0).round() / 10.0)
            .collect::<Vec<_>>(),
        samples.iter().map(|s| s.1).collect::<Vec<_>>(),
        end.0 as f64 / 1048576.0,
        end.1,
        index / 1048576.0
    );
    assert_eq!(hung, 0, "every request ended");
    assert_eq!(refused, 0, "the gateway always accepted");
    assert_eq!(sent, completed + cancelled + errored);
    let accounted = (answered + left_waiting) as u64;
    let early = get(&tally.cancelled_early);
    assert!(
        accounted <= sent && accounted + early >= sent,
        "the gateway accounted for {accounted} of {sent} requests ({early} left before any answer)"
    );
    assert!(
        cancelled * 4 > sent,
        "about 30% cancelled: {cancelled} of {sent}"
    );
    assert!(
        errored * 10 < sent,
        "errors only around the two restarts: {errored} of {sent}"
    );
    // The prefix index (capped at 4 MiB here) fills during warm-up; after it, memory is flat.
    assert!(
        late_rss <= early_rss + early_rss / 8 + (4 << 20),
        "RSS grew after warm-up: {early_rss} -> {late_rss}"
    );
    assert!(
        end.1 <= warm.1 + 8,
        "open descriptors after the load ({}) above those under load at warm-up ({})",
        end.1,
        warm.1
    );
}
