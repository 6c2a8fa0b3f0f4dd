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
//! home's credit by `max(0, 1 - 2f)`, since the home is what replicas agree on; with
//! `fade_by_continuation`, only as far as such requests are seen to continue later (a moving share
//! of those past a shared prefix that continue a private one), since the home matters for the
//! turns that follow, and questions that are each new follow none. When every worker
//! publishes KV events they do not fade: the events show every replica where the others' requests
//! went.
//!
//! With `step_phase`, the queue also holds what remains of the step a worker is running. vLLM
//! sends a step's tokens to every stream when the step ends, and a request that arrives waits for
//! the step under way before its prefill can start. A worker's load falls at the end of a step
//! (first tokens clear pending prefill, finished answers leave), just as its next one begins, so
//! a choice by load alone keeps taking the worker with the most of a step still ahead. Each
//! worker's steps are timed from the bursts of this gateway's streams from it
//! ([`crate::load::StepClock`]: a base time plus a time per prefill token, fitted over recent
//! steps), and the base time less the time since its last burst counts as that many tokens of
//! pending prefill. With `step_prefill`, the prefill the step under way began with (this gateway's
//! pending prefill when its burst came) shrinks at the fitted rate once the base time is spent:
//! a worker most of the way through a long prefill step is nearly free, not as busy as one that
//! has just begun it. With `step_transient_only`, the step places only what does not last: a
//! turn that holds more somewhere goes without it, and a question or a new prompt counts it only
//! while fewer than half of such requests are seen to be continued or reused.
//!
//! With `price_by_speed`, each worker's cost (and, with `fresh_by_writes`, its recent writes) is
//! counted in its own time: times its fitted time per prefill token over the pool's median
//! ([`crate::load::StepClock::slowness`], rated at each load poll by [`crate::load::rate_speeds`]).
//! A pool of one model on unlike GPUs otherwise prices a queue on a GPU three times as fast as
//! the same queue on the slow one, and keeps the slow ones as busy. Alike workers read 1. With
//! `home_by_speed` too, each worker is home to keys in proportion to its speed (weighted
//! rendezvous: the highest `u^slowness`, `pass::home_rank`), so that homes, where replicas
//! meet and new prompts start, are where the capacity is.
//!
//! Several replicas sharing nothing each know only the turns they routed. Once one of them sends
//! a turn elsewhere for load, it would follow that copy while the others keep to the home, and
//! the conversation would bounce between two workers, each missing the other's turns. So when the
//! workers' polled load shows requests beyond this gateway's own (a share `f` of what the polls
//! found over about the last 32 of them, [`crate::load::Traffic`], since at light load one poll
//! finds the other replicas' requests or none), the
//! home is presumed to hold, besides what it is known to, the rest of what any worker is known
//! to hold (in proportion to `f` below [`PRESUME_ALL_FROM`]): the other replicas send the
//! conversation there. For the same reason
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
//! With `fresh_by_writes`, a lone gateway gives that credit for a prompt of which nothing at all
//! is known to the worker it has had write the fewest tokens lately instead of to the hash home
//! (unless a prompt already waits to prefill there): a new conversation starts where the fewest
//! live. Replicas keep the home, where they meet.
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
//! A busy pool has no idle worker, and there a prefix that draws a steady share of the traffic
//! (eight prefixes each used by one request in eight) stays on the one or two workers that first
//! took it: its copy costs `miss_weight` times its tokens against queues a few dozen tokens
//! apart, and its requests queue behind each other's prefill on those holders while round-robin,
//! which has put every prefix on every worker, spreads them. With `spread_share`, a prefix whose
//! share of this gateway's requests `s` (from the moving mean of the requests between two that
//! use it, [`crate::index::Matches::popular`]) would give each of its holders more than
//! `spread_share` of a worker's fair load (`s / holders > spread_share / n`) is presumed on every
//! worker, as a prefix past a full holder list is: its requests go where the least prefill waits
//! (`hot_pending_weight`, as for a prefix most workers hold), and each further worker's first
//! copy is paid once, labelled `replicated`, predicted uncached. It stops spreading at about
//! `s × n / spread_share` holders, so in a large pool a prefix is copied where its load needs
//! it, not to every worker. Two gates keep it to prefixes that queue behind themselves. More of
//! its requests must be in flight than it has holders (`s` times this gateway's in flight, from
//! the pool's sample; so it also stops at that many holders): a conversation is one request at a time however large its share of a
//! small stream, and at light load no prefix waits behind its own requests. And its holders must
//! have more requests in flight than the pool's mean: where they do not, its requests wait no
//! longer there, and moving them would only pay a copy (a conversation two replicas send to its
//! home would lose it). The second gate finds the holders' workers by a one-bit filter over the
//! pool, only for a decision on a popular prefix.
//!
//! Outcomes: `longest_match` (the chosen worker holds the longest known prefix), `hash_home` (no
//! worker holds any of it; the home took it), `least_written` (no worker holds any of it; the
//! worker written to least lately took it, `fresh_by_writes`), `replicated` (someone holds it,
//! the chosen worker held none of it), `spilled` (a worker holding less than the longest, or not
//! the home, for load), `fallback` (no routing key). Learning ([`Policy::observe`]): a request
//! that failed takes back what it added to the index; an answer's usage updates bytes per token
//! and the worker's trust. With `evict_by_capacity`, each write to the index is dated on the chosen
//! worker's KV clock ([`crate::load::KvClock`]: its prompt's uncached part counts at once, its
//! answer's generated tokens when it ends), so that what the worker has written a KV cache's
//! worth of tokens after no longer counts as held there.
//!
//! Cost: one index walk and one index write per request (one mutex each), plus pricing the
//! workers from relaxed atomics, and with `spread_share` a sample of the pool's load and, for a
//! popular prefix, a pass over the pool, up to its last holder, to find their loads (3.33
//! against 2.77 us a decision at 1,024 workers with it on and off, criterion). A pool of up to [`PRICE_ALL_UP_TO`] workers is priced whole. A
//! larger one is priced on a sample: the workers the index lists as holding more of the prompt
//! than everyone, the home (found by one light pass of a hash and a compare per worker), and
//! [`SAMPLED`] others evenly spread from an offset that rotates with each decision. So a
//! conversation still finds its holder and a new prompt its home on every replica, and a spill
//! for load takes the least loaded of the sample rather than of the pool (the power of many
//! choices: the least loaded of 64 workers picked without regard to load is, on average, among
//! the lightest 1/65). Not with KV events, whose per-worker blocks are read for every worker
//! anyway, nor with `load_bound`. Parameters: see [`CacheAwareParams`].
//!
//! Layout: [`known`] surveys what the index and the workers' events know of the prompt, [`pass`]
//! prices the workers, [`pool`] samples the pool's load; this file holds the policy, its learning,
//! and [`CacheAware::decide`], which reads as the list of those steps.

