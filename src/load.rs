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

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use futures_util::future::join_all;
use http_body_util::{BodyExt, Full, Limited};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::{
    index::Restarts,
    proxy::Upstreams,
    workers::{HeldWorker, Worker},
};

/// Largest `/metrics` answer read; vLLM's is tens of kilobytes.
const METRICS_LIMIT: usize = 4 << 20;

/// Laid out in declaration order, 32 bytes: it sits in the worker's first cache line.
#[derive(Debug)]
#[repr(C)]
pub struct Load {
    pending_prefill: AtomicU64,
    /// Prompt tokens of this gateway's requests in flight on the worker, counted from the choice
    /// to the end of the answer: the context each decode step reads on their behalf.
    context_tokens: AtomicU64,
    /// Requests the worker had at the last poll beyond this gateway's own in flight then.
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

    /// Requests queued or running on the worker: this gateway's in-flight count now, plus what the
    /// last successful poll saw beyond this gateway's own.
    pub fn queued(&self, local_inflight: usize) -> usize {
        if !self.polled.load(Ordering::Relaxed) {
            return local_inflight;
        }
        local_inflight + self.others.load(Ordering::Relaxed) as usize
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

    /// Records a poll's result; `local_inflight` is this gateway's in-flight count as it arrived.
    pub fn store(&self, p: Option<Polled>, local_inflight: usize) {
        let Some(p) = p else {
            self.polled.store(false, Ordering::Relaxed);
            return;
        };
        let count = |v: f64| v.clamp(0.0, f64::from(u32::MAX)) as u32;
        let others = (p.running + p.waiting - local_inflight as f64).max(0.0);
        self.others.store(count(others), Ordering::Relaxed);
        self.kv_usage_permille
            .store(count(p.kv_usage * 1000.0), Ordering::Relaxed);
        self.polled.store(true, Ordering::Relaxed);
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

/// When the worker's engine steps end, as this gateway sees them, and how long a step takes.
///
/// vLLM runs a step (the scheduled prefills and one token for every running sequence) and then
/// sends every stream its token at once. So the frames of this gateway's streams from one worker
/// come in bursts, one a step, and a request sent there waits for the step under way to end
/// before its own prefill can start. A policy that places by load sees a worker's load fall at
/// the end of a step (its first tokens clear pending prefill, its finished answers leave), that
/// is just as a new step begins, and would keep choosing the worker with the longest wait still
/// ahead. The clock gives that wait: a step lasts `base + per_token × prefill` (fitted over the
/// bursts seen, in windows of steps that end where none of this gateway's prefill is left
/// outstanding, so that a prompt prefilled in chunks over several steps counts whole: see
/// [`StepFit`]), so
/// what remains of a step without this gateway's prefill is `base` less the time since the last
/// burst. The prefill part is the pending prefill a policy already prices; of the prefill the step
/// began with, what its fitted rate has worked through since the base time ended is done
/// ([`StepClock::prefill_done`]).
#[derive(Debug, Default)]
pub struct StepClock {
    /// [`now_us`] when the last burst began; 0 before any.
    last: AtomicU64,
    /// Prompt tokens whose first token came in the burst that began at `last`.
    cleared: AtomicU64,
    /// This gateway's pending prefill when the step under way began (after the burst that began
    /// it cleared its first tokens): what that step is prefilling, since vLLM schedules a step
    /// from what is waiting when it starts.
    in_step: AtomicU64,
    /// The fit, as `f64` bits: microseconds of a step with no prefill, and per prefill token. Both
    /// 0 while unknown.
    base_us: AtomicU64,
    per_token_us: AtomicU64,
    fit: parking_lot::Mutex<StepFit>,
    /// Its time per prefill token over the pool's median, the median of the last [`RATINGS`]
    /// polls' readings ([`rate_speeds`]), as `f64` bits; 0 (read as 1) before the first.
    ratio: AtomicU64,
    /// Those readings, oldest first (only the load poll touches them).
    readings: parking_lot::Mutex<VecDeque<f64>>,
    /// [`now_us`] when this gateway's pending prefill there last rose from none: no step that
    /// prefills a prompt sent since began before it.
    sent: AtomicU64,
    /// Load polls left for which the pool's readings come from the fits against the workers'
    /// counters: [`RATINGS`] from each poll that showed others' requests beside this gateway's
    /// (the same on every worker of the pool; [`rate_speeds`]).
    beside: AtomicU32,
}

/// Moving moments of recent windows of steps: (steps, prefill tokens, duration) each.
///
/// A step's duration cannot be paired with the prompt tokens whose first token ended it alone:
/// vLLM prefills a prompt longer than its token budget (`max_num_batched_tokens`, 2,048 on many
/// setups) in chunks, one a step, and only the last chunk's step returns a first token. Paired
/// step by step, a long chunk's step counts as a long step without prefill and the last chunk's
/// as a short one with the whole prompt, which fits a base several times too long and a time per
/// token a tenth of the true one (seen on the simulated L4 at 2,048-token prompts). So steps are
/// summed into windows that end where none of this gateway's prefill is outstanding: every
/// prompt whose first token came in a window was prefilled in it, whatever its chunks, and the
/// fit is `duration = base × steps + per_token × tokens` over the windows. A window that runs
/// [`MAX_WINDOW_STEPS`] steps without such a moment ends anyway, off by at most the chunk
/// under way at its end.
///
/// Windows without prefill and windows with it are kept in moving moments of their own, which
/// the fit weighs alike. Most windows are a single step that only decodes (88% of them in a
/// mixed run on the simulated L4s), so in one moving mean a window with prefill is outweighed
/// fifteen to one by the time the next comes, and the time per token would rest on two or three
/// windows: one mistimed window (a probe build once saw a 12 ms step clear a 2,048-token prompt)
/// would move it by more than half. Kept apart, the time per token rests on the last
/// [`STEP_WINDOW`] windows with prefill.
#[derive(Debug, Default)]
struct StepFit {
    /// The duration of the step that the burst at `last` ended; its tokens are counted since.
    gap: f64,
    /// The same step's duration if it prefilled anything: from no earlier than the send of the
    /// first prompt after a moment with none of this gateway's pending ([`StepClock::sent`]).
    /// Shorter than `gap` where the worker sat idle, as far as this gateway can tell, before
    /// that prompt came.
    prefill_gap: f64,
    /// This gateway's prefill pending when that step began: what it could prefill.
    began: f64,
    /// The window being summed: steps, prompt tokens cleared, duration.
    open: (f64, f64, f64),
    /// The moving moments of the windows without this gateway's prefill and of those with it.
    bare: Moments,
    prefill: Moments,
    /// The same fit over the intervals between load polls, from the worker's own counters.
    polls: PollFit,
}

/// Moving means of `(n, x, d)` samples and their products, over the last [`STEP_WINDOW`] or so,
/// for the least-squares fit `d = base × n + per_token × x`.
#[derive(Clone, Debug, Default)]
struct Moments {
    /// Samples added (saturating).
    windows: u32,
    n: f64,
    x: f64,
    d: f64,
    nn: f64,
    nx: f64,
    xx: f64,
    nd: f64,
    xd: f64,
}

impl Moments {
    fn add(&mut self, n: f64, x: f64, d: f64) {
        self.windows = self.windows.saturating_add(1);
        let a = 1.0 / STEP_WINDOW.min(f64::from(self.windows));
        let mv = |m: &mut f64, v: f64| *m += a * (v - *m);
        mv(&mut self.n, n);
        mv(&mut self.x, x);
        mv(&mut self.d, d);
        mv(&mut self.nn, n * n);
        mv(&mut self.nx, n * x);
        mv(&mut self.xx, x * x);
        mv(&mut self.nd, n * d);
        mv(&mut self.xd, x * d);
    }

    /// The moments of both sets of samples, each set weighing as much as the other whatever
    /// their counts.
    fn joined(&self, o: &Self) -> Self {
        Self {
            windows: self.windows.saturating_add(o.windows),
            n: self.n + o.n,
            x: self.x + o.x,
            d: self.d + o.d,
            nn: self.nn + o.nn,
            nx: self.nx + o.nx,
            xx: self.xx + o.xx,
            nd: self.nd + o.nd,
            xd: self.xd + o.xd,
        }
    }

    /// `(base, per_token)`, both positive, once [`SOLVE_WINDOWS`] samples are in; `(0, 0)` otherwise. Least
    /// squares through the origin in two variables: samples whose `x` is always in the same
    /// proportion to their `n` cannot tell base from tokens.
    fn solve(&self) -> (f64, f64) {
        let det = self.nn * self.xx - self.nx * self.nx;
        if self.windows < SOLVE_WINDOWS || det <= 1e-6 * self.nn * self.xx {
            return (0.0, 0.0);
        }
        let base = (self.nd * self.xx - self.xd * self.nx) / det;
        let per_token = (self.xd * self.nn - self.nd * self.nx) / det;
        if per_token > 0.0 && base > 0.0 {
            (base, per_token)
        } else {
            (0.0, 0.0)
        }
    }
}

/// A worker's steps fitted over the intervals between load polls against the prefill its own
/// counters show done in each ([`Polled::prefilled`]):
/// every replica's and every client's, where [`StepFit`]'s windows know only this gateway's
/// prompts. Windows span load polls that all found this gateway with requests in flight there,
/// so that its streams' bursts mark the worker's steps throughout ([`StepClock::polled`]).
#[derive(Debug, Default)]
struct PollFit {
    /// Steps seen since the window under way began (the one under way then in part) and their
    /// microseconds, and when it began ([`now_us`]).
    steps: f64,
    time: f64,
    since: u64,
    /// The worker's prefilled-token counter where it began; `None` while no window is under way.
    prefilled: Option<f64>,
    moments: Moments,
    /// The fit's time per prefill token, in microseconds; 0 while unknown.
    per_token: f64,
}

/// Steps a window of [`PollFit`] sums at least, so that the prefill of the step under way at
/// either end, which the counters may place on the other side of it, is a small part of it.
const POLL_WINDOW_STEPS: f64 = 16.0;
/// Bursts closer together than this are one (a step's frames spread as they are relayed).
const MIN_STEP_GAP_US: u64 = 500;
/// Windows in the fit's moving means.
const STEP_WINDOW: f64 = 32.0;
/// Windows a fit ([`Moments::solve`]) needs at the fewest.
const SOLVE_WINDOWS: u32 = 8;
/// Steps after which a window ends even with prefill outstanding (a worker that never drains).
const MAX_WINDOW_STEPS: f64 = 16.0;

impl StepFit {
    /// What a step that began with `began` tokens pending and cleared `tokens` should take, by
    /// the fit (`base`, `per_token`) or before one by the mean step, at the mean step's time per
    /// mean token (which overstates it): a step that prefills several prompts after many that
    /// prefilled none is long, and no pause.
    fn expected(&self, base: f64, per_token: f64, began: f64, tokens: f64) -> f64 {
        let x = tokens.max(began);
        if per_token > 0.0 {
            return base + per_token * x;
        }
        let m = self.moments();
        let n = m.n.max(1e-9);
        let (step, mean_x) = (m.d / n, m.x / n);
        step + step / mean_x.max(1.0) * (x - mean_x).max(0.0)
    }

    /// Adds a complete step; returns the fit's `(base, per_token)` once a window closes, `(0, 0)`
    /// while unknown; `None` while the window is still open.
    fn step(&mut self, ended: f64, tokens: f64, outstanding: bool) -> Option<(f64, f64)> {
        let open = &mut self.open;
        *open = (open.0 + 1.0, open.1 + tokens, open.2 + ended);
        if outstanding && open.0 < MAX_WINDOW_STEPS {
            return None;
        }
        let (n, x, d) = std::mem::take(open);
        if x > 0.0 {
            &mut self.prefill
        } else {
            &mut self.bare
        }
        .add(n, x, d);
        Some(self.moments().solve())
    }

    /// Both sets of windows' moments, weighed alike.
    fn moments(&self) -> Moments {
        self.bare.joined(&self.prefill)
    }

    /// Windows added to either set (saturating).
    fn windows(&self) -> u32 {
        self.bare.windows.saturating_add(self.prefill.windows)
    }
}

impl StepClock {
    /// A frame of a stream went by at `now` ([`now_us`]); its first frame cleared `cleared` prompt
    /// tokens of pending prefill, which left `pending()` tokens of this gateway's pending there
    /// (read only when the frame begins a burst: every frame of every stream comes here).
    pub fn frame(&self, now: u64, cleared: u64, pending: impl FnOnce() -> u64) {
        let last = self.last.load(Ordering::Relaxed);
        let base = f64::from_bits(self.base_us.load(Ordering::Relaxed));
        let min_gap = MIN_STEP_GAP_US.max((base / 4.0) as u64);
        let gap = now.saturating_sub(last);
        if gap < min_gap
            || self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            if cleared > 0 {
                self.cleared.fetch_add(cleared, Ordering::Relaxed);
                // Cleared in the burst that began the step: not part of it. A plain load and
                // store; a race loses a few tokens of an estimate.
                let in_step = self.in_step.load(Ordering::Relaxed);
                self.in_step
                    .store(in_step.saturating_sub(cleared), Ordering::Relaxed);
            }
            return;
        }
        // What the step that the burst at `last` began started with: the prefill left once that
        // burst's first tokens had cleared.
        let began = self.in_step.swap(pending(), Ordering::Relaxed) as f64;
        // A new burst: the step that the last one ended is complete with its tokens.
        let tokens = self.cleared.swap(cleared, Ordering::Relaxed) as f64;
        let mut fit = self.fit.lock();
        if last != 0 {
            // Every gap counts towards the poll window, a long one too (beside other replicas, a
            // step that prefills their prompts is long, not a pause), as far as it falls after
            // the window's start: a pause before the window is none of it.
            let part = now.saturating_sub(last.max(fit.polls.since)) as f64;
            fit.polls.steps += part / gap.max(1) as f64;
            fit.polls.time += part;
        }
        let gap = if last == 0 { 0.0 } else { gap as f64 };
        let sent = self.sent.load(Ordering::Relaxed);
        let prefill_gap = if sent > last && sent <= now {
            gap.min(now.saturating_sub(sent) as f64)
        } else {
            gap
        };
        let ended = std::mem::replace(&mut fit.gap, gap);
        let ended_prefill = std::mem::replace(&mut fit.prefill_gap, prefill_gap);
        // A step that prefilled began once the prompt was there: the time the worker sat idle
        // before it (waiting for this gateway's next prompts, or for a slower worker's answers
        // to end a wave of requests) is none of the step's.
        let ended = if tokens > 0.0 { ended_prefill } else { ended };
        // And what the step that has just ended (the one the burst at `last` ended) began with.
        let ended_began = std::mem::replace(&mut fit.began, began);
        // An idle pause is no step: leave out what is far longer than the step should be, and the
        // window it falls in.
        let per_token = f64::from_bits(self.per_token_us.load(Ordering::Relaxed));
        let expected = fit.expected(base, per_token, ended_began, tokens);
        if ended <= 0.0 || (fit.windows() >= 8 && ended > 4.0 * expected) {
            fit.open = Default::default();
            return;
        }
        // The window ends where nothing of this gateway's is left to prefill after the step.
        let Some((base, per_token)) = fit.step(ended, tokens, began > 0.0) else {
            return;
        };
        self.base_us.store(base.to_bits(), Ordering::Relaxed);
        self.per_token_us
            .store(per_token.to_bits(), Ordering::Relaxed);
    }

    /// A prompt was sent at `now` ([`now_us`]) to the worker, which had none of this gateway's
    /// prompts waiting for their first token.
    pub fn sent(&self, now: u64) {
        self.sent.store(now, Ordering::Relaxed);
    }

    /// What remains at `now` of the step under way without this gateway's prefill, in prompt
    /// tokens of prefill time; 0 while the fit is unknown.
    #[inline]
    pub fn remaining_tokens(&self, now: u64) -> f64 {
        let per_token = f64::from_bits(self.per_token_us.load(Ordering::Relaxed));
        if per_token <= 0.0 {
            return 0.0;
        }
        let base = f64::from_bits(self.base_us.load(Ordering::Relaxed));
        let since = now.saturating_sub(self.last.load(Ordering::Relaxed)) as i64 as f64;
        (base - since).max(0.0) / per_token
    }

    /// How much of the step under way's own prefill (this gateway's prompts it began with, no more
    /// than the `pending` still there) is done at `now`, in prompt tokens: the step spends its
    /// base time first, as far as the fit can tell, then prefill at the fitted rate. 0 while the
    /// fit is unknown, and once the step has run twice its fitted length. Less what [`Self::remaining_tokens`] gives, it is what remains of the
    /// step with its prefill: pending prefill a step is working through shrinks as it goes.
    #[inline]
    pub fn prefill_done(&self, now: u64, pending: u64) -> f64 {
        self.phase(now).map_or(0.0, |(base, per_token, since)| {
            self.done_at(base, per_token, since, pending)
        })
    }

    /// What remains of the step under way with its own prefill, in prompt tokens:
    /// [`Self::remaining_tokens`] less [`Self::prefill_done`], reading the clock's atomics once
    /// (the pricing pass calls it for every worker of every decision).
    #[inline]
    pub fn remaining_less_done(&self, now: u64, pending: u64) -> f64 {
        self.phase(now).map_or(0.0, |(base, per_token, since)| {
            (base - since).max(0.0) / per_token - self.done_at(base, per_token, since, pending)
        })
    }

    /// The fit's base and time per token and the microseconds since the last burst at `now`;
    /// `None` while the fit is unknown.
    #[inline]
    fn phase(&self, now: u64) -> Option<(f64, f64, f64)> {
        let per_token = f64::from_bits(self.per_token_us.load(Ordering::Relaxed));
        if per_token <= 0.0 {
            return None;
        }
        let base = f64::from_bits(self.base_us.load(Ordering::Relaxed));
        let since = now.saturating_sub(self.last.load(Ordering::Relaxed)) as i64 as f64;
        Some((base, per_token, since))
    }

    fn done_at(&self, base: f64, per_token: f64, since: f64, pending: u64) -> f64 {
        let in_step = self.in_step.load(Ordering::Relaxed).min(pending) as i64 as f64;
        let worked = (since - base).max(0.0) / per_token;
        // A step twice as long as its fit allows is not the step the fit describes (a stalled
        // worker, a preemption): what it began with is not taken for done.
        if worked > 2.0 * in_step + base / per_token {
            return 0.0;
        }
        worked.min(in_step)
    }

    /// How many times the pool's median time this worker takes per prefill token, by the step
    /// fits ([`rate_speeds`]): above 1 on a slower GPU, below on a faster one; 1 while unknown or
    /// within [`SPEED_DEADBAND`] of the median.
    #[inline]
    pub fn slowness(&self) -> f64 {
        let ratio = f64::from_bits(self.ratio.load(Ordering::Relaxed));
        if ratio <= 0.0 || (1.0 / SPEED_DEADBAND..=SPEED_DEADBAND).contains(&ratio) {
            1.0
        } else {
            ratio
        }
    }

    /// The fitted time per prefill token, in microseconds, once the fit has run over a full
    /// moving window of [`STEP_WINDOW`] windows: the first fits can be far off (seen on a pool of
    /// one GPU type: a base of 54 us beside three of 10 ms, a time per token a third of the
    /// others').
    fn settled_per_token(&self) -> Option<f64> {
        let (_, per_token) = self.fit()?;
        (self.fit.lock().windows() >= STEP_WINDOW as u32).then_some(per_token)
    }

    /// A load poll at `now` ([`now_us`]): `prefilled` is the worker's count of the prompt tokens
    /// it prefilled ([`Polled::prefilled`]; `None` where it does not show one), `busy` whether
    /// this gateway had requests in flight there. Polls that find this gateway busy and show it
    /// sum the steps between them into a window; once a window holds [`POLL_WINDOW_STEPS`]
    /// steps, its steps, their time and the prefill the counters moved by over it go to
    /// [`Self::settled_pool_per_token`]'s fit. A poll that finds this gateway idle, or counters
    /// missing or fallen (a restart), drops the window under way.
    pub fn polled(&self, now: u64, prefilled: Option<f64>, busy: bool) {
        let mut fit = self.fit.lock();
        let p = &mut fit.polls;
        let start = p.prefilled;
        let (steps, time) = (p.steps, p.time);
        let restart = |p: &mut PollFit| {
            p.prefilled = prefilled.filter(|_| busy);
            (p.steps, p.time, p.since) = (0.0, 0.0, now);
        };
        let (Some(before), Some(after), true) = (start, prefilled, busy) else {
            return restart(p);
        };
        let prefill = after - before;
        if prefill < 0.0 {
            return restart(p);
        }
        if steps < POLL_WINDOW_STEPS {
            return;
        }
        restart(p);
        p.moments.add(steps, prefill, time);
        p.per_token = p.moments.solve().1;
    }

    /// The time per prefill token, in microseconds, fitted over windows of load polls against
    /// the prefill the worker's own counters show ([`Self::polled`]), as soon as it solves
    /// ([`SOLVE_WINDOWS`] windows). Unlike [`Self::fit`], it counts the prefill of every
    /// replica's requests. Its first readings can be well off (seen: an L4 rated 4.1 times an
    /// L40S, the presets' ratio 2.9), which the median of [`RATINGS`] readings then outvotes;
    /// counted only from the sixteenth window, two replicas on the unlike pool kept less of what
    /// rating early gained them (`docs/measurements.md`, "Replicas rated from their first polls").
    fn settled_pool_per_token(&self) -> Option<f64> {
        let per_token = self.fit.lock().polls.per_token;
        (per_token > 0.0).then_some(per_token)
    }

    /// The fitted step without prefill and per prefill token, in microseconds, when known.
    pub fn fit(&self) -> Option<(f64, f64)> {
        let per_token = f64::from_bits(self.per_token_us.load(Ordering::Relaxed));
        (per_token > 0.0).then(|| {
            (
                f64::from_bits(self.base_us.load(Ordering::Relaxed)),
                per_token,
            )
        })
    }
}

/// Reads vLLM's load gauges from a Prometheus text exposition, summing label sets, and what its
/// KV cache holds ([`KvClock`]). `None` when none of the gauges is there (not a vLLM worker, or
/// not yet serving). With `engine`, only that data-parallel engine's series (vLLM's `engine`
/// label is the rank) and those of no engine count.
pub fn parse_vllm_metrics(text: &str, engine: Option<u32>) -> Option<Polled> {
    let mut p = Polled::default();
    let mut seen = false;
    // Releases that show both name the same count twice; the older name counts only alone.
    let mut gpu_hits = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("vllm:") else {
            if let Some(v) = line.strip_prefix("process_start_time_seconds ") {
                p.started = v.trim().parse::<f64>().ok().filter(|v| v.is_finite());
            }
            continue;
        };
        let name_end = rest.find(['{', ' ']).unwrap_or(rest.len());
        if engine.is_some_and(|rank| engine_of(rest).is_some_and(|e| e != Some(rank))) {
            continue;
        }
        let Some(value) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        let slot = match &rest[..name_end] {
            "num_requests_running" => &mut p.running,
            "num_requests_waiting" => &mut p.waiting,
            // `gpu_cache_usage_perc` before vLLM 0.10.
            "kv_cache_usage_perc" | "gpu_cache_usage_perc" => &mut p.kv_usage,
            "cache_config_info" => {
                let blocks = label(rest, "num_gpu_blocks").and_then(|v| v.parse::<f64>().ok());
                let size = label(rest, "block_size").and_then(|v| v.parse::<f64>().ok());
                if let (Some(blocks), Some(size)) = (blocks, size) {
                    p.kv_capacity += blocks * size;
                }
                continue;
            }
            "prompt_tokens_total" => {
                *p.prompt_tokens.get_or_insert(0.0) += value;
                continue;
            }
            "prefix_cache_hits_total" => {
                *p.prefix_hits.get_or_insert(0.0) += value;
                continue;
            }
            "gpu_prefix_cache_hits_total" => {
                *gpu_hits.get_or_insert(0.0) += value;
                continue;
            }
            "prompt_tokens_by_source_total" => {
                if label(rest, "source") == Some("local_compute") {
                    *p.prompt_computed.get_or_insert(0.0) += value;
                }
                continue;
            }
            _ => continue,
        };
        *slot += value;
        seen = true;
    }
    p.prefix_hits = p.prefix_hits.or(gpu_hits);
    seen.then_some(p)
}

/// The data-parallel engine a vLLM sample is of (its `engine` label, the rank): `None` for a
/// sample of no engine, `Some(None)` for one whose label is not a rank.
pub(crate) fn engine_of(sample: &str) -> Option<Option<u32>> {
    label(sample, "engine").map(|e| e.parse().ok())
}

/// The value of label `name` in a sample's `{...}`, unescaped values only (vLLM's numbers).
pub(crate) fn label<'a>(sample: &'a str, name: &str) -> Option<&'a str> {
    let labels = &sample[sample.find('{')? + 1..sample.find('}')?];
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

