//! Exact cache state from vLLM's KV cache events.
//!
//! A vLLM worker started with `--kv-events-config '{"enable_kv_cache_events": true,
//! "publisher": "zmq", ...}'` publishes every block it stores or evicts. [`follow`] subscribes to
//! one worker's events and keeps a [`WorkerBlocks`]: the blocks that worker holds now, keyed by a
//! hash chain of our own over the blocks' token ids.
//!
//! Why our own hash: vLLM's block hashes start from a per-process random seed unless
//! `PYTHONHASHSEED` is fixed, and depend on its `prefix_caching_hash_algo`, so a router cannot
//! recompute them from a request. `BlockStored` carries the token ids, so the chain
//! [`chain`]`(parent, tokens)` can be computed both from events and from a tokenized request;
//! the engine hash → own hash map lets `BlockRemoved` (hashes only) be applied.
//!
//! A hybrid model's worker publishes each of its KV cache groups' blocks under the same hashes,
//! each group storing and evicting on its own schedule. The first full-attention group it stores
//! blocks of ([`decode::CacheGroup::is_full_attention`]) gives the blocks held, keyed as above.
//! A sliding-window group keeps only the blocks within its window of where each prompt ended, and
//! vLLM reuses a prefix only up to a point where that group also holds the blocks its window
//! reaches back over (`cdiv(window - 1, block_size)` of them), so a prefix that other prompts
//! share but none ended at (a system prompt, under different questions) is not reused at all:
//! its blocks are tracked too (`WindowGroup`), and [`WorkerBlocks::prefix_depth`] counts a
//! prefix only up to such a point. Other groups' events (Mamba states, chunked local attention)
//! are counted and left out, so on such models the depth may be more than vLLM reuses.
//!
//! A block's `extra_keys` (vLLM 0.32) and its LoRA adapter are part of its hash in vLLM, so they
//! are in ours: a request's `cache_salt` keys its first block ([`salted_root`]), and an adapter
//! the chain's root ([`adapter_root`]; a request's `model` is known as an adapter once events
//! show blocks under that name, [`request_root`]), so a salted or adapted prefix is held for the
//! same salt and adapter only, as in vLLM; images and prompt embeddings give keys no text request
//! makes ([`decode::block_key`]). Events for a medium other than the GPU (CPU offload tiers) are
//! ignored.
//!
//! From vLLM 0.33, a worker running EAGLE-style speculative decoding hashes each block with the
//! token after it too (the drafter's KV at a block's last position depends on it), and says which
//! in each store (`lookahead_token_ids`): such a block is reused only by a prompt that goes on
//! with that token, which [`WorkerBlocks::reusable_depth`] checks at the end of a held prefix.

pub mod decode;
pub mod discover;
mod subscriber;

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use decode::{decode_batch, CacheGroup, EventBatch, KvEvent};
pub use subscriber::{follow, EventSource, EventsFrom, Feed, FeedStats};

/// The chain value before a prompt's first block.
pub const ROOT: u64 = 0;

/// The chain value before the first block of a prompt sent with `cache_salt`: vLLM hashes the
/// salt into that block's hash, so no other salt, and no unsalted prompt, shares its blocks.
pub fn salted_root(salt: &[u8]) -> u64 {
    // Not 0 (ROOT) for any salt in practice; the seed only sets these apart from other hashes.
    xxh3_64_with_seed(salt, 0x6b76_7361_6c74)
}

/// The chain value before the first block of a prompt run under LoRA adapter `name` (vLLM's
/// served name, which requests give as their `model`), from the root it would have otherwise
/// ([`ROOT`], or [`salted_root`]): vLLM hashes the adapter into every block, so the base model and
/// other adapters share none of its blocks.
pub fn adapter_root(name: &[u8], root: u64) -> u64 {
    xxh3_64_with_seed(name, root ^ 0x6c6f_7261)
}

/// Where a request's block chain starts on events: `root` (the request's own, with its salt),
/// moved to its adapter's when some worker's events have shown blocks stored under an adapter of
/// the request's `model` name. Until then an adapter's requests count as the base model's.
pub fn request_root(
    workers: &[std::sync::Arc<crate::workers::Worker>],
    model: Option<&str>,
    root: u64,
) -> u64 {
    let Some(model) = model else { return root };
    // Most pools serve no adapters: a flag per feed keeps their workers' locks out of it.
    let adapter = workers.iter().any(|w| {
        w.events.as_ref().is_some_and(|f| {
            f.has_adapters.load(std::sync::atomic::Ordering::Relaxed)
                && f.blocks().adapters.contains(model)
        })
    });
    if adapter {
        adapter_root(model.as_bytes(), root)
    } else {
        root
    }
}

/// Adapter names a worker's events may teach, at most: more than any pool loads.
const MAX_ADAPTERS: usize = 4096;