mod known;
mod pass;
mod pool;
#[cfg(test)]
mod tests;

use std::sync::{
    atomic::{AtomicU64, AtomicUsize, Ordering},
    Arc,
};

use self::{
    known::Known,
    pass::{Candidate, Pass, Priced, QueueWeights, NONE, PRICE_ALL_UP_TO},
    pool::{PoolLoad, PoolSample},
};
use super::{Observed, Outcome, Policy, Prediction, Selection};
use crate::{
    config::CacheAwareParams,
    index::{IndexStats, PrefixIndex},
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
    /// Rotates ties among requests without a key, and a large pool's load sample; from a random
    /// point, as every policy's turn counter ([`super::random_cursor`]).
    tie_break: AtomicUsize,
    /// The moving share of recent prompts whose first block some worker was known to hold, as
    /// `f64` bits (`new_prompt_by_reuse`); starts at 1.
    reuse: AtomicU64,
    /// The moving share of recent requests past a prefix most workers hold that continued
    /// something private beyond it, as `f64` bits (`fade_by_continuation`); starts at 1.
    continuing: AtomicU64,
    /// The moving share of recent prompts of which nothing was known that the worker reported
    /// holding at least a block of, as `f64` bits (`reuse_from_usage`); starts at 1.
    unseen_reuse: AtomicU64,
}

