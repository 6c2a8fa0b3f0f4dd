//! `cache_aware`: each request goes to the worker where it is estimated to cost least, counting
//! both the prefill of what that worker does not hold of the prompt and the work queued on it.
//!
//! Algorithm. The prefix index ([`crate::index`]) gives, per worker, how many leading blocks of
//! the prompt it was recently sent (blocks end at message ends too, so a conversation's earlier
//! turns are whole blocks of its later ones). For each usable worker `w`, in prompt tokens:
//!
//! `cost(w) = miss_weight × (prompt − trust(w) × held(w)) + pending_weight × pending_prefill(w)
//!           + (request_cost + context_weight × context(w)) × queued(w)`
//!
//! where `held` is the matched prefix, `trust` the share of predicted cached tokens the worker
//! has been confirming (its `usage.prompt_tokens_details.cached_tokens`), `pending_prefill` the
//! uncached prompt tokens this gateway sent it that it has not started answering, `context` the
//! mean prompt tokens of this gateway's requests in flight there (each decode step reads their KV
//! cache, so a long conversation queued costs more than a short question), and `queued` this
//! gateway's live in-flight count plus what the worker's own running + waiting showed beyond it
//! at the last poll ([`crate::load::Load::queued`]). Bytes
//! become tokens at the ratio the workers' `usage` reports teach (start: `bytes_per_token`).
//!
//! The request's rendezvous home (highest `mix(key, worker)`, where `key` is the hash of the
//! first block past the part of the prompt that most workers hold, with `shared_home`:
//! past a shared system prompt, so the same for every turn of a conversation on every replica)
//! is credited `home_affinity` × the tokens no worker is known to hold, and breaks ties.
//! Replicas that have not seen a conversation thus agree on where its unknown part most likely
//! is, and a new prefix starts on one worker, not on all. With `reuse_affinity` set, a request
//! that continues a prefix one worker holds and no other recent request went through (a
//! conversation's next turn) is credited that share of the part instead: the turns after it
//! carry it too, so at 1 a conversation that load placed away from its home settles there once
//! its history elsewhere is worth less than its new text.
//!
//! Except for a request known no further than a prefix most workers hold (a new question under a
//! shared system prompt; any request of a prefix hot enough to be everywhere): every holder
//! would prefill the same for it, and its time to first token depends on the prefill already
//! sent to a worker and not started, since vLLM runs all prefills scheduled in a step before any
//! of them answers. A hash would put such simultaneous arrivals together at random, so for them
//! the home gets no credit and pending prefill weighs `hot_pending_weight` more. Only as far as
//! this gateway sees the pool's traffic: with other replicas' share `f`, both fade back to the
//! home's credit by `max(0, 1 - 2f)`, since the home is what replicas agree on. When every worker
//! publishes KV events they do not fade: the events show every replica where the others' requests
//! went.
//!
//! Several replicas sharing nothing each know only the turns they routed. Once one of them sends
//! a turn elsewhere for load, it would follow that copy while the others keep to the home, and
//! the conversation would bounce between two workers, each missing the other's turns. So when the
//! workers' polled load shows requests beyond this gateway's own (a share `f` of the pool's), the
//! home is presumed to hold, besides what it is known to, `min(1, 2f)` of the rest of what any
//! worker is known to hold: the other replicas send the conversation there. For the same reason
//! the home's credit for the part no worker is known to hold rises from `home_affinity` (or
//! `reuse_affinity`) by `min(1, 2f)` of the rest: the turns this replica has not seen went there.
//! Not for a prompt of which nothing at all is known, which is as likely new: placed by its hash
//! alone, new prompts would queue by chance. A lone gateway sees `f = 0` and follows what it
//! knows. With `new_prompt_by_reuse`, even the half credit of such a prompt fades once fewer
//! than half of recent prompts start with something known (by `min(1, 2 × share)`): where
//! nothing is ever reused, the hash would place prompts at random and long ones would pile up.
//! It comes back by `min(1, 2f)`, because other replicas' conversations reach this one with
//! nothing known.
//!
//! What follows from the cost: a conversation stays with its deepest blocks until the load gap
//! exceeds what moving would cost in prefill; a prefix shared by everyone (a system prompt)
//! starts on its home and is copied to another worker whenever the home's queue exceeds the
//! prefix's prefill (hot prefixes replicate; each conversation still sticks by its deeper
//! blocks); and simultaneous arrivals do not herd, because each choice adds its prefill and
//! its request to the chosen worker's accounting before the next choice reads it.
//!
//! A copy is an investment: once a worker holds a prefix, every later request that shares it
//! saves that prefill there. Priced against one request's wait, a copy of a prefix everyone
//! shares is never worth it to a cold worker, and that worker can stay idle for good: with the
//! others splitting the load, or at light load with one worker taking everything (a request
//! there waits behind a dozen others, 64-odd tokens each, against a 1,024-token system prompt
//! weighed three times). What that leaves out is that the copy is paid once and the worker it
//! adds serves its share of every later request: its decode steps are not shared with the
//! others', and the prefills of the requests it takes stall nobody else. So to an idle worker
//! that holds none of the prompt, the hot part of the prompt is priced as held while the mean in
//! flight is over 1 (`amortize_hot_copies`). Hot: at least two workers hold it, or one of the
//! last `n` requests (`n` workers) went through it, a sample that catches a prefix drawing about
//! a worker's share of the traffic or more ([`crate::index::Matches::recent`]). A conversation's
//! own earlier turns are hot by that sample only when there are about `n` conversations or
//! fewer, and then, one request each at a time, the mean is at most 1: a conversation stays
//! where its history is. Only idle
//! workers: the same discount for any worker below the mean made copies where loads were merely
//! uneven and cost p95 TTFT on three of five bench workloads (see `docs/measurements.md`).
//! With `load_bound` set, a worker at or over that many times the mean load is also left out
//! first (bounded loads).
//!
//! Outcomes: `longest_match` (the chosen worker holds the longest known prefix), `hash_home` (no
//! worker holds any of it; the home took it), `replicated` (someone holds it, the chosen worker
//! held none of it), `spilled` (a worker holding less than the longest, or not the home, for
//! load), `fallback` (no routing key). Learning ([`Policy::observe`]): a request that failed
//! takes back what it added to the index; an answer's usage updates bytes per token and the
//! worker's trust.
//!
//! Cost: one index walk and one index write per request (one mutex each), plus pricing the
//! workers from relaxed atomics. A pool of up to [`PRICE_ALL_UP_TO`] workers is priced whole. A
//! larger one is priced on a sample: the workers the index lists as holding more of the prompt
//! than everyone, the home (found by one light pass of a hash and a compare per worker), and
//! [`SAMPLED`] others evenly spread from an offset that rotates with each decision. So a
//! conversation still finds its holder and a new prompt its home on every replica, and a spill
//! for load takes the least loaded of the sample rather than of the pool (the power of many
//! choices: the least loaded of 64 workers picked without regard to load is, on average, among
//! the lightest 1/65). Not with KV events, whose per-worker blocks are read for every worker
//! anyway, nor with `load_bound`. Parameters: see [`CacheAwareParams`].

use std::sync::{
    atomic::{AtomicU64, AtomicUsize, Ordering},
    Arc,
};

use super::{Observed, Outcome, Policy, Prediction, Selection};
use crate::{
    config::CacheAwareParams,
    index::{IndexStats, PrefixIndex},
    kv_events::BlockChains,
    routing_key::RequestInfo,
    workers::Worker,
};

pub struct CacheAware {
    params: CacheAwareParams,
    index: PrefixIndex,
    /// Learnt canonical bytes per token, as `f64` bits.
    bytes_per_token: AtomicU64,
    /// Answers it was learnt from.
    learnt_from: AtomicU64,
    tie_break: AtomicUsize,
    /// The moving share of recent prompts whose first block some worker was known to hold, as
    /// `f64` bits (`new_prompt_by_reuse`); starts at 1.
    reuse: AtomicU64,
}

/// Requests the reuse share averages over, about.
const REUSE_WINDOW: f64 = 64.0;

/// A rendezvous score of the key for the worker. Both are xxh3 outputs, so their xor is already
/// uniform; one odd multiply and a fold decorrelate neighbouring keys, at a nanosecond per worker.
fn mix(key: u64, worker: u64) -> u64 {
    let z = (key ^ worker).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^ (z >> 29)
}

/// The usable workers among some of the pool's, and their requests in flight: this gateway's
/// (`local`) and in all by the last poll (`queued`, other replicas' included).
#[derive(Clone, Copy, Default)]
struct PoolLoad {
    usable: usize,
    local: usize,
    queued: usize,
}

impl PoolLoad {
    fn of<'a>(workers: impl Iterator<Item = &'a Arc<Worker>>) -> Self {
        workers
            .filter(|w| w.is_usable())
            .fold(Self::default(), |sum, w| {
                let local = w.inflight();
                Self {
                    usable: sum.usable + 1,
                    local: sum.local + local,
                    queued: sum.queued + w.load.queued(local),
                }
            })
    }

    /// At most [`SAMPLED`] of `workers`, evenly spread (all of them in a pool of up to that
    /// many): what a decision needs of the whole pool's load (its mean, other replicas' share) is
    /// an average, and a full sum is about 1.3 us of a decision at 1,024 workers (criterion).
    fn sampled(workers: &[Arc<Worker>]) -> Self {
        Self::of(
            workers
                .iter()
                .step_by(workers.len().div_ceil(SAMPLED).max(1)),
        )
    }

    /// The mean requests in flight per usable worker.
    fn mean(self) -> f64 {
        if self.usable == 0 {
            0.0
        } else {
            self.queued as f64 / self.usable as f64
        }
    }

    /// The share of the requests in flight that are not this gateway's (other replicas'), in
    /// [0, 1].
    fn foreign_share(self) -> f64 {
        if self.queued > self.local {
            (self.queued - self.local) as f64 / self.queued as f64
        } else {
            0.0
        }
    }
}

/// The `k`-th largest value (the largest that at least `k` hold), 0 with fewer than `k`.
fn kth_largest(values: impl Iterator<Item = u64>, k: usize) -> u64 {
    let mut values: Vec<u64> = values.collect();
    if k == 0 || values.len() < k {
        return 0;
    }
    let (_, kth, _) = values.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    *kth
}

/// The second largest value (the largest that at least two hold), 0 with fewer than two.
fn second_largest(values: impl Iterator<Item = u64>) -> u64 {
    let (mut first, mut second) = (0, 0);
    for v in values {
        if v > first {
            (first, second) = (v, first);
        } else if v > second {
            second = v;
        }
    }
    second
}