/// Our hash of a block: its token ids, chained to the hash of the block before it.
pub fn chain(parent: u64, tokens: &[u32]) -> u64 {
    // On the routing path for every block of a tokenized request: blocks up to 256 tokens
    // (vLLM's are 16-128) are laid out on the stack, not in an allocation per block.
    let mut stack = [0u8; 1024];
    let mut heap = Vec::new();
    let bytes: &mut [u8] = if tokens.len() * 4 <= stack.len() {
        &mut stack[..tokens.len() * 4]
    } else {
        heap.resize(tokens.len() * 4, 0);
        &mut heap
    };
    for (out, t) in bytes.chunks_exact_mut(4).zip(tokens) {
        out.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(bytes, parent)
}

/// A prompt's block chain for each block size the workers report (usually one), each made on
/// first need, and what each worker's events say it holds of it.
pub struct BlockChains<'t> {
    tokens: &'t [u32],
    root: u64,
    /// Whether the prompt goes on past `tokens` (only its head was tokenized).
    goes_on: bool,
    by_size: Vec<(u32, Vec<u64>)>,
}

/// How much of a prompt one worker's events say it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub block_size: u32,
    /// Leading full blocks of the prompt the worker holds.
    pub blocks: usize,
    /// Full blocks the prompt's tokens make at that size.
    pub of: usize,
}

impl<'t> BlockChains<'t> {
    /// The chains of `tokens` from `root` ([`ROOT`], or a salted prompt's [`salted_root`]).
    pub fn new(tokens: &'t [u32], root: u64) -> Self {
        Self {
            tokens,
            root,
            goes_on: false,
            by_size: Vec::new(),
        }
    }

    /// The same, for a prompt of which `tokens` is only the head: where a worker's hashes
    /// cover the tokens after a block, a block at the head's end counts as held.
    pub fn going_on(mut self, goes_on: bool) -> Self {
        self.goes_on = goes_on;
        self
    }

    /// What `w`'s events say it holds of the prompt; `None` for a worker without events or
    /// whose block size is not known yet.
    pub fn held_by(&mut self, w: &crate::workers::Worker) -> Option<Held> {
        let blocks = w.events.as_ref()?.blocks();
        let size = blocks.block_size?;
        let (tokens, goes_on) = (self.tokens, self.goes_on);
        let chain = self.chain(size);
        Some(Held {
            block_size: size,
            blocks: blocks.reusable_depth(chain, tokens, size as usize, goes_on),
            of: chain.len(),
        })
    }

    /// The chain at `size` tokens a block.
    pub fn chain(&mut self, size: u32) -> &[u64] {
        let i = match self.by_size.iter().position(|(s, _)| *s == size) {
            Some(i) => i,
            None => {
                let chain =
                    crate::tokenize::block_chain_from(self.root, self.tokens, size as usize);
                self.by_size.push((size, chain));
                self.by_size.len() - 1
            }
        };
        &self.by_size[i].1
    }

    /// The first chain made, with its block size.
    pub fn first(&self) -> Option<(u32, &[u64])> {
        self.by_size.first().map(|(s, c)| (*s, c.as_slice()))
    }
}

/// Whether some worker's events say it holds every full block of `tokens` chained from `root`
/// (or `tokens` fills no block of its size): it may hold more of the prompt than `tokens` shows,
/// so routing on them needs more of the prompt tokenized. Workers without events hold nothing
/// here.
pub fn some_worker_holds_all(
    workers: &[std::sync::Arc<crate::workers::Worker>],
    tokens: &[u32],
    root: u64,
) -> bool {
    let mut chains = BlockChains::new(tokens, root);
    // Full attention's blocks, not what a sliding window lets the head's end reuse: a prompt
    // that ended further on keeps its window there, and its blocks are reusable up to there.
    workers.iter().any(|w| {
        let Some(feed) = w.events.as_ref() else {
            return false;
        };
        let blocks = feed.blocks();
        blocks.block_size.is_some_and(|size| {
            let chain = chains.chain(size);
            blocks.held_depth(chain) == chain.len()
        })
    })
}