/// The mean tokens of one of the routing key's blocks, from the worker's count of the prompt's
/// tokens: in proportion to the bytes the key covers, which for a prompt longer than the key
/// (past `max_blocks`) are fewer than the prompt's. At least 1.
fn mean_block_tokens(req: &RequestInfo, usage: &super::Usage) -> u64 {
    let blocks = req.block_hashes.len().max(1) as u64;
    let key_bytes = req.bytes_at_depth(req.block_hashes.len());
    if req.prompt_bytes == 0 || key_bytes == 0 {
        return usage.prompt_tokens.div_ceil(blocks).max(1);
    }
    let key_tokens = (usage.prompt_tokens * key_bytes.min(req.prompt_bytes)) / req.prompt_bytes;
    key_tokens.div_ceil(blocks).max(1)
}

/// Requests the reuse share averages over, about.
const REUSE_WINDOW: f64 = 64.0;

/// Other replicas' share of the pool's requests ([`pool::PoolSample::share`]) from which the home
/// is presumed to hold all of what this replica knows of a prompt elsewhere, and in proportion
/// below it. Whatever their share, the other replicas send a conversation's turns home, and the
/// turn this replica moved for load is one they did not see; a presumption that stopped short of
/// parity would hand the conversation to that one turn's worker. Not at any share above 0, for
/// a pool that clients also reach directly now and then.
const PRESUME_ALL_FROM: f64 = 0.1;

impl CacheAware {
    pub fn new(params: CacheAwareParams) -> Self {
        Self {
            index: PrefixIndex::with_max_bytes(params.index_max_bytes),
            bytes_per_token: AtomicU64::new(params.bytes_per_token.to_bits()),
            learnt_from: AtomicU64::new(0),
            tie_break: super::random_cursor(),
            reuse: AtomicU64::new(1f64.to_bits()),
            continuing: AtomicU64::new(1f64.to_bits()),
            unseen_reuse: AtomicU64::new(1f64.to_bits()),
            params,
        }
    }

    /// The moving share of recent prompts that started with something known (see `reuse`).
    fn reuse_share_now(&self) -> f64 {
        f64::from_bits(self.reuse.load(Ordering::Relaxed))
    }

    /// Counts one more prompt into the reuse share (see [`count_into`]).
    fn count_reuse(&self, known: bool) {
        count_into(&self.reuse, known);
    }

    /// The moving share of requests past a shared prefix that continue something beyond it
    /// (see `continuing`).
    fn continuing_now(&self) -> f64 {
        f64::from_bits(self.continuing.load(Ordering::Relaxed))
    }

    /// The moving share of new prompts the workers held part of (see `unseen_reuse`).
    fn unseen_reuse_now(&self) -> f64 {
        f64::from_bits(self.unseen_reuse.load(Ordering::Relaxed))
    }

    fn bytes_per_token(&self) -> f64 {
        f64::from_bits(self.bytes_per_token.load(Ordering::Relaxed))
    }

