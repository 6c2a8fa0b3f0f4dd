//! Routing policies: one small synchronous trait, one factory from the config enum, one file per algorithm.
//!
//! A policy sees the workers that serve the request's model (with their load signals) and the
//! request's routing key, and names one of them. It must not block or allocate much: it runs on
//! every request. A policy that learns is told how each request it routed ended ([`Policy::observe`]).

use std::sync::Arc;

use crate::{config::PolicyConfig, routing_key::RequestInfo, workers::Worker};

pub mod arms;
mod cache_aware;
mod least_conn;
mod prefix;
mod round_robin;

pub use cache_aware::CacheAware;
pub use least_conn::LeastConn;
pub use prefix::Prefix;
pub use round_robin::RoundRobin;

/// A policy's turn counter (round-robin's cursor, a tie-break's rotation), starting at a random
/// point: gateway replicas started together would otherwise turn in step, and requests reaching
/// two of them at once would land on one worker together.
fn random_cursor() -> std::sync::atomic::AtomicUsize {
    use std::hash::BuildHasher;
    let start = std::collections::hash_map::RandomState::new().hash_one(0u64);
    std::sync::atomic::AtomicUsize::new(start as usize)
}

/// How a worker was chosen; counted in `kvroute_routing_decisions_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The policy's first choice.
    Preferred,
    /// The first choice was unusable or over its load bound; a later candidate took it.
    Spilled,
    /// No candidate in the policy's own order would do; the least-loaded worker took it.
    LeastConnFallback,
    /// The worker holding the longest known prefix of the prompt.
    LongestMatch,
    /// No worker holds any of the prompt: its rendezvous home, equal on every replica.
    HashHome,
    /// Another worker holds the prompt's prefix but was too busy: this one gets a copy.
    Replicated,
    /// The request had no routing key: the worker with the least work queued.
    Fallback,
    /// The worker whose KV cache events show it holds the prompt's longest prefix.
    ExactMatch,
    /// No worker holds any of the prompt, and no other replica needs it at its home: the worker
    /// this gateway has had write the fewest tokens lately, where the fewest conversations live.
    LeastWritten,
}

impl Outcome {
    /// How many outcomes there are.
    pub const COUNT: usize = Outcome::LeastWritten as usize + 1;

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Preferred => "preferred",
            Outcome::Spilled => "spilled",
            Outcome::LeastConnFallback => "least_conn_fallback",
            Outcome::LongestMatch => "longest_match",
            Outcome::HashHome => "hash_home",
            Outcome::Replicated => "replicated",
            Outcome::Fallback => "fallback",
            Outcome::ExactMatch => "exact_match",
            Outcome::LeastWritten => "least_written",
        }
    }
}

/// What a policy expects of the worker it chose, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prediction {
    pub prompt_tokens: u32,
    /// What the policy's index says the worker holds (before any discount for trust).
    pub cached_tokens: u32,
    /// Leading blocks of the routing key the worker was believed to hold.
    pub matched_blocks: u32,
    /// Nothing of the prompt, not even its first block, was known on any worker.
    pub fresh: bool,
}

impl Prediction {
    /// Prompt tokens the worker is expected to compute.
    pub fn uncached(self) -> u32 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Index into the slice the policy was given.
    pub index: usize,
    pub outcome: Outcome,
    /// Set by policies that model the workers' caches.
    pub prediction: Option<Prediction>,
}

impl Selection {
    pub fn new(index: usize, outcome: Outcome) -> Self {
        Self {
            index,
            outcome,
            prediction: None,
        }
    }
}

/// The token counts a worker reported in its answer's `usage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    /// `prompt_tokens_details.cached_tokens`, when the worker reports it (vLLM needs
    /// `--enable-prompt-tokens-details`).
    pub cached_tokens: Option<u64>,
    /// `completion_tokens`, when the answer has it.
    pub completion_tokens: Option<u64>,
}

/// How a routed request ended, as far as the gateway saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observed {
    /// A 2xx answer, with its usage if it carried one.
    Answered(Option<Usage>),
    /// No answer, or an error status: the worker did not take the prompt.
    Failed,
}

pub trait Policy: Send + Sync + 'static {
    /// The config name, used as the `policy` label.
    fn name(&self) -> &'static str;

    /// Picks one of `workers` for `req`, or `None` when none is usable.
    fn select(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection>;

    /// The choice [`Policy::select`] would make for `req` now, without making it: nothing is
    /// learnt or recorded (`/debug/route`). `None` from a policy whose choice is a turn of a
    /// rotation and means nothing until it is taken.
    fn peek(&self, _workers: &[Arc<Worker>], _req: &RequestInfo) -> Option<Selection> {
        None
    }

    /// Whether [`Policy::observe`] does anything (the proxy then reads usage from answers).
    fn learns(&self) -> bool {
        false
    }

    /// A peer replica sent `worker` a prompt through all of `hashes` (chained block hashes,
    /// as [`RequestInfo::block_hashes`]), `uncached` tokens of which it expected the worker to
    /// prefill ([`crate::peers`]): a policy that keeps an index learns it as its own placement.
    fn learn_placement(&self, _worker: &Worker, _hashes: &[u64], _uncached: u64) {}

    /// The policy's prefix index, if it keeps one.
    fn index_stats(&self) -> Option<crate::index::IndexStats> {
        None
    }

    /// The moving share of recent prompts that began with something the policy knew, if it
    /// keeps one (`cache_aware` with `new_prompt_by_reuse`).
    fn reuse_share(&self) -> Option<f64> {
        None
    }

    /// The moving share of recent requests past a prefix most workers hold that continued
    /// something private beyond it, if the policy keeps one (`cache_aware` with
    /// `fade_by_continuation`).
    fn continuing_share(&self) -> Option<f64> {
        None
    }

    /// The moving share of recent prompts of which nothing was known that the worker they went
    /// to reported it had cached in part, if the policy keeps one (`cache_aware` with
    /// `reuse_from_usage`).
    fn unseen_reuse_share(&self) -> Option<f64> {
        None
    }

    /// A request this policy sent to `worker` ended; called once, after the response.
    fn observe(
        &self,
        _worker: &Worker,
        _req: &RequestInfo,
        _selection: &Selection,
        _result: Observed,
    ) {
    }
}

/// The one place a policy is built from its config.
pub fn build(cfg: &PolicyConfig) -> Arc<dyn Policy> {
    match cfg {
        PolicyConfig::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyConfig::LeastConn => Arc::new(LeastConn::default()),
        PolicyConfig::Prefix(p) => Arc::new(Prefix::new(p.clone())),
        PolicyConfig::CacheAware(p) => Arc::new(CacheAware::new(p.clone())),
    }
}

/// The usable worker with the fewest requests in flight; ties go to the first at or after `start`
/// (callers rotate `start` so ties do not all land on worker 0).
pub fn least_loaded(workers: &[Arc<Worker>], start: usize) -> Option<usize> {
    let n = workers.len();
    (0..n)
        .map(|k| (start + k) % n)
        .filter(|&i| workers[i].is_usable())
        .min_by_key(|&i| workers[i].inflight())
}