/// A worker's KV cache as a clock of the tokens written into it, so that a policy that learns
/// the cache from its own requests can presume what the worker has since evicted: vLLM reuses
/// the least recently used free block for each new one, so a block not used again is gone once
/// about a cache's worth of tokens has been written after it ([`crate::index`]).
///
/// The clock counts what this gateway sent (each prompt's uncached part, as the decision
/// predicted it, and what the answer shows beyond that: generated tokens, prompt tokens that
/// were not cached after all), not the worker's own counters of every replica's traffic. A
/// replica sees its share of the writes and the same share of the requests that refresh a block
/// (vLLM moves a block it reuses to the back of the eviction queue): dated by every replica's
/// writes, what the other replicas keep using would age as if nobody did, and it is presumed
/// evicted too soon (measured with two replicas on Mooncake's synthetic trace: 0.70x the cached
/// tokens reported, against 1.04x for one gateway; `docs/measurements.md`). Counted this way,
/// traffic that does not pass through this gateway makes presumed evictions come late, never
/// early.
///
/// The polls also watch for restarts: a worker that restarted (its process start time changed,
/// or its prompt token counter fell) has an empty cache, and the indexes stop counting it as
/// holding anything it was sent before ([`Restarts`]).
#[derive(Debug, Default)]
pub struct KvClock {
    /// Tokens the cache holds, from `vllm:cache_config_info`; 0 while unknown.
    capacity: AtomicU64,
    /// Tokens this gateway expects the worker to have written for it.
    sent: AtomicU64,
    restarts: Restarts,
    /// At the last poll that showed them, as `f64` bits (0 while never shown): the worker's
    /// prompt token counter and its process's start time.
    prompt_tokens: AtomicU64,
    started: AtomicU64,
    /// Tokens written lately: a sum that decays by `e` every [`RECENT_TAU_US`], as `f64` bits,
    /// and when it last moved ([`now_us`]). What conversations live on the worker, roughly.
    recent: AtomicU64,
    recent_at: AtomicU64,
}