    /// The weights of the queue's cost: each queued request costs `request_cost_tokens` plus
    /// `context_weight` per token of its prompt, and the prefill not yet started costs
    /// `pending_weight` per token ([`QueueWeights::cost`] says how other replicas' requests are
    /// counted).
    fn queue_weights(&self) -> QueueWeights {
        QueueWeights {
            pending: self.params.pending_weight,
            request: self.params.request_cost_tokens,
            context: self.params.context_weight,
            now: if self.params.step_phase {
                crate::load::now_us()
            } else {
                0
            },
            step_prefill: self.params.step_prefill,
            step_share: 1.0,
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

    /// How many times the pool's median time `w` takes per token, with `price_by_speed`; else 1.
    fn slowness(&self, w: &Worker) -> f64 {
        if self.params.price_by_speed {
            w.steps.slowness()
        } else {
            1.0
        }
    }

    /// No key: the usable worker with the least work queued, ties rotating. The work is priced
    /// as the pass prices it for keyed requests ([`QueueWeights::cost`]), with weights (and the
    /// clock the step remainders are read at) fixed once for the decision.
    fn least_work(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection> {
        let prompt = req.prompt_bytes as f64 / self.bytes_per_token();
        let weights = self.queue_weights();
        let queue_cost = |w: &Worker| {
            let local = w.inflight();
            weights.cost(w, local, w.load.queued(local), prompt) * self.slowness(w)
        };
        let n = workers.len();
        let start = self.tie_break.fetch_add(1, Ordering::Relaxed) % n.max(1);
        (0..n)
            .map(|k| (start + k) % n)
            .filter(|&i| workers[i].is_usable())
            .map(|i| (queue_cost(&workers[i]), i))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, i)| Selection::new(i, Outcome::Fallback))
    }

    /// The choice for `req` and what it expects there, and what it saw of the prompt for the
    /// moving shares ([`Seen`]); changes no routing state.
    fn decide(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<(Selection, Seen)> {
        let Some(&last) = req.block_hashes.last() else {
            return self.least_work(workers, req).map(|s| (s, Seen::default()));
        };
        let bpt = self.bytes_per_token();
        let sample = PoolSample::new(workers);
        let known = Known::survey(
            &self.params,
            &self.index,
            (workers, &sample),
            req,
            last,
            bpt,
        );
        let alone = self.alone(&known, &sample);
        let pass = self.pass(workers, req, &known, &sample, alone);
        let held_by = |index: usize, w: &Worker, depth: usize| known.held_by(req, index, w, depth);
        let Priced { best, home } = self.price(&pass, &known, &held_by)?;
        let (home, lightest) = self.lightest_for_new(&pass, &known, &sample, home, &held_by);
        let (credited, presumed) = self.credit_home(workers, req, &known, &sample, home, alone);
        let chosen = if credited.beats(&best) { home } else { best };
        let listed = known.matches.depth_of(workers[chosen.index].id_hash);
        let selection = selection(req, &known, chosen, listed, (home, lightest), presumed);
        let seen = Seen {
            any: known.any(),
            continues: (known.key_depth > 0 && !known.all_exact)
                .then_some(known.deepest > known.key_depth),
        };
        Some((selection, seen))
    }

    /// How far this request is one whose time to first token is set by the prefill already
    /// waiting on each worker rather than by what it holds: known no further than a prefix most
    /// workers hold (`hot_pending_weight`), so every holder would prefill the same for it. 1 for
    /// such a request as far as this gateway decides alone, fading with other replicas' share,
    /// since the home is what replicas agree on. On events, replicas need no home to agree on:
    /// each sees where the others' requests went, so the spread holds whatever their share.
    fn alone(&self, known: &Known, sample: &PoolSample) -> f64 {
        if self.params.hot_pending_weight <= 0.0 || !self.params.shared_home {
            0.0
        } else if known.all_exact {
            let holding = known
                .exacts
                .iter()
                .flatten()
                .filter(|&&e| e == known.exact_deepest);
            if known.exact_deepest > 0 && holding.count() >= known.most {
                1.0
            } else {
                0.0
            }
        } else if known.key_depth > 0 && known.key_depth == known.deepest {
            let fade = if self.params.fade_by_continuation {
                (2.0 * self.continuing_now()).min(1.0)
            } else {
                1.0
            };
            1.0 - sample.others() * fade
        } else {
            0.0
        }
    }

    /// How much of the step's remainder prices this request (`step_transient_only`), by how
    /// likely its placement is to last: a question under a prefix most workers hold sets where its
    /// conversation goes as far as such questions are continued; a prompt of which nothing is
    /// known, as far as prompts start with something known again (each share as the policy
    /// reports it, none while its moving share is off); anything else follows what it holds. The
    /// step counts by `1 - min(1, 2 × share)`: fully where placements never last, not at all
    /// where half of them do.
    fn step_share(&self, known: &Known, alone: f64) -> f64 {
        let lasting = if alone > 0.0 {
            self.continuing_share()
        } else if !known.any() {
            self.reuse_share()
        } else {
            Some(1.0)
        };
        lasting.map_or(1.0, |share| 1.0 - (2.0 * share).min(1.0))
    }

    /// What the pricing pass needs, fixed before it: the holders, the hot part of the prompt and
    /// the idle credit it earns, the load bound, and the queue's weights.
    fn pass<'a>(
        &self,
        workers: &'a [Arc<Worker>],
        req: &RequestInfo,
        known: &'a Known,
        sample: &PoolSample,
        alone: f64,
    ) -> Pass<'a> {
        let matches = &known.matches;
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
        let miss = self.params.miss_weight;
        // The hot part of the prompt: what at least two workers hold, or what one of the last
        // `workers` requests went through (about a worker's share of the traffic or more), which
        // the one worker holding it cannot keep to itself without leaving others idle.
        let hot = if self.params.amortize_hot_copies {
            let by_events = known::second_largest(known.exacts.iter().flatten().copied());
            let depth = known.shared_depth.max(matches.recent);
            known.tokens_at(req, depth).max(by_events as f64)
        } else {
            0.0
        };
        // Usable workers and their requests in flight, for bounded loads.
        let cap = if self.params.load_bound > 0.0 {
            self.load_cap(PoolLoad::of(workers.iter()))
        } else {
            usize::MAX
        };
        // An idle worker short of the hot prefix is credited it while the pool's mean (from a
        // sample, read only when the prefix is hot) is over one request in flight.
        let idle_credit = if hot > 0.0 && sample.load().mean() > 1.0 {
            miss * hot
        } else {
            0.0
        };
        let mut weights = self.queue_weights();
        weights.pending += self.params.hot_pending_weight * alone;
        if self.params.step_transient_only {
            weights.step_share = self.step_share(known, alone);
            if weights.step_share <= 0.0 {
                weights.now = 0;
            }
        }
        Pass {
            workers,
            key: known.key,
            cap,
            holders,
            matches,
            everyone_held: known.tokens_at(req, matches.everyone) / 1000.0,
            full_price: miss * known.prompt,
            prompt: known.prompt,
            miss,
            idle_credit,
            weights,
            by_speed: self.params.price_by_speed,
            home_by_speed: self.params.price_by_speed
                && self.params.home_by_speed
                && workers.len() <= PRICE_ALL_UP_TO,
        }
    }

