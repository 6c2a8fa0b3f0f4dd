//! Load signals: what a policy may know about a worker's queue beyond this gateway's in-flight count.
//!
//! Two sources. The gateway's own accounting is exact and immediate but sees only this replica's
//! requests: in-flight requests, and the prompt tokens sent that the worker has not started
//! answering yet (its prefill queue as this replica made it). The worker's `/metrics`, polled every
//! `load_signals.interval_seconds`, sees every replica's traffic but lags: vLLM's
//! `vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`
//! (summed over engines). [`Load::queued`] adds to this gateway's live in-flight count the
//! requests the worker had *beyond* this gateway's own at the last poll: other replicas' (and
//! other clients') traffic. Only that part is stale, so a lone replica reacts at once, and
//! replicas see each other without all steering away from (and then onto) the same worker for
//! a whole poll interval, as they would if the stale total replaced their live count.
//!
//! Here: the gateway's own accounting ([`Load`], [`RequestLoad`]) and the step clocks' time base;
//! in the files beside it, the step clock of each worker's engine (`step_clock`), the workers'
//! speeds rated from it (`speeds`), the KV clock that dates what a worker's cache holds
//! (`kv_clock`), how much of its traffic is other replicas' over many polls (`traffic`), vLLM's
//! metrics exposition read (`exposition`) and the poll loop (`poller`).

mod exposition;
mod kv_clock;
mod poller;
mod speeds;
mod step_clock;
mod traffic;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::workers::HeldWorker;

pub(crate) use exposition::{engine_of, label};
pub use exposition::{engine_ranks, parse_vllm_metrics};
pub use kv_clock::{KvClock, RECENT_TAU_US};
pub use poller::run;
pub use speeds::{rate_speeds, ALONE_SHARE, SPEED_DEADBAND};
pub use step_clock::StepClock;
pub use traffic::Traffic;

/// Laid out in declaration order, 56 bytes: the figures a pricing pass reads together.
#[derive(Debug)]
#[repr(C)]
pub struct Load {
    pending_prefill: AtomicU64,
    /// Prompt tokens of this gateway's requests in flight on the worker, counted from the choice
    /// to the end of the answer: the context each decode step reads on their behalf.
    context_tokens: AtomicU64,
    /// What peer replicas last said they have on the worker ([`crate::peers`]): their pending
    /// prefill and context in tokens, and (below) their requests in flight. All 0 without peers.
    peer_pending: AtomicU64,
    peer_context: AtomicU64,
    peer_inflight: AtomicU32,
    /// Requests the worker had at the last poll beyond this gateway's own in flight then and its
    /// peers' (other replicas that do not tell, other clients).
    others: AtomicU32,
    /// Share of the cached tokens a policy predicted that the worker then reported, in permille,
    /// smoothed: how far a policy may trust its index for this worker.
    cache_trust_permille: AtomicU32,
    kv_usage_permille: AtomicU32,
    /// The last poll succeeded; polled figures are used only then.
    polled: AtomicBool,
}

impl Default for Load {
    fn default() -> Self {
        Self {
            pending_prefill: AtomicU64::new(0),
            context_tokens: AtomicU64::new(0),
            peer_pending: AtomicU64::new(0),
            peer_context: AtomicU64::new(0),
            peer_inflight: AtomicU32::new(0),
            others: AtomicU32::new(0),
            kv_usage_permille: AtomicU32::new(0),
            polled: AtomicBool::new(false),
            cache_trust_permille: AtomicU32::new(1000),
        }
    }
}

/// What one poll of a worker's `/metrics` said.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Polled {
    pub running: f64,
    pub waiting: f64,
    pub kv_usage: f64,
    /// Tokens its KV cache holds: `num_gpu_blocks` × `block_size` of `vllm:cache_config_info`,
    /// summed over engines; 0 when not shown.
    pub kv_capacity: f64,
    /// `vllm:prompt_tokens_total`, summed over engines: a counter, so it falls only when the
    /// worker restarts.
    pub prompt_tokens: Option<f64>,
    /// `process_start_time_seconds` (vLLM with one API server shows it).
    pub started: Option<f64>,
    /// `vllm:prefix_cache_hits_total` (or, where a release shows only that,
    /// `vllm:gpu_prefix_cache_hits_total`), summed over engines: prompt tokens found cached.
    pub prefix_hits: Option<f64>,
    /// `vllm:prompt_tokens_by_source_total{source="local_compute"}`, summed over engines: the
    /// prompt tokens the worker prefilled itself (vLLM 0.32 shows it; which release first did
    /// was not checked).
    pub prompt_computed: Option<f64>,
}