/// The blocks one worker holds, as its events said.
#[derive(Debug)]
pub struct WorkerBlocks {
    /// Engine hash → our chain hash.
    by_engine: HashMap<u64, u64>,
    /// Our chain hashes held, with how many engine blocks map to each.
    held: HashMap<u64, u32>,
    max_blocks: usize,
    /// Blocks not recorded: their parent was unknown (an event missed), or the cap was reached.
    pub skipped: u64,
    /// Tokens per block (vLLM's `--block-size`): the largest of the followed group's stores
    /// since its first after a clear. (A hybrid model's worker also stores entries of its
    /// smaller hashing size; kept from an earlier run until the first store after a clear, so
    /// routing knows the size meanwhile.)
    pub block_size: Option<u32>,
    /// Whether the next store sets `block_size` whatever it was (after a clear).
    size_stale: bool,
    /// The cache group followed (see the module's notes); `None` until the first store of a
    /// full-attention group after a clear.
    followed: Option<i64>,
    /// Events of the worker's other cache groups, left out.
    pub other_groups: u64,
    /// LoRA adapters blocks were stored under (their served names), up to `MAX_ADAPTERS`.
    pub adapters: std::collections::HashSet<String>,
    /// A hybrid model's sliding-window groups.
    windows: Vec<WindowGroup>,
    /// Our chain hash → an engine hash of it, for the blocks held, kept while `windows` is not
    /// empty (a window group's events name engine hashes; the chains are ours).
    engine_of: HashMap<u64, u64>,
    /// How many tokens after each block the worker's block hashes cover (vLLM 0.33's lookahead
    /// hashes, with EAGLE-style speculative decoding: the drafter's KV at a block's last
    /// position depends on the next token), as its stores since the last clear carried them; 0
    /// for none.
    lookahead: usize,
    /// Engine hash → [`ahead`] of the tokens it was stored with after it, for blocks stored
    /// with lookahead tokens.
    ahead_of_engine: HashMap<u64, u64>,
    /// (our chain hash, [`ahead`] of the tokens after it) → engine blocks stored so: which
    /// continuations of a block the worker would reuse it for.
    continued: HashMap<(u64, u64), u32>,
}

/// One engine block fewer under `key`; true when that was the last (the key is then gone).
fn release<K: Eq + std::hash::Hash>(counts: &mut HashMap<K, u32>, key: &K) -> bool {
    let Some(n) = counts.get_mut(key) else {
        return false;
    };
    *n -= 1;
    if *n > 0 {
        return false;
    }
    counts.remove(key);
    true
}

/// A key for the tokens a block was hashed with after it (its lookahead tokens).
fn ahead(tokens: &[u32]) -> u64 {
    chain(AHEAD_SEED, tokens)
}

const AHEAD_SEED: u64 = 0x6c6f_6f6b_6168_6561;

/// A sliding-window cache group of a hybrid model: the blocks it holds, and how many of them
/// before a hit point vLLM needs for a hit there.
#[derive(Debug)]
struct WindowGroup {
    idx: i64,
    /// `cdiv(window - 1, block_size)`, as vLLM's sliding-window manager counts them.
    reach: usize,
    /// Engine hashes of the blocks it holds.
    held: std::collections::HashSet<u64>,
}