    /// Prices the workers: the cheapest and the key's home, `None` when no worker is usable.
    /// The pass is compiled once for each combination of what is known before it (any events
    /// at all; an idle worker's credit for a hot prefix; blocks presumed on every worker), so the
    /// common pool runs no per-worker code for what it lacks: this loop is the decision's cost at
    /// scale. A large pool is priced on a sample for load ([`Pass::candidates`]), which keeps
    /// every worker that may hold more of the prompt and the home, so the choice differs from
    /// pricing all only where a sampled worker's queue stands in for the least loaded one's. Not
    /// with events (every worker's own blocks are already read) nor with a load bound (the home
    /// must be under it, which the light pass does not read).
    fn price(
        &self,
        pass: &Pass,
        known: &Known,
        held_by: &impl Fn(usize, &Worker, usize) -> f64,
    ) -> Option<Priced> {
        let workers = pass.workers;
        let flags = price_flags(pass, known);
        let sampled = (workers.len() > PRICE_ALL_UP_TO
            && !known.any_exact()
            && pass.cap == usize::MAX)
            .then(|| {
                let turn = self.tie_break.fetch_add(1, Ordering::Relaxed);
                let priced = pass.candidates(turn);
                pass.price(priced.iter().map(|&i| (i, &workers[i])), flags, held_by)
            });
        let priced = match sampled {
            Some(priced) if priced.best.index != NONE => priced,
            // None usable among them (the home was ejected since the light pass): price all.
            _ => pass.price(workers.iter().enumerate(), flags, held_by),
        };
        (priced.best.index != NONE).then_some(priced)
    }