impl Polled {
    /// The prompt tokens the worker has prefilled, as a counter: its own count of them where it
    /// shows one, else its prompt tokens less those it found cached. The first is counted
    /// for each request once, when its first token comes. Of the second pair, vLLM 0.32 counts
    /// the prompt then and the hits when the request is admitted; earlier releases counted the
    /// hits at every step a request waited to be admitted, so under KV pressure the difference
    /// could fall.
    pub fn prefilled(&self) -> Option<f64> {
        self.prompt_computed
            .or_else(|| Some(self.prompt_tokens? - self.prefix_hits?))
    }
}

impl Load {
    /// Prompt tokens this gateway sent that the worker has not started answering.
    pub fn pending_prefill(&self) -> u64 {
        self.pending_prefill.load(Ordering::Relaxed)
    }

    /// Prompt tokens of this gateway's requests in flight on the worker.
    pub fn context_tokens(&self) -> u64 {
        self.context_tokens.load(Ordering::Relaxed)
    }

    /// Requests queued or running on the worker: this gateway's in-flight count now and its
    /// peers' as they last said, plus what the last successful poll saw beyond both.
    pub fn queued(&self, local_inflight: usize) -> usize {
        let known = local_inflight + self.peer_inflight() as usize;
        if !self.polled.load(Ordering::Relaxed) {
            return known;
        }
        known + self.others.load(Ordering::Relaxed) as usize
    }

    /// Peer replicas' requests in flight on the worker, as they last said.
    pub fn peer_inflight(&self) -> u32 {
        self.peer_inflight.load(Ordering::Relaxed)
    }

    /// Peer replicas' pending prefill and context on the worker, in tokens, as they last said.
    pub fn peer_tokens(&self) -> (u64, u64) {
        (
            self.peer_pending.load(Ordering::Relaxed),
            self.peer_context.load(Ordering::Relaxed),
        )
    }

    /// What peer replicas have on the worker, summed over them: requests in flight, pending
    /// prefill and context tokens. Only the peers' receiver writes it.
    pub fn set_peers(&self, inflight: u32, pending: u64, context: u64) {
        self.peer_inflight.store(inflight, Ordering::Relaxed);
        self.peer_pending.store(pending, Ordering::Relaxed);
        self.peer_context.store(context, Ordering::Relaxed);
    }

    /// The worker's KV cache usage in [0, 1], when polled.
    pub fn kv_usage(&self) -> Option<f64> {
        self.polled
            .load(Ordering::Relaxed)
            .then(|| f64::from(self.kv_usage_permille.load(Ordering::Relaxed)) / 1000.0)
    }

    pub fn cache_trust(&self) -> f64 {
        f64::from(self.cache_trust_permille()) / 1000.0
    }

    /// [`Self::cache_trust`] in permille, for a loop that would rather not divide.
    pub fn cache_trust_permille(&self) -> u32 {
        self.cache_trust_permille.load(Ordering::Relaxed)
    }

    /// Moves the trust a tenth of the way towards `observed` (in [0, 1]).
    pub fn learn_cache_trust(&self, observed: f64) {
        let now = self.cache_trust();
        let next = (0.9 * now + 0.1 * observed.clamp(0.0, 1.0)) * 1000.0;
        self.cache_trust_permille
            .store(next.round() as u32, Ordering::Relaxed);
    }

    /// Records a poll's result; `local_inflight` is as many of this gateway's requests as the
    /// worker can have counted (the poll loop's: the most in flight as the poll went out or as it
    /// came back), `peers` as many of its peers' ([`crate::peers`]; 0 without). Returns the
    /// requests the worker had beyond both (of replicas and clients that do not tell), `None`
    /// for a failed poll.
    pub fn store(&self, p: Option<Polled>, local_inflight: usize, peers: usize) -> Option<f64> {
        let Some(p) = p else {
            self.polled.store(false, Ordering::Relaxed);
            return None;
        };
        let count = |v: f64| v.clamp(0.0, f64::from(u32::MAX)) as u32;
        let others = (p.running + p.waiting - local_inflight as f64).max(0.0);
        let untold = (others - peers as f64).max(0.0);
        self.others.store(count(untold), Ordering::Relaxed);
        self.kv_usage_permille
            .store(count(p.kv_usage * 1000.0), Ordering::Relaxed);
        self.polled.store(true, Ordering::Relaxed);
        Some(untold)
    }
}

/// One request's share of a worker's load: its uncached prompt tokens count in the worker's pending
/// prefill until it starts answering ([`RequestLoad::done`]) and its whole prompt in the
/// worker's in-flight context until dropped.
#[derive(Debug)]
pub struct RequestLoad {
    worker: HeldWorker,
    tokens: u64,
    context: u64,
}