/// The time constant of [`KvClock::recent`]: a minute.
pub const RECENT_TAU_US: u64 = 60_000_000;

impl KvClock {
    /// Tokens this gateway has had the worker write lately (decaying by `e` a minute), at `now`
    /// ([`now_us`]).
    pub fn recent(&self, now: u64) -> f64 {
        let sum = f64::from_bits(self.recent.load(Ordering::Relaxed));
        let at = self.recent_at.load(Ordering::Relaxed);
        sum * (-(now.saturating_sub(at) as f64) / RECENT_TAU_US as f64).exp()
    }

    /// Adds `tokens` to the recent sum. Two writers at once may lose one's tokens: a moving sum,
    /// cheaper than a retry loop.
    fn add_recent(&self, tokens: u64) {
        let now = now_us();
        let next = self.recent(now) + tokens as f64;
        self.recent.store(next.to_bits(), Ordering::Relaxed);
        self.recent_at.store(now, Ordering::Relaxed);
    }

    /// Tokens the worker's KV cache holds, once a poll has shown it.
    pub fn capacity(&self) -> Option<u64> {
        Some(self.capacity.load(Ordering::Relaxed)).filter(|&c| c > 0)
    }

    /// Counts `tokens` this gateway expects the worker to write (a prompt's uncached part, an
    /// answer's generated tokens).
    pub fn add(&self, tokens: u64) {
        if tokens > 0 {
            self.sent.fetch_add(tokens, Ordering::Relaxed);
            self.add_recent(tokens);
        }
    }

