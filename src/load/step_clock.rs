//! A worker's engine steps as this gateway sees them: when they end, and a fit of how long one
//! takes with and without prefill, from its streams' bursts and from the worker's own counters.

use std::{
    collections::VecDeque,
    sync::atomic::{AtomicU32, AtomicU64, Ordering},
};

use super::speeds::SPEED_DEADBAND;

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
/// `StepFit`), so
/// what remains of a step without this gateway's prefill is `base` less the time since the last
/// burst. The prefill part is the pending prefill a policy already prices; of the prefill the step
/// began with, what its fitted rate has worked through since the base time ended is done
/// ([`StepClock::prefill_done`]).
#[derive(Debug, Default)]
pub struct StepClock {
    /// [`now_us`](super::now_us) when the last burst began; 0 before any.
    last: AtomicU64,
    /// Prompt tokens whose first token came in the burst that began at `last`.
    cleared: AtomicU64,
    /// This gateway's pending prefill when the step under way began (after the burst that began
    /// it cleared its first tokens): what that step is prefilling, since vLLM schedules a step
    /// from what is waiting when it starts.
    in_step: AtomicU64,
    /// The fit, as `f64` bits: microseconds of a step with no prefill, and per prefill token. Both
    /// 0 while unknown; the base can be 0 in a known fit (see `Moments::solve`).
    base_us: AtomicU64,
    per_token_us: AtomicU64,
    fit: parking_lot::Mutex<StepFit>,
    /// Its time per prefill token over the pool's median, the median of the last [`RATINGS`](super::speeds::RATINGS)
    /// polls' readings ([`rate_speeds`](super::rate_speeds)), as `f64` bits; 0 (read as 1) before the first.
    pub(super) ratio: AtomicU64,
    /// Those readings, oldest first (only the load poll touches them).
    pub(super) readings: parking_lot::Mutex<VecDeque<f64>>,
    /// [`now_us`](super::now_us) when this gateway's pending prefill there last rose from none: no step that
    /// prefills a prompt sent since began before it.
    sent: AtomicU64,
    /// Load polls left for which the pool's readings come from the fits against the workers'
    /// counters: [`RATINGS`](super::speeds::RATINGS) from each poll that showed others' requests beside this gateway's
    /// (the same on every worker of the pool; [`rate_speeds`](super::rate_speeds)).
    pub(super) beside: AtomicU32,
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
    dd: f64,
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
        mv(&mut self.dd, d * d);
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
            dd: self.dd + o.dd,
        }
    }

    /// `(base, per_token)` once [`SOLVE_WINDOWS`] samples are in, `per_token` positive and
    /// `base` not negative; `(0, 0)` otherwise. Least squares through the origin in two
    /// variables: samples whose `x` is always in the same proportion to their `n` cannot tell
    /// base from tokens. Where the fit's base falls below 0 (a step's fixed part lost in the
    /// spread of its prefill: seen on a CPU vLLM beside busy cores, its time per token several
    /// times its idle one and its base within the noise of it), the answer is the least-squares one
    /// with the base held at 0, the best of those with a base that can be: the time per token is
    /// still known, where leaving the whole fit unknown would drop the worker's step clock and
    /// speed rating for as long as it lasts.
    fn solve(&self) -> (f64, f64) {
        if self.windows < SOLVE_WINDOWS {
            return (0.0, 0.0);
        }
        let (base, per_token) = match self.free() {
            Some((base, per_token)) if base > 0.0 => (base, per_token),
            // A convex fit whose best point lies below the bound has its best within the bound
            // on it.
            Some(_) => (0.0, self.xd / self.xx),
            None => return (0.0, 0.0),
        };
        if per_token > 0.0 {
            (base, per_token)
        } else {
            (0.0, 0.0)
        }
    }

    /// The standard error of [`Self::solve`]'s time per token as a share of it, from the spread
    /// of the samples about the fit over the last [`STEP_WINDOW`] of them; infinite while the
    /// fit is unknown. Where a window's prefill is a small part of its time (a lightly loaded
    /// worker whose prompts are mostly cached: a couple of hundred tokens against sixteen steps
    /// of decoding), the time per token is lost in the steps' own spread, and the fit moves by
    /// several times from one window to the next.
    fn per_token_error(&self) -> f64 {
        let (base, per_token) = self.solve();
        if per_token <= 0.0 {
            return f64::INFINITY;
        }
        // Mean squared residual: E[(d - base n - per_token x)^2], from the moments.
        let residual = self.dd - 2.0 * (base * self.nd + per_token * self.xd)
            + base * base * self.nn
            + 2.0 * base * per_token * self.nx
            + per_token * per_token * self.xx;
        // The variance of the time per token: with the base fitted, the residual over the
        // part of `x` that `n` does not explain; with the base held at 0, over `x` alone.
        let spread = if base > 0.0 {
            self.xx - self.nx * self.nx / self.nn
        } else {
            self.xx
        };
        let samples = STEP_WINDOW.min(f64::from(self.windows));
        if spread <= 0.0 {
            return f64::INFINITY;
        }
        (residual.max(0.0) / (spread * samples)).sqrt() / per_token
    }

    /// The least-squares `(base, per_token)` with no bound on either; `None` where the samples
    /// cannot tell base from tokens.
    fn free(&self) -> Option<(f64, f64)> {
        let det = self.nn * self.xx - self.nx * self.nx;
        (det > 1e-6 * self.nn * self.xx).then(|| {
            (
                (self.nd * self.xx - self.xd * self.nx) / det,
                (self.xd * self.nn - self.nd * self.nx) / det,
            )
        })
    }
}