impl RequestLoad {
    pub fn new(worker: impl Into<HeldWorker>, tokens: u64, context: u64) -> Self {
        let worker = worker.into();
        let load = &worker.load;
        if load.pending_prefill.fetch_add(tokens, Ordering::Relaxed) == 0 && tokens > 0 {
            worker.steps.sent(now_us());
        }
        load.context_tokens.fetch_add(context, Ordering::Relaxed);
        crate::peers::changed();
        Self {
            worker,
            tokens,
            context,
        }
    }

    /// The worker started answering: its prefill of this prompt is over. Called on every relayed
    /// frame, so after the first it costs a comparison, not an atomic write. Returns the tokens
    /// it took off the pending prefill (0 after the first call).
    pub fn done(&mut self) -> u64 {
        if self.tokens == 0 {
            return 0;
        }
        let t = std::mem::take(&mut self.tokens);
        self.worker
            .load
            .pending_prefill
            .fetch_sub(t, Ordering::Relaxed);
        crate::peers::changed();
        t
    }
}

impl Drop for RequestLoad {
    fn drop(&mut self) {
        self.done();
        self.worker
            .load
            .context_tokens
            .fetch_sub(self.context, Ordering::Relaxed);
        crate::peers::changed();
    }
}

/// The step clocks' time base: microseconds since the first call in this process, plus an hour,
/// so that 0 can mean "never" and a time shortly before the first call is still a time.
pub fn now_us() -> u64 {
    us_at(std::time::Instant::now())
}

/// `at` on the step clocks' time base ([`now_us`]), for a caller that has read the clock already.
pub fn us_at(at: std::time::Instant) -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    const START_US: u64 = 3_600_000_000;
    let epoch = *EPOCH.get_or_init(std::time::Instant::now);
    START_US + at.saturating_duration_since(epoch).as_micros() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_adds_only_what_the_worker_had_beyond_this_gateway() {
        let l = Load::default();
        assert_eq!(l.queued(2), 2);
        // The worker ran 8 when this gateway had 2 in flight: 6 are someone else's.
        let polled = Polled {
            running: 5.0,
            waiting: 3.0,
            kv_usage: 0.5,
            ..Polled::default()
        };
        assert_eq!(l.store(Some(polled), 2, 0), Some(6.0));
        assert_eq!(l.queued(2), 8);
        // This gateway's own changes count at once; the others' part waits for the next poll.
        assert_eq!(l.queued(0), 6);
        assert_eq!(l.queued(10), 16);
        assert_eq!(l.kv_usage(), Some(0.5));
        // A lone gateway: the worker's count is its own, nothing is added.
        assert_eq!(l.store(Some(polled), 9, 0), Some(0.0));
        assert_eq!(l.queued(3), 3);
        assert_eq!(l.store(None, 0, 0), None);
        assert_eq!(l.queued(2), 2);
    }

    #[test]
    fn peers_count_as_they_say_and_the_poll_adds_only_what_nobody_told() {
        let l = Load::default();
        // A peer says it has 4 requests there: they count at once, before any poll.
        l.set_peers(4, 300, 2_000);
        assert_eq!(l.queued(2), 6);
        assert_eq!(l.peer_tokens(), (300, 2_000));
        // The worker ran 9 with 2 of ours and 4 of the peer's: 3 are from someone untold.
        let polled = Polled {
            running: 6.0,
            waiting: 3.0,
            ..Polled::default()
        };
        // Beyond what this gateway and its peer know of.
        assert_eq!(l.store(Some(polled), 2, 4), Some(3.0));
        assert_eq!(l.queued(2), 9);
        // The peer's requests end: they leave at once, the untold 3 stay till the next poll.
        l.set_peers(0, 0, 0);
        assert_eq!(l.queued(2), 5);
    }

    #[test]
    fn a_request_counts_its_prefill_until_it_answers_and_its_prompt_until_it_ends() {
        let w = &crate::workers::test_workers(1)[0];
        let mut a = RequestLoad::new(w, 100, 400);
        let b = RequestLoad::new(w, 30, 50);
        assert_eq!(
            (w.load.pending_prefill(), w.load.context_tokens()),
            (130, 450)
        );
        a.done();
        a.done();
        assert_eq!(
            (w.load.pending_prefill(), w.load.context_tokens()),
            (30, 450)
        );
        drop(a);
        assert_eq!(
            (w.load.pending_prefill(), w.load.context_tokens()),
            (30, 50)
        );
        drop(b);
        assert_eq!((w.load.pending_prefill(), w.load.context_tokens()), (0, 0));
    }

    #[test]
    fn trust_moves_towards_what_is_observed() {
        let l = Load::default();
        for _ in 0..50 {
            l.learn_cache_trust(0.2);
        }
        assert!((l.cache_trust() - 0.2).abs() < 0.02, "{}", l.cache_trust());
    }
}