#[derive(Clone, Copy)]
struct Candidate {
    index: usize,
    cost: f64,
    score: u64,
    depth: usize,
}

impl Candidate {
    /// Lower cost first; equal costs go to the higher rendezvous score.
    fn beats(&self, other: &Candidate) -> bool {
        self.cost < other.cost || (self.cost == other.cost && self.score > other.score)
    }
}

/// The weights of [`CacheAware::queue_cost`], copied out so the pass keeps them in registers.
#[derive(Clone, Copy)]
struct QueueWeights {
    pending: f64,
    request: f64,
    context: f64,
}

impl QueueWeights {
    #[inline(always)]
    fn cost(self, w: &Worker, local: usize, queued: usize, prompt: f64) -> f64 {
        // Counts go through `i64`: one instruction to a float on x86-64, where `u64` takes
        // several, and this runs for every worker of every decision (all are far below 2^63).
        let own = w.load.context_tokens() as i64 as f64;
        let own_pending = w.load.pending_prefill() as i64 as f64;
        let queued_f = queued as i64 as f64;
        // Tokens read per decode step on behalf of the queue, and prefill not started. Other
        // replicas' requests there are taken to be like this gateway's on average, or, with none
        // of its own there, their prompts like this one (their prefill then unknown). No division
        // with one gateway.
        let (context, pending) = if queued == local {
            (own, own_pending)
        } else if local == 0 {
            (prompt * queued_f, own_pending)
        } else {
            let per_own = queued_f / local as i64 as f64;
            (own * per_own, own_pending * per_own)
        };
        self.pending * pending + self.request * queued_f + self.context * context
    }
}

/// What one pass over the workers needs, fixed before it.
#[derive(Clone, Copy)]
struct Pass<'a> {
    workers: &'a [Arc<Worker>],
    key: u64,
    cap: usize,
    holders: u64,
    matches: &'a crate::index::Matches,
    /// Prompt tokens of the leading blocks presumed on every worker
    /// ([`crate::index::Matches::everyone`]) per permille of the worker's trust.
    everyone_held: f64,
    full_price: f64,
    prompt: f64,
    miss: f64,
    idle_credit: f64,
    weights: QueueWeights,
}

/// What the pass found: the cheapest worker and the key's home.
struct Priced {
    best: Candidate,
    home: Candidate,
}

