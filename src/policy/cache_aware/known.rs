//! What one decision knows of the prompt before it prices any worker: how far each worker's
//! known prefix goes by this gateway's index, what the workers' own KV events say they hold, the
//! part no worker is known to hold, and the key of the prompt's rendezvous home.

use std::sync::Arc;

use super::pool::PoolSample;
use crate::{
    config::CacheAwareParams,
    index::{Matches, PrefixIndex},
    kv_events::BlockChains,
    routing_key::RequestInfo,
    workers::Worker,
};

pub(super) struct Known {
    /// The index's match, with blocks presumed on every worker for their popularity counted in
    /// `everyone`.
    pub(super) matches: Matches,
    /// Leading blocks presumed on every worker for their popularity beyond a full holder list
    /// (0: none).
    pub(super) popular: usize,
    /// The deepest match of the index, in blocks.
    pub(super) deepest: usize,
    /// Canonical bytes per token, as learnt when the decision began.
    pub(super) bpt: f64,
    /// The prompt in tokens: counted when the request was tokenized, else from its bytes.
    pub(super) prompt: f64,
    /// What each worker's own events say it holds of the prompt, in tokens (`None`: that worker
    /// publishes none); empty when the request was not tokenized.
    pub(super) exacts: Vec<Option<u64>>,
    /// Every usable worker publishes events.
    pub(super) all_exact: bool,
    /// The most of the prompt any worker's events hold, in tokens (0 without events).
    pub(super) exact_deepest: u64,
    /// Prompt tokens no worker is known to hold.
    pub(super) unknown: f64,
    /// Blocks of the prompt that at least two workers hold, by this gateway's index.
    pub(super) shared_depth: usize,
    /// How many workers make "most" of the pool (more than half, at least two, at most a block's
    /// holder list).
    pub(super) most: usize,
    /// The blocks the home's key lies past.
    pub(super) key_depth: usize,
    /// The home's rendezvous key.
    pub(super) key: u64,
}