    /// With `fresh_by_writes`, for a prompt of which nothing is known on a lone gateway: the
    /// usable worker written to least lately, priced, in the home's place, and `true`. Else
    /// `home` and `false`.
    fn lightest_for_new(
        &self,
        pass: &Pass,
        known: &Known,
        sample: &PoolSample,
        home: Candidate,
        held_by: &impl Fn(usize, &Worker, usize) -> f64,
    ) -> (Candidate, bool) {
        let workers = pass.workers;
        if !self.params.fresh_by_writes
            || known.any()
            || workers.len() > PRICE_ALL_UP_TO
            || sample.others() > 0.0
        {
            return (home, false);
        }
        let now = crate::load::now_us();
        // Written lately in the worker's own time: a GPU three times as fast writes three times
        // the tokens for the same share of its time.
        let written = |w: &Worker| w.kv.recent(now) * self.slowness(w);
        let lightest = (0..workers.len())
            .filter(|&i| workers[i].is_usable())
            .map(|i| (written(&workers[i]), i))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        // The home where it is among the lightest (an idle pool's first prompts: by hash).
        let Some((least, i)) = lightest else {
            return (home, false);
        };
        // Nor where a prompt already waits to prefill on the lightest: a burst of new prompts
        // (conversations that end together) would otherwise all go there, its credit outweighing
        // the prefill they queue; the rest go by hash, as without the flag.
        if written(&workers[home.index]) <= least || workers[i].load.pending_prefill() > 0 {
            return (home, false);
        }
        let flags = price_flags(pass, known);
        let priced = pass.price(std::iter::once((i, &workers[i])), flags, held_by);
        if priced.best.index == NONE {
            (home, false)
        } else {
            (priced.best, true)
        }
    }

    /// The home as the choice weighs it against the cheapest worker, and the tokens it is
    /// presumed to hold beyond what it is known to.
    ///
    /// Other replicas send this prompt's conversation to its home too: presume the home holds
    /// what it is known to, plus the gap to what any worker is known to hold in proportion to
    /// the share of the pool's requests this gateway does not see (`shared_home`). Events are
    /// everyone's knowledge already, so not with them. The part no worker is known to hold is
    /// credited to the home by `home_affinity`, and by more of it as other replicas' share
    /// grows: they send the turns this gateway has not seen there. By `reuse_affinity` for a
    /// request that continues a prefix one worker holds and no other recent request went
    /// through (a conversation's next turn): the turns after it carry its new part too. A
    /// question on a shared document is not followed by its own text.
    fn credit_home(
        &self,
        workers: &[Arc<Worker>],
        req: &RequestInfo,
        known: &Known,
        sample: &PoolSample,
        home: Candidate,
        alone: f64,
    ) -> (Candidate, f64) {
        let params = &self.params;
        let deepest = known.deepest;
        let h = match params.reuse_affinity {
            Some(r)
                if params.shared_home && deepest > known.shared_depth.max(known.matches.recent) =>
            {
                r
            }
            _ => params.home_affinity,
        };
        // A prompt of which no worker is known to hold anything, not even a shared prefix, is as
        // likely new as another replica's (a conversation's turns carry its system prompt or its
        // own earlier turns): it keeps `home_affinity`, or replicas would place every new prompt
        // by its hash alone.
        let replicas_matter = params.shared_home
            && !known.all_exact
            && deepest > 0
            && (home.depth < deepest || known.unknown > 0.0);
        // A prompt of which nothing at all is known, where fewer than half of this gateway's
        // prompts start with anything known, is as likely never to come back: its credit fades
        // by `min(1, 2 × share)`, except as far as other replicas' unseen traffic may send it home
        // (`new_prompt_by_reuse`). The other replicas' share is sampled only when the credit
        // fades. Meant to leave traffic whose prompts mostly continue something (a conversation's
        // first turn is new, its later ones are not) alone: it does where clients pause between
        // requests or arrive in open loop, not always in a closed loop without pauses, whose
        // clients fall into step (see `docs/measurements.md`, "Clients that think").
        let gate = if params.new_prompt_by_reuse && !known.any() {
            (2.0 * self.reuse_share_now()).min(1.0)
        } else {
            1.0
        };
        let h = if gate < 1.0 {
            let mut back = sample.others();
            if params.reuse_from_usage {
                back = back.min((2.0 * self.unseen_reuse_now()).min(1.0));
            }
            h * (gate + (1.0 - gate) * back)
        } else {
            h
        };
        let (presumed, affinity) = if replicas_matter {
            let others = sample.others();
            let presumed = if home.depth < deepest {
                let held = known.held_by(req, home.index, &workers[home.index], home.depth);
                let full = (sample.share() / PRESUME_ALL_FROM).min(1.0);
                full * (known.tokens_at(req, deepest) - held).max(0.0)
            } else {
                0.0
            };
            (presumed, h + (1.0 - h) * others)
        } else {
            (0.0, h)
        };
        // In the home's own time, as its cost is (`price_by_speed`).
        let credit = (1.0 - alone)
            * params.miss_weight
            * (affinity * known.unknown + presumed)
            * self.slowness(&workers[home.index]);
        let credited = Candidate {
            cost: home.cost - credit,
            ..home
        };
        (credited, presumed)
    }
}