    /// Tokens this gateway has had the worker write into its KV cache so far.
    pub fn now(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Counts `tokens` (see [`Self::add`]) and returns the clock after them with the capacity,
    /// when the capacity is known.
    pub fn stamp(&self, tokens: u64) -> Option<(u64, u64)> {
        self.add(tokens);
        self.capacity().map(|c| (self.now(), c))
    }

    /// The worker's prompt token counter at the last poll that showed it (0 until one has).
    pub fn polled_prompt_tokens(&self) -> f64 {
        f64::from_bits(self.prompt_tokens.load(Ordering::Relaxed))
    }

    /// The restarts its polls have seen, for the indexes.
    pub fn restarts(&self) -> &Restarts {
        &self.restarts
    }

    /// Records a poll's capacity, and whether the worker restarted since the last poll that
    /// showed its counters (then `true`, and its restart count moves on). A failed poll changes
    /// nothing: the last known capacity still holds, and a restart during an outage shows at the
    /// next poll that answers.
    pub fn store(&self, p: Option<&Polled>) -> bool {
        let Some(p) = p else {
            return false;
        };
        if p.kv_capacity >= 1.0 {
            self.capacity.store(p.kv_capacity as u64, Ordering::Relaxed);
        }
        // The last value shown, replaced by `now` (0 before any was shown).
        let last = |slot: &AtomicU64, now: f64| {
            f64::from_bits(slot.swap(now.to_bits(), Ordering::Relaxed))
        };
        let fell = p
            .prompt_tokens
            .is_some_and(|now| now < last(&self.prompt_tokens, now));
        // The start time is whole seconds plus a fraction from the kernel's clock ticks: it
        // reads the same at every poll of one process.
        let started = p.started.is_some_and(|now| {
            let before = last(&self.started, now);
            before > 0.0 && (now - before).abs() >= 1.0
        });
        let restarted = fell || started;
        if restarted {
            self.restarts.bump();
        }
        restarted
    }
}

/// Times per prefill token closer to the pool's median than this factor count as the median's:
/// a fit moves by some percent between alike workers, and a pool of one GPU type is priced as it
/// was without speeds. Unlike GPUs differ by more (an L40S takes about a third of an L4's time).
pub const SPEED_DEADBAND: f64 = 1.25;

/// A worker is rated by the median of its last this many polls' readings: a fit strays now and
/// then for a while (seen on a pool of one GPU type: one worker at 17 us a token, its neighbours
/// at 76; under the mixed workload with two gateway replicas, each one's fit thrown by the
/// other's 2,048-token prompts, about 4x off for some 25 polls on end, which a rating moved a
/// twentieth of the way each poll followed out to 2x), and that should not send a worker the
/// pool's traffic. A GPU of another type reads apart at every poll and is rated within half a
/// window, or within [`FIRST_RATINGS`] polls of its first reading.
const RATINGS: usize = 64;

/// A worker's first rating comes from this many readings: until a worker has been read at all,
/// polls that give no reading add nothing, so a gateway that has just started (a replica in a
/// rollout) rates its workers a few polls after their fits settle instead of once their readings
/// outnumber the polls it waited through. Placed while every worker reads 1, the conversations
/// of two replicas on 2 simulated L4s and 2 L40Ss started at the pool's median speed and stayed
/// (`docs/measurements.md`, "Replicas rated from their first polls").
const FIRST_RATINGS: usize = 8;

/// Workers are rated while no more than this share of the requests in flight on the pool, as
/// polled, are other than this gateway's ([`rate_speeds`]).
pub const ALONE_SHARE: f64 = 0.25;

impl StepClock {
    /// Adds a poll's reading of this worker beside the pool's median, `None` for a poll that
    /// could not read it (no settled fit, no pool to compare with), which counts as 1 once the
    /// worker has been read before and not at all until then; its rating becomes the median of
    /// the last [`RATINGS`] readings, 1 until there are [`FIRST_RATINGS`].
    fn rate(&self, seen: Option<f64>) {
        let mut readings = self.readings.lock();
        if seen.is_none() && readings.is_empty() {
            return;
        }
        if readings.len() == RATINGS {
            readings.pop_front();
        }
        readings.push_back(seen.unwrap_or(1.0));
        let ratio = if readings.len() >= FIRST_RATINGS {
            crate::bench::stats::median(readings.make_contiguous()).unwrap_or(1.0)
        } else {
            1.0
        };
        self.ratio.store(ratio.to_bits(), Ordering::Relaxed);
    }
}

/// Rates each worker's [`StepClock::slowness`] by its fitted time per prefill token over the
/// median of the fitted workers' (no reading where its fit has not settled or fewer than two
/// workers have one; at most 4 times off), the median of its last [`RATINGS`] readings
/// ([`FIRST_RATINGS`] at least; see `StepClock::rate`); a rating within [`SPEED_DEADBAND`] of 1
/// reads as 1. What a worker's queue and misses cost in time, for a pool of unlike GPUs serving
/// one model.
///
/// Whose fit: while this gateway has the pool to itself, its own ([`StepClock::fit`]). Where
/// the polled load shows more than [`ALONE_SHARE`] of the requests in flight are someone else's
/// (other replicas', clients going to the workers directly), and for [`RATINGS`] polls after
/// that, the fit against the workers' own counters ([`StepClock::polled`]): a worker's steps
/// then carry others' prefill too, which this gateway's own fit takes for its own prompts' cost
/// (under the mixed workload with two replicas on 4 simulated L4s, ratings from it left the
/// deadband for seconds on end and one run of three collapsed, p95 TTFT 2.3x), and the
/// counters count it. While nothing is in flight no reading is taken.
pub fn rate_speeds(workers: &[Arc<Worker>]) {
    let (local, others) = workers.iter().fold((0, 0), |(local, others), w| {
        (local + w.inflight(), others + w.load.queued(0))
    });
    if local + others == 0 {
        return;
    }
    // Beside others, and for a window of polls after them (their requests come and go), each
    // worker's time per token as fitted against its own counters. One choice for the whole pool
    // (a worker added since takes it up too): readings of the two kinds are not to be mixed in
    // one median. Kept on the workers' clocks, the function having no state of its own.
    let shared = others as f64 > ALONE_SHARE * (local + others) as f64;
    let beside = if shared {
        RATINGS as u32
    } else {
        let left = |w: &Arc<Worker>| w.steps.beside.load(Ordering::Relaxed);
        workers
            .iter()
            .map(left)
            .max()
            .unwrap_or(0)
            .saturating_sub(1)
    };
    let readings: Vec<Option<f64>> = workers
        .iter()
        .map(|w| {
            w.steps.beside.store(beside, Ordering::Relaxed);
            if beside > 0 {
                w.steps.settled_pool_per_token()
            } else {
                w.steps.settled_per_token()
            }
        })
        .collect();
    let fitted: Vec<f64> = readings.iter().flatten().copied().collect();
    let median = if fitted.len() >= 2 {
        crate::bench::stats::median(&fitted).unwrap_or(0.0)
    } else {
        0.0
    };
    for (w, reading) in workers.iter().zip(readings) {
        // A reading more than four times off the median is more likely a bad fit than a GPU:
        // it counts as four times.
        let seen = match reading {
            Some(per_token) if median > 0.0 => Some((per_token / median).clamp(0.25, 4.0)),
            _ => None,
        };
        w.steps.rate(seen);
    }
}

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
        for (w, (p, ranks)) in workers.iter().zip(join_all(polls).await) {
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
            let inflight = w.inflight();
            w.steps.polled(
                now_us(),
                p.as_ref().and_then(Polled::prefilled),
                inflight > 0,
            );
            w.load.store(p, inflight);
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

/// The worker's load signals, and for the worker of a `data_parallel_size: auto` entry the
/// engines its exposition shows ([`engine_ranks`]).
async fn poll(
    up: &Upstreams,
    w: &Worker,
    path: &str,
    timeout: Duration,
) -> (Option<Polled>, Option<Vec<u32>>) {
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
    match tokio::time::timeout(timeout, read).await {
        Ok(Some(read)) => read,
        _ => (None, None),
    }
}

/// The data-parallel engines a vLLM exposition shows: the ranks its samples' `engine` labels
/// name, in order. `None` when a label is not a rank below [`MAX_DATA_PARALLEL_SIZE`]: what the
/// worker serves is then not read as ranks.
///
/// [`MAX_DATA_PARALLEL_SIZE`]: crate::config::MAX_DATA_PARALLEL_SIZE
pub fn engine_ranks(text: &str) -> Option<Vec<u32>> {
    let mut ranks = std::collections::BTreeSet::new();
    for sample in text.lines().filter_map(|l| l.strip_prefix("vllm:")) {
        match engine_of(sample) {
            None => {}
            Some(Some(r)) if r < crate::config::MAX_DATA_PARALLEL_SIZE => {
                ranks.insert(r);
            }
            Some(_) => return None,
        }
    }
    Some(ranks.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllms_gauges_summed_over_engines() {
        let text =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:num_requests_waiting_by_reason{reason=\"x\"} 9.0\n\
            vllm:prompt_tokens_total{engine=\"0\"} 1000.0\n\
            vllm:prefix_cache_hits_total{engine=\"0\"} 600.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\"} 20.0\n\
            vllm:gpu_prefix_cache_hits_total{engine=\"0\"} 600.0\n";
        let p = parse_vllm_metrics(text, None).unwrap();
        assert_eq!(
            p,
            Polled {
                running: 5.0,
                waiting: 4.0,
                kv_usage: 0.25,
                kv_capacity: 0.0,
                prompt_tokens: Some(1000.0),
                started: None,
                // The deprecated name of the same count is not added to it.
                prefix_hits: Some(620.0),
                prompt_computed: None,
            }
        );
        assert_eq!(p.prefilled(), Some(380.0), "prompt tokens less hits");
        // Where the worker counts what it prefilled, that count.
        let by_source = format!(
            "{text}vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"local_compute\"}} 390.0\n\
            vllm:prompt_tokens_by_source_total{{engine=\"1\",model_name=\"m\",source=\"local_compute\"}} 5.0\n\
            vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"local_cache_hit\"}} 610.0\n\
            vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"external_kv_transfer\"}} 0.0\n"
        );
        let p = parse_vllm_metrics(&by_source, None).unwrap();
        assert_eq!(p.prompt_computed, Some(395.0));
        assert_eq!(p.prefilled(), Some(395.0));
        // A release that shows only the old name.
        let old = "vllm:num_requests_running 1\nvllm:gpu_prefix_cache_hits_total 7.0\n";
        assert_eq!(
            parse_vllm_metrics(old, None).unwrap().prefix_hits,
            Some(7.0)
        );
        assert_eq!(parse_vllm_metrics("other_metric 1\n", None), None);
    }

    #[test]
    fn the_engines_an_exposition_shows_are_its_ranks() {
        let text = "vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 0.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
            other_metric{engine=\"7\"} 1\n\
            process_start_time_seconds 1.0\n";
        assert_eq!(engine_ranks(text), Some(vec![0, 1]));
        assert_eq!(engine_ranks("vllm:num_requests_running 0\n"), Some(vec![]));
        // A label that is no rank, or beyond any size kvroute expands to, is not read as ranks.
        let odd = "vllm:num_requests_running{engine=\"x\"} 0\n";
        assert_eq!(engine_ranks(odd), None);
        let far = "vllm:num_requests_running{engine=\"100000\"} 0\n";
        assert_eq!(engine_ranks(far), None);
    }

    #[test]
    fn one_data_parallel_rank_reads_its_own_engines_series_only() {
        let text = "process_start_time_seconds 1700000000.5\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 1.0\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"300\"} 1.0\n\
            vllm:prompt_tokens_total{engine=\"0\"} 1000.0\n\
            vllm:prompt_tokens_total{engine=\"1\"} 70.0\n";
        let one = parse_vllm_metrics(text, Some(1)).unwrap();
        assert_eq!(
            one,
            Polled {
                running: 2.0,
                waiting: 1.0,
                kv_usage: 0.5,
                kv_capacity: 300.0 * 16.0,
                prompt_tokens: Some(70.0),
                started: Some(1700000000.5),
                prefix_hits: None,
                prompt_computed: None,
            }
        );
        let zero = parse_vllm_metrics(text, Some(0)).unwrap();
        assert_eq!((zero.running, zero.waiting), (3.0, 4.0));
        assert_eq!(zero.prompt_tokens, Some(1000.0));
        // A rank the server does not have shows no gauges: not read as an idle worker.
        assert_eq!(parse_vllm_metrics(text, Some(2)), None);
    }

    #[test]
    fn reads_the_kv_capacity_summed_over_engines() {
        let text = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"5400\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"100\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"2\"} 1.0\n";
        let p = parse_vllm_metrics(text, None).unwrap();
        assert_eq!(
            p.kv_capacity,
            5500.0 * 16.0,
            "an engine without its block count adds none"
        );
        let p = parse_vllm_metrics("vllm:num_requests_running 1.0\n", None).unwrap();
        assert_eq!(p.kv_capacity, 0.0);
    }

    #[test]
    fn the_kv_clock_counts_what_this_gateway_had_the_worker_write() {
        let c = KvClock::default();
        assert_eq!(c.stamp(100), None, "no capacity known yet");
        c.add(20);
        assert_eq!(c.now(), 120);
        c.store(Some(&Polled {
            kv_capacity: 4096.0,
            ..Polled::default()
        }));
        assert_eq!(c.stamp(300), Some((420, 4096)));
        c.store(None);
        c.store(Some(&Polled::default()));
        assert_eq!(c.capacity(), Some(4096), "a failed or blank poll keeps it");
    }

    #[test]
    fn the_recent_writes_decay_by_e_each_time_constant() {
        let c = KvClock::default();
        assert_eq!(c.recent(now_us()), 0.0);
        c.add(1_000);
        let then = now_us();
        let fresh = c.recent(then);
        assert!((999.0..=1_000.0).contains(&fresh), "{fresh}");
        let later = c.recent(then + RECENT_TAU_US);
        let e = std::f64::consts::E;
        assert!((later - 1_000.0 / e).abs() < 1.0, "{later}");
    }

    #[test]
    fn a_restart_shows_as_a_new_start_time_or_a_counter_that_fell() {
        let text = "vllm:num_requests_running{engine=\"0\"} 0.0\n\
            vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 700.0\n\
            vllm:prompt_tokens_total{engine=\"1\",model_name=\"m\"} 300.0\n\
            vllm:prompt_tokens_created{engine=\"0\",model_name=\"m\"} 1.7e9\n\
            process_start_time_seconds 1.76427538912e+09\n";
        let p = parse_vllm_metrics(text, None).unwrap();
        assert_eq!(p.prompt_tokens, Some(1000.0));
        assert_eq!(p.started, Some(1_764_275_389.12));
        let polled = |prompt_tokens: Option<f64>, started: Option<f64>| Polled {
            prompt_tokens,
            started,
            ..Polled::default()
        };
        let c = KvClock::default();
        assert!(
            !c.store(Some(&polled(Some(1000.0), Some(100.5)))),
            "first sight"
        );
        assert!(!c.store(Some(&polled(Some(1500.0), Some(100.5)))));
        assert!(!c.store(None), "a failed poll");
        assert!(!c.store(Some(&polled(None, None))), "counters not shown");
        assert_eq!(c.restarts().count(), 0);
        // Back after an outage with a counter below the last one seen.
        assert!(c.store(Some(&polled(Some(20.0), None))));
        assert_eq!(c.restarts().count(), 1);
        assert!(!c.store(Some(&polled(Some(20.0), Some(100.5)))));
        // A new process that has already served more than the old one had: its start time.
        assert!(c.store(Some(&polled(Some(5000.0), Some(260.0)))));
        assert_eq!(c.restarts().count(), 2);
        assert!(!c.store(Some(&polled(Some(5001.0), Some(260.0)))));
    }

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
        l.store(Some(polled), 2);
        assert_eq!(l.queued(2), 8);
        // This gateway's own changes count at once; the others' part waits for the next poll.
        assert_eq!(l.queued(0), 6);
        assert_eq!(l.queued(10), 16);
        assert_eq!(l.kv_usage(), Some(0.5));
        // A lone gateway: the worker's count is its own, nothing is added.
        l.store(Some(polled), 9);
        assert_eq!(l.queued(3), 3);
        l.store(None, 0);
        assert_eq!(l.queued(2), 2);
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

    /// Frames of a worker whose steps take 20 ms plus 10 us per prefill token, each burst's
    /// frames 50 us apart, the first of a burst carrying the prompt tokens the step prefilled.
    fn steps(clock: &StepClock, mut t: u64, prefills: impl Iterator<Item = u64>) -> u64 {
        for x in prefills {
            t += 20_000 + 10 * x;
            clock.frame(t, x, || 0);
            for f in 1..6 {
                clock.frame(t + 50 * f, 0, || 0);
            }
        }
        t
    }

    #[test]
    fn workers_are_rated_by_their_time_per_token_beside_the_pools_median() {
        // Per prefill token: two workers at 10 us, one at 11 (within the deadband), one at 30 (a
        // GPU a third as fast), one never timed, and one at 30 timed over too few steps for its
        // fit to have settled.
        let ws = crate::workers::test_workers(6);
        let mix = [0, 128, 0, 512, 256, 0, 0, 1024];
        let timed = [(10, 200), (10, 200), (11, 200), (30, 200), (0, 0), (30, 20)];
        for (w, (per_token, steps)) in ws.iter().zip(timed) {
            let mut t = 1_000;
            for x in mix.iter().copied().cycle().take(steps) {
                t += 20_000 + per_token * x;
                w.steps.frame(t, x, || 0);
                w.steps.frame(t + 50, 0, || 0);
            }
        }
        // Nothing in flight: no reading is taken.
        for _ in 0..RATINGS {
            rate_speeds(&ws);
        }
        assert_eq!(ws[3].steps.slowness(), 1.0);
        let _inflight: Vec<_> = ws.iter().map(|w| w.acquire()).collect();
        // Rated from its first few readings on.
        for _ in 0..FIRST_RATINGS - 1 {
            rate_speeds(&ws);
        }
        assert_eq!(ws[3].steps.slowness(), 1.0);
        rate_speeds(&ws);
        let slowness: Vec<f64> = ws.iter().map(|w| w.steps.slowness()).collect();
        // The median of 10, 10, 11 and 30 is 10.5: the slow one is about 2.9 times it.
        assert_eq!(slowness[..3], [1.0, 1.0, 1.0]);
        assert!((slowness[3] - 30.0 / 10.5).abs() < 0.15, "{slowness:?}");
        assert_eq!(slowness[4], 1.0);
        assert!(ws[5].steps.fit().is_some());
        assert_eq!(slowness[5], 1.0);
        // A window of readings later, one fitted worker has no pool to be compared with: once
        // read, it goes back to 1 over the polls that cannot read it.
        for _ in 0..RATINGS {
            rate_speeds(&ws);
        }
        for _ in 0..RATINGS / 2 - 1 {
            rate_speeds(&ws[3..]);
        }
        assert!(ws[3].steps.slowness() > 2.5);
        rate_speeds(&ws[3..]);
        rate_speeds(&ws[3..]);
        assert_eq!(ws[3].steps.slowness(), 1.0);
        // Rated again, then beside another replica: the polls show two requests on each worker
        // for this gateway's one. The steps this gateway timed then carry the other's prefill
        // too, and its own fits no longer count: with no fit against the workers' counters,
        // every reading is 1 until the rating is.
        for _ in 0..RATINGS {
            rate_speeds(&ws);
        }
        assert!(ws[3].steps.slowness() > 2.5);
        let polled = Polled {
            running: 2.0,
            ..Polled::default()
        };
        for w in &ws {
            w.load.store(Some(polled), w.inflight());
        }
        for _ in 0..RATINGS / 2 + 1 {
            rate_speeds(&ws);
        }
        assert_eq!(ws[3].steps.slowness(), 1.0);
        // Fitted against their counters (the slow one at 30 us a token, the others at 10 and
        // 11): rated apart again, by those fits.
        for (w, per_token) in ws.iter().zip([10, 10, 11, 30, 10, 10]) {
            fit_against_counters(&w.steps, 20_000, per_token, 3, STEP_WINDOW as usize);
        }
        for _ in 0..RATINGS / 2 + 1 {
            rate_speeds(&ws);
        }
        let slowness: Vec<f64> = ws.iter().map(|w| w.steps.slowness()).collect();
        assert_eq!(slowness[..3], [1.0, 1.0, 1.0]);
        assert!((slowness[3] - 3.0).abs() < 0.15, "{slowness:?}");
    }

    /// Feeds `clock` `windows` poll windows' worth of steps of `base + per_token × prefill`
    /// microseconds, a poll every four steps, this gateway busy throughout, `1 / share` of each
    /// step's prefill its own and the rest another replica's (the worker's counter shows it all).
    fn fit_against_counters(
        clock: &StepClock,
        base: u64,
        per_token: u64,
        share: u64,
        windows: usize,
    ) {
        let mix = [0, 300, 0, 900, 150, 0, 600, 0, 1200, 0, 30];
        // On from where the clock and the counters are.
        let mut t = clock.last.load(Ordering::Relaxed).max(1_000);
        clock.frame(t, 0, || 0);
        let mut prefilled = clock.fit.lock().polls.prefilled.unwrap_or(1_000.0);
        clock.polled(t, Some(prefilled), true);
        let steps = POLL_WINDOW_STEPS as usize * windows;
        for (i, x) in mix.iter().copied().cycle().take(steps).enumerate() {
            t += base + per_token * x;
            clock.frame(t, x / share, || 0);
            prefilled += x as f64;
            if i % 4 == 3 {
                clock.polled(t, Some(prefilled), true);
            }
        }
    }

    #[test]
    fn after_other_replicas_leave_the_pool_is_rated_from_the_counters_for_a_window_of_polls() {
        // By the counters, worker 3 takes three times the others' time per token; by this
        // gateway's own fits all four look alike (worker 3's prompts all its own, the others'
        // a third: their own fits take the other replica's prefill for theirs). Worker 4 joins
        // later: its own fit nine times too slow, its counters' fit like the others'.
        let ws = crate::workers::test_workers(5);
        for (w, (per_token, share)) in ws.iter().zip([(10, 3), (10, 3), (10, 3), (30, 1), (10, 9)])
        {
            fit_against_counters(&w.steps, 20_000, per_token, share, STEP_WINDOW as usize);
        }
        let (four, _inflight) = (&ws[..4], ws.iter().map(|w| w.acquire()).collect::<Vec<_>>());
        let others = |running: f64| {
            for w in &ws {
                let polled = Polled {
                    running,
                    ..Polled::default()
                };
                w.load.store(Some(polled), w.inflight());
            }
        };
        // Beside another replica.
        others(2.0);
        for _ in 0..RATINGS / 2 + 1 {
            rate_speeds(four);
        }
        assert!((ws[3].steps.slowness() - 3.0).abs() < 0.15);
        // It leaves: for a window of polls the counters still rate the pool, worker 4 (joined
        // now) included.
        others(1.0);
        for _ in 0..RATINGS - 1 {
            rate_speeds(&ws);
        }
        assert!((ws[3].steps.slowness() - 3.0).abs() < 0.15);
        assert_eq!(ws[4].steps.slowness(), 1.0);
        // Then this gateway's own fits, by which worker 4 is slow and worker 3 like the others.
        for _ in 0..RATINGS / 2 + 2 {
            rate_speeds(&ws);
        }
        assert_eq!(ws[3].steps.slowness(), 1.0);
        assert!(ws[4].steps.slowness() > 2.5, "{}", ws[4].steps.slowness());
    }

    #[test]
    fn a_workers_steps_are_fitted_against_the_prefill_its_own_counters_show() {
        let clock = StepClock::default();
        fit_against_counters(&clock, 20_000, 30, 3, SOLVE_WINDOWS as usize - 1);
        // Not before it has enough windows.
        assert_eq!(clock.settled_pool_per_token(), None);
        fit_against_counters(&clock, 20_000, 30, 3, 1);
        let per_token = clock.settled_pool_per_token().expect("a fit");
        assert!((per_token - 30.0).abs() < 0.5, "{per_token}");
        // The fit of this gateway's own prompts alone takes the other's prefill for its own
        // prompts' cost: about three times too slow.
        let (_, own) = clock.fit().expect("own fit");
        assert!(own > 60.0, "own fit {own}");
    }

    #[test]
    fn a_poll_window_spans_polls_with_counters_that_find_this_gateway_busy() {
        let clock = StepClock::default();
        let windows = || clock.fit.lock().polls.moments.windows;
        // Steps of 20 ms, each with 100 prompt tokens of prefill; a poll every `steps` of them.
        let (mut t, mut prompt) = (1_000, 0.0);
        clock.frame(t, 0, || 0);
        let mut run = |steps: usize, counters: bool, busy: bool, fell: bool| {
            for _ in 0..steps {
                t += 20_000;
                prompt += 100.0;
                clock.frame(t, 0, || 0);
            }
            if fell {
                prompt = 0.0;
            }
            clock.polled(t, counters.then_some(prompt), busy);
            t
        };
        run(0, true, true, false);
        // Four polls of four steps: one window of sixteen.
        for _ in 0..4 {
            run(4, true, true, false);
        }
        assert_eq!(windows(), 1);
        // A poll that finds this gateway idle, shows no counters, or counters that fell (a
        // restart) drops the window under way.
        for (counters, busy, fell) in [
            (true, false, false),
            (false, true, false),
            (true, true, true),
        ] {
            run(8, true, true, false);
            run(8, counters, busy, fell);
            run(8, true, true, false);
            assert_eq!(windows(), 1);
            run(0, true, true, false);
        }
        run(16, true, true, false);
        assert_eq!(windows(), 2);
        // Idle for about a second (a poll finds nothing in flight), then requests again, a poll
        // and a burst 30 ms after it: the window holds the 30 ms since that poll, not the second
        // before it, and that share of the gap as steps.
        let t = run(0, true, true, false);
        clock.polled(t + 500_000, Some(prompt), false);
        clock.polled(t + 990_000, Some(prompt), true);
        clock.frame(t + 1_020_000, 0, || 0);
        let polls = &clock.fit.lock().polls;
        assert_eq!(polls.time, 30_000.0);
        assert!((polls.steps - 30_000.0 / 1_020_000.0).abs() < 1e-9);
    }

    #[test]
    fn a_rating_holds_through_a_fit_that_strays_for_a_while() {
        let clock = StepClock::default();
        for _ in 0..RATINGS {
            clock.rate(Some(1.0));
        }
        // Four times the median for almost half a window of polls on end: a fit thrown off (as
        // two replicas' long prompts did), not a slower GPU.
        for _ in 0..RATINGS / 2 - 1 {
            clock.rate(Some(4.0));
        }
        assert_eq!(clock.slowness(), 1.0);
        // Slower at every poll for more than half the window: a GPU of another type.
        clock.rate(Some(3.0));
        clock.rate(Some(3.0));
        assert_eq!(clock.slowness(), 3.0);
        for _ in 0..RATINGS {
            clock.rate(Some(0.3));
        }
        assert_eq!(clock.slowness(), 0.3);
    }

    #[test]
    fn a_worker_is_rated_from_its_first_readings_however_long_it_went_unread() {
        let clock = StepClock::default();
        // Polls while its fit settles: no reading, and they do not count.
        for _ in 0..RATINGS {
            clock.rate(None);
        }
        // Rated from its eighth reading: eight polls, not half a window of them.
        for _ in 0..7 {
            clock.rate(Some(3.0));
        }
        assert_eq!(clock.slowness(), 1.0);
        clock.rate(Some(3.0));
        assert_eq!(clock.slowness(), 3.0);
        // Once read, a poll that cannot read it counts as 1 (its fit gone, or its pool).
        for _ in 0..9 {
            clock.rate(None);
        }
        assert_eq!(clock.slowness(), 1.0);
    }

    #[test]
    fn the_step_clock_fits_a_steps_base_and_prefill_time_from_its_bursts() {
        let clock = StepClock::default();
        assert_eq!(clock.fit(), None);
        assert_eq!(clock.remaining_tokens(1_000_000), 0.0);
        let mix = [0, 128, 0, 512, 256, 0, 0, 1024];
        let t = steps(&clock, 1_000, mix.iter().copied().cycle().take(200));
        let (base, per_token) = clock.fit().expect("fitted");
        assert!((base - 20_000.0).abs() < 500.0, "base {base} us");
        assert!((per_token - 10.0).abs() < 0.5, "per token {per_token} us");
        // Just after a burst a whole step's base is ahead, 2,000 tokens' worth; half of it half-way.
        let ahead = |at: u64| clock.remaining_tokens(at);
        assert!(
            (ahead(t + 250) - 1_975.0).abs() < 100.0,
            "{}",
            ahead(t + 250)
        );
        assert!(
            (ahead(t + 10_000) - 1_000.0).abs() < 100.0,
            "{}",
            ahead(t + 10_000)
        );
        assert_eq!(ahead(t + 25_000), 0.0);
        // An idle pause is no step: the fit holds through it.
        let t = steps(&clock, t + 5_000_000, mix.iter().copied().take(4));
        let (base, per_token) = clock.fit().expect("fitted");
        assert!(
            (base - 20_000.0).abs() < 1_000.0,
            "base after a pause {base} us"
        );
        assert!(
            (per_token - 10.0).abs() < 1.0,
            "per token after a pause {per_token} us"
        );
        assert!(ahead(t + 250) > 1_800.0);
    }

    #[test]
    fn a_worker_idle_until_its_next_prompts_came_is_timed_from_their_send() {
        // Waves of prompts on a worker whose steps take 20 ms plus 10 us per prefill token: each
        // wave's prompts are prefilled in one step, then decoded for five. Every other wave
        // comes after a pause twice as long as its prefill (it waits for a worker a third as
        // fast to finish its share): the step that prefills it spans the pause, from the last
        // burst to the next, but began when the prompts were sent. The others are sent 2 ms
        // before the end of the previous wave's last decode step, which they wait for: that
        // step, though it ends after their send, is timed whole, as it prefilled nothing.
        let clock = StepClock::default();
        let waves = [512u64, 1_024, 2_048, 256, 1_536, 768, 384];
        let mut t = 1_000;
        for (i, x) in waves.iter().copied().cycle().take(140).enumerate() {
            let paused = i % 2 == 0;
            if paused {
                t += 20 * x;
                clock.sent(t);
            }
            t += 20_000 + 10 * x;
            clock.frame(t, x, || 0);
            for step in 0..5 {
                t += 20_000;
                if paused && step == 4 {
                    // The next wave, sent while this step runs.
                    clock.sent(t - 2_000);
                }
                clock.frame(t, 0, || 0);
                clock.frame(t + 50, 0, || 0);
            }
        }
        let (base, per_token) = clock.fit().expect("fitted");
        assert!((base - 20_000.0).abs() < 1_000.0, "base {base} us");
        assert!((per_token - 10.0).abs() < 1.0, "per token {per_token} us");
    }

    #[test]
    fn prompts_prefilled_in_chunks_over_several_steps_do_not_skew_the_fit() {
        // A worker that prefills at most 2,048 tokens a step (vLLM's chunked prefill), its steps
        // 20 ms plus 10 us per token prefilled. Prompts of 3,000 and 5,000 tokens take two and
        // three steps, and only the last returns their first token; every step also decodes, so
        // every step ends in a burst.
        let clock = StepClock::default();
        let arrivals = [3_000u64, 128, 0, 5_000, 256, 0, 512, 0, 2_048, 64, 0, 0];
        // (tokens left to prefill, the prompt's tokens), in arrival order.
        let mut queue: std::collections::VecDeque<(u64, u64)> = Default::default();
        let mut t = 1_000;
        for x in arrivals.iter().copied().cycle().take(600) {
            let mut budget = 2_048;
            let (mut prefilled, mut cleared) = (0, 0);
            while let Some(front) = queue.front_mut() {
                let chunk = front.0.min(budget);
                (front.0, budget, prefilled) = (front.0 - chunk, budget - chunk, prefilled + chunk);
                if front.0 > 0 {
                    break;
                }
                cleared += front.1;
                queue.pop_front();
            }
            t += 20_000 + 10 * prefilled;
            // Arrivals while the step ran wait for the next one, which the burst begins.
            if x > 0 {
                queue.push_back((x, x));
            }
            let pending: u64 = queue.iter().map(|p| p.1).sum();
            clock.frame(t, cleared, || pending);
            for f in 1..6 {
                clock.frame(t + 50 * f, 0, || pending);
            }
        }
        let (base, per_token) = clock.fit().expect("fitted");
        assert!((base - 20_000.0).abs() < 1_000.0, "base {base} us");
        assert!((per_token - 10.0).abs() < 0.5, "per token {per_token} us");
    }

    #[test]
    fn a_step_works_through_the_prefill_it_began_with() {
        let clock = StepClock::default();
        let mix = [0, 128, 0, 512, 256, 0, 0, 1024];
        let t = steps(&clock, 1_000, mix.iter().copied().cycle().take(200));
        assert_eq!(
            clock.prefill_done(t + 50_000, 1_000),
            0.0,
            "nothing began there"
        );
        // The next step begins with 1,000 tokens waiting; a frame of the same burst clears 200
        // of them (their first token ended the step before): 800 are this step's.
        let t = t + 20_000;
        clock.frame(t, 0, || 1_000);
        clock.frame(t + 100, 200, || 800);
        let done = |at: u64, pending: u64| clock.prefill_done(at, pending);
        assert_eq!(done(t + 10_000, 800), 0.0, "still in the base time");
        assert!(
            (done(t + 25_000, 800) - 500.0).abs() < 50.0,
            "{}",
            done(t + 25_000, 800)
        );
        assert!(
            (done(t + 40_000, 800) - 800.0).abs() < 1e-9,
            "no more than it began with"
        );
        assert!(
            done(t + 40_000, 300) <= 300.0,
            "no more than is still pending"
        );
        // Twice the step's fitted length (20 ms and 8 ms of prefill) and more: stalled.
        assert_eq!(done(t + 60_000, 800), 0.0, "an overdue step is not trusted");
        // What remains of the step with its prefill falls as the step goes.
        let ahead = |at: u64| clock.remaining_less_done(at, 800);
        for at in [1_000, 15_000, 25_000, 40_000, 60_000] {
            let apart = clock.remaining_tokens(t + at) - done(t + at, 800);
            assert_eq!(ahead(t + at), apart, "at {at} us");
        }
        assert!(ahead(t + 1_000) > ahead(t + 15_000));
        assert!(ahead(t + 15_000) > ahead(t + 25_000));
        assert!(ahead(t + 25_000) > ahead(t + 40_000));
    }

    #[test]
    fn without_prefills_of_different_sizes_the_step_clock_prices_nothing() {
        // Every step alike: a base time, but nothing to tell tokens from time by.
        let clock = StepClock::default();
        let t = steps(&clock, 1_000, std::iter::repeat_n(0, 100));
        assert_eq!(clock.fit(), None);
        assert_eq!(clock.remaining_tokens(t + 100), 0.0);
    }

    #[test]
    fn a_mistimed_window_among_many_without_prefill_does_not_drag_the_time_per_token() {
        // One step in sixteen prefills (the rest only decode), 20 ms plus 10 us per token. Once,
        // the gateway sees a 2,048-token prompt's prefill step as one without prefill (40 ms)
        // and its first token in the next, a plain 20 ms step: a window that clears 2,048 tokens
        // in no prefill time at all.
        let clock = StepClock::default();
        let prefills = [512u64, 1_024, 2_048, 256];
        let mut t = 1_000;
        let mut worst: f64 = 0.0;
        for i in 0..1_600u64 {
            let (x, took) = match (i % 16, i / 16) {
                (0, 60) => (0, 20_000 + 10 * 2_048),
                (1, 60) => (2_048, 20_000),
                (0, k) => {
                    let x = prefills[k as usize % prefills.len()];
                    (x, 20_000 + 10 * x)
                }
                _ => (0, 20_000),
            };
            t += took;
            clock.frame(t, x, || 0);
            for f in 1..6 {
                clock.frame(t + 50 * f, 0, || 0);
            }
            if i >= 16 * 40 {
                let (_, per_token) = clock.fit().expect("fitted");
                worst = worst.max((per_token - 10.0).abs() / 10.0);
            }
        }
        assert!(
            worst < 0.15,
            "the time per token strayed by {:.0}%",
            worst * 100.0
        );
    }
}