impl Known {
    /// Walks the index for `req` (whose last block hash is `last`) and reads the workers' events.
    pub(super) fn survey(
        params: &CacheAwareParams,
        index: &PrefixIndex,
        (workers, sample): (&[Arc<Worker>], &PoolSample),
        req: &RequestInfo,
        last: u64,
        bpt: f64,
    ) -> Self {
        // A prefix one of the last `workers` requests went through counts as hot; only the idle
        // credit and `reuse_affinity` ask (a window of 0 makes the walk skip the sample).
        let window = if params.amortize_hot_copies || params.reuse_affinity.is_some() {
            u32::try_from(workers.len()).unwrap_or(u32::MAX)
        } else {
            0
        };
        // A prefix is popular while its share `s` of this gateway's requests is over its
        // holders' count times `spread_share / n`, and while more of its requests are in flight
        // (`s` times this gateway's) than it has holders: a prefix whose requests do not overlap
        // (one conversation's turns, or any prefix at light load) never queues behind itself.
        let spread = if params.spread_share > 0.0 {
            let limit = workers.len() as f64 / params.spread_share;
            limit.min(sample.load().local_in(workers.len())) as f32
        } else {
            0.0
        };
        let mut matches = index.matches(&req.block_hashes, window, spread);
        // A prefix too popular for its few holders is presumed on every worker, as one past a
        // full holder list is: a further worker's first copy is paid once and shared by the
        // requests that follow it there (`spread_share`). Only while its holders are busier
        // than the pool: where they are not, its requests wait no longer there than elsewhere.
        let popular = if matches.popular > matches.everyone
            && holders_busier(workers, &matches, sample.load().mean())
        {
            matches.popular
        } else {
            0
        };
        matches.everyone = matches.everyone.max(popular);
        let deepest = matches.deepest();
        let prompt = match &req.tokens {
            Some(t) => t.len() as f64 + f64::from(req.tokens_after),
            None => req.prompt_bytes as f64 / bpt,
        };
        // What each worker's own events say it holds, in tokens, when the request was tokenized.
        let mut chains =
            BlockChains::new(req.tokens.as_deref().unwrap_or_default(), req.token_root)
                .going_on(req.tokens_after > 0);
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
        let shared_depth = if params.shared_home || params.amortize_hot_copies {
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
        let key_depth = if !params.shared_home {
            deepest
        } else if matches.depths.len() < most {
            matches.everyone // too few holders: no need to collect their depths
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
        let exact_deepest = exacts.iter().flatten().copied().max().unwrap_or(0);
        if all_exact {
            if let Some((size, chain)) = chains.first().filter(|(_, c)| !c.is_empty()) {
                unknown = (prompt - exact_deepest as f64).max(0.0);
                let past = (exact_deepest / u64::from(size)) as usize;
                key = chain[past.min(chain.len() - 1)];
            }
        }
        Self {
            matches,
            popular,
            deepest,
            bpt,
            prompt,
            exacts,
            all_exact,
            exact_deepest,
            unknown,
            shared_depth,
            most,
            key_depth,
            key,
        }
    }

    /// Some worker publishes events.
    pub(super) fn any_exact(&self) -> bool {
        self.exacts.iter().any(Option::is_some)
    }

    /// Anything of the prompt is known to be on some worker, by the index or by events.
    pub(super) fn any(&self) -> bool {
        self.deepest > 0 || self.exact_deepest > 0
    }

    /// The prompt's first `depth` blocks, in tokens.
    pub(super) fn tokens_at(&self, req: &RequestInfo, depth: usize) -> f64 {
        req.bytes_at_depth(depth) as f64 / self.bpt
    }

    /// Prompt tokens the worker at `index` is priced as holding: what its own events say, which
    /// beats what this gateway has routed there (the index's `depth` blocks, times the worker's
    /// trust).
    pub(super) fn held_by(&self, req: &RequestInfo, index: usize, w: &Worker, depth: usize) -> f64 {
        match self.exacts.get(index).copied().flatten() {
            Some(held) => held as f64,
            None if depth > 0 => self.tokens_at(req, depth) * w.load.cache_trust(),
            None => 0.0,
        }
    }
}

/// The workers the index lists as holding the popular blocks of `matches` have more requests in
/// flight, on average, than the pool's `mean`. Looked up by a one-bit filter on each worker's id
/// first, and no further than the last holder: only decisions on a popular prefix come here,
/// and a pool's holders are at most [`crate::index::HOLDERS`].
fn holders_busier(workers: &[Arc<Worker>], matches: &Matches, mean: f64) -> bool {
    let (listed, mask) = matches
        .depths
        .iter()
        .filter(|&&(_, d)| d >= matches.popular)
        .fold((0, 0u64), |(n, m), &(id, _)| (n + 1, m | 1 << (id & 63)));
    let (mut found, mut count, mut queued) = (0, 0usize, 0usize);
    for w in workers {
        if mask & 1 << (w.id_hash & 63) == 0 || matches.depth_of(w.id_hash) < matches.popular {
            continue;
        }
        found += 1;
        if w.is_usable() {
            count += 1;
            queued += w.load.queued(w.inflight());
        }
        if found == listed {
            break;
        }
    }
    count > 0 && queued as f64 > mean * count as f64
}

/// The `k`-th largest value (the largest that at least `k` hold), 0 with fewer than `k`.
pub(super) fn kth_largest(values: impl Iterator<Item = u64>, k: usize) -> u64 {
    let mut values: Vec<u64> = values.collect();
    if k == 0 || values.len() < k {
        return 0;
    }
    let (_, kth, _) = values.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    *kth
}

/// The second largest value (the largest that at least two hold), 0 with fewer than two.
pub(super) fn second_largest(values: impl Iterator<Item = u64>) -> u64 {
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
