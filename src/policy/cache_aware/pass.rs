//! The pricing pass: each usable worker's cost for one request, the cheapest of them and the
//! request's rendezvous home; in a pool larger than [`PRICE_ALL_UP_TO`], on a sample of workers
//! that keeps every holder of the prompt and the home.

use std::sync::Arc;

use crate::{index::Matches, workers::Worker};

/// A rendezvous score of the key for the worker. Both are xxh3 outputs, so their xor is already
/// uniform; one odd multiply and a fold decorrelate neighbouring keys, at a nanosecond per worker.
pub(super) fn mix(key: u64, worker: u64) -> u64 {
    let z = (key ^ worker).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^ (z >> 29)
}

/// A worker's rank for a key's home, from its rendezvous score and its slowness (its time per
/// token over the pool's median): `slowness × log2(u)`, `u` the score as a fraction of 2^64,
/// the logarithm of `u^slowness`. The highest is the home; each worker is home to a share of
/// keys in proportion to `1 / slowness` (weighted rendezvous hashing), and workers rated alike
/// keep the order of their scores. The logarithm is the score's exponent plus a quadratic in its
/// mantissa (within 0.008 of `log2`, and rising with the score): a few instructions a worker
/// where `powf` would take tens of nanoseconds, and the same on every replica.
#[inline(always)]
pub(super) fn home_rank(score: u64, slowness: f64) -> f64 {
    if score == 0 {
        return f64::NEG_INFINITY;
    }
    let zeros = score.leading_zeros();
    // The bits below the leading one, as a fraction in [0, 1).
    let mantissa = ((score << zeros) << 1 >> 11) as i64 as f64 * (1.0 / 9_007_199_254_740_992.0);
    let log2 = mantissa + 0.3466 * mantissa * (1.0 - mantissa) - f64::from(zeros) - 1.0;
    slowness * log2
}

#[derive(Clone, Copy)]
pub(super) struct Candidate {
    pub(super) index: usize,
    pub(super) cost: f64,
    pub(super) score: u64,
    pub(super) depth: usize,
}

impl Candidate {
    /// Lower cost first; equal costs go to the higher rendezvous score.
    pub(super) fn beats(&self, other: &Candidate) -> bool {
        self.cost < other.cost || (self.cost == other.cost && self.score > other.score)
    }
}

/// The queue's weights (`pending_weight`, `request_cost_tokens`, `context_weight`), copied out
/// of the params so the pass keeps them in registers.
#[derive(Clone, Copy)]
pub(super) struct QueueWeights {
    pub(super) pending: f64,
    pub(super) request: f64,
    pub(super) context: f64,
    /// [`crate::load::now_us`] of the decision, to price what remains of each worker's step
    /// (`step_phase`); 0 leaves it out.
    pub(super) now: u64,
    /// Take off the pending prefill what the step under way has done of its own (`step_prefill`).
    pub(super) step_prefill: bool,
    /// How much of the step remainder counts (`step_transient_only`); 1 otherwise.
    pub(super) step_share: f64,
}

impl QueueWeights {
    /// The work queued on `w`, in prompt tokens, given its requests in flight: this gateway's
    /// (`local`) and all of them by the last poll (`queued`, its peers' included).
    #[inline(always)]
    pub(super) fn cost(self, w: &Worker, local: usize, queued: usize, prompt: f64) -> f64 {
        // Counts go through `i64`: one instruction to a float on x86-64, where `u64` takes
        // several, and this runs for every worker of every decision (all are far below 2^63).
        let own_pending_tokens = w.load.pending_prefill();
        // What peer replicas said they have there counts as this gateway's own: their tokens
        // are known, not guessed (all 0 without peers).
        let (peer_pending, peer_context) = w.load.peer_tokens();
        let known = local + w.load.peer_inflight() as usize;
        let own = (w.load.context_tokens() + peer_context) as i64 as f64;
        let own_pending = (own_pending_tokens + peer_pending) as i64 as f64;
        let queued_f = queued as i64 as f64;
        // Tokens read per decode step on behalf of the queue, and prefill not started. Requests
        // nobody told of there (other replicas', other clients') are taken to be like the known
        // ones on average, or, with none known there, their prompts like this one (their prefill
        // then unknown). No division with one gateway.
        let (context, pending) = if queued == known {
            (own, own_pending)
        } else if known == 0 {
            (prompt * queued_f, own_pending)
        } else {
            let per_own = queued_f / known as i64 as f64;
            (own * per_own, own_pending * per_own)
        };
        // What remains of the step under way delays this request's prefill as much as prefill
        // queued in front of it would.
        let step = if self.now == 0 {
            0.0
        } else if self.step_prefill {
            w.steps
                .remaining_less_done(self.now, own_pending_tokens + peer_pending)
        } else {
            w.steps.remaining_tokens(self.now)
        };
        self.pending * (pending + self.step_share * step)
            + self.request * queued_f
            + self.context * context
    }
}