/// A worker's steps fitted over the intervals between load polls against the prefill its own
/// counters show done in each ([`Polled::prefilled`](super::Polled::prefilled)):
/// every replica's and every client's, where [`StepFit`]'s windows know only this gateway's
/// prompts. Windows span load polls that all found this gateway with requests in flight there,
/// so that its streams' bursts mark the worker's steps throughout ([`StepClock::polled`]).
#[derive(Debug, Default)]
struct PollFit {
    /// Steps seen since the window under way began (the one under way then in part) and their
    /// microseconds, and when it began ([`now_us`](super::now_us)).
    steps: f64,
    time: f64,
    since: u64,
    /// The worker's prefilled-token counter where it began; `None` while no window is under way.
    prefilled: Option<f64>,
    moments: Moments,
    /// The fit's time per prefill token, in microseconds; 0 while unknown.
    per_token: f64,
    /// Its standard error as a share of it ([`Moments::per_token_error`]).
    error: f64,
}

/// The largest standard error, as a share of the time per token, of a pool fit that a speed
/// rating reads ([`StepClock::pool_reading`]). Ratings within [`SPEED_DEADBAND`] of the pool's
/// median read as alike, so a fit that cannot tell 1.25 from 1 says nothing; unlike GPUs (an
/// L40S takes about a third of an L4's time per token) are told apart well within it.
///
/// [`SPEED_DEADBAND`]: super::speeds::SPEED_DEADBAND
pub(super) const POOL_FIT_MAX_ERROR: f64 = 0.1;

/// What a poll reads of a worker's time per prefill token for its speed rating, from its pool fit
/// ([`StepClock::pool_reading`]) or this gateway's own fit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum SpeedReading {
    /// No fit yet.
    Unknown,
    /// A fit too uncertain to read ([`POOL_FIT_MAX_ERROR`]).
    Unsure,
    /// Microseconds per prefill token.
    PerToken(f64),
}

/// Steps a window of [`PollFit`] sums at least, so that the prefill of the step under way at
/// either end, which the counters may place on the other side of it, is a small part of it.
const POLL_WINDOW_STEPS: f64 = 16.0;
/// Bursts closer together than this are one (a step's frames spread as they are relayed).
const MIN_STEP_GAP_US: u64 = 500;
/// Windows in the fit's moving means.
pub(super) const STEP_WINDOW: f64 = 32.0;
/// Windows a fit ([`Moments::solve`]) needs at the fewest.
const SOLVE_WINDOWS: u32 = 8;
/// Steps after which a window ends even with prefill outstanding (a worker that never drains).
const MAX_WINDOW_STEPS: f64 = 16.0;