/// What the pricing pass is compiled for ([`Pass::price`]): any events at all, an idle worker's
/// credit for a hot prefix, blocks presumed on every worker.
fn price_flags(pass: &Pass, known: &Known) -> (bool, bool, bool) {
    (
        known.any_exact(),
        pass.idle_credit > 0.0,
        known.matches.everyone > 0,
    )
}

/// What a decision saw of the prompt, for the moving shares it feeds.
#[derive(Default)]
struct Seen {
    /// Some worker was known to hold the start of the prompt (`new_prompt_by_reuse`).
    any: bool,
    /// For a prompt past a prefix most workers hold (by the index), whether it continued
    /// something known beyond it (`fade_by_continuation`).
    continues: Option<bool>,
}

/// Counts one more sample into a moving share over about [`REUSE_WINDOW`] samples, held as `f64`
/// bits. A plain load and store: two decisions at once may lose one sample of a moving
/// average, which is cheaper than a retry loop. No store when the share does not move (at 1,
/// where every sample is true), so such traffic does not bounce the cache line every decision
/// reads.
fn count_into(share: &AtomicU64, sample: bool) {
    let now = f64::from_bits(share.load(Ordering::Relaxed));
    let sample = if sample { 1.0 } else { 0.0 };
    let next = now + (sample - now) / REUSE_WINDOW;
    if next != now {
        share.store(next.to_bits(), Ordering::Relaxed);
    }
}