impl WorkerBlocks {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            by_engine: HashMap::new(),
            held: HashMap::new(),
            max_blocks,
            skipped: 0,
            block_size: None,
            size_stale: true,
            followed: None,
            other_groups: 0,
            adapters: Default::default(),
            windows: Vec::new(),
            engine_of: HashMap::new(),
            lookahead: 0,
            ahead_of_engine: HashMap::new(),
            continued: HashMap::new(),
        }
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.by_engine.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_engine.is_empty()
    }

    /// Whether the worker holds the block whose chain hash is `own`.
    pub fn holds(&self, own: u64) -> bool {
        self.held.contains_key(&own)
    }

    /// How many of `chain_hashes` the worker's full-attention blocks hold from the first, whether
    /// or not a sliding window lets vLLM reuse them (see [`Self::prefix_depth`]).
    pub fn held_depth(&self, chain_hashes: &[u64]) -> usize {
        chain_hashes.iter().take_while(|h| self.holds(**h)).count()
    }

    /// How many of `chain_hashes` (a request's blocks, in order) the worker would reuse: those
    /// it holds from the first, and of a hybrid model's, only up to the last point where each
    /// sliding-window group holds the blocks its window reaches back over.
    pub fn prefix_depth(&self, chain_hashes: &[u64]) -> usize {
        let held = self.held_depth(chain_hashes);
        if self.windows.is_empty() {
            return held;
        }
        let in_window = |w: &WindowGroup, own: &u64| {
            self.engine_of
                .get(own)
                .is_some_and(|engine| w.held.contains(engine))
        };
        // From the longest down: a point fails at the last block its window lacks, and every
        // point past that block reaches back over it too, so the next to try ends there. Each
        // block is looked at about once per group.
        let mut p = held;
        while p > 0 {
            let missing = self.windows.iter().find_map(|w| {
                let from = p.saturating_sub(w.reach);
                chain_hashes[from..p]
                    .iter()
                    .rposition(|own| !in_window(w, own))
                    .map(|i| from + i)
            });
            match missing {
                None => return p,
                Some(block) => p = block,
            }
        }
        0
    }

    /// How many of a prompt's blocks the worker would reuse: [`Self::prefix_depth`], and where
    /// its hashes cover the tokens after each block too, only up to a block it stored with the
    /// tokens the prompt (`tokens`, at `size` tokens a block) goes on with, as vLLM looks its
    /// blocks up by those hashes. A block at the end of `tokens` counts when the prompt
    /// `goes_on` past them (its head alone was tokenized), and not when it ends there: vLLM does
    /// not hash a block before the tokens after it exist.
    pub fn reusable_depth(
        &self,
        chain_hashes: &[u64],
        tokens: &[u32],
        size: usize,
        goes_on: bool,
    ) -> usize {
        let mut depth = self.prefix_depth(chain_hashes);
        if self.lookahead == 0 {
            return depth;
        }
        while depth > 0 {
            let end = depth * size;
            let continued = match tokens.get(end..end + self.lookahead) {
                Some(next) => self
                    .continued
                    .contains_key(&(chain_hashes[depth - 1], ahead(next))),
                None => goes_on,
            };
            if continued {
                break;
            }
            depth -= 1;
        }
        depth
    }

    pub fn clear(&mut self) {
        self.by_engine.clear();
        self.held.clear();
        self.lookahead = 0;
        self.ahead_of_engine.clear();
        self.continued.clear();
        self.size_stale = true;
        self.followed = None;
        self.windows.clear();
        self.engine_of.clear();
    }

    /// Applies a sliding-window group's event, if `idx` is one (a store registers it); false
    /// for another group's.
    fn apply_to_window(&mut self, idx: i64, event: &KvEvent) -> bool {
        if let KvEvent::BlockStored {
            group, block_size, ..
        } = event
        {
            if let Some(window) = group.window() {
                if !self.windows.iter().any(|w| w.idx == idx) {
                    if self.windows.is_empty() {
                        // From now on the held blocks need their engine hashes.
                        for (&engine, &own) in &self.by_engine {
                            self.engine_of.entry(own).or_insert(engine);
                        }
                    }
                    self.windows.push(WindowGroup {
                        idx,
                        reach: (window as usize - 1).div_ceil((*block_size).max(1) as usize),
                        held: Default::default(),
                    });
                }
            }
        }
        let max = self.max_blocks;
        let Some(w) = self.windows.iter_mut().find(|w| w.idx == idx) else {
            return false;
        };
        match event {
            KvEvent::BlockStored { block_hashes, .. } => {
                for &engine in block_hashes {
                    if w.held.len() < max {
                        w.held.insert(engine);
                    }
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for engine in block_hashes {
                    w.held.remove(engine);
                }
            }
            KvEvent::AllBlocksCleared => {}
        }
        true
    }

    /// Whether an event of cache group `idx` is the followed group's; a store of a
    /// full-attention group is followed from then on when none is yet.
    fn follows(&mut self, idx: i64, full_attention_store: bool) -> bool {
        let follows = match self.followed {
            Some(f) => f == idx,
            None if full_attention_store => {
                self.followed = Some(idx);
                true
            }
            // A removal before any store (nothing held to remove), or another group's store.
            None => false,
        };
        if !follows {
            self.other_groups += 1;
        }
        follows
    }

    /// Places a store's blocks in this worker's chain (under our hashes of their tokens), or
    /// hands them to the sliding-window group they belong to.
    /// (Called by [`Self::apply`] with a `BlockStored` event; any other does nothing.)
    fn stored(&mut self, event: &KvEvent) {
        let KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            group,
            block_keys,
            lora_name,
            lookahead,
            ..
        } = event
        else {
            return;
        };
        let idx = group.index();
        let window = group.window().is_some() || self.windows.iter().any(|w| w.idx == idx);
        if window && self.apply_to_window(idx, event) {
            return;
        }
        if !self.follows(group.index(), group.is_full_attention()) {
            return;
        }
        if let Some(name) = lora_name {
            if self.adapters.len() < MAX_ADAPTERS && !self.adapters.contains(name) {
                self.adapters.insert(name.clone());
            }
        }
        if *block_size == 0 {
            // Nothing to chain (offloading tiers' placeholders; not on the GPU anyway).
            self.skipped += block_hashes.len() as u64;
            return;
        }
        let mut parent = match parent_block_hash {
            None => ROOT,
            Some(p) => match self.by_engine.get(p) {
                Some(&own) => own,
                None => {
                    // Its prefix is unknown to us (stored before we subscribed, or in
                    // a message lost for good): these blocks cannot be placed.
                    self.skipped += block_hashes.len() as u64;
                    return;
                }
            },
        };
        self.block_size = Some(match self.block_size {
            Some(b) if !self.size_stale => b.max(*block_size),
            _ => *block_size,
        });
        self.size_stale = false;
        if let Some(first) = lookahead.first() {
            self.lookahead = first.len();
        }
        let size = *block_size as usize;
        for (i, &engine) in block_hashes.iter().enumerate() {
            let Some(tokens) = token_ids.get(i * size..(i + 1) * size) else {
                self.skipped += (block_hashes.len() - i) as u64;
                return;
            };
            // A block's extra keys (a salt, an image) are in vLLM's hash of it, and so
            // in ours, through its parent's value.
            let key = block_keys.get(i).copied().flatten().unwrap_or(0);
            let own = chain(parent ^ key, tokens);
            parent = own;
            if self.by_engine.contains_key(&engine) {
                continue;
            }
            if self.by_engine.len() >= self.max_blocks {
                self.skipped += 1;
                continue;
            }
            self.by_engine.insert(engine, own);
            *self.held.entry(own).or_default() += 1;
            if let Some(next) = lookahead.get(i) {
                let next = ahead(next);
                self.ahead_of_engine.insert(engine, next);
                *self.continued.entry((own, next)).or_default() += 1;
            }
            if !self.windows.is_empty() {
                self.engine_of.entry(own).or_insert(engine);
            }
        }
    }

    /// Applies one of the worker's events to what it is known to hold: blocks stored, blocks
    /// removed, everything cleared. Events for tiers other than the GPU's are ignored.
    pub fn apply(&mut self, event: &KvEvent) {
        if !event.on_gpu() {
            return;
        }
        match event {
            KvEvent::BlockStored { .. } => self.stored(event),
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
                ..
            } => {
                let idx = group_idx.unwrap_or(0);
                if self.windows.iter().any(|w| w.idx == idx) && self.apply_to_window(idx, event) {
                    return;
                }
                if !self.follows(idx, false) {
                    return;
                }
                for engine in block_hashes {
                    let Some(own) = self.by_engine.remove(engine) else {
                        continue;
                    };
                    if let Some(next) = self.ahead_of_engine.remove(engine) {
                        release(&mut self.continued, &(own, next));
                    }
                    if release(&mut self.held, &own) {
                        self.engine_of.remove(&own);
                    }
                }
            }
            KvEvent::AllBlocksCleared => self.clear(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: 2,
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            group: CacheGroup::full_attention(),
            block_keys: Vec::new(),
            lookahead: Vec::new(),
        }
    }

    fn removed(hashes: &[u64], group_idx: Option<i64>) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: Some("GPU".into()),
            group_idx,
        }
    }

    fn in_group(mut e: KvEvent, idx: i64, kind: &str) -> KvEvent {
        if let KvEvent::BlockStored { group, .. } = &mut e {
            *group = CacheGroup {
                idx: Some(idx),
                kind: Some(kind.into()),
                sliding_window: None,
            };
        }
        e
    }

    #[test]
    fn stored_blocks_chain_by_their_tokens_and_removals_apply_by_engine_hash() {
        let mut w = WorkerBlocks::new(100);
        w.apply(&stored(&[11, 12], None, vec![1, 2, 3, 4]));
        w.apply(&stored(&[13], Some(12), vec![5, 6]));
        let a = chain(ROOT, &[1, 2]);
        let b = chain(a, &[3, 4]);
        let c = chain(b, &[5, 6]);
        assert_eq!(w.prefix_depth(&[a, b, c]), 3);
        assert_eq!(
            w.prefix_depth(&[a, chain(a, &[3, 9])]),
            1,
            "another second block"
        );
        w.apply(&removed(&[12], None));
        assert_eq!(w.prefix_depth(&[a, b, c]), 1);
        assert_eq!(w.len(), 2);
        w.apply(&KvEvent::AllBlocksCleared);
        assert!(w.is_empty());
        assert_eq!(w.prefix_depth(&[a]), 0);
    }

    fn stored_ahead(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: Vec<u32>,
        lookahead: &[&[u32]],
    ) -> KvEvent {
        let mut e = stored(hashes, parent, tokens);
        if let KvEvent::BlockStored { lookahead: l, .. } = &mut e {
            *l = lookahead.iter().map(|t| t.to_vec()).collect();
        }
        e
    }

    /// A worker whose block hashes cover the next token (vLLM 0.33+ with EAGLE-style
    /// speculative decoding) reuses a block only for a prompt that goes on with the token it was
    /// stored with, and hashes no block before that token exists.
    #[test]
    fn where_hashes_cover_the_next_token_a_block_counts_only_for_the_same_continuation() {
        let mut w = WorkerBlocks::new(100);
        // [1, 2, 3, 4, 5] prefilled: (5 - 1) / 2 = 2 blocks hashed, each with the token after it.
        w.apply(&stored_ahead(
            &[11, 12],
            None,
            vec![1, 2, 3, 4],
            &[&[3], &[5]],
        ));
        fn depth_in(w: &WorkerBlocks, tokens: &[u32], goes_on: bool) -> usize {
            w.reusable_depth(&block_chain(tokens), tokens, 2, goes_on)
        }
        assert_eq!(depth_in(&w, &[1, 2, 3, 4, 5, 6], false), 2);
        assert_eq!(
            depth_in(&w, &[1, 2, 3, 4, 7, 8], false),
            1,
            "goes on otherwise"
        );
        assert_eq!(
            depth_in(&w, &[1, 2, 3, 4], false),
            1,
            "ends after the block"
        );
        assert_eq!(
            depth_in(&w, &[1, 2, 3, 4], true),
            2,
            "only its head tokenized"
        );
        assert_eq!(
            w.prefix_depth(&block_chain(&[1, 2, 3, 4, 7, 8])),
            2,
            "the tokens alone"
        );
        // The same block again, stored with another token after it: a second engine block.
        w.apply(&stored_ahead(&[13], Some(11), vec![3, 4], &[&[7]]));
        assert_eq!(depth_in(&w, &[1, 2, 3, 4, 7, 8], false), 2);
        w.apply(&removed(&[12], None));
        assert_eq!(
            depth_in(&w, &[1, 2, 3, 4, 5, 6], false),
            1,
            "that copy evicted"
        );
        assert_eq!(
            depth_in(&w, &[1, 2, 3, 4, 7, 8], false),
            2,
            "the other kept"
        );
        // A restarted worker may run without lookahead hashes.
        w.apply(&KvEvent::AllBlocksCleared);
        w.apply(&stored(&[21, 22], None, vec![1, 2, 3, 4]));
        assert_eq!(depth_in(&w, &[1, 2, 3, 4], false), 2);
    }

    #[test]
    fn an_unknown_parent_skips_and_the_cap_holds() {
        let mut w = WorkerBlocks::new(2);
        w.apply(&stored(&[21], Some(999), vec![1, 2]));
        assert_eq!((w.len(), w.skipped), (0, 1));
        w.apply(&stored(&[1, 2, 3], None, vec![1, 2, 3, 4, 5, 6]));
        assert_eq!((w.len(), w.skipped), (2, 2));
    }

    #[test]
    fn the_chain_hash_is_the_same_for_short_and_long_blocks() {
        // The stack and heap layouts must agree: the value is xxh3 over little-endian ids.
        for n in [0usize, 1, 16, 256, 257, 1000] {
            let tokens: Vec<u32> = (0..n as u32)
                .map(|t| t.wrapping_mul(2_654_435_761))
                .collect();
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            assert_eq!(
                chain(42, &tokens),
                xxh3_64_with_seed(&bytes, 42),
                "{n} tokens"
            );
        }
    }

    /// Gemma 3's shape: a sliding-window group stores the same blocks under the same hashes and
    /// evicts them on its own schedule; only the full-attention group's say what is held.
    #[test]
    fn a_hybrid_models_other_groups_do_not_move_the_full_attention_blocks() {
        let mut w = WorkerBlocks::new(100);
        // The sliding-window group's store comes first: not followed, so not held either.
        w.apply(&in_group(
            stored(&[11, 12], None, vec![1, 2, 3, 4]),
            1,
            "sliding_window",
        ));
        assert!(w.is_empty());
        w.apply(&in_group(
            stored(&[11, 12], None, vec![1, 2, 3, 4]),
            0,
            "full_attention",
        ));
        let a = chain(ROOT, &[1, 2]);
        let b = chain(a, &[3, 4]);
        assert_eq!(w.prefix_depth(&[a, b]), 2);
        // The window moves on and its group evicts the first block: still held.
        w.apply(&removed(&[11], Some(1)));
        assert_eq!(w.prefix_depth(&[a, b]), 2);
        // A Mamba group's state entry of another size changes neither blocks nor size.
        let mut state = in_group(stored(&[40], None, vec![1, 2, 3, 4]), 2, "mamba");
        if let KvEvent::BlockStored { block_size, .. } = &mut state {
            *block_size = 4;
        }
        w.apply(&state);
        assert_eq!((w.len(), w.block_size), (2, Some(2)));
        assert_eq!(w.other_groups, 3);
        // The full-attention group's own eviction counts.
        w.apply(&removed(&[12], Some(0)));
        assert_eq!(w.prefix_depth(&[a, b]), 1);
        // A worker that restarts with its groups in another order is followed afresh.
        w.apply(&KvEvent::AllBlocksCleared);
        w.apply(&in_group(
            stored(&[51], None, vec![7, 7]),
            1,
            "full_attention",
        ));
        w.apply(&in_group(
            stored(&[52], None, vec![8, 8]),
            0,
            "sliding_window",
        ));
        assert!(w.holds(chain(ROOT, &[7, 7])));
        assert!(!w.holds(chain(ROOT, &[8, 8])));
    }

    /// Gemma 3's shape as vLLM 0.32 publishes it (seen from a CPU vLLM serving a two-layer
    /// Gemma 3 with a 64-token window): the window group, 0 here, stores only the last blocks of
    /// each prompt (its `token_ids` are the whole prompt's), before the full-attention group
    /// stores them all. vLLM reuses a prefix only up to a point the window group also holds the
    /// blocks before: the prompt itself and its continuations, not a prefix it shares with
    /// another prompt that ended elsewhere (its system prompt, under another question).
    #[test]
    fn a_sliding_window_group_limits_the_prefix_to_where_its_window_is_held() {
        let mut w = WorkerBlocks::new(100);
        // Window 4 tokens, blocks of 2: a hit needs the cdiv(3, 2) = 2 blocks before it.
        let mut window = in_group(
            stored(&[2, 3], None, vec![1, 2, 3, 4, 5, 6]),
            0,
            "sliding_window",
        );
        if let KvEvent::BlockStored { group, .. } = &mut window {
            group.sliding_window = Some(4);
        }
        w.apply(&window);
        w.apply(&in_group(
            stored(&[1, 2, 3], None, vec![1, 2, 3, 4, 5, 6]),
            1,
            "full_attention",
        ));
        let a = block_chain(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(w.prefix_depth(&a[..3]), 3, "the prompt itself");
        assert_eq!(
            w.prefix_depth(&a),
            3,
            "its continuation, up to where it ended"
        );
        let b = block_chain(&[1, 2, 3, 4, 9, 9]);
        assert_eq!(w.len(), 3);
        assert_eq!(
            w.prefix_depth(&b),
            0,
            "its first two blocks under another ending"
        );
        // A prompt that ended at the shared part makes it reusable.
        let mut ended = in_group(stored(&[1], None, vec![1, 2, 3, 4]), 0, "sliding_window");
        if let KvEvent::BlockStored { group, .. } = &mut ended {
            group.sliding_window = Some(4);
        }
        w.apply(&ended);
        assert_eq!(w.prefix_depth(&b), 2);
        // The window group evicts the prompt's last block: its full length is no longer reused.
        w.apply(&removed(&[3], Some(0)));
        assert_eq!(w.prefix_depth(&a[..3]), 2);
        assert_eq!(w.len(), 3, "full attention still holds every block");
        assert_eq!(w.other_groups, 0, "both groups modelled");
        w.apply(&KvEvent::AllBlocksCleared);
        w.apply(&stored(&[7], None, vec![1, 2]));
        assert_eq!(w.prefix_depth(&a), 1, "a cleared worker is followed afresh");
    }

    /// Whether to tokenize past a head asks whether a worker may hold more than the head: on a
    /// hybrid model, its full-attention blocks say so, even where the window group holds
    /// nothing at the head's end (the prompt it served ended further on).
    #[test]
    fn a_hybrid_worker_holding_past_the_head_asks_for_more_of_the_prompt() {
        let metrics = crate::metrics::Metrics::new();
        let cfg = crate::config::WorkerConfig::from_url("http://127.0.0.1:13100");
        let mut w = crate::workers::Worker::new(&cfg, &metrics).unwrap();
        let feed = Feed::new(100);
        let mut window = in_group(
            stored(&[3], None, vec![1, 2, 3, 4, 5, 6]),
            0,
            "sliding_window",
        );
        if let KvEvent::BlockStored { group, .. } = &mut window {
            group.sliding_window = Some(2);
        }
        let full = in_group(
            stored(&[1, 2, 3], None, vec![1, 2, 3, 4, 5, 6]),
            1,
            "full_attention",
        );
        feed.apply(&crate::sim::events::encode(&[window, full]));
        w.events = Some(std::sync::Arc::new(feed));
        let ws = vec![std::sync::Arc::new(w)];
        let head = [1, 2, 3, 4];
        assert_eq!(
            ws[0]
                .events
                .as_ref()
                .unwrap()
                .blocks()
                .prefix_depth(&block_chain(&head)),
            0,
            "nothing reusable that ends at the head"
        );
        assert!(some_worker_holds_all(&ws, &head, ROOT));
        assert!(!some_worker_holds_all(&ws, &[1, 2, 9, 9], ROOT));
    }

    proptest::proptest! {
        /// The depth a sliding window allows is the longest point up to which full attention
        /// holds every block and the window the `reach` blocks before it, as a plain search over
        /// every point finds it.
        #[test]
        fn the_window_limited_depth_is_the_longest_point_the_window_holds_before(
            held in 0usize..24,
            extra in 0usize..8,
            window in 1u32..12,
            in_window in proptest::collection::vec(proptest::bool::ANY, 32),
        ) {
            let n = held + extra;
            let tokens: Vec<u32> = (0..2 * n as u32).collect();
            let mut w = WorkerBlocks::new(1000);
            let mut sw = in_group(stored(&[], None, vec![]), 0, "sliding_window");
            if let KvEvent::BlockStored { group, block_hashes, token_ids, .. } = &mut sw {
                group.sliding_window = Some(window);
                *block_hashes = (0..held as u64).filter(|&i| in_window[i as usize]).map(|i| i + 1).collect();
                *token_ids = tokens.clone();
            }
            w.apply(&sw);
            let full: Vec<u64> = (1..=held as u64).collect();
            w.apply(&in_group(stored(&full, None, tokens[..2 * held].to_vec()), 1, "full_attention"));
            let chain = block_chain(&tokens);
            let reach = (window as usize - 1).div_ceil(2);
            let naive = (1..=held)
                .rev()
                .find(|&p| (p.saturating_sub(reach)..p).all(|b| in_window[b]))
                .unwrap_or(0);
            proptest::prop_assert_eq!(w.prefix_depth(&chain), naive);
        }
    }

    fn block_chain(tokens: &[u32]) -> Vec<u64> {
        crate::tokenize::block_chain(tokens, 2)
    }

    /// A hybrid model whose attention blocks are larger than its hashing blocks also stores
    /// entries of the hashing size; the block size routing chains at stays the larger.
    #[test]
    fn the_block_size_is_the_largest_stored_since_a_clear() {
        let mut w = WorkerBlocks::new(100);
        w.apply(&stored(&[1], None, vec![1, 2]));
        let mut big = stored(&[2], None, vec![1, 2, 3, 4]);
        if let KvEvent::BlockStored { block_size, .. } = &mut big {
            *block_size = 4;
        }
        w.apply(&big);
        w.apply(&stored(&[3], None, vec![5, 6]));
        assert_eq!(w.block_size, Some(4));
        // Kept through a clear until the next store, which sets it afresh.
        w.apply(&KvEvent::AllBlocksCleared);
        assert_eq!(w.block_size, Some(4));
        w.apply(&stored(&[4], None, vec![5, 6]));
        assert_eq!(w.block_size, Some(2));
    }

    /// vLLM hashes a LoRA adapter into every block it computes: a request for the adapter (its
    /// `model` is the adapter's served name) chains from the adapter's root once some worker's
    /// events have shown blocks under it, and finds them there, not the base model's.
    #[test]
    fn a_request_for_an_adapter_the_events_showed_chains_from_its_root() {
        let metrics = crate::metrics::Metrics::new();
        let worker = |i: u16, events: &[KvEvent]| {
            let cfg =
                crate::config::WorkerConfig::from_url(format!("http://127.0.0.1:{}", 13000 + i));
            let mut w = crate::workers::Worker::new(&cfg, &metrics).unwrap();
            let feed = Feed::new(100);
            feed.apply(&crate::sim::events::encode(events));
            w.events = Some(std::sync::Arc::new(feed));
            std::sync::Arc::new(w)
        };
        let mut lora = stored(&[1, 2], None, vec![1, 2, 3, 4]);
        if let KvEvent::BlockStored { lora_name, .. } = &mut lora {
            *lora_name = Some("my-adapter".into());
        }
        let base = stored(&[3, 4], None, vec![1, 2, 3, 4]);
        let ws = vec![worker(0, &[base]), worker(1, &[lora])];
        let root = request_root(&ws, Some("my-adapter"), ROOT);
        assert_eq!(root, adapter_root(b"my-adapter", ROOT));
        assert_eq!(request_root(&ws, Some("base"), ROOT), ROOT);
        assert_eq!(request_root(&ws, None, ROOT), ROOT);
        let salted = salted_root(b"t");
        assert_eq!(
            request_root(&ws, Some("my-adapter"), salted),
            adapter_root(b"my-adapter", salted)
        );
        // The adapter's request finds the adapter's blocks on worker 1 and nothing on worker 0;
        // the base model's the other way round.
        let tokens = [1, 2, 3, 4];
        let mut chains = BlockChains::new(&tokens, root);
        let held = |c: &mut BlockChains, i: usize| c.held_by(&ws[i]).unwrap().blocks;
        assert_eq!((held(&mut chains, 0), held(&mut chains, 1)), (0, 2));
        let mut chains = BlockChains::new(&tokens, ROOT);
        assert_eq!((held(&mut chains, 0), held(&mut chains, 1)), (2, 0));
    }

    #[test]
    fn other_media_are_ignored() {
        let mut w = WorkerBlocks::new(10);
        let mut e = stored(&[1], None, vec![1, 2]);
        if let KvEvent::BlockStored { medium, .. } = &mut e {
            *medium = Some("CPU".into());
        }
        w.apply(&e);
        assert!(w.is_empty());
    }
}
