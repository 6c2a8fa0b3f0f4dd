//! The load poll: every worker's `/metrics` read at each interval, and what it shows handed to
//! the worker's load, KV and step clocks, the speed ratings and the data-parallel ranks.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::future::join_all;
use http_body_util::{BodyExt, Full, Limited};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::{engine_ranks, now_us, parse_vllm_metrics, rate_speeds, Polled};
use crate::{proxy::Upstreams, workers::Worker};

/// Largest `/metrics` answer read; vLLM's is tens of kilobytes.
const METRICS_LIMIT: usize = 4 << 20;

/// Polls every worker's metrics until `cancel` fires; returns at once when polling is off.
pub async fn run(up: Arc<Upstreams>, cancel: CancellationToken) {
    let cfg = up.config.load_signals.clone();
    if cfg.interval_seconds <= 0.0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_secs_f64(cfg.interval_seconds));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let timeout = Duration::from_secs_f64(cfg.timeout_seconds);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let workers = up.pool.snapshot();
        let polls = workers.iter().map(|w| poll(&up, w, &cfg.path, timeout));
        let mut engines = Vec::new();
        for (w, (p, ranks, (local, peers))) in workers.iter().zip(join_all(polls).await) {
            if let (Some(url), Some(ranks)) = (&w.ranks_of, ranks) {
                engines.push((url, ranks));
            }
            if w.kv.store(p.as_ref()) {
                tracing::warn!(
                    worker = %w.name,
                    "worker restarted (its counters started over): its KV cache is empty, and what it was sent before no longer counts as cached"
                );
                up.metrics
                    .worker_restarts
                    .with_label_values(&[&w.name])
                    .inc();
            }
            w.steps.polled(
                now_us(),
                p.as_ref().and_then(Polled::prefilled),
                w.inflight() > 0,
            );
            w.polled(p, local, peers);
        }
        rate_speeds(&workers);
        for (url, ranks) in engines {
            follow_ranks(&up, url, ranks);
        }
    }
}

/// Routes to the data-parallel ranks the `auto` worker entry `url` was seen to have.
fn follow_ranks(up: &Upstreams, url: &str, ranks: Vec<u32>) {
    match up.pool.ranks_seen(url, &ranks, &up.metrics) {
        None => {}
        Some(Ok((added, removed))) => {
            if crate::config::numbered_from_zero(&ranks) {
                tracing::info!(
                    worker = url,
                    ?ranks,
                    added,
                    removed,
                    "data-parallel engines found behind the worker: each rank is routed to as a worker"
                );
            } else {
                tracing::warn!(
                    worker = url,
                    ?ranks,
                    "the worker's data-parallel engines are not numbered from 0 (vLLM's hybrid or external load balancing, whose servers take X-data-parallel-rank as an index among their own engines): it is routed to as one worker, and vLLM picks the engine"
                );
            }
            if added + removed > 0 {
                up.metrics
                    .discovery_updates
                    .with_label_values(&["data_parallel", "applied"])
                    .inc();
            }
        }
        Some(Err(e)) => {
            tracing::warn!(worker = url, error = %e, "data-parallel ranks not applied");
            up.metrics
                .discovery_updates
                .with_label_values(&["data_parallel", "rejected"])
                .inc();
        }
    }
}

/// The worker's load signals, for the worker of a `data_parallel_size: auto` entry the engines
/// its exposition shows ([`engine_ranks`]), and the most requests this gateway had in flight there
/// as the poll went out or as its answer came back: as many of this gateway's own as the worker
/// can have counted, but for one that both started and ended meanwhile. Read after all the polls
/// came back, or at either end alone, the count would miss a request that ended while the poll
/// was out, and a lone gateway would take the worker's count of it for another replica's. The
/// same for the requests its peers said they had there ([`crate::peers`]).
async fn poll(
    up: &Upstreams,
    w: &Worker,
    path: &str,
    timeout: Duration,
) -> (Option<Polled>, Option<Vec<u32>>, (usize, usize)) {
    let sent = w.inflight();
    let peers_sent = w.load.peer_inflight();
    let read = async {
        let uri = http::Uri::builder()
            .scheme(w.scheme.clone())
            .authority(w.authority.clone())
            .path_and_query(path)
            .build()
            .ok()?;
        let req = http::Request::get(uri).body(Full::new(Bytes::new())).ok()?;
        let resp = up.client.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = Limited::new(resp.into_body(), METRICS_LIMIT)
            .collect()
            .await
            .ok()?;
        let rank = w.data_parallel_rank.as_ref().map(|r| r.0);
        let body = body.to_bytes();
        let text = std::str::from_utf8(&body).ok()?;
        let polled = parse_vllm_metrics(text, rank);
        let ranks = w
            .ranks_of
            .as_ref()
            .and(polled.as_ref())
            .and_then(|_| engine_ranks(text));
        Some((polled, ranks))
    };
    let (polled, ranks) = match tokio::time::timeout(timeout, read).await {
        Ok(Some(read)) => read,
        _ => (None, None),
    };
    let peers = peers_sent.max(w.load.peer_inflight()) as usize;
    (polled, ranks, (sent.max(w.inflight()), peers))
}
