//! Active health checks: GET the configured path on every worker each interval, and mark a worker
//! down after `unhealthy_threshold` failures in a row, up after `healthy_threshold` successes.
//!
//! Passive health (5xx streaks, refused connections) lives on the worker itself
//! ([`crate::workers::Worker::record_status`], [`crate::workers::Worker::eject_for`]) because the
//! proxy sees those outcomes; this task only probes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use http_body_util::Full;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::proxy::Upstreams;
use crate::workers::Worker;

/// Consecutive results of one worker's probes.
#[derive(Default)]
struct Streak {
    ok: u32,
    fail: u32,
}

/// Probes until `cancel` fires; returns at once when active checks are off (interval 0).
pub async fn run(up: Arc<Upstreams>, cancel: CancellationToken) {
    let cfg = up.config.health.clone();
    if cfg.interval_seconds <= 0.0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_secs_f64(cfg.interval_seconds));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut streaks: HashMap<String, Streak> = HashMap::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let workers = up.pool.snapshot();
        let timeout = Duration::from_secs_f64(cfg.timeout_seconds);
        let results = join_all(workers.iter().map(|w| probe(&up, w, &cfg.path, timeout))).await;
        streaks.retain(|name, _| workers.iter().any(|w| &w.name == name));
        for (w, ok) in workers.iter().zip(results) {
            let result = if ok { "ok" } else { "fail" };
            up.metrics
                .health_checks
                .with_label_values(&[&w.name, result])
                .inc();
            let s = streaks.entry(w.name.clone()).or_default();
            if ok {
                s.ok += 1;
                s.fail = 0;
                if s.ok >= cfg.healthy_threshold {
                    w.set_down(false);
                }
            } else {
                s.fail += 1;
                s.ok = 0;
                if s.fail >= cfg.unhealthy_threshold {
                    w.set_down(true);
                }
            }
            w.publish_health();
        }
    }
}

/// One probe: a 2xx answer within `timeout`.
async fn probe(up: &Upstreams, w: &Worker, path: &str, timeout: Duration) -> bool {
    let uri = match http::Uri::builder()
        .scheme(w.scheme.clone())
        .authority(w.authority.clone())
        .path_and_query(path)
        .build()
    {
        Ok(u) => u,
        Err(_) => return false,
    };
    let Ok(req) = http::Request::get(uri).body(Full::new(Bytes::new())) else {
        return false;
    };
    matches!(
        tokio::time::timeout(timeout, up.client.request(req)).await,
        Ok(Ok(resp)) if resp.status().is_success()
    )
}