impl StepFit {
    /// What a step that began with `began` tokens pending and cleared `tokens` should take, by
    /// the fit (`base`, `per_token`) or, before one or while its base is held at 0 (by which a
    /// step that only decodes would take no time, and every one be a pause), by the mean step,
    /// at the mean step's time per mean token (which overstates it): a step that prefills
    /// several prompts after many that prefilled none is long, and no pause.
    fn expected(&self, base: f64, per_token: f64, began: f64, tokens: f64) -> f64 {
        let x = tokens.max(began);
        if per_token > 0.0 && base > 0.0 {
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
    /// A frame of a stream went by at `now` ([`now_us`](super::now_us)); its first frame cleared `cleared` prompt
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

    /// Peer replicas said their prompts' first tokens cleared `cleared` tokens of their pending
    /// prefill there ([`crate::peers`]): heard a moment after the burst their first tokens came
    /// in (the same step end as this gateway's frames), so counted with it, as a frame of this
    /// gateway's that came late in the burst would be. Without it, a replica beside others fits
    /// its steps to its own prefill alone, and every step that prefilled a peer's prompt looks
    /// long for the tokens it shows.
    pub fn peer_cleared(&self, cleared: u64) {
        if cleared == 0 || self.last.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.cleared.fetch_add(cleared, Ordering::Relaxed);
        let in_step = self.in_step.load(Ordering::Relaxed);
        self.in_step
            .store(in_step.saturating_sub(cleared), Ordering::Relaxed);
    }

    /// A prompt was sent at `now` ([`now_us`](super::now_us)) to the worker, which had none of this gateway's
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
    /// fits ([`rate_speeds`](super::rate_speeds)): above 1 on a slower GPU, below on a faster one; 1 while unknown or
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
    pub(super) fn settled_per_token(&self) -> Option<f64> {
        let (_, per_token) = self.fit()?;
        (self.fit.lock().windows() >= STEP_WINDOW as u32).then_some(per_token)
    }

    /// A load poll at `now` ([`now_us`](super::now_us)): `prefilled` is the worker's count of the prompt tokens
    /// it prefilled ([`Polled::prefilled`](super::Polled::prefilled); `None` where it does not show one), `busy` whether
    /// this gateway had requests in flight there. Polls that find this gateway busy and show it
    /// sum the steps between them into a window; once a window holds `POLL_WINDOW_STEPS`
    /// steps, its steps, their time and the prefill the counters moved by over it go to
    /// `Self::pool_reading`'s fit. A poll that finds this gateway idle, or counters
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
        p.error = p.moments.per_token_error();
    }

    /// The time per prefill token, in microseconds, fitted over windows of load polls against
    /// the prefill the worker's own counters show ([`Self::polled`]), as soon as it solves
    /// ([`SOLVE_WINDOWS`] windows). Unlike [`Self::fit`], it counts the prefill of every
    /// replica's requests. Its first readings can be well off (seen: an L4 rated 4.1 times an
    /// L40S, the presets' ratio 2.9), which the median of [`RATINGS`](super::speeds::RATINGS) readings then outvotes;
    /// counted only from the sixteenth window, two replicas on the unlike pool kept less of what
    /// rating early gained them (`docs/measurements.md`, "Replicas rated from their first polls").
    /// Read only while its standard error is within [`POOL_FIT_MAX_ERROR`] of it: at light load,
    /// a window's prefill is too small a part of its time to be told from the steps' spread
    /// (seen: four alike simulated L4s rated from 0.25 to 1.9 by two replicas with 16 users
    /// pausing 2 s, each replica rating different workers apart, so that their homes differed).
    pub(super) fn pool_reading(&self) -> SpeedReading {
        let fit = self.fit.lock();
        let p = &fit.polls;
        if p.per_token <= 0.0 {
            SpeedReading::Unknown
        } else if p.error > POOL_FIT_MAX_ERROR {
            SpeedReading::Unsure
        } else {
            SpeedReading::PerToken(p.per_token)
        }
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

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

    /// microseconds, a poll every four steps, this gateway busy throughout, `1 / share` of each
    /// step's prefill its own and the rest another replica's (the worker's counter shows it all).
    pub(crate) fn fit_against_counters(
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

    /// Steps of 20 ms, give or take 2 (the spread of a real engine's steps), plus `per_token`
    /// microseconds per prefill token, the counters polled every four steps, this gateway busy
    /// throughout; each step prefills `1 / thin` of [`fit_against_counters`]'s mix.
    pub(crate) fn spread_steps(clock: &StepClock, per_token: u64, thin: u64) {
        let mix = [0, 300, 0, 900, 150, 0, 600, 0, 1200, 0, 30];
        let mut t = 1_000;
        clock.frame(t, 0, || 0);
        let mut prefilled = 1_000.0;
        clock.polled(t, Some(prefilled), true);
        let steps = POLL_WINDOW_STEPS as usize * 2 * STEP_WINDOW as usize;
        for (i, x) in mix.iter().copied().cycle().take(steps).enumerate() {
            let x = x / thin;
            let jitter = (i as u64 * 7_919) % 13 * 333;
            t += 18_000 + jitter + per_token * x;
            clock.frame(t, x, || 0);
            prefilled += x as f64;
            if i % 4 == 3 {
                clock.polled(t, Some(prefilled), true);
            }
        }
    }

    /// A worker whose prompts are mostly cached prefills a few tokens a window, whose time is
    /// lost in the spread of its steps: its pool fit is not read. The same steps with the
    /// prefill of a busy pool are, within a tenth of the truth.
    #[test]
    fn a_pool_fit_lost_in_the_spread_of_the_steps_is_not_read() {
        let light = StepClock::default();
        spread_steps(&light, 50, 40);
        assert_eq!(light.pool_reading(), SpeedReading::Unsure);
        let busy = StepClock::default();
        spread_steps(&busy, 50, 1);
        let SpeedReading::PerToken(per_token) = busy.pool_reading() else {
            panic!("not read: {:?}", busy.pool_reading());
        };
        assert!((per_token - 50.0).abs() < 5.0, "{per_token}");
    }

    #[test]
    fn a_workers_steps_are_fitted_against_the_prefill_its_own_counters_show() {
        let clock = StepClock::default();
        fit_against_counters(&clock, 20_000, 30, 3, SOLVE_WINDOWS as usize - 1);
        // Not before it has enough windows.
        assert_eq!(clock.pool_reading(), SpeedReading::Unknown);
        fit_against_counters(&clock, 20_000, 30, 3, 1);
        let SpeedReading::PerToken(per_token) = clock.pool_reading() else {
            panic!("no fit: {:?}", clock.pool_reading());
        };
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
    fn a_peers_prefill_heard_after_the_burst_counts_in_the_step_it_ended() {
        // Steps of 20 ms plus 10 us a token, prefilling this gateway's prompts and a peer's.
        let (told, untold) = (StepClock::default(), StepClock::default());
        let own = [0u64, 128, 0, 512, 256, 0, 0, 1024];
        let theirs = [256u64, 0, 512, 0, 0, 1024, 128, 0, 64];
        let mut t = 1_000;
        for (&x, &y) in own.iter().cycle().zip(theirs.iter().cycle()).take(300) {
            t += 20_000 + 10 * (x + y);
            for c in [&told, &untold] {
                c.frame(t, x, || 0);
            }
            // The peer's first tokens came in the same burst; its word of them a moment later.
            told.peer_cleared(y);
            for f in 1..6 {
                for c in [&told, &untold] {
                    c.frame(t + 50 * f, 0, || 0);
                }
            }
        }
        let (base, per_token) = told.fit().expect("fitted");
        assert!((base - 20_000.0).abs() < 1_000.0, "base {base} us");
        assert!((per_token - 10.0).abs() < 0.5, "per token {per_token} us");
        // Untold, the peer's prefill is time without tokens.
        let (base, per_token) = untold.fit().expect("fitted");
        assert!(
            (base - 20_000.0).abs() > 2_000.0 || (per_token - 10.0).abs() > 2.0,
            "untold: base {base} us, per token {per_token} us"
        );
    }

    #[test]
    fn a_base_lost_in_the_spread_of_the_prefill_is_held_at_zero_not_left_unknown() {
        // Steps of 300 us per prefill token, each 2 ms short of it: fitted freely, the base is
        // -2 ms.
        let mut m = Moments::default();
        for x in [100.0, 200.0, 300.0, 400.0].into_iter().cycle().take(8) {
            m.add(1.0, x, 300.0 * x - 2_000.0);
        }
        let (free, _) = m.free().expect("a free fit");
        assert!((free + 2_000.0).abs() < 1.0, "the free fit's base {free}");
        let (base, per_token) = m.solve();
        assert_eq!(base, 0.0);
        // With the base at 0, the least-squares time per token: 300 less 2,000 × 250 / 75,000
        // (the mean prompt over the mean of its square), about 293.3.
        assert!((per_token - 293.33).abs() < 0.1, "per token {per_token}");
        // Through the clock: bursts of such steps, each clearing its prompt.
        let clock = StepClock::default();
        let mut t = 1_000;
        for x in [100u64, 200, 300, 400].into_iter().cycle().take(80) {
            t += 300 * x - 2_000;
            clock.frame(t, x, || 0);
        }
        let (base, per_token) = clock.fit().expect("a fit with its base at 0");
        assert_eq!(base, 0.0);
        assert!((per_token - 293.33).abs() < 0.5, "per token {per_token}");
        // No base: nothing of a step is left once its prefill is priced.
        assert_eq!(clock.remaining_tokens(t + 10), 0.0);
        // A step that only decodes is still a step, not a pause to leave out (by the fit alone
        // it would take no time): it closes a window of its own once the next burst ends it.
        clock.frame(t + 1_000, 0, || 0);
        let windows = clock.fit.lock().windows();
        clock.frame(t + 2_000, 0, || 0);
        assert_eq!(clock.fit.lock().windows(), windows + 1);
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