/// The decision for `chosen`, whose index lists it as holding `listed` blocks of the prompt:
/// why it was chosen, and what it is expected to hold of the prompt.
fn selection(
    req: &RequestInfo,
    known: &Known,
    chosen: Candidate,
    listed: usize,
    (home, lightest): (Candidate, bool),
    presumed: f64,
) -> Selection {
    let exact = known.exacts.get(chosen.index).copied().flatten();
    // Priced as holding a popular prefix it was never sent: the copy starts here.
    let copied = exact.is_none() && chosen.depth <= known.popular && listed < chosen.depth;
    let depth = if copied { listed } else { chosen.depth };
    let outcome = match (known.deepest, chosen.depth) {
        _ if exact.is_some_and(|t| t > 0) => Outcome::ExactMatch,
        _ if copied => Outcome::Replicated,
        (0, _) if chosen.index == home.index && lightest => Outcome::LeastWritten,
        (0, _) if chosen.index == home.index => Outcome::HashHome,
        (d, c) if c < d && presumed > 0.0 && chosen.index == home.index => Outcome::HashHome,
        (0, _) => Outcome::Spilled,
        (d, c) if c == d => Outcome::LongestMatch,
        (_, 0) => Outcome::Replicated,
        _ => Outcome::Spilled,
    };
    let prediction = Prediction {
        prompt_tokens: known.prompt.round() as u32,
        cached_tokens: match exact {
            Some(held) => held.min(u64::from(u32::MAX)) as u32,
            None => known.tokens_at(req, depth).round() as u32,
        },
        matched_blocks: depth as u32,
        fresh: !known.any(),
    };
    Selection {
        index: chosen.index,
        outcome,
        prediction: Some(prediction),
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn select(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection> {
        let (selection, seen) = self.decide(workers, req)?;
        if self.params.new_prompt_by_reuse && selection.prediction.is_some() {
            self.count_reuse(seen.any);
        }
        if let Some(continues) = seen.continues.filter(|_| self.params.fade_by_continuation) {
            count_into(&self.continuing, continues);
        }
        let Some(prediction) = selection.prediction else {
            return Some(selection); // no key: nothing to learn
        };
        let worker = &workers[selection.index];
        // The prompt's uncached part is written into the worker's KV cache: its clock moves.
        let uncached = prediction
            .prompt_tokens
            .saturating_sub(prediction.cached_tokens);
        let kv = worker.kv.stamp(u64::from(uncached));
        let kv = kv.filter(|_| self.params.evict_by_capacity);
        let restarts = Some(worker.kv.restarts());
        self.index
            .insert_at(&req.block_hashes, worker.id_hash, kv, restarts);
        worker
            .peer_outbox
            .placed(&req.block_hashes, u64::from(uncached));
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

    fn learn_placement(&self, worker: &Worker, hashes: &[u64], uncached: u64) {
        // The peer's prompt is written into the worker's KV cache as this gateway's would be.
        let kv = worker.kv.stamp(uncached);
        let kv = kv.filter(|_| self.params.evict_by_capacity);
        let restarts = Some(worker.kv.restarts());
        self.index.insert_at(hashes, worker.id_hash, kv, restarts);
    }

    fn reuse_share(&self) -> Option<f64> {
        self.params
            .new_prompt_by_reuse
            .then(|| self.reuse_share_now())
    }

    fn continuing_share(&self) -> Option<f64> {
        self.params
            .fade_by_continuation
            .then(|| self.continuing_now())
    }

    fn unseen_reuse_share(&self) -> Option<f64> {
        self.params
            .reuse_from_usage
            .then(|| self.unseen_reuse_now())
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
        // What the worker wrote beyond the prompt's part the decision counted on its KV clock.
        let uncached = usage.cached_tokens.map_or(0, |c| {
            let predicted = predicted
                .prompt_tokens
                .saturating_sub(predicted.cached_tokens);
            usage.prompt_tokens.saturating_sub(c + u64::from(predicted))
        });
        worker
            .kv
            .add(uncached + usage.completion_tokens.unwrap_or(0));
        if let Some(cached) = usage.cached_tokens {
            // A prompt of which nothing was known, of which the worker held at least about one
            // of the routing key's blocks: another replica (or something else unseen) sent its
            // beginning there. Where that never happens, other replicas' traffic is no reason
            // to give such prompts their home's credit back.
            if predicted.fresh && self.params.reuse_from_usage && usage.prompt_tokens > 0 {
                count_into(&self.unseen_reuse, cached >= mean_block_tokens(req, &usage));
            }
            if predicted.cached_tokens > 0 {
                worker
                    .load
                    .learn_cache_trust(cached as f64 / f64::from(predicted.cached_tokens));
            }
        }
    }
}