/// What one pass over the workers needs, fixed before it.
#[derive(Clone, Copy)]
pub(super) struct Pass<'a> {
    pub(super) workers: &'a [Arc<Worker>],
    pub(super) key: u64,
    pub(super) cap: usize,
    pub(super) holders: u64,
    pub(super) matches: &'a Matches,
    /// Prompt tokens of the leading blocks presumed on every worker
    /// ([`crate::index::Matches::everyone`]) per permille of the worker's trust.
    pub(super) everyone_held: f64,
    pub(super) full_price: f64,
    pub(super) prompt: f64,
    pub(super) miss: f64,
    pub(super) idle_credit: f64,
    pub(super) weights: QueueWeights,
    /// Each worker's cost is in its own time (`price_by_speed`).
    pub(super) by_speed: bool,
    /// Each worker is home to keys in proportion to its speed (`home_by_speed`); only where every
    /// worker is priced (up to [`PRICE_ALL_UP_TO`]): a larger pool's light pass
    /// ([`Pass::candidates`]) finds the home by the plain score, reading no worker's rating.
    pub(super) home_by_speed: bool,
}

/// What the pass found: the cheapest worker and the key's home.
pub(super) struct Priced {
    pub(super) best: Candidate,
    pub(super) home: Candidate,
}

pub(super) const NONE: usize = usize::MAX;

