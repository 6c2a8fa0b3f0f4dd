//! A simulated server's engines: one, or several data-parallel ranks behind one API server, as
//! vLLM runs them with `--data-parallel-size N`.
//!
//! Each rank is an engine of its own (its own scheduler, KV cache, metrics series labelled
//! `engine="<rank>"` and, when it publishes them, KV event sockets on the configured ports plus
//! the rank). A request names its rank with the `X-data-parallel-rank` header; one that does not
//! is placed by vLLM's own balancer, modelled on vLLM 0.32's `DPLBAsyncMPClient` (in
//! `vllm/v1/engine/core_client.py`): each rank's score is the greater of the API server's own
//! unfinished requests on it and the coordinator's latest waiting + running count for it, plus
//! `6 × waiting × (KV usage − 0.5)` when its KV cache is over half full and requests wait; the
//! lowest score wins, ties going to the rank after the last one chosen; the chosen rank's
//! waiting count is raised by one until the next snapshot. The coordinator publishes a snapshot
//! of every rank's counts every 100 ms (in modelled time) while they change. Nothing in it looks
//! at the prompt: which rank holds a prefix plays no part.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::engine::{EngineRequest, Event};
use super::metrics::SimMetrics;
use super::worker::EngineHandle;

/// The header a router names a rank with, as vLLM reads it.
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// How often vLLM's coordinator publishes the ranks' counts while they change (its
/// `min_stats_update_interval_ms`), in modelled seconds.
const SNAPSHOT_EVERY: f64 = 0.1;

/// One rank's engine and what the balancer reads of it.
pub struct Rank {
    pub engine: EngineHandle,
    pub metrics: Arc<SimMetrics>,
}

/// The engines of one simulated server.
pub struct Engines {
    ranks: Vec<Rank>,
    /// The API server's unfinished requests per rank (exact, as vLLM's client counts them).
    inflight: Arc<[AtomicUsize]>,
    balancer: Mutex<Balancer>,
    /// Wall-clock length of the coordinator's publication interval.
    snapshot_every: Duration,
}

struct Balancer {
    /// Per rank: waiting, running, KV usage, as of `taken`.
    counts: Vec<(f64, f64, f64)>,
    taken: Option<Instant>,
    /// Where the next scan starts.
    start: usize,
}

/// A request's place on its rank, given back when its response is dropped.
pub struct RankSlot {
    inflight: Arc<[AtomicUsize]>,
    rank: usize,
}

impl Drop for RankSlot {
    fn drop(&mut self) {
        self.inflight[self.rank].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why a request was not taken.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The header named a rank the server does not have (vLLM answers 400).
    NoSuchRank { rank: i64, ranks: usize },
    /// The engine loop has stopped.
    ShuttingDown,
}

impl Engines {
    /// `ranks` in rank order (at least one); `time_scale` as the engine loops run.
    pub fn new(ranks: Vec<Rank>, time_scale: f64) -> Self {
        assert!(!ranks.is_empty(), "a server has at least one engine");
        let n = ranks.len();
        Self {
            inflight: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            balancer: Mutex::new(Balancer {
                counts: vec![(0.0, 0.0, 0.0); n],
                taken: None,
                start: 0,
            }),
            snapshot_every: Duration::from_secs_f64(SNAPSHOT_EVERY / time_scale),
            ranks,
        }
    }

    /// Queues `req` on the rank `header` names (vLLM ignores a value that is not an integer, and
    /// refuses a rank it lacks, a server of one engine too), or on the one the balancer picks.
    /// Its events arrive on the receiver; the slot holds its place in the balancer's counts until
    /// dropped (with the response).
    pub fn submit(
        &self,
        header: Option<&http::HeaderValue>,
        req: EngineRequest,
    ) -> Result<(mpsc::UnboundedReceiver<Event>, RankSlot), Refused> {
        let named = header
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<i64>().ok());
        let rank = match named {
            Some(r) if r < 0 || r as usize >= self.ranks.len() => {
                return Err(Refused::NoSuchRank {
                    rank: r,
                    ranks: self.ranks.len(),
                })
            }
            Some(r) => r as usize,
            None if self.ranks.len() == 1 => 0,
            None => self.balance(),
        };
        let events = self.ranks[rank]
            .engine
            .submit(req)
            .ok_or(Refused::ShuttingDown)?;
        self.inflight[rank].fetch_add(1, Ordering::Relaxed);
        let slot = RankSlot {
            inflight: self.inflight.clone(),
            rank,
        };
        Ok((events, slot))
    }

    /// vLLM's choice for a request that names no rank.
    fn balance(&self) -> usize {
        let mut b = self.balancer.lock();
        let now = Instant::now();
        if b.taken
            .is_none_or(|t| now.duration_since(t) >= self.snapshot_every)
        {
            // A new snapshot replaces the counts wholesale, this server's own raises with them.
            b.counts = self.ranks.iter().map(|r| r.metrics.load()).collect();
            b.taken = Some(now);
        }
        let n = self.ranks.len();
        let mut best = (f64::INFINITY, 0);
        for i in 0..n {
            let idx = (b.start + i) % n;
            let (waiting, running, kv_usage) = b.counts[idx];
            let own = self.inflight[idx].load(Ordering::Relaxed) as f64;
            let mut score = own.max(waiting + running);
            if waiting > 0.0 {
                score += waiting * 6.0 * (kv_usage - 0.5).max(0.0);
            }
            if score < best.0 {
                best = (score, idx);
            }
        }
        let chosen = best.1;
        b.counts[chosen].0 += 1.0;
        b.start = (b.start + 1) % n;
        chosen
    }

    /// Empties every rank's prefix cache; true only if each could.
    pub async fn reset_prefix_cache(&self) -> bool {
        let mut all = true;
        for r in &self.ranks {
            all &= r.engine.reset_prefix_cache().await;
        }
        all
    }
}