const NONE: usize = usize::MAX;

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
        } = *self;
        let everyone = matches.everyone;
        let mut best = Candidate {
            index: NONE,
            cost: f64::INFINITY,
            score: 0,
            depth: 0,
        };
        let mut home = best;
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
            if home.index == NONE || score > home.score {
                home = c;
            }
        }
        Priced { best, home }
    }

    /// [`Self::run`] compiled for what is known before it (see [`CacheAware::decide`]).
    fn price<'w>(
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
    fn candidates(&self, turn: usize) -> Vec<usize> {
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
pub const PRICE_ALL_UP_TO: usize = 128;
/// Workers whose bit is among a large pool's holders that the light pass notes to look up after
/// it ([`Pass::candidates`]); past this many it searches the pool again. Eight holders set at most
/// 8 of the 64 bits: about 128 workers of 1,024.
const NOTED: usize = 256;
/// Workers priced for load in a larger pool, besides the prompt's holders and its home; also the
/// sample the pool's mean load is read from ([`PoolLoad::sampled`]).
pub const SAMPLED: usize = 64;

impl CacheAware {
    pub fn new(params: CacheAwareParams) -> Self {
        Self {
            index: PrefixIndex::with_max_bytes(params.index_max_bytes),
            bytes_per_token: AtomicU64::new(params.bytes_per_token.to_bits()),
            learnt_from: AtomicU64::new(0),
            tie_break: AtomicUsize::new(0),
            reuse: AtomicU64::new(1f64.to_bits()),
            params,
        }
    }

    /// The moving share of recent prompts that started with something known (see `reuse`).
    fn reuse_share_now(&self) -> f64 {
        f64::from_bits(self.reuse.load(Ordering::Relaxed))
    }

    /// Counts one more prompt into the reuse share. A plain load and store: two decisions at
    /// once may lose one sample of a moving average, which is cheaper than a retry loop. No
    /// store when the share does not move (at 1, where every prompt starts with something
    /// known), so such traffic does not bounce the cache line every decision reads.
    fn count_reuse(&self, known: bool) {
        let share = self.reuse_share_now();
        let sample = if known { 1.0 } else { 0.0 };
        let next = share + (sample - share) / REUSE_WINDOW;
        if next != share {
            self.reuse.store(next.to_bits(), Ordering::Relaxed);
        }
    }

    fn bytes_per_token(&self) -> f64 {
        f64::from_bits(self.bytes_per_token.load(Ordering::Relaxed))
    }

    /// The work queued on `w`, in prompt tokens: the one definition both paths price with. Each
    /// queued request costs `request_cost_tokens` plus `context_weight` per token of its prompt,
    /// and the prefill not yet started costs `pending_weight` per token; requests the worker has
    /// beyond this gateway's (another replica's) are taken to be like this gateway's there on
    /// average (in context and in prefill pending), or, for context, like `prompt` (the request
    /// being placed) when this gateway has none there.
    #[inline]
    fn queue_cost(&self, w: &Worker, prompt: f64) -> f64 {
        let local = w.inflight();
        self.queue_cost_at(w, local, w.load.queued(local), prompt)
    }

    /// [`Self::queue_cost`] with the worker's in-flight counts already read.
    #[inline]
    fn queue_cost_at(&self, w: &Worker, local: usize, queued: usize, prompt: f64) -> f64 {
        self.queue_weights().cost(w, local, queued, prompt)
    }

    fn queue_weights(&self) -> QueueWeights {
        QueueWeights {
            pending: self.params.pending_weight,
            request: self.params.request_cost_tokens,
            context: self.params.context_weight,
        }
    }

    /// The fewest requests in flight at which a worker is passed over (`load_bound`; see
    /// [`CacheAwareParams`]): the bound times the mean over usable workers, counting the new
    /// request, rounded up. Some usable worker is always under it, since the bound is at least 1.
    fn load_cap(&self, load: PoolLoad) -> usize {
        let bound = self.params.load_bound;
        if bound <= 0.0 || load.usable == 0 {
            return usize::MAX;
        }
        (bound * (load.queued + 1) as f64 / load.usable as f64).ceil() as usize
    }

    /// No key: the usable worker with the least work queued, ties rotating.
    fn least_work(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection> {
        let prompt = req.prompt_bytes as f64 / self.bytes_per_token();
        let n = workers.len();
        let start = self.tie_break.fetch_add(1, Ordering::Relaxed) % n.max(1);
        (0..n)
            .map(|k| (start + k) % n)
            .filter(|&i| workers[i].is_usable())
            .map(|i| (self.queue_cost(&workers[i], prompt), i))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, i)| Selection::new(i, Outcome::Fallback))
    }

    /// The choice for `req` and what it expects there, and whether any worker was known to hold
    /// the start of the prompt; changes no routing state.
    fn decide(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<(Selection, bool)> {
        let Some(&last) = req.block_hashes.last() else {
            return self.least_work(workers, req).map(|s| (s, false));
        };
        // A prefix one of the last `workers` requests went through counts as hot below; only
        // the idle credit and `reuse_affinity` ask (a window of 0 makes the walk skip the sample).
        let window = if self.params.amortize_hot_copies || self.params.reuse_affinity.is_some() {
            u32::try_from(workers.len()).unwrap_or(u32::MAX)
        } else {
            0
        };
        let matches = self.index.matches(&req.block_hashes, window);
        let deepest = matches.deepest();
        let bpt = self.bytes_per_token();
        let prompt = match &req.tokens {
            Some(t) => t.len() as f64 + f64::from(req.tokens_after),
            None => req.prompt_bytes as f64 / bpt,
        };
        // What each worker's own events say it holds, in tokens, when the request was tokenized.
        let mut chains = BlockChains::new(req.tokens.as_deref().unwrap_or_default());
        let exacts: Vec<Option<u64>> = match req.tokens {
            Some(_) => workers
                .iter()
                .map(|w| {
                    let h = chains.held_by(w)?;
                    Some(h.blocks as u64 * u64::from(h.block_size))
                })
                .collect(),
            None => Vec::new(),
        };
        let mut unknown = (req.prompt_bytes - req.bytes_at_depth(deepest)) as f64 / bpt;
        // Blocks of the prompt that at least two workers hold, by this gateway's index.
        let shared_depth = if self.params.shared_home || self.params.amortize_hot_copies {
            (second_largest(matches.depths.iter().map(|&(_, d)| d as u64)) as usize)
                .max(matches.everyone)
        } else {
            0
        };
        // The home's key: past the part of the prompt that most workers hold (a system prompt
        // everyone shares), not merely two: a conversation that one spill put on a second worker
        // must keep its key, or its home would move with what each replica happens to know.
        // A block records its last `HOLDERS` holders, so in a larger pool a prefix on all of them
        // is as widely held as the index can tell.
        let most = (workers.len() / 2 + 1).clamp(2, crate::index::HOLDERS);
        let key_depth = if !self.params.shared_home {
            deepest
        } else if matches.depths.len() < most {
            0 // too few holders: no need to collect their depths
        } else {
            (kth_largest(matches.depths.iter().map(|&(_, d)| d as u64), most) as usize)
                .max(matches.everyone)
        };
        let mut key = req.block_hashes.get(key_depth).copied().unwrap_or(last);
        // When every usable worker publishes events, the part no worker holds and the home's key
        // come from them too: every replica reads the same events, so every replica then agrees
        // on the home, whatever each has routed itself.
        let all_exact = !exacts.is_empty()
            && workers
                .iter()
                .zip(&exacts)
                .all(|(w, e)| e.is_some() || !w.is_usable());
        // The most of the prompt any worker's events hold, in tokens (0 without events).
        let exact_deepest = exacts.iter().flatten().copied().max().unwrap_or(0);
        if all_exact {
            if let Some((size, chain)) = chains.first().filter(|(_, c)| !c.is_empty()) {
                unknown = (prompt - exact_deepest as f64).max(0.0);
                let past = (exact_deepest / u64::from(size)) as usize;
                key = chain[past.min(chain.len() - 1)];
            }
        }

        // One bit per holder (by the low bits of its id): most workers hold nothing, and this
        // answers that without searching the holders. Only holders of more than the blocks
        // presumed on every worker: the pass prices the others at those blocks without asking,
        // and a full holder list would otherwise send an eighth of the workers down the search
        // at random (a mispredicted branch each; 6.2 against 5.5 us a decision at 1,024 workers).
        let holders = matches
            .depths
            .iter()
            .filter(|&&(_, d)| d > matches.everyone)
            .fold(0u64, |m, &(id, _)| m | 1 << (id & 63));
        // Each usable worker priced (all of them up to `PRICE_ALL_UP_TO`) is the decision's cost at
        // scale, so the pass keeps its state in registers: no Option, constants hoisted, the index
        // consulted only for workers whose bit says they may hold something.
        let miss = self.params.miss_weight;
        let full_price = miss * prompt;
        // Prompt tokens a worker is priced as holding: what its own events say, which beats what
        // this gateway has routed there (the index's match, times the worker's trust). Kept out
        // of `Candidate`, which the pass copies per worker, and recomputed for the two it keeps.
        let any_exact = exacts.iter().any(Option::is_some);
        let held_by = |index: usize, w: &Worker, depth: usize| -> f64 {
            match exacts.get(index).copied().flatten() {
                Some(held) => held as f64,
                None if depth > 0 => req.bytes_at_depth(depth) as f64 / bpt * w.load.cache_trust(),
                None => 0.0,
            }
        };
        // The hot part of the prompt: what at least two workers hold, or what one of the last
        // `workers` requests went through (about a worker's share of the traffic or more), which
        // the one worker holding it cannot keep to itself without leaving others idle.
        let hot = if self.params.amortize_hot_copies {
            let by_events = second_largest(exacts.iter().flatten().copied());
            let depth = shared_depth.max(matches.recent);
            (req.bytes_at_depth(depth) as f64 / bpt).max(by_events as f64)
        } else {
            0.0
        };
        // Usable workers and their requests in flight, for bounded loads.
        let cap = if self.params.load_bound > 0.0 {
            self.load_cap(PoolLoad::of(workers.iter()))
        } else {
            usize::MAX
        };
        // The pool's load from a sample: the mean that an idle worker short of the hot prefix is
        // measured against, read when the prefix is hot.
        let sampled = (hot > 0.0).then(|| PoolLoad::sampled(workers));
        // The pass is compiled once for each combination of what is known before it (any events
        // at all; an idle worker's credit for a hot prefix), so the common pool, which has
        // neither, runs no per-worker code for them: this loop is the decision's cost at scale.
        let idle_credit = if sampled.is_some_and(|l| l.mean() > 1.0) {
            miss * hot
        } else {
            0.0
        };
        // How far other replicas decide where this prompt goes: `min(1, 2f)` for their share `f`
        // of the requests in flight. From the same sample, taken now if it was not above, at most
        // once, and only for the prompts that need it, rather than in the pass: two more running
        // sums there cost every decision about 0.3 us at 1,024 workers (criterion).
        let others = std::cell::OnceCell::new();
        let others = || {
            *others.get_or_init(|| {
                let load = sampled.unwrap_or_else(|| PoolLoad::sampled(workers));
                (2.0 * load.foreign_share()).min(1.0)
            })
        };
        // Nothing is known past a prefix most workers hold: spread by pending prefill, not by the
        // home's hash, as far as this gateway decides alone (`hot_pending_weight`).
        // On events, replicas need no home to agree on: each sees where the others' requests
        // went, so the spread holds whatever their share of the traffic.
        let alone = if self.params.hot_pending_weight <= 0.0 || !self.params.shared_home {
            0.0
        } else if all_exact {
            let holding = exacts.iter().flatten().filter(|&&e| e == exact_deepest);
            if exact_deepest > 0 && holding.count() >= most {
                1.0
            } else {
                0.0
            }
        } else if key_depth > 0 && key_depth == deepest {
            1.0 - others()
        } else {
            0.0
        };
        let mut weights = self.queue_weights();
        weights.pending += self.params.hot_pending_weight * alone;
        let pass = Pass {
            workers,
            key,
            cap,
            holders,
            matches: &matches,
            everyone_held: req.bytes_at_depth(matches.everyone) as f64 / bpt / 1000.0,
            full_price,
            prompt,
            miss,
            idle_credit,
            weights,
        };
        let known = (any_exact, idle_credit > 0.0, matches.everyone > 0);
        // A large pool is priced on a sample for load (`candidates`), which keeps every worker
        // that may hold more of the prompt and the home, so the choice differs from pricing all
        // only where a sampled worker's queue stands in for the least loaded one's. Not with
        // events (every worker's own blocks are already read) nor with a load bound (the home
        // must be under it, which the light pass does not read).
        let sampled =
            (workers.len() > PRICE_ALL_UP_TO && !any_exact && cap == usize::MAX).then(|| {
                let turn = self.tie_break.fetch_add(1, Ordering::Relaxed);
                let priced = pass.candidates(turn);
                pass.price(priced.iter().map(|&i| (i, &workers[i])), known, &held_by)
            });
        let Priced { best, home } = match sampled {
            Some(priced) if priced.best.index != NONE => priced,
            // None usable among them (the home was ejected since the light pass): price all.
            _ => pass.price(workers.iter().enumerate(), known, &held_by),
        };
        if best.index == NONE {
            return None;
        }
        let mut chosen = best;
        // Other replicas send this prompt's conversation to its home too: presume the home holds
        // what it is known to, plus the gap to what any worker is known to hold in proportion to
        // the share of the pool's requests this gateway does not see (`shared_home`). Events are
        // everyone's knowledge already, so not with them. The part no worker is known to hold is
        // credited to the home by `home_affinity`, and by more of it as other replicas' share
        // grows: they send the turns this gateway has not seen there. By `reuse_affinity` for a
        // request that continues a prefix one worker holds and no other recent request went
        // through (a conversation's next turn): the turns after it carry its new part too. A
        // question on a shared document is not followed by its own text.
        let h = match self.params.reuse_affinity {
            Some(r) if self.params.shared_home && deepest > shared_depth.max(matches.recent) => r,
            _ => self.params.home_affinity,
        };
        // A prompt of which no worker is known to hold anything, not even a shared prefix, is as
        // likely new as another replica's (a conversation's turns carry its system prompt or its
        // own earlier turns): it keeps `home_affinity`, or replicas would place every new prompt
        // by its hash alone.
        let replicas_matter = self.params.shared_home
            && !all_exact
            && deepest > 0
            && (home.depth < deepest || unknown > 0.0);
        // A prompt of which nothing at all is known, where fewer than half of this gateway's
        // prompts start with anything known, is as likely never to come back: its credit fades
        // by `min(1, 2 × share)`, except as far as other replicas' unseen traffic may send it home
        // (`new_prompt_by_reuse`). The other replicas' share is sampled only when the credit
        // fades. Meant to leave traffic whose prompts mostly continue something (a conversation's
        // first turn is new, its later ones are not) alone: it does where clients pause between
        // requests or arrive in open loop, not always in a closed loop without pauses, whose
        // clients fall into step (see `docs/measurements.md`, "Clients that think").
        let known_any = deepest > 0 || exact_deepest > 0;
        let gate = if self.params.new_prompt_by_reuse && !known_any {
            (2.0 * self.reuse_share_now()).min(1.0)
        } else {
            1.0
        };
        let h = if gate < 1.0 {
            h * (gate + (1.0 - gate) * others())
        } else {
            h
        };
        let (presumed, affinity) = if replicas_matter {
            let others = others();
            let presumed = if home.depth < deepest {
                let known = req.bytes_at_depth(deepest) as f64 / bpt;
                let home_held = held_by(home.index, &workers[home.index], home.depth);
                others * (known - home_held).max(0.0)
            } else {
                0.0
            };
            (presumed, h + (1.0 - h) * others)
        } else {
            (0.0, h)
        };
        let credited = Candidate {
            cost: home.cost
                - (1.0 - alone) * self.params.miss_weight * (affinity * unknown + presumed),
            ..home
        };
        if credited.beats(&chosen) {
            chosen = home;
        }

        let exact = exacts.get(chosen.index).copied().flatten();
        let outcome = match (deepest, chosen.depth) {
            _ if exact.is_some_and(|t| t > 0) => Outcome::ExactMatch,
            (0, _) if chosen.index == home.index => Outcome::HashHome,
            (d, c) if c < d && presumed > 0.0 && chosen.index == home.index => Outcome::HashHome,
            (0, _) => Outcome::Spilled,
            (d, c) if c == d => Outcome::LongestMatch,
            (_, 0) => Outcome::Replicated,
            _ => Outcome::Spilled,
        };
        let prediction = Prediction {
            prompt_tokens: prompt.round() as u32,
            cached_tokens: match exact {
                Some(held) => held.min(u64::from(u32::MAX)) as u32,
                None => (req.bytes_at_depth(chosen.depth) as f64 / bpt).round() as u32,
            },
            matched_blocks: chosen.depth as u32,
        };
        let selection = Selection {
            index: chosen.index,
            outcome,
            prediction: Some(prediction),
        };
        Some((selection, known_any))
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn select(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection> {
        let (selection, known) = self.decide(workers, req)?;
        if self.params.new_prompt_by_reuse && selection.prediction.is_some() {
            self.count_reuse(known);
        }
        let Some(prediction) = selection.prediction else {
            return Some(selection); // no key: nothing to learn
        };
        let worker = &workers[selection.index];
        self.index.insert(&req.block_hashes, worker.id_hash);
        tracing::debug!(
            policy = "cache_aware",
            outcome = selection.outcome.as_str(),
            worker = %worker.name,
            matched_blocks = prediction.matched_blocks,
            predicted_cached_tokens = prediction.cached_tokens,
            prompt_tokens = prediction.prompt_tokens,
            "routing decision"
        );
        Some(selection)
    }

    fn peek(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection> {
        self.decide(workers, req).map(|(selection, _)| selection)
    }

    fn learns(&self) -> bool {
        true
    }

    fn index_stats(&self) -> Option<IndexStats> {
        Some(self.index.stats())
    }

    fn reuse_share(&self) -> Option<f64> {
        self.params
            .new_prompt_by_reuse
            .then(|| self.reuse_share_now())
    }

    fn observe(&self, worker: &Worker, req: &RequestInfo, selection: &Selection, result: Observed) {
        let Some(predicted) = selection.prediction else {
            return;
        };
        let usage = match result {
            Observed::Failed => {
                // The worker never took this prompt: take back the blocks this request added.
                let from = (predicted.matched_blocks as usize).min(req.block_hashes.len());
                self.index.remove(&req.block_hashes[from..], worker.id_hash);
                return;
            }
            Observed::Answered(None) => return,
            Observed::Answered(Some(u)) => u,
        };
        if usage.prompt_tokens > 0 && req.prompt_bytes > 0 {
            let seen = req.prompt_bytes as f64 / usage.prompt_tokens as f64;
            // The mean of the first twenty answers, then a moving average over about twenty.
            let n = self.learnt_from.fetch_add(1, Ordering::Relaxed) as f64;
            let alpha = (1.0 / (n + 1.0)).max(0.05);
            let next = (1.0 - alpha) * self.bytes_per_token() + alpha * seen;
            self.bytes_per_token
                .store(next.to_bits(), Ordering::Relaxed);
        }
        if let Some(cached) = usage.cached_tokens {
            if predicted.cached_tokens > 0 {
                worker
                    .load
                    .learn_cache_trust(cached as f64 / f64::from(predicted.cached_tokens));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{policy::Usage, workers::test_workers};

    fn policy() -> CacheAware {
        CacheAware::new(CacheAwareParams::default())
    }

    /// Weights 1 and 64 tokens per queued request whatever its context, so the arithmetic in
    /// the comments is plain tokens.
    fn unit() -> CacheAware {
        CacheAware::new(CacheAwareParams {
            miss_weight: 1.0,
            pending_weight: 1.0,
            request_cost_tokens: 64.0,
            context_weight: 0.0,
            ..CacheAwareParams::default()
        })
    }

    /// A request in flight on `w` as the proxy accounts it: its slot, `pending` uncached tokens
    /// until it answers and a `context`-token prompt until it ends.
    fn hold(
        w: &Arc<Worker>,
        pending: u64,
        context: u64,
    ) -> (crate::workers::InflightGuard, crate::load::RequestLoad) {
        (
            w.acquire(),
            crate::load::RequestLoad::new(w, pending, context),
        )
    }

    /// Places `requests` one after another, each held in flight unstarted (`pending` tokens to
    /// prefill, `context` in all) as the proxy would hold it: how many went to each worker.
    fn arrive_together(
        p: &CacheAware,
        ws: &[Arc<Worker>],
        requests: impl Iterator<Item = RequestInfo>,
        (pending, context): (u64, u64),
    ) -> Vec<usize> {
        let mut held = Vec::new();
        let mut per_worker = vec![0; ws.len()];
        for r in requests {
            let s = pick(p, ws, &r);
            per_worker[s.index] += 1;
            held.push(hold(&ws[s.index], pending, context));
        }
        per_worker
    }

    /// A conversation: `shared` blocks common to all, then `own` blocks of conversation `c`.
    fn convo(c: u64, shared: u64, own: u64) -> RequestInfo {
        let hashes = (0..shared)
            .chain((0..own).map(|i| (c + 1) << 32 | i))
            .collect();
        RequestInfo::keyed(hashes, 256)
    }

    fn pick(p: &CacheAware, ws: &[Arc<Worker>], r: &RequestInfo) -> Selection {
        p.select(ws, r).unwrap()
    }

    /// Workers that all publish events and hold none of 4-token blocks of unrelated tokens.
    fn workers_with_events(n: usize) -> Vec<Arc<Worker>> {
        workers_storing(n, vec![7], vec![u32::MAX; 4])
    }

    /// Workers that all publish events, each of which stored `tokens` as blocks of 4 tokens.
    fn workers_storing(n: usize, block_hashes: Vec<u64>, tokens: Vec<u32>) -> Vec<Arc<Worker>> {
        use crate::kv_events::{Feed, KvEvent};
        let metrics = crate::metrics::Metrics::new();
        (0..n)
            .map(|i| {
                let cfg = crate::config::WorkerConfig::from_url(format!(
                    "http://127.0.0.1:{}",
                    12000 + i
                ));
                let mut w = Worker::new(&cfg, &metrics).unwrap();
                let feed = Feed::new(1000);
                feed.blocks().apply(&KvEvent::BlockStored {
                    block_hashes: block_hashes.clone(),
                    parent_block_hash: None,
                    token_ids: tokens.clone(),
                    block_size: 4,
                    lora_id: None,
                    medium: None,
                });
                w.events = Some(Arc::new(feed));
                Arc::new(w)
            })
            .collect()
    }

    /// Two replicas fed the same events choose alike even when one has routed part of the
    /// prompt itself and the other has not: the home of what no worker holds comes from the
    /// events, not from each replica's own index.
    #[test]
    fn replicas_fed_the_same_events_pick_the_same_home() {
        let ws = workers_with_events(4);
        let (a, b) = (policy(), policy());
        for c in 0..64u64 {
            let mut req = convo(c, 1, 3);
            req.tokens = Some((0..40).map(|t| (c * 1000 + t) as u32).collect());
            // Replica a once sent the first two blocks of this prompt to some worker.
            a.index
                .insert(&req.block_hashes[..2], ws[c as usize % 4].id_hash);
            let (sa, sb) = (a.peek(&ws, &req).unwrap(), b.peek(&ws, &req).unwrap());
            assert_eq!(sa.index, sb.index, "conversation {c}");
        }
    }

    #[test]
    fn on_events_questions_under_a_prefix_every_worker_holds_spread_by_pending_prefill() {
        // Every worker's events hold the same 32-token system prompt. A new question under it:
        // every worker would prefill the same 8 tokens, and wherever it goes, the events tell
        // every replica so. It goes where no prefill waits, as with one gateway, whatever the
        // polled load says of other replicas.
        let system: Vec<u32> = (0..32).collect();
        let ws = workers_storing(4, (100..108).collect(), system.clone());
        let question = |c: u32| {
            let mut r = convo(u64::from(c), 2, 1);
            let tokens: Vec<u32> = system
                .iter()
                .copied()
                .chain(1000 * c..1000 * c + 8)
                .collect();
            r.tokens = Some(tokens.into());
            r
        };
        let p = policy();
        let _mine = another_replica_as_busy(&ws);
        let home = p.peek(&ws, &question(1)).unwrap().index;
        let held = hold(&ws[home], 8, 40);
        assert_ne!(p.peek(&ws, &question(1)).unwrap().index, home);
        drop(held);
        let together = arrive_together(&p, &ws, (10..18).map(question), (8, 40));
        assert_eq!(together, [2, 2, 2, 2]);
    }

    #[test]
    fn a_worker_whose_events_hold_the_prompt_wins_over_what_the_index_knows() {
        use crate::kv_events::{Feed, KvEvent};
        let tokens: Vec<u32> = (0..40).collect();
        let metrics = crate::metrics::Metrics::new();
        let mut ws = Vec::new();
        for i in 0..3 {
            let cfg =
                crate::config::WorkerConfig::from_url(format!("http://127.0.0.1:{}", 11000 + i));
            let mut w = Worker::new(&cfg, &metrics).unwrap();
            let feed = Feed::new(1000);
            if i == 2 {
                // Worker 2 stored the first 8 blocks of 4 tokens (someone else's traffic).
                feed.blocks().apply(&KvEvent::BlockStored {
                    block_hashes: (100..108).collect(),
                    parent_block_hash: None,
                    token_ids: tokens[..32].to_vec(),
                    block_size: 4,
                    lora_id: None,
                    medium: None,
                });
            } else {
                feed.blocks().apply(&KvEvent::BlockStored {
                    block_hashes: vec![7],
                    parent_block_hash: None,
                    token_ids: vec![9, 9, 9, 9],
                    block_size: 4,
                    lora_id: None,
                    medium: None,
                });
            }
            w.events = Some(Arc::new(feed));
            ws.push(Arc::new(w));
        }
        let p = CacheAware::new(CacheAwareParams::default());
        // The index was told worker 0 holds this routing key; the events say worker 2 does.
        let mut req = convo(1, 2, 2);
        p.index.insert(&req.block_hashes, ws[0].id_hash);
        req.tokens = Some(tokens.clone().into());
        let s = pick(&p, &ws, &req);
        assert_eq!(s.index, 2);
        assert_eq!(s.outcome, Outcome::ExactMatch);
        let predicted = s.prediction.unwrap();
        assert_eq!(predicted.cached_tokens, 32);
        assert_eq!(predicted.prompt_tokens, 40);
        // Without token ids the events cannot be used: the index's guess stands.
        let fresh = CacheAware::new(CacheAwareParams::default());
        fresh.index.insert(&req.block_hashes, ws[0].id_hash);
        req.tokens = None;
        let s = pick(&fresh, &ws, &req);
        assert_eq!((s.index, s.outcome), (0, Outcome::LongestMatch));
    }

    #[test]
    fn a_conversation_follows_its_deepest_blocks_although_all_share_the_first() {
        let ws = test_workers(4);
        let p = unit();
        // Two conversations with the same 4-block system prompt, placed on different workers by load.
        let first = pick(&p, &ws, &convo(1, 4, 1));
        // 6 in flight cost 384 tokens: more than the 320-token prompt would cost elsewhere.
        let busy: Vec<_> = (0..6).map(|_| ws[first.index].acquire()).collect();
        let other = pick(&p, &ws, &convo(2, 4, 1));
        assert_ne!(first.index, other.index);
        drop(busy);
        // Their next turns go back to where each one's history is, not to one system-prompt home
        // (nor to the conversation's home, credited with half of the new block).
        let next1 = pick(&p, &ws, &convo(1, 4, 2));
        let next2 = pick(&p, &ws, &convo(2, 4, 2));
        assert_eq!(
            (next1.index, next1.outcome),
            (first.index, Outcome::LongestMatch)
        );
        assert_eq!(
            (next2.index, next2.outcome),
            (other.index, Outcome::LongestMatch)
        );
        assert_eq!(next2.prediction.unwrap().matched_blocks, 5);
    }

    /// On a lone gateway with `reuse_affinity: 1`, a conversation's next turn is credited at its
    /// home with all of its new text, a new prompt with half of it (`home_affinity`): through the
    /// same load gap the first stays where its next turns will look for it and the second goes to
    /// an idle worker. Unset, the next turn is credited like a new prompt and moves too, and so
    /// does a turn whose prefix one of the last few requests went through, whether or not hot
    /// copies are amortized (which also read the last few requests).
    #[test]
    fn with_reuse_affinity_a_next_turn_keeps_its_home_through_a_gap_that_moves_new_and_hot_prompts()
    {
        for amortize_hot_copies in [true, false] {
            reuse_affinity_through_a_gap(amortize_hot_copies);
        }
    }

    fn reuse_affinity_through_a_gap(amortize_hot_copies: bool) {
        let ws = test_workers(4);
        let half = CacheAware::new(CacheAwareParams {
            amortize_hot_copies,
            ..unit().params
        });
        let p = CacheAware::new(CacheAwareParams {
            reuse_affinity: Some(1.0),
            ..half.params.clone()
        });
        let first = pick(&p, &ws, &convo(1, 0, 1));
        assert_eq!(first.outcome, Outcome::HashHome);
        let home = first.index;
        assert_eq!(pick(&half, &ws, &convo(1, 0, 1)).index, home);
        // Other users' requests since (without them the conversation's own last turn would make
        // its prefix look like one that everyone is using).
        for c in 10..14 {
            pick(&p, &ws, &convo(c, 0, 1));
            pick(&half, &ws, &convo(c, 0, 1));
        }
        // Another 2-block prompt with the same home, found by a policy that has seen nothing.
        let probe = unit();
        let new = (100..)
            .map(|c| convo(c, 0, 2))
            .find(|r| pick(&probe, &ws, r).index == home)
            .unwrap();
        // One request with 40 tokens of prefill pending: 104 tokens of queue on the home.
        let _busy = hold(&ws[home], 40, 0);
        // Next turn, 128 tokens: 64 held at home, 64 new. Home 64 + 104 - 64 = 104; idle 128.
        let next = pick(&p, &ws, &convo(1, 0, 2));
        assert_eq!((next.index, next.outcome), (home, Outcome::LongestMatch));
        // New, 128 tokens: home 128 + 104 - 64 = 168; idle 128.
        let moved = pick(&p, &ws, &new);
        assert_ne!(moved.index, home);
        assert_eq!(moved.outcome, Outcome::Spilled);
        // Unset, the next turn's new text is credited as a new prompt's and it moves: 136 > 128.
        assert_ne!(pick(&half, &ws, &convo(1, 0, 2)).index, home);
        // A prefix one of the last 4 requests went through may be a document many questions
        // share, whose new text comes once: its turn 3, with one more request queued at home
        // (168), is credited half: 64 + 168 - 32 = 200 against 192 on an idle worker.
        let _more = hold(&ws[home], 0, 0);
        let after = pick(&p, &ws, &convo(1, 0, 3));
        assert_ne!(
            after.index, home,
            "amortize_hot_copies: {amortize_hot_copies}"
        );
    }

    #[test]
    fn a_new_prefix_goes_home_and_replicas_agree_on_the_home() {
        let ws = test_workers(8);
        let (a, b) = (policy(), policy());
        let r = convo(7, 0, 6);
        let sa = pick(&a, &ws, &r);
        assert_eq!(sa.outcome, Outcome::HashHome);
        assert_eq!(sa.index, pick(&b, &ws, &r).index);
    }

    /// A gateway whose index holds the 4-block system prompt on every worker.
    fn knowing_the_system_prompt(ws: &[Arc<Worker>], params: CacheAwareParams) -> CacheAware {
        let p = CacheAware::new(params);
        for w in ws {
            p.index.insert(&[0, 1, 2, 3], w.id_hash);
        }
        p
    }

    /// Two replicas whose indexes hold the 4-block system prompt on every worker.
    fn two_replicas_knowing_the_system_prompt(ws: &[Arc<Worker>]) -> (CacheAware, CacheAware) {
        let knowing = || knowing_the_system_prompt(ws, CacheAwareParams::default());
        (knowing(), knowing())
    }

    /// Four requests of this gateway's in flight on every worker, and a poll that saw as many
    /// again from elsewhere (another replica's). The guards hold this gateway's requests.
    fn another_replica_as_busy(ws: &[Arc<Worker>]) -> Vec<crate::workers::InflightGuard> {
        polled_beside_four_of_ours(ws, 8.0)
    }

    /// Four requests of this gateway's in flight on every worker, and a poll that saw `running`
    /// there in all (the rest other replicas'). The guards hold this gateway's requests.
    fn polled_beside_four_of_ours(
        ws: &[Arc<Worker>],
        running: f64,
    ) -> Vec<crate::workers::InflightGuard> {
        let mut mine = Vec::new();
        for w in ws {
            mine.extend((0..4).map(|_| w.acquire()));
            let polled = crate::load::Polled {
                running,
                ..Default::default()
            };
            w.load.store(Some(polled), 4);
        }
        mine
    }

    #[test]
    fn with_another_replica_the_home_is_credited_with_all_of_an_unseen_turn() {
        let ws = test_workers(8);
        // A conversation this replica has not seen: the system prompt (on every worker), then
        // three blocks of its own, 192 tokens.
        let r = convo(9, 4, 3);
        let home = (0..ws.len())
            .max_by_key(|&i| mix(r.block_hashes[4], ws[i].id_hash))
            .unwrap();
        let p = knowing_the_system_prompt(
            &ws,
            CacheAwareParams {
                miss_weight: 1.0,
                request_cost_tokens: 80.0,
                context_weight: 0.0,
                ..CacheAwareParams::default()
            },
        );
        // Another replica as busy as this one: it sends the turns this one has not seen to the
        // home, so nearly all of the 192 tokens are credited there (`min(1, 2f)` of the rest
        // above `home_affinity`, with `f` just under a half), where alone it would be half.
        let _mine = another_replica_as_busy(&ws);
        // Two more requests on the home, 160 tokens of queue: more than half of the unseen turn,
        // less than all of it. The home keeps the conversation.
        let mut extra: Vec<_> = (0..2).map(|_| ws[home].acquire()).collect();
        assert_eq!(p.peek(&ws, &r).unwrap().index, home);
        // A third, 240 tokens: more than all of it. The conversation goes elsewhere, so the
        // credit is the unseen turn's, not more.
        extra.push(ws[home].acquire());
        assert_ne!(p.peek(&ws, &r).unwrap().index, home);
    }

    /// Beside another replica, a prompt nothing of which is known (no shared prefix, no earlier
    /// turn) is credited at its home as by one gateway, half of it: it may as well be new.
    #[test]
    fn with_another_replica_a_prompt_nothing_of_which_is_known_is_credited_half() {
        let (ws, p, r, home) = new_prompt_and_its_home(false);
        let _mine = another_replica_as_busy(&ws);
        // One more request on the home, 80 tokens of queue: less than half of the prompt.
        let mut extra = vec![ws[home].acquire()];
        assert_eq!(p.peek(&ws, &r).unwrap().index, home);
        // Two, 160 tokens: more than half of it, less than all. Elsewhere.
        extra.push(ws[home].acquire());
        assert_ne!(p.peek(&ws, &r).unwrap().index, home);
    }

    /// Eight workers, a policy whose queued request costs 80 tokens (`new_prompt_by_reuse` as
    /// given), a 192-token prompt nothing of which is known, and its home (by rendezvous over its
    /// first block).
    fn new_prompt_and_its_home(
        new_prompt_by_reuse: bool,
    ) -> (Vec<Arc<Worker>>, CacheAware, RequestInfo, usize) {
        let ws = test_workers(8);
        let r = convo(9, 0, 3);
        let home = (0..ws.len())
            .max_by_key(|&i| mix(r.block_hashes[0], ws[i].id_hash))
            .unwrap();
        let p = CacheAware::new(CacheAwareParams {
            miss_weight: 1.0,
            request_cost_tokens: 80.0,
            context_weight: 0.0,
            new_prompt_by_reuse,
            ..CacheAwareParams::default()
        });
        (ws, p, r, home)
    }

    /// Routes `n` prompts that are each new (first blocks never seen) and end at once.
    fn route_never_reused(p: &CacheAware, ws: &[Arc<Worker>], n: u64) {
        for c in 0..n {
            pick(p, ws, &convo(1_000 + c, 0, 2));
        }
    }

    #[test]
    fn where_prompts_are_never_reused_a_new_one_is_placed_by_cost_not_by_its_hash() {
        let (ws, p, r, home) = new_prompt_and_its_home(true);
        // One request on the home (80 tokens of queue) against half of the prompt's 192: home.
        let _extra = ws[home].acquire();
        assert_eq!(p.peek(&ws, &r).unwrap().index, home);
        // After 300 prompts none of which started with anything known, the share is about 1%
        // (0.98^300), the credit about a token: the idle workers are cheaper.
        route_never_reused(&p, &ws, 300);
        assert!(p.reuse_share_now() < 0.02, "share {}", p.reuse_share_now());
        let chosen = p.peek(&ws, &r).unwrap().index;
        assert_ne!(chosen, home);
        assert_eq!(ws[chosen].inflight(), 0, "an idle worker is the cheapest");
    }

    #[test]
    fn where_most_prompts_start_with_something_known_a_new_one_keeps_all_of_its_home_credit() {
        let (ws, p, r, home) = new_prompt_and_its_home(true);
        let _extra = ws[home].acquire();
        // Three questions under one system prompt for every two new prompts: a share of about
        // 0.6, enough for the whole credit (96 tokens against the home's 80 of queue). Scaled by
        // the share itself, the credit would be about 58 and the prompt would go elsewhere.
        for c in 0..300 {
            let own = convo(2_000 + c, 0, 2);
            let request = if c % 5 < 3 {
                convo(1_000 + c, 2, 1)
            } else {
                own
            };
            pick(&p, &ws, &request);
        }
        let share = p.reuse_share_now();
        assert!((0.5..0.75).contains(&share), "share {share}");
        assert_eq!(p.peek(&ws, &r).unwrap().index, home);
    }

    #[test]
    fn beside_another_replica_a_new_prompt_keeps_its_home_credit_however_rare_reuse_is() {
        // The other replica's conversations reach this one with nothing known: they still have
        // to meet at the home, so its share of the traffic (a half here) restores the credit.
        let (ws, p, r, home) = new_prompt_and_its_home(true);
        let _theirs = another_replica_as_busy(&ws);
        route_never_reused(&p, &ws, 300);
        assert!(p.reuse_share_now() < 0.02, "share {}", p.reuse_share_now());
        let _extra = ws[home].acquire();
        assert_eq!(p.peek(&ws, &r).unwrap().index, home);
    }

    #[test]
    fn without_the_flag_the_reuse_share_is_not_kept_and_a_new_prompt_goes_home() {
        let ws = test_workers(8);
        let p = CacheAware::new(CacheAwareParams {
            new_prompt_by_reuse: false,
            ..CacheAwareParams::default()
        });
        route_never_reused(&p, &ws, 300);
        assert_eq!(p.reuse_share_now(), 1.0);
        assert_eq!(
            Policy::reuse_share(&p),
            None,
            "no share to export without the flag"
        );
        let r = convo(9, 0, 3);
        assert_eq!(pick(&p, &ws, &r).outcome, Outcome::HashHome);
    }

    #[test]
    fn another_replicas_conversation_is_looked_for_at_its_home() {
        // Replica `a` saw turn 1; replica `b` knows only the shared system prompt (on all workers)
        // and sees turn 2: both must choose the same worker.
        let ws = test_workers(6);
        let (a, b) = two_replicas_knowing_the_system_prompt(&ws);
        let t1 = pick(&a, &ws, &convo(3, 4, 2));
        let t2 = pick(&b, &ws, &convo(3, 4, 4));
        assert_eq!(t1.index, t2.index);
    }

    #[test]
    fn with_other_replicas_in_the_pool_a_spilled_conversation_returns_to_its_home() {
        // Both replicas know the system prompt is on every worker. Replica `a` once sent three
        // turns of conversation 3 to worker `x` (spilled for load); replica `b` never saw it.
        let ws = test_workers(4);
        let replica = |shared_home: bool| {
            let params = CacheAwareParams {
                shared_home,
                ..CacheAwareParams::default()
            };
            knowing_the_system_prompt(&ws, params)
        };
        let (a, b) = (replica(true), replica(true));
        let next = convo(3, 4, 4);
        let home = b.peek(&ws, &next).unwrap().index;
        let x = (home + 1) % ws.len();
        a.index.insert(&convo(3, 4, 3).block_hashes, ws[x].id_hash);
        // Alone in the pool, `a` knows best: the conversation stays where its history is.
        let alone = a.peek(&ws, &next).unwrap();
        assert_eq!((alone.index, alone.outcome), (x, Outcome::LongestMatch));
        // The workers' polled load shows as many requests again from elsewhere: another replica
        // sends this conversation's turns to its home, so `a` does too, and the two agree.
        let _mine = another_replica_as_busy(&ws);
        let shared = a.peek(&ws, &next).unwrap();
        assert_eq!((shared.index, shared.outcome), (home, Outcome::HashHome));
        assert_eq!(b.peek(&ws, &next).unwrap().index, home);
        // What it predicts is what it knows the home holds, not what it presumed.
        assert_eq!(shared.prediction.unwrap().matched_blocks, 4);
        // With `shared_home` off it follows its own history whatever the others do.
        let own = replica(false);
        own.index
            .insert(&convo(3, 4, 3).block_hashes, ws[x].id_hash);
        assert_eq!(own.peek(&ws, &next).unwrap().index, x);
    }

    #[test]
    fn a_spilled_conversation_returns_to_a_home_that_holds_most_of_it_when_others_route_a_third() {
        // Replica `a` sent the first two turns of conversation 3 home, then one turn to `x` for
        // load: the home lacks one block of what `x` holds.
        let ws = test_workers(4);
        let a = knowing_the_system_prompt(&ws, CacheAwareParams::default());
        let next = convo(3, 4, 4);
        let home = a.peek(&ws, &next).unwrap().index;
        let x = (home + 1) % ws.len();
        a.index
            .insert(&convo(3, 4, 2).block_hashes, ws[home].id_hash);
        a.index.insert(&convo(3, 4, 3).block_hashes, ws[x].id_hash);
        // Other replicas route a third of the pool's requests (`min(1, 2f)` = 2/3): the home is
        // presumed to hold two thirds of the block it lacks, and that, with its share of the new
        // block, outweighs the one block `x` holds beyond it. A presumption of two thirds of
        // everything `x` holds (299 tokens) would be less than the home holds already (384),
        // crediting nothing, and the conversation would stay split.
        let _mine = polled_beside_four_of_ours(&ws, 6.0);
        let back = a.peek(&ws, &next).unwrap();
        assert_eq!((back.index, back.outcome), (home, Outcome::HashHome));
        // What it predicts there is what it knows the home holds.
        assert_eq!(back.prediction.unwrap().matched_blocks, 6);
    }

    #[test]
    fn a_conversation_on_two_workers_keeps_its_home_on_every_replica() {
        // The system prompt is on all four workers. Replica `a` also put the first turns of each
        // conversation on two workers (its home and one it spilled to); replica `b` knows
        // nothing of them. With the other replica's traffic showing in the polled load, both
        // send every conversation's next turn to the same worker.
        let ws = test_workers(4);
        let (a, b) = two_replicas_knowing_the_system_prompt(&ws);
        let _mine = another_replica_as_busy(&ws);
        for c in 0..32u64 {
            let next = convo(c, 4, 4);
            let home = b.peek(&ws, &next).unwrap().index;
            let earlier = convo(c, 4, 3);
            a.index.insert(&earlier.block_hashes, ws[home].id_hash);
            a.index
                .insert(&earlier.block_hashes, ws[(home + 1) % 4].id_hash);
            assert_eq!(a.peek(&ws, &next).unwrap().index, home, "conversation {c}");
        }
        assert_eq!(kth_largest([5, 9, 1, 9].into_iter(), 3), 5);
        assert_eq!(kth_largest([5, 9].into_iter(), 3), 0);
    }

    #[test]
    fn a_hot_prefix_is_copied_when_its_holder_is_busy() {
        // The cost alone: without the idle workers' credit for a copy (tested below), which at a
        // mean of 2 in flight would copy the prefix sooner.
        let ws = test_workers(3);
        let p = CacheAware::new(CacheAwareParams {
            amortize_hot_copies: false,
            ..unit().params
        });
        let shared = convo(0, 8, 0); // 2,048 bytes: ~512 tokens at 4 bytes per token
        let home = pick(&p, &ws, &shared).index;
        // 6 requests in flight (384 tokens) cost less than recomputing the prefix elsewhere: it stays.
        let held: Vec<_> = (0..6).map(|_| ws[home].acquire()).collect();
        let s = pick(&p, &ws, &convo(5, 8, 1));
        assert_eq!((s.index, s.outcome), (home, Outcome::LongestMatch));
        // 9 (576 tokens) cost more: a copy goes to another worker.
        let more: Vec<_> = (0..3).map(|_| ws[home].acquire()).collect();
        let s = pick(&p, &ws, &convo(6, 8, 1));
        assert_ne!(s.index, home);
        assert_eq!(s.outcome, Outcome::Replicated);
        drop((held, more));
        // Now two workers hold the prefix, and each conversation sticks to where it went.
        assert_eq!(p.index.matches(&shared.block_hashes, 4).depths.len(), 2);
        assert_eq!(pick(&p, &ws, &convo(6, 8, 2)).index, s.index);
        assert_eq!(pick(&p, &ws, &convo(5, 8, 2)).index, home);
    }

    #[test]
    fn with_a_load_bound_a_worker_without_the_shared_prefix_is_not_left_idle() {
        // Three workers hold a shared 512-token prefix and have 10 requests each; the fourth
        // holds nothing and has none. By cost alone, waiting behind 10 requests (160 tokens at 16
        // each) is cheaper than copying the prefix (512 tokens): it stays with a holder. The bound
        // (1.25 × 31 / 4, rounded up: 10) passes over the three and sends it to the fourth.
        let ws = test_workers(4);
        let shared = convo(0, 8, 0);
        let run = |bound: f64| {
            let p = CacheAware::new(CacheAwareParams {
                load_bound: bound,
                request_cost_tokens: 16.0,
                amortize_hot_copies: false,
                ..unit().params
            });
            for w in &ws[..3] {
                p.index.insert(&shared.block_hashes, w.id_hash);
            }
            let held: Vec<_> = ws[..3]
                .iter()
                .flat_map(|w| (0..10).map(|_| w.acquire()))
                .collect();
            let s = pick(&p, &ws, &convo(9, 8, 1));
            drop(held);
            s
        };
        let unbounded = run(0.0);
        assert!(unbounded.index < 3, "{unbounded:?}");
        assert_eq!(unbounded.outcome, Outcome::LongestMatch);
        let bounded = run(1.25);
        assert_eq!((bounded.index, bounded.outcome), (3, Outcome::Replicated));
        // Under the bound the cost decides as before: one fewer in flight on a holder, and it
        // takes the request.
        let p = CacheAware::new(CacheAwareParams {
            load_bound: 1.25,
            request_cost_tokens: 16.0,
            amortize_hot_copies: false,
            ..unit().params
        });
        for w in &ws[..3] {
            p.index.insert(&shared.block_hashes, w.id_hash);
        }
        let mut held: Vec<_> = ws[..3]
            .iter()
            .flat_map(|w| (0..10).map(|_| w.acquire()))
            .collect();
        held.pop(); // the third holder is down to 9 (cap: 1.25 × 30 / 4, rounded up: 10)
        let s = pick(&p, &ws, &convo(9, 8, 1));
        assert_eq!((s.index, s.outcome), (2, Outcome::LongestMatch));
    }

    #[test]
    fn a_copy_of_a_hot_prefix_is_shared_by_the_requests_an_idle_worker_will_take() {
        // Three workers hold a shared 512-token prefix and have `busy` requests each; the fourth
        // has `idle` and holds `part` blocks of it. Each queued request costs 16 tokens.
        let ws = test_workers(4);
        let shared = convo(0, 8, 0);
        let run = |amortize: bool, busy: usize, idle: usize, part: usize| {
            let p = CacheAware::new(CacheAwareParams {
                request_cost_tokens: 16.0,
                amortize_hot_copies: amortize,
                ..unit().params
            });
            for w in &ws[..3] {
                p.index.insert(&shared.block_hashes, w.id_hash);
            }
            if part > 0 {
                p.index.insert(&shared.block_hashes[..part], ws[3].id_hash);
            }
            let held: Vec<_> = ws[..3]
                .iter()
                .flat_map(|w| (0..busy).map(|_| w.acquire()))
                .chain((0..idle).map(|_| ws[3].acquire()))
                .collect();
            let s = pick(&p, &ws, &convo(9, 8, 1));
            drop(held);
            s
        };
        // Priced in full, the copy (512 tokens) costs more than waiting behind 12 (192 tokens):
        // the idle worker would stay idle.
        let full = run(false, 12, 0, 0);
        assert!(full.index < 3, "{full:?}");
        // Amortized: to an idle worker the hot prefix is priced as held, since every later
        // request there shares the copy: it costs the 64 tokens the holders would prefill too,
        // against their 192 of waiting (or 160 after the home's credit).
        let shared_copy = run(true, 12, 0, 0);
        assert_eq!(
            (shared_copy.index, shared_copy.outcome),
            (3, Outcome::Replicated)
        );
        // A worker that is not idle pays for the copy in full, however far below the mean (it
        // has 2, the mean is 9.5): locality is unchanged where loads are merely uneven.
        let busy = run(true, 12, 2, 0);
        assert!(busy.index < 3, "{busy:?}");
        // A worker that holds part of the prompt is priced by what it holds, as before: a
        // conversation does not scatter to workers that hold only its start.
        let partial = run(true, 12, 0, 2);
        assert!(partial.index < 3, "{partial:?}");
        // A prefix only one worker holds and that no recent request went through is not hot:
        // its holder keeps it until its queue costs more than a copy, however idle the others.
        let p = CacheAware::new(CacheAwareParams {
            request_cost_tokens: 16.0,
            ..unit().params
        });
        p.index.insert(&shared.block_hashes, ws[0].id_hash);
        for k in 0..4 {
            p.index.insert(&[1 << 60 | k], ws[0].id_hash); // other traffic since
        }
        let held: Vec<_> = (0..12).map(|_| ws[0].acquire()).collect(); // 192 < 512 tokens
        let s = pick(&p, &ws, &convo(9, 8, 1));
        assert_eq!((s.index, s.outcome), (0, Outcome::LongestMatch));
        drop(held);
    }

    /// At light load, one long system prompt shared by every conversation (the bench's `chat` at
    /// a few requests a second): whichever worker took the first request holds it, and pricing
    /// a copy against one request's wait kept every later request there, with three workers
    /// idle and every answer decoding beside all the others (e2e 1.3x round-robin's).
    #[test]
    fn a_prefix_every_request_shares_spreads_to_idle_workers_though_one_worker_holds_it() {
        let ws = test_workers(4);
        // 16 blocks of 256 bytes: 1,024 tokens of system prompt, then a 64-token question.
        let question = |c| convo(c, 16, 1);
        let p = policy();
        let first = pick(&p, &ws, &question(0)).index;
        // Twelve conversations in flight there (1,300 tokens each), one more arriving: the mean
        // in flight is over 1 and the others are idle.
        let held: Vec<_> = (0..12).map(|_| hold(&ws[first], 0, 1300)).collect();
        let s = pick(&p, &ws, &question(1));
        assert_ne!(s.index, first, "{s:?}");
        assert_eq!(s.outcome, Outcome::Replicated);
        // A conversation already on the holder stays: the idle worker would have to prefill its
        // earlier turns, which no recent request shares.
        p.index
            .insert(&convo(2, 16, 8).block_hashes, ws[first].id_hash);
        for c in 10..14 {
            pick(&p, &ws, &question(c)); // traffic since: the system prompt stays hot
        }
        assert_eq!(pick(&p, &ws, &convo(2, 16, 9)).index, first);
        drop(held);
        // Five in flight (a mean of 1.25; about 1.6 requests a second in the bench): a copy
        // still, where the mean had to be over 2 before and one worker took nearly all of them.
        let p = policy();
        let first = pick(&p, &ws, &question(0)).index;
        let mut held: Vec<_> = (0..4).map(|_| hold(&ws[first], 0, 1300)).collect();
        // With four (a mean of 1), no copy: see the next test for why the credit waits for that.
        assert_eq!(pick(&p, &ws, &question(1)).index, first);
        held.push(hold(&ws[first], 0, 1300));
        assert_ne!(pick(&p, &ws, &question(2)).index, first);
        drop(held);
    }

    /// What the credit must not do: its sample of hot prefixes cannot tell a system prompt that
    /// many conversations share from one conversation's own earlier turns, which are among the
    /// last `n` requests whenever there are about `n` conversations or fewer. Those are also at
    /// most one request in flight per worker on average, so the credit waits for more: such a
    /// conversation would otherwise move to an idle worker and prefill its history again. (A
    /// lone one also stays by its home's tie-break, so the first part passes without the
    /// threshold; the second, four at a time, fails without it.)
    #[test]
    fn up_to_one_conversation_per_worker_is_not_copied_to_an_idle_worker() {
        let ws = test_workers(4);
        let p = policy();
        let first = pick(&p, &ws, &convo(1, 16, 4)).index;
        // Its next turns, one after another: each finds its own last turn hot and every worker
        // idle.
        for turn in 5..10 {
            let s = pick(&p, &ws, &convo(1, 16, turn));
            assert_eq!(
                (s.index, s.outcome),
                (first, Outcome::LongestMatch),
                "turn {turn}"
            );
        }
        // Four conversations at a time, each with its next turn in flight while the others
        // arrive. All four start on the system prompt's first holder (nothing else is known),
        // so that worker has four in flight and the others none: a mean of 1, and every
        // conversation stays with its history rather than being copied to an idle worker.
        let p = policy();
        let homes: Vec<usize> = (10..14)
            .map(|c| pick(&p, &ws, &convo(c, 16, 4)).index)
            .collect();
        assert!(homes.iter().all(|&h| h == homes[0]), "{homes:?}");
        for turn in 5..8 {
            let mut held = Vec::new();
            for (c, &home) in (10..14).zip(&homes) {
                let s = pick(&p, &ws, &convo(c, 16, turn));
                assert_eq!(s.index, home, "conversation {c}, turn {turn}");
                held.push(hold(&ws[s.index], 0, 1300));
            }
        }
    }

    #[test]
    fn the_default_weighs_a_miss_three_times_its_tokens_and_a_queued_request_by_its_context() {
        // A 576-token request whose first 512 tokens its holder holds: 192 weighted tokens of
        // prefill there, 1,728 elsewhere, and up to 96 of credit (3 × 0.5 × its 64 unknown tokens)
        // on whichever worker is the home of its last block. A queued request costs 4 + 0.04 × its
        // prompt tokens. The prefix is not hot (other traffic came between its requests), so an
        // idle worker gets no credit for it.
        let ws = test_workers(3);
        let other_traffic = |p: &CacheAware| {
            for k in 0..ws.len() as u64 {
                p.index.insert(&[1 << 60 | k], ws[0].id_hash);
            }
        };
        let p = policy();
        let holder = pick(&p, &ws, &convo(0, 8, 0)).index;
        other_traffic(&p);
        // 512-token requests in flight cost 24.48 each: it stays at 58 (1,612) ...
        let mut held: Vec<_> = (0..58).map(|_| hold(&ws[holder], 0, 512)).collect();
        assert_eq!(pick(&p, &ws, &convo(5, 8, 1)).index, holder);
        other_traffic(&p);
        // ... and is copied at 67 (1,832).
        held.extend((0..9).map(|_| hold(&ws[holder], 0, 512)));
        assert_ne!(pick(&p, &ws, &convo(6, 8, 1)).index, holder);
        drop(held);
        // 2,048-token conversations in flight cost 85.92 each: it stays at 15 (1,481) and is
        // copied at 20 (1,910). (A fresh policy: the first one now knows a copy.)
        let p = policy();
        let holder = pick(&p, &ws, &convo(0, 8, 0)).index;
        other_traffic(&p);
        let mut held: Vec<_> = (0..15).map(|_| hold(&ws[holder], 0, 2048)).collect();
        assert_eq!(pick(&p, &ws, &convo(7, 8, 1)).index, holder);
        other_traffic(&p);
        held.extend((0..5).map(|_| hold(&ws[holder], 0, 2048)));
        assert_ne!(pick(&p, &ws, &convo(8, 8, 1)).index, holder);
        drop(held);
    }

    /// A pool larger than [`PRICE_ALL_UP_TO`]: a decision prices a sample for load, but always
    /// the workers holding the prompt, wherever the sample falls.
    #[test]
    fn in_a_large_pool_a_conversation_follows_its_holder_whatever_the_sample() {
        let ws = test_workers(1024);
        let p = unit();
        let home = pick(&p, &ws, &convo(1, 0, 1)).index;
        p.index
            .remove(&convo(1, 0, 1).block_hashes, ws[home].id_hash);
        // The home busy (20 × 64 tokens against half its 256 unknown tokens of credit): the first
        // turn goes to some idle worker, not the home.
        let _busy: Vec<_> = (0..20).map(|_| ws[home].acquire()).collect();
        let holder = pick(&p, &ws, &convo(1, 0, 4)).index;
        assert_ne!(holder, home);
        // Each later turn is cheapest on the holder (it misses only the new turn); the sample
        // rotates through all 1,024 workers over these 16 decisions, and holds it in one.
        for turn in 2..=17 {
            let s = pick(&p, &ws, &convo(1, 0, 4 * turn));
            assert_eq!(s.index, holder, "turn {turn}: {s:?}");
            assert_eq!(s.outcome, Outcome::LongestMatch);
        }
    }

    /// In a large idle pool every new prompt goes to its rendezvous home among all the workers,
    /// as it does in a small pool where all are priced: replicas agree on it.
    #[test]
    fn in_a_large_pool_a_new_prompt_goes_to_its_home_among_all_workers() {
        let ws = test_workers(1024);
        let p = policy();
        for c in 0..32 {
            let r = convo(500 + c, 0, 2);
            let key = r.block_hashes[0];
            let home = (0..ws.len())
                .max_by_key(|&i| mix(key, ws[i].id_hash))
                .unwrap();
            let s = p.peek(&ws, &r).unwrap();
            assert_eq!(
                (s.index, s.outcome),
                (home, Outcome::HashHome),
                "prompt {c}"
            );
        }
    }

    /// What sampling gives up, stated: in a large pool a lone idle worker is found when the
    /// rotating sample holds it (one decision in 16 at 1,024 workers: twice in 32), and otherwise
    /// the home takes the request at one request in flight, like every other sampled worker.
    #[test]
    fn in_a_large_pool_a_lone_idle_worker_is_found_once_per_turn_of_the_sample() {
        let ws = test_workers(1024);
        let p = unit();
        let r = convo(9, 0, 1);
        let home = p.peek(&ws, &r).unwrap().index;
        let idle = if home == 5 { 6 } else { 5 };
        let _busy: Vec<_> = (0..ws.len())
            .filter(|&i| i != idle)
            .map(|i| ws[i].acquire())
            .collect();
        // The home costs 64 + 64 - 32 (half its unknown 64 tokens credited), the idle worker
        // 64, every other 128.
        let choices: Vec<usize> = (0..32).map(|_| p.peek(&ws, &r).unwrap().index).collect();
        let found = choices.iter().filter(|&&i| i == idle).count();
        assert_eq!(found, 2, "{choices:?}");
        assert!(
            choices.iter().all(|&i| i == idle || i == home),
            "{choices:?}"
        );
        // In a pool small enough to price every worker, it is found every time.
        let small = &ws[..PRICE_ALL_UP_TO];
        assert!((0..4).all(|_| p.peek(small, &r).unwrap().index == idle));
    }

    /// The light pass notes the workers whose bit is among the holders' and looks them up after
    /// it; past [`NOTED`] of them it searches the pool again. Either way every holder is priced:
    /// a conversation whose prefix seven workers hold goes to the one of them that is idle.
    #[test]
    fn in_a_large_pool_every_holder_is_priced_however_many_workers_share_their_bits() {
        for n in [1024, 4096] {
            let ws = test_workers(n);
            let p = unit();
            let r = convo(3, 0, 8);
            let holders: Vec<usize> = (0..7).map(|k| (k * 577 + 13) % n).collect();
            for &h in &holders {
                p.index.insert(&r.block_hashes[..4], ws[h].id_hash);
            }
            let bits = holders
                .iter()
                .fold(0u64, |m, &h| m | 1 << (ws[h].id_hash & 63));
            let sharing = ws
                .iter()
                .filter(|w| bits & 1 << (w.id_hash & 63) != 0)
                .count();
            // 1,024 workers take the noted path, 4,096 the search.
            assert_eq!(
                sharing > NOTED,
                n > 1024,
                "{n} workers: {sharing} share a bit"
            );
            let idle = holders[4];
            let _busy: Vec<_> = holders
                .iter()
                .filter(|&&h| h != idle)
                .flat_map(|&h| (0..30).map(move |_| h))
                .map(|h| ws[h].acquire())
                .collect();
            // The idle holder misses 4 of 8 blocks; any other idle worker all 8, less the home's
            // credit for half of the unknown 4.
            for _ in 0..8 {
                let s = p.peek(&ws, &r).unwrap();
                assert_eq!(
                    (s.index, s.outcome),
                    (idle, Outcome::LongestMatch),
                    "{n} workers"
                );
            }
        }
    }

    /// The light pass reads usability only for the highest score: when that worker is down, a
    /// new prompt goes to the usable worker with the next highest, as pricing all of them does.
    #[test]
    fn in_a_large_pool_a_new_prompt_whose_home_is_down_goes_to_the_next_highest_score() {
        let ws = test_workers(1024);
        let p = policy();
        for c in 0..8 {
            let r = convo(700 + c, 0, 2);
            let score = |i: &usize| mix(r.block_hashes[0], ws[*i].id_hash);
            let home = (0..ws.len()).max_by_key(score).unwrap();
            ws[home].set_down(true);
            let next = (0..ws.len())
                .filter(|&i| i != home)
                .max_by_key(score)
                .unwrap();
            let s = p.peek(&ws, &r).unwrap();
            assert_eq!(
                (s.index, s.outcome),
                (next, Outcome::HashHome),
                "prompt {c}"
            );
            ws[home].set_down(false);
        }
    }

    /// Another replica's requests on a worker are taken to be as far from starting as this
    /// gateway's there: four requests in all behind one of ours with 200 tokens to prefill are
    /// priced as 800 pending, more than the 400 of a worker where all four are ours.
    #[test]
    fn another_replicas_requests_count_as_much_pending_prefill_as_ours_there() {
        let ws = test_workers(2);
        let p = unit();
        let mut held: Vec<_> = (0..4).map(|_| hold(&ws[0], 100, 0)).collect();
        held.push(hold(&ws[1], 200, 0));
        let polled = crate::load::Polled {
            running: 4.0,
            ..Default::default()
        };
        ws[0].load.store(Some(polled), 4);
        ws[1].load.store(Some(polled), 1);
        // Both have four requests queued; a one-block prompt (64 tokens) is new to both, so
        // besides the pending prefill only the home's credit (under 64 tokens) separates them.
        for c in 0..8 {
            let s = p.peek(&ws, &convo(900 + c, 0, 1)).unwrap();
            assert_eq!(s.index, 0, "prompt {c}: {s:?}");
        }
    }

    #[test]
    fn simultaneous_arrivals_spread_instead_of_herding() {
        let ws = test_workers(4);
        let p = policy();
        let per_worker =
            arrive_together(&p, &ws, (0..40).map(|c| convo(100 + c, 0, 4)), (256, 256));
        // Each new prompt's home is credited its unknown 256 tokens × 0.5 × 3 = 384 tokens; each
        // request placed costs 0.5 × 256 pending + 4 + 0.04 × 256 = 142: no worker gets more
        // than three requests ahead of the least loaded.
        let (min, max) = (per_worker.iter().min(), per_worker.iter().max());
        assert!(
            max.zip(min).is_some_and(|(a, b)| a - b <= 3),
            "{per_worker:?}"
        );
    }

    #[test]
    fn under_a_prefix_every_worker_holds_a_request_goes_where_no_prefill_is_pending() {
        // The 4-block system prompt is on every worker; a new question under it is known no
        // further, so every worker would prefill the same.
        let ws = test_workers(4);
        let p = knowing_the_system_prompt(&ws, CacheAwareParams::default());
        let question = convo(5, 4, 2);
        let home = p.peek(&ws, &question).unwrap().index;
        // One 256-token prompt sent to the home and not started: by its hash alone (the old
        // weighting) the home would still take the question ...
        let held = hold(&ws[home], 256, 256);
        let by_hash = knowing_the_system_prompt(
            &ws,
            CacheAwareParams {
                hot_pending_weight: 0.0,
                ..CacheAwareParams::default()
            },
        );
        assert_eq!(by_hash.peek(&ws, &question).unwrap().index, home);
        // ... but its prefill would run in the same step: it goes where nothing is pending.
        let s = p.peek(&ws, &question).unwrap();
        assert_ne!(s.index, home);
        assert_eq!(s.outcome, Outcome::LongestMatch);
        drop(held);
        // Eight questions arriving together, none answered yet: two on each worker.
        let questions = (0..8).map(|c| convo(10 + c, 4, 2));
        assert_eq!(
            arrive_together(&p, &ws, questions, (128, 1152)),
            [2, 2, 2, 2]
        );
    }

    #[test]
    fn in_a_pool_larger_than_a_blocks_holder_list_new_conversations_have_their_own_homes() {
        // Sixteen workers hold the system prompt; its blocks list the last 8. Those 8 must count
        // as "most workers", or every conversation keys on the system prompt's first block and
        // all of them share one home.
        let ws = test_workers(16);
        let params = CacheAwareParams {
            hot_pending_weight: 0.0, // the home decides, not the pending prefill
            ..CacheAwareParams::default()
        };
        let p = knowing_the_system_prompt(&ws, params);
        let homes: std::collections::HashSet<usize> = (0..32)
            .map(|c| p.peek(&ws, &convo(10 + c, 4, 2)).unwrap().index)
            .collect();
        assert!(homes.len() > 1, "all on {homes:?}");
    }

    #[test]
    fn a_prefix_on_more_workers_than_its_holder_list_is_priced_as_held_by_every_worker() {
        // Sixteen workers were sent the system prompt; its blocks list the last 8. A worker the
        // list crowded out (or that another replica sent it to) holds it as well: priced cold,
        // it would lose every conversation homed there to the 8 listed workers.
        let ws = test_workers(16);
        let p = knowing_the_system_prompt(&ws, CacheAwareParams::default());
        let listed: Vec<usize> = (8..16).collect();
        for c in 0..64u64 {
            let turn = convo(c, 4, 4);
            let key = turn.block_hashes[4];
            let home = (0..16).max_by_key(|&i| mix(key, ws[i].id_hash)).unwrap();
            let s = pick(&p, &ws, &turn);
            assert_eq!(s.index, home, "conversation {c}");
            assert_eq!(s.prediction.unwrap().matched_blocks, 4);
            if !listed.contains(&home) {
                return;
            }
        }
        panic!("no conversation was homed on an unlisted worker");
    }

    #[test]
    fn past_a_prefix_on_a_full_holder_list_a_conversation_follows_its_own_blocks() {
        // As above: every worker is priced as holding the system prompt. A conversation's own
        // blocks past it are still looked up, and its next turn goes where they are.
        let ws = test_workers(16);
        let p = knowing_the_system_prompt(&ws, CacheAwareParams::default());
        for c in 0..16u64 {
            let first = pick(&p, &ws, &convo(100 + c, 4, 4));
            let next = pick(&p, &ws, &convo(100 + c, 4, 6));
            assert_eq!(
                (next.index, next.outcome),
                (first.index, Outcome::LongestMatch),
                "conversation {c}"
            );
            assert_eq!(next.prediction.unwrap().matched_blocks, 8);
        }
    }

    #[test]
    fn with_other_replicas_in_the_pool_a_question_under_a_shared_prefix_goes_home() {
        // As above, but the polled load shows as much traffic again from another replica, which
        // sends this conversation's next turn to its home: this replica does too.
        let ws = test_workers(4);
        let (p, other) = two_replicas_knowing_the_system_prompt(&ws);
        let question = convo(5, 4, 2);
        let home = p.peek(&ws, &question).unwrap().index;
        let _mine = another_replica_as_busy(&ws);
        let _held = hold(&ws[home], 256, 256);
        assert_eq!(p.peek(&ws, &question).unwrap().index, home);
        assert_eq!(other.peek(&ws, &convo(5, 4, 4)).unwrap().index, home);
    }

    #[test]
    fn a_failed_request_takes_back_only_what_it_added() {
        let ws = test_workers(2);
        let p = policy();
        let s1 = pick(&p, &ws, &convo(1, 2, 1));
        let r2 = convo(1, 2, 4);
        let s2 = pick(&p, &ws, &r2);
        assert_eq!(s2.index, s1.index);
        p.observe(&ws[s2.index], &r2, &s2, Observed::Failed);
        let m = p.index.matches(&r2.block_hashes, 2);
        assert_eq!(m.depth_of(ws[s1.index].id_hash), 3, "turn 1's blocks stay");
    }

    #[test]
    fn usage_teaches_bytes_per_token_and_trust() {
        let ws = test_workers(2);
        let p = policy();
        let r = convo(1, 4, 0); // 1,024 bytes
        let s = pick(&p, &ws, &r);
        let w = &ws[s.index];
        for _ in 0..100 {
            let s = pick(&p, &ws, &r);
            p.observe(
                w,
                &r,
                &s,
                Observed::Answered(Some(Usage {
                    prompt_tokens: 512,
                    cached_tokens: Some(0),
                })),
            );
        }
        assert!(
            (p.bytes_per_token() - 2.0).abs() < 0.05,
            "{}",
            p.bytes_per_token()
        );
        assert!(w.load.cache_trust() < 0.05, "{}", w.load.cache_trust());
    }

    #[test]
    fn unusable_workers_are_never_chosen_and_no_key_means_least_work() {
        let ws = test_workers(3);
        let p = policy();
        ws[1].eject_for(std::time::Duration::from_secs(60));
        let _busy = ws[0].acquire();
        let s = p.select(&ws, &RequestInfo::unkeyed()).unwrap();
        assert_eq!((s.index, s.outcome), (2, Outcome::Fallback));
        for c in 0..50 {
            assert_ne!(pick(&p, &ws, &convo(c, 1, 2)).index, 1);
        }
        ws[0].eject_for(std::time::Duration::from_secs(60));
        ws[2].eject_for(std::time::Duration::from_secs(60));
        assert!(p.select(&ws, &convo(1, 1, 1)).is_none());
    }
}