impl Pass<'_> {
    /// Prices the usable workers among `priced` (all of them, or [`Self::candidates`]). `EXACT`:
    /// some worker publishes events, so `held_by` is asked of every worker; `IDLE`: an idle worker
    /// holding nothing is credited `idle_credit`; `EVERYONE`: the prompt begins with blocks
    /// presumed on every worker (`everyone_held`).
    #[inline(always)]
    fn run<'w, const EXACT: bool, const IDLE: bool, const EVERYONE: bool>(
        &self,
        priced: impl Iterator<Item = (usize, &'w Arc<Worker>)>,
        held_by: &impl Fn(usize, &Worker, usize) -> f64,
    ) -> Priced {
        // Everything the loop reads besides the workers, in locals.
        let Pass {
            workers: _,
            key,
            cap,
            holders,
            matches,
            everyone_held,
            full_price,
            prompt,
            miss,
            idle_credit,
            weights,
            by_speed,
            home_by_speed,
        } = *self;
        let everyone = matches.everyone;
        let mut best = Candidate {
            index: NONE,
            cost: f64::INFINITY,
            score: 0,
            depth: 0,
        };
        let mut home = best;
        let mut home_top = f64::NEG_INFINITY;
        for (index, w) in priced {
            if !w.is_usable() {
                continue;
            }
            let local = w.inflight();
            let queued = w.load.queued(local);
            if queued >= cap {
                continue;
            }
            let mut cost = full_price + weights.cost(w, local, queued, prompt);
            let mut depth = 0;
            let mut held = 0.0;
            if holders & (1 << (w.id_hash & 63)) != 0 {
                depth = matches.depth_of(w.id_hash);
                if depth > everyone {
                    held = held_by(index, w, depth);
                }
            }
            if (EVERYONE || EXACT) && everyone > 0 && depth <= everyone {
                depth = everyone;
                held = everyone_held * f64::from(w.load.cache_trust_permille());
            }
            if EXACT {
                held = held_by(index, w, depth);
            }
            cost -= miss * held;
            // An idle worker holding none of a hot prefix while the others are busy: the copy is
            // shared by the requests that follow it there (see `amortize_hot_copies`).
            if IDLE && held == 0.0 && queued == 0 {
                cost -= idle_credit;
            }
            // Read once for the cost and the home (`home_by_speed` comes with `by_speed`).
            let slowness = if by_speed { w.steps.slowness() } else { 1.0 };
            cost *= slowness;
            let score = mix(key, w.id_hash);
            let c = Candidate {
                index,
                cost,
                score,
                depth,
            };
            if c.beats(&best) {
                best = c;
            }
            let (rank, higher) = if home_by_speed {
                let rank = home_rank(score, slowness);
                (rank, rank > home_top)
            } else {
                (0.0, score > home.score)
            };
            if home.index == NONE || higher {
                (home, home_top) = (c, rank);
            }
        }
        Priced { best, home }
    }

    /// [`Self::run`] compiled for what is known before it (see [`CacheAware::decide`]).
    pub(super) fn price<'w>(
        &self,
        priced: impl Iterator<Item = (usize, &'w Arc<Worker>)>,
        (exact, idle, everyone): (bool, bool, bool),
        held_by: &impl Fn(usize, &Worker, usize) -> f64,
    ) -> Priced {
        // With blocks presumed on every worker, no worker holds none of the prompt: no idle credit.
        match (exact, idle, everyone) {
            (false, _, true) => self.run::<false, false, true>(priced, held_by),
            (false, false, false) => self.run::<false, false, false>(priced, held_by),
            (false, true, false) => self.run::<false, true, false>(priced, held_by),
            (true, false, _) => self.run::<true, false, false>(priced, held_by),
            (true, true, _) => self.run::<true, true, false>(priced, held_by),
        }
    }

    /// The workers a decision prices in a pool of more than [`PRICE_ALL_UP_TO`]: every worker
    /// the index lists as holding more of the prompt than the blocks presumed on all, the key's
    /// home (the usable worker with the highest score), and [`SAMPLED`] others evenly spread
    /// from an offset that `turn` rotates, so that every worker is among them once in
    /// `workers / SAMPLED` decisions. Finding the first two is one light pass (a hash and a
    /// compare per worker); pricing a worker reads its load and costs several times that.
    ///
    /// Not inlined, and nothing in the scan calls out, so its state stays in registers (inlined
    /// into `decide`, it spilled to the stack): the workers whose bit is among `holders` are noted
    /// in a buffer and looked up after it, and usability is read only for the winner.
    #[inline(never)]
    pub(super) fn candidates(&self, turn: usize) -> Vec<usize> {
        let Pass {
            workers,
            key,
            holders,
            matches,
            ..
        } = *self;
        let stride = workers.len().div_ceil(SAMPLED);
        let mut priced = Vec::with_capacity(SAMPLED + matches.depths.len() + 1);
        priced.extend((turn % stride..workers.len()).step_by(stride));
        let mut noted = [0u32; NOTED];
        let mut hits = 0;
        let (mut home, mut top) = (NONE, 0);
        for (index, w) in workers.iter().enumerate() {
            let id = w.id_hash;
            let score = mix(key, id);
            if score > top {
                (home, top) = (index, score);
            }
            if holders & (1 << (id & 63)) != 0 {
                noted[hits % NOTED] = index as u32;
                hits += 1;
            }
        }
        let holds =
            |id: u64| holders & (1 << (id & 63)) != 0 && matches.depth_of(id) > matches.everyone;
        if hits <= NOTED {
            for &index in &noted[..hits] {
                if holds(workers[index as usize].id_hash) {
                    priced.push(index as usize);
                }
            }
        } else {
            let held = workers.iter().enumerate().filter(|(_, w)| holds(w.id_hash));
            priced.extend(held.map(|(index, _)| index));
        }
        // The highest score is out of routing (down, draining, ejected): seldom, so only then is
        // every worker's usability read.
        if home == NONE || !workers[home].is_usable() {
            // The first of the highest, as the pricing pass breaks ties.
            home = workers
                .iter()
                .enumerate()
                .filter(|(_, w)| w.is_usable())
                .min_by_key(|(_, w)| std::cmp::Reverse(mix(key, w.id_hash)))
                .map_or(NONE, |(index, _)| index);
        }
        if home != NONE {
            priced.push(home);
        }
        priced
    }
}

/// Pools up to this size have every usable worker priced by each decision.
pub(super) const PRICE_ALL_UP_TO: usize = 128;
/// Workers whose bit is among a large pool's holders that the light pass notes to look up after
/// it ([`Pass::candidates`]); past this many it searches the pool again. Eight holders set at most
/// 8 of the 64 bits: about 128 workers of 1,024.
pub(super) const NOTED: usize = 256;
/// Workers priced for load in a larger pool, besides the prompt's holders and its home; also the
/// sample the pool's mean load is read from ([`PoolLoad::sampled`]).
pub(super) const SAMPLED: usize = 64;
