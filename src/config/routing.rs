//! Routing settings: the policy and its parameters, the routing key, and A/B arms.

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError};

/// What decides routing, and what a reload swaps live.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingConfig {
    pub policy: PolicyConfig,
    pub ab: Option<AbConfig>,
}

impl Config {
    pub fn routing(&self) -> RoutingConfig {
        RoutingConfig {
            policy: self.policy.clone(),
            ab: self.ab.clone(),
        }
    }
}

/// A/B test of routing logic: each request goes to one arm, sticky per client (by
/// `sticky_header` when the request has it, else by its prompt's first block), in proportion to
/// the weights. Every metric carries the arm's name in its `arm` label.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbConfig {
    pub arms: Vec<ArmConfig>,
    #[serde(default)]
    pub sticky_header: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArmConfig {
    /// Label value on metrics: letters, digits, `-` and `_`, at most 32.
    pub name: String,
    pub weight: f64,
    pub policy: PolicyConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyConfig {
    RoundRobin,
    LeastConn,
    Prefix(PrefixParams),
    CacheAware(CacheAwareParams),
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::CacheAware(CacheAwareParams::default())
    }
}

impl PolicyConfig {
    pub const NAMES: [&'static str; 4] = ["round_robin", "least_conn", "prefix", "cache_aware"];

    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::RoundRobin => "round_robin",
            PolicyConfig::LeastConn => "least_conn",
            PolicyConfig::Prefix(_) => "prefix",
            PolicyConfig::CacheAware(_) => "cache_aware",
        }
    }

    /// The policy called `name`, keeping `self`'s parameters when it is already that policy.
    pub fn with_name(self, name: &str) -> Result<Self, ConfigError> {
        if self.name() == name {
            return Ok(self);
        }
        match name {
            "round_robin" => Ok(PolicyConfig::RoundRobin),
            "least_conn" => Ok(PolicyConfig::LeastConn),
            "prefix" => Ok(PolicyConfig::Prefix(PrefixParams::default())),
            "cache_aware" => Ok(PolicyConfig::CacheAware(CacheAwareParams::default())),
            other => Err(ConfigError::Invalid(format!(
                "unknown policy {other:?}; expected one of {}",
                Self::NAMES.join(", ")
            ))),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixParams {
    /// How many leading blocks of the routing key choose the worker.
    pub key_blocks: usize,
    /// Bounded load: a worker is over its bound when its in-flight count would exceed
    /// `load_factor` × the pool's mean (counting the new request).
    pub load_factor: f64,
    /// How many further candidates in hash order are tried before falling back to least-connections.
    pub spill_candidates: usize,
}

impl Default for PrefixParams {
    fn default() -> Self {
        Self {
            key_blocks: 4,
            load_factor: 1.5,
            spill_candidates: 1,
        }
    }
}

/// `cache_aware`: the worker with the lowest estimated cost, prefill of what it does not hold of
/// the prompt plus the work queued on it, from a bounded index of the prefixes sent to each worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheAwareParams {
    /// Memory the prefix index may use, in bytes.
    pub index_max_bytes: usize,
    /// What one request queued or running on a worker costs a new arrival there, in prompt
    /// tokens of prefill, besides its context (`context_weight`): the per-sequence share of a
    /// decode step.
    pub request_cost_tokens: f64,
    /// What each prompt token of a request queued or running on a worker costs a new arrival
    /// there, in prompt tokens of prefill: every decode step reads that request's KV cache, so a
    /// long conversation weighs on a worker more than a short question. At the default 0.04, a
    /// 512-token request costs about 24 tokens and a 1,536-token one about 65.
    pub context_weight: f64,
    /// Canonical prompt bytes per token until the workers' `usage` reports teach the real ratio.
    pub bytes_per_token: f64,
    /// Share of the prompt that no worker is known to hold that the request's rendezvous home is
    /// credited with: another replica may have sent that prefix there. With `shared_home`, it
    /// rises towards 1 by `min(1, 2f)` of the rest while the polled load shows other replicas'
    /// share `f` of the traffic: they send the turns this gateway has not seen to the home. Not
    /// for a prompt of which nothing is known (no shared prefix, no earlier turn): a new one.
    pub home_affinity: f64,
    /// `home_affinity` for a request that continues a prefix that one worker is known to hold
    /// and that none of the last `n` requests (`n` workers) went through: a conversation's next
    /// turn, whose new part the turns after it will carry too. With `shared_home` only (without
    /// it the home's key moves with every turn). A question on a prefix that many requests share
    /// keeps `home_affinity`: its own text comes once. Unset: `home_affinity`. At 1, a
    /// conversation that load placed away from its home settles there. On the bench's chat
    /// workload that cost 0.6-1% of throughput in two batches, and steadied the p95 TTFT in one
    /// of them only (see `docs/measurements.md`).
    pub reuse_affinity: Option<f64>,
    /// Fade the home's credit for a prompt of which nothing at all is known (no worker holds
    /// its first block) when fewer than half of this gateway's recent prompts (a moving share
    /// over about the last 64) start with something known, by `min(1, 2 × share)`. Where prompts
    /// are never reused (every one new, of any length), a hash places them at random and the long
    /// ones pile up; such traffic is then placed by cost alone, while a pool whose prompts mostly
    /// share system prompts or earlier turns keeps the whole credit for its new ones. Only as far
    /// as this gateway sees the pool's traffic: with other replicas' share `f` (polled load), the
    /// credit comes back by `min(1, 2f)`, since their conversations' turns reach this replica
    /// unknown and must still meet at the home. On by default: with clients that pause between
    /// requests (`bench --think-time`) or arrive in open loop, it cut random's and mixed's p95
    /// TTFT to 0.69-0.78x and left the other workloads at 0.98-1.07x; only in a closed loop
    /// without pauses did random's and multi-turn's tails pay for it, 1.46x and 1.10-1.28x (see
    /// `docs/measurements.md`, "Clients that think").
    pub new_prompt_by_reuse: bool,
    /// Weight of the prefill a worker would have to do (the tokens it does not hold). Above 1
    /// because a miss costs more than the request's own wait: its prefill stalls every sequence
    /// decoding on that worker, and the copy it makes evicts other prefixes.
    pub miss_weight: f64,
    /// Weight of the prefill this gateway has queued on a worker that it has not started
    /// (chunked prefill overlaps part of it with decoding). Other replicas' requests there (from
    /// the polled load) are counted as having as much of it as this gateway's, on average.
    /// Heavier, a request is less often sent where an earlier one's prefill has yet to run, at
    /// the price of more copies: at 3.0 (as heavy as a miss), with pausing clients, p95 TTFT was
    /// 0.89x the default's on 8 prefixes and 0.87x on zipf, but without pauses 1.49x on zipf,
    /// and multi-turn lost 3 points of hit rate (see `docs/measurements.md`, "Prefill waiting
    /// behind prefill").
    pub pending_weight: f64,
    /// Bounded loads: a worker is chosen only while its requests in flight are under this many
    /// times the mean over the usable workers (counting the new request), rounded up, as in
    /// consistent hashing with bounded loads (HAProxy's `hash-balance-factor 125` is 1.25). The
    /// cost alone prices a cold worker's one-off copy of a shared prefix against every request's
    /// own wait, and can leave a worker idle for good; this bounds that. 0 turns it off; else at
    /// least 1.
    pub load_bound: f64,
    /// Price a copy of a hot prefix to an idle worker that holds none of the prompt as an
    /// investment the requests to come share: while the mean in flight is over 1, the hot part
    /// is priced as held there (at 1 or less, a conversation's own earlier turns can look hot).
    /// Hot: at least two workers hold it, or one of the last `n` requests went through it (`n`
    /// workers; about a worker's share of the traffic or more).
    /// Otherwise the copy costs its whole prefill. A worker without a prefix that everyone
    /// shares is not left idle, beside the others or at light load beside one busy holder.
    pub amortize_hot_copies: bool,
    /// Replicas without shared state agree on a conversation's worker. The home's rendezvous key
    /// is the first block past the part of the prompt that most workers hold (more than half, at
    /// least two: a shared system prompt), the same for every turn of a conversation on every
    /// replica, even once a spill has put the conversation on a second worker; and when the
    /// workers' polled load shows traffic beyond this gateway's own (other replicas), the home is
    /// presumed to hold, besides what it is known to, the rest of what any worker is known to
    /// hold in proportion to that traffic's share (all of it from one half on), since the other
    /// replicas send it there too; for the same reason the home's credit for the part no worker
    /// is known to hold rises from `home_affinity` towards all of it.
    /// Off: the key is the first block past this gateway's longest known match.
    pub shared_home: bool,
    /// For a request whose known prefix most workers hold and of which nothing deeper is known
    /// (a question under a shared system prompt, any request of a hot prefix), every holder
    /// costs the same prefill. What then sets its time to first token is the prefill already
    /// sent to a worker and not started: vLLM runs every prefill scheduled in a step before any
    /// of them answers. So for such a request each worker's pending prefill weighs this much
    /// more, and the rendezvous home is not credited (its hash would put simultaneous arrivals
    /// together at random). While the polled load shows other replicas' traffic (share `f`),
    /// both fade back to the home's credit, by `max(0, 1 - 2f)`: the home is what replicas agree
    /// on. Not when every worker publishes KV events: then the events tell every replica where a
    /// request went, and "known no further" means the deepest any worker's events hold of the
    /// prompt is held by most workers. 0 turns it off.
    pub hot_pending_weight: f64,
    /// With other replicas, keep `hot_pending_weight`'s fade to the home only as far as requests
    /// come back to continue what they started. The home matters to a question under a prefix
    /// most workers hold because its conversation's next turn may reach another replica, which
    /// sends it to the home. So the fade is scaled by `min(1, 2 × continuing)`, where
    /// `continuing` is the moving share (about the last 64) of this gateway's requests past such
    /// a shared prefix that continue something private beyond it (a conversation's earlier
    /// turn). Where none do (questions on popular documents or prefixes, each new), every
    /// replica places them by pending prefill, as one gateway does. Starts at 1 (the fade in
    /// full). No effect on a lone gateway. Two replicas against one gateway's p95 TTFT (closed
    /// loop, lengths ± 50%, medians of 3): zipf 1.09x against 1.19x with it off, 8 prefixes
    /// 1.05x against 1.20x, chat 1.03x against 1.06x (see `docs/measurements.md`).
    pub fade_by_continuation: bool,
    /// Spread a popular prefix over as many workers as its traffic needs: while a prefix's share
    /// `s` of this gateway's requests (a moving mean over about its last 8 uses) is more than
    /// its holders' count times `spread_share` of one worker's fair share (`1/n`), i.e. while
    /// each holder would take more than `spread_share` of a worker's load from that prefix
    /// alone, every worker is priced as holding it, as a prefix past a full holder list is. A
    /// copy to a further worker is then paid once and shared by the requests that follow it
    /// there, and the prefix's requests spread by pending prefill instead of queueing on one or
    /// two holders. Two gates keep it to prefixes that queue behind themselves: more of the
    /// prefix's requests are in flight (`s` times this gateway's) than it has holders, so one
    /// conversation's turns (one at a time) and any prefix at light load stay put; and its
    /// holders have more requests in flight than the pool's mean, so a prefix whose holders are
    /// no busier than the rest is not moved. At 0.125, with 4 busy workers: 8 equally popular
    /// prefixes reach every worker, a prefix of 1 request in 18 reaches two, one of 1 in 200
    /// stays on its first; with 1,024 workers, a prefix of 1 request in 4,096 reaches two. 0
    /// turns it off.
    pub spread_share: f64,
    /// Presume a worker has evicted what it was sent once a KV cache's worth of tokens has been
    /// written there since: its capacity from `vllm:cache_config_info` (`num_gpu_blocks` ×
    /// `block_size`), the writes counted from this gateway's own requests (uncached prompt
    /// tokens and generated tokens; see [`crate::load::KvClock`] for why not the worker's
    /// counters). vLLM takes the least recently used free block for each new one, so an index
    /// that kept everything it sent would predict hits on prompts long gone once the workers'
    /// caches overflow (long prompts, many of them). Acts only once a poll has shown a worker's
    /// capacity. Workers that publish KV events are read from their events anyway.
    pub evict_by_capacity: bool,
    /// Count what remains of the step a worker is running in its queue. vLLM sends a step's
    /// tokens to every stream at once when the step ends, so a worker's load falls (first tokens
    /// clear pending prefill, answers end) just as its next step begins, and a choice by load
    /// alone keeps taking the worker with the longest wait ahead. With this, each worker's steps
    /// are timed from the bursts of this gateway's streams from it, fitted as a base time plus a
    /// time per prefill token ([`crate::load::StepClock`]), and the base time less the time
    /// since its last burst is priced as that many tokens of pending prefill. Only streams are
    /// timed; with none, nothing changes. Against it off (closed loop, lengths ± 50%, medians
    /// of 3): 8 prefixes every worker holds 1.00x round-robin's p95 TTFT against 1.21x; zipf
    /// 0.98x, multi-turn 0.97x, chat and 200 prefixes level (see `docs/measurements.md`).
    pub step_phase: bool,
    /// With `step_phase`, the step under way works through the prefill it began with: past its
    /// base time, the part of that prefill its fitted rate says is done no longer counts as
    /// pending. Without it, a worker half-way through a long prefill step looks as busy as one
    /// that has just begun it.
    pub step_prefill: bool,
    /// With `step_phase`, the step under way is priced only for requests whose placement does
    /// not last. A step's remainder is gone within a step, while a conversation's first turn sets
    /// where its later turns go and a turn moved for it stays moved, its history prefilled again.
    /// So a request that holds more somewhere than elsewhere is placed without it; a question
    /// known no further than a prefix most workers hold counts it by `1 - min(1, 2c)`, `c` the
    /// moving share of such questions that go on to continue something private beyond the prefix
    /// (`fade_by_continuation`); a prompt of which nothing is known, by `1 - min(1, 2r)`, `r` the
    /// moving share of prompts that start with something known (`new_prompt_by_reuse`).
    pub step_transient_only: bool,
    /// With `new_prompt_by_reuse`, the home's credit that other replicas' traffic gives back to a
    /// prompt of which nothing is known comes back only as far as such prompts turn out to be
    /// held where they went: the moving share of them whose worker reported at least one routing
    /// block's worth of `cached_tokens` (`min(1, 2 × share)`, starting at 1). Where prompts are
    /// never reused, replicas then place them by cost, not by hash. Workers that report no
    /// `cached_tokens` leave the credit as it was.
    pub reuse_from_usage: bool,
    /// A lone gateway gives the home's credit for a prompt of which nothing at all is known (a
    /// conversation's first turn) not to the prompt's hash home but to the usable worker this
    /// gateway has had write the fewest tokens lately ([`crate::load::KvClock::recent`]: uncached
    /// prompt tokens and generated tokens, decaying by `e` a minute): a new conversation starts
    /// where the fewest live, and its later turns follow it, so conversations are spread by what
    /// they bring rather than by chance. Not while a prompt this gateway sent there waits to
    /// prefill (a burst of new conversations would all go to one worker, the credit outweighing
    /// the prefill they queue), nor beside other replicas (polled load beyond this gateway's own),
    /// which meet a conversation's turns at its hash home, nor in pools of more than 128 workers.
    /// On multi-turn, against it off (medians of 3, one gateway): p95 TTFT 0.93x with output
    /// lengths ± 50%, 0.92x with pauses, 0.96x with equal lengths, at the same throughput (see
    /// `docs/measurements.md`, "New conversations where the fewest live").
    pub fresh_by_writes: bool,
    /// Price each worker in its own time: its cost (the prefill it would do, the work queued on
    /// it) times its fitted time per prefill token over the pool's median
    /// ([`crate::load::StepClock::slowness`], from the step fits of `step_phase`, re-read at each
    /// load poll), and with `fresh_by_writes` its recent writes the same way. In a pool of one
    /// model on unlike GPUs, a queue on a GPU three times as fast is a third of the wait, and a
    /// cache miss there a third of the prefill. Workers within 1.25x of the median, or not yet
    /// timed (no streams), count as the median. While other replicas' requests are more than a
    /// quarter of the pool's in flight, their prefill throws this gateway's own fits off, and
    /// the workers are timed against the prefill their own counters show instead
    /// ([`crate::load::Polled::prefilled`]; [`crate::load::rate_speeds`]), read only while that
    /// fit's standard error is within a tenth of it (at light load it is not). A pool of one GPU
    /// type is priced as without it: on 4 simulated L4s and on 4 L40Ss, one gateway, every
    /// workload, the ratings read 1 at every scrape (see `docs/measurements.md`, "A pool of
    /// unlike GPUs").
    pub price_by_speed: bool,
    /// With `price_by_speed`, each worker is home to a share of prompts in proportion to its
    /// speed (weighted rendezvous hashing: a prompt's home is the worker with the highest
    /// `u^slowness`, `u` its rendezvous score in (0, 1]), not an equal share: in a pool of
    /// unlike GPUs the homes that replicas meet at, and that new prompts start on, are then
    /// where the capacity is, and the cost does not keep moving a slow home's conversations
    /// away from it. Workers rated alike (all 1) keep the plain rendezvous order, and a
    /// replica whose ratings differ a little from another's disagrees on about that share of
    /// homes only. Not in pools of more than 128 workers, whose homes are found without
    /// reading the workers' ratings.
    pub home_by_speed: bool,
}

impl Default for CacheAwareParams {
    fn default() -> Self {
        Self {
            index_max_bytes: 64 << 20,
            request_cost_tokens: 4.0,
            context_weight: 0.04,
            bytes_per_token: 4.0,
            home_affinity: 0.5,
            reuse_affinity: None,
            new_prompt_by_reuse: true,
            miss_weight: 3.0,
            pending_weight: 0.5,
            load_bound: 0.0,
            amortize_hot_copies: true,
            shared_home: true,
            hot_pending_weight: 3.0,
            fade_by_continuation: true,
            spread_share: 0.125,
            evict_by_capacity: true,
            step_phase: true,
            step_prefill: true,
            step_transient_only: true,
            reuse_from_usage: true,
            fresh_by_writes: true,
            price_by_speed: true,
            home_by_speed: true,
        }
    }
}

impl CacheAwareParams {
    pub fn validate(&self) -> Result<(), String> {
        let finite_pos = |v: f64| v.is_finite() && v > 0.0;
        if self.index_max_bytes < 4096 {
            return Err("cache_aware.index_max_bytes must be at least 4096".into());
        }
        let ok = self.request_cost_tokens.is_finite()
            && self.request_cost_tokens >= 0.0
            && self.context_weight.is_finite()
            && self.context_weight >= 0.0
            && finite_pos(self.bytes_per_token)
            && (0.0..=1.0).contains(&self.home_affinity)
            && self.reuse_affinity.is_none_or(|r| (0.0..=1.0).contains(&r))
            && finite_pos(self.miss_weight)
            && self.pending_weight.is_finite()
            && self.pending_weight >= 0.0
            && self.hot_pending_weight.is_finite()
            && self.hot_pending_weight >= 0.0
            && (0.0..=1.0).contains(&self.spread_share)
            && (self.load_bound == 0.0 || (self.load_bound.is_finite() && self.load_bound >= 1.0));
        if !ok {
            return Err("cache_aware: request_cost_tokens >= 0, context_weight >= 0, bytes_per_token > 0, home_affinity and reuse_affinity in [0, 1], miss_weight > 0, pending_weight >= 0, hot_pending_weight >= 0, spread_share in [0, 1], load_bound 0 or >= 1".into());
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingKeyConfig {
    /// Size of one hashed block of the canonical prompt, in bytes.
    pub block_bytes: usize,
    /// Blocks hashed at most; bytes past `block_bytes × max_blocks` are never read (the
    /// blocks that end early at a message's end count too).
    pub max_blocks: usize,
}

impl Default for RoutingKeyConfig {
    fn default() -> Self {
        Self {
            block_bytes: 256,
            max_blocks: 256,
        }
    }
}
