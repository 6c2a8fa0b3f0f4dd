//! The paged KV cache: fixed blocks of `block_size` tokens (16 by default), prefix reuse by chained block hash, LRU eviction.
//!
//! Modelled on vLLM's block pool with automatic prefix caching: a full block is registered under
//! the hash of its tokens chained with the previous block's hash, so equal hashes mean equal
//! prefixes. A block no running request references stays cached (and reusable) until a new
//! allocation evicts it, least recently freed first; a request's blocks are freed tail first so a
//! shared head outlives the private tails that hang off it.
//!
//! Complexity: allocation and free are O(log B) per block (B = blocks in the pool); a prefix
//! lookup is O(k) hash-map probes for k matched blocks.

use std::collections::{BTreeMap, HashMap};

use crate::kv_events::KvEvent;

/// Tokens per KV block, vLLM's default `--block-size` on CUDA.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Clone, Copy, Debug, Default)]
struct Block {
    refs: u32,
    hash: Option<u64>,
    /// Position in `evictable` while `refs == 0`.
    stamp: u64,
}

#[derive(Debug)]
pub struct KvCache {
    blocks: Vec<Block>,
    /// Blocks no request holds, oldest first: allocation takes from the front.
    evictable: BTreeMap<u64, u32>,
    cached: HashMap<u64, u32>,
    clock: u64,
    block_size: usize,
    /// Tokens after each block hashed with it (vLLM 0.33's lookahead hashes, with EAGLE-style
    /// speculative decoding); 0 for none.
    lookahead: usize,
    /// What a vLLM worker with KV cache events enabled would publish, since the last take.
    events: Option<Vec<KvEvent>>,
}

impl KvCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut blocks = vec![Block::default(); num_blocks];
        let mut evictable = BTreeMap::new();
        for (i, b) in blocks.iter_mut().enumerate() {
            b.stamp = i as u64;
            evictable.insert(i as u64, i as u32);
        }
        Self {
            blocks,
            evictable,
            cached: HashMap::new(),
            clock: num_blocks as u64,
            block_size,
            lookahead: 0,
            events: None,
        }
    }

    /// Hashes each block with the `n` tokens after it, as vLLM 0.33 does where the drafter of
    /// EAGLE-style speculative decoding reads them: a block is then reused only by a prompt
    /// that goes on with the same tokens, and no block is hashed before they exist.
    pub fn set_hash_lookahead(&mut self, n: usize) {
        self.lookahead = n;
    }

    /// Tokens after each block hashed with it.
    pub fn lookahead(&self) -> usize {
        self.lookahead
    }

    /// Records the events vLLM publishes (`BlockStored` when a block is cached under a new
    /// hash, `BlockRemoved` when an allocation evicts it, `AllBlocksCleared` on a reset).
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn emit(&mut self, event: KvEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    /// Drops every cached hash; `false` (and nothing changed) while any block is referenced.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.evictable.len() != self.blocks.len() {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.emit(KvEvent::AllBlocksCleared);
        true
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Chained hashes of every full block of `tokens` (followed by its lookahead tokens),
    /// continuing from those already in `hashes`.
    pub fn extend_hashes(&self, hashes: &mut Vec<u64>, tokens: &[u32]) {
        extend_hashes(hashes, tokens, self.block_size, self.lookahead);
    }

    /// Blocks that an allocation may take (free or cached but unreferenced).
    pub fn num_available(&self) -> usize {
        self.evictable.len()
    }

    /// Share of blocks referenced by requests, as vLLM's `kv_cache_usage_perc` (0..1).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.evictable.len() as f64 / self.blocks.len() as f64
    }

    /// The cached blocks holding the longest prefix of `hashes`.
    pub fn match_prefix(&self, hashes: &[u64]) -> Vec<u32> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// Takes a reference on already-cached blocks (a prefix hit).
    pub fn touch(&mut self, ids: &[u32]) {
        for &id in ids {
            let b = &mut self.blocks[id as usize];
            if b.refs == 0 {
                self.evictable.remove(&b.stamp);
            }
            b.refs += 1;
        }
    }

    /// Allocates `n` blocks, evicting the least recently freed cached blocks; `None` if fewer
    /// than `n` are available (nothing is taken then).
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.evictable.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, id) = self.evictable.pop_first()?;
            let b = &mut self.blocks[id as usize];
            if let Some(h) = b.hash.take() {
                if self.cached.get(&h) == Some(&id) {
                    self.cached.remove(&h);
                    if let Some(events) = &mut self.events {
                        // As vLLM 0.32 sends them: removals name the group by index only.
                        events.push(KvEvent::BlockRemoved {
                            block_hashes: vec![h],
                            medium: Some(crate::kv_events::decode::MEDIUM_GPU.into()),
                            group_idx: Some(0),
                        });
                    }
                }
            }
            b.refs = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Records that held blocks are now full: `ids[k]` with the content `hashes[k]` stands for,
    /// chained onto `parent` (the hash of the block before `ids[0]`, if any), holding
    /// `tokens[k * block_size..]` (`tokens` goes on with the last block's lookahead tokens, if
    /// any). A block whose hash is new to the cache is published as stored;
    /// one whose content another block already caches is not (as in vLLM, the first copy is the
    /// one found).
    pub fn register(&mut self, ids: &[u32], hashes: &[u64], parent: Option<u64>, tokens: &[u32]) {
        let size = self.block_size;
        let mut run: Option<KvEvent> = None;
        let mut parent = parent;
        for (k, (&id, &hash)) in ids.iter().zip(hashes).enumerate() {
            let b = &mut self.blocks[id as usize];
            let fresh = b.hash.is_none() && !self.cached.contains_key(&hash);
            if b.hash.is_none() {
                b.hash = Some(hash);
                self.cached.entry(hash).or_insert(id);
            }
            if self.events.is_some() {
                if fresh {
                    let block = &tokens[k * size..(k + 1) * size];
                    let ahead: Vec<Vec<u32>> = match self.lookahead {
                        0 => Vec::new(),
                        n => vec![tokens[(k + 1) * size..(k + 1) * size + n].to_vec()],
                    };
                    match &mut run {
                        Some(KvEvent::BlockStored {
                            block_hashes,
                            token_ids,
                            lookahead,
                            ..
                        }) => {
                            block_hashes.push(hash);
                            token_ids.extend_from_slice(block);
                            lookahead.extend(ahead);
                        }
                        _ => {
                            run = Some(KvEvent::BlockStored {
                                block_hashes: vec![hash],
                                parent_block_hash: parent,
                                token_ids: block.to_vec(),
                                block_size: size as u32,
                                lora_id: None,
                                lora_name: None,
                                medium: Some(crate::kv_events::decode::MEDIUM_GPU.into()),
                                // One group, labelled as vLLM 0.32 labels a model's only one.
                                group: crate::kv_events::CacheGroup::full_attention(),
                                // Plain text: the simulator takes no salts or images.
                                block_keys: Vec::new(),
                                lookahead: ahead,
                            });
                        }
                    }
                } else if let Some(e) = run.take() {
                    self.emit(e);
                }
            }
            parent = Some(hash);
        }
        if let Some(e) = run {
            self.emit(e);
        }
    }

    /// Drops a request's references, tail first, so its private tail is evicted before its head.
    pub fn free(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.refs > 0, "double free of block {id}");
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                self.clock += 1;
                b.stamp = self.clock;
                self.evictable.insert(b.stamp, id);
            }
        }
    }
}

/// Hash of one full block chained onto its parent's; FNV-1a over the token ids.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = parent ^ 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for byte in t.to_le_bytes() {
            h ^= u64::from(byte);
            h = h.wrapping_mul(PRIME);
        }
    }
    h
}

/// Chained hashes of every full `block`-token block of `tokens` that `lookahead` more tokens
/// follow, each over its tokens and those, continuing from those already in `hashes`.
pub fn extend_hashes(hashes: &mut Vec<u64>, tokens: &[u32], block: usize, lookahead: usize) {
    let full = tokens.len().saturating_sub(lookahead) / block;
    for j in hashes.len()..full {
        let parent = j.checked_sub(1).map_or(0, |p| hashes[p]);
        hashes.push(block_hash(
            parent,
            &tokens[j * block..(j + 1) * block + lookahead],
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: &[u32]) -> Vec<u64> {
        let mut h = Vec::new();
        extend_hashes(&mut h, tokens, DEFAULT_BLOCK_SIZE, 0);
        h
    }

    #[test]
    fn a_freed_prefix_is_found_again_until_evicted() {
        let mut kv = KvCache::new(4, DEFAULT_BLOCK_SIZE);
        let prompt: Vec<u32> = (0..40).collect();
        let h = hashes(&prompt);
        assert_eq!(h.len(), 2);
        let ids = kv.allocate(3).unwrap();
        kv.register(&ids[..2], &h, None, &prompt[..32]);
        kv.free(&ids);
        assert_eq!(kv.usage(), 0.0);
        assert_eq!(kv.match_prefix(&h), ids[..2]);
        // Taking the one never-used block keeps the prefix; the next allocation evicts the
        // private tail first, then the head's second block, and the chain breaks there.
        let a = kv.allocate(1).unwrap();
        assert_eq!(kv.match_prefix(&h).len(), 2);
        let b = kv.allocate(1).unwrap();
        assert_eq!(b, [ids[2]], "tail evicted first");
        let _c = kv.allocate(1).unwrap();
        assert_eq!(kv.match_prefix(&h).len(), 1);
        assert!(kv.allocate(2).is_none());
        assert_eq!(a.len(), 1);
    }

    #[test]
    fn chained_hashes_differ_when_an_earlier_block_differs() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[0] = 999;
        assert_ne!(hashes(&a)[1], hashes(&b)[1]);
        assert_eq!(hashes(&a), hashes(&a));
    }

    /// With the token after each block in its hash (vLLM 0.33's lookahead), a block is hashed
    /// only once that token exists, and its store says which token it was.
    #[test]
    fn lookahead_hashes_wait_for_the_next_token_and_stores_carry_it() {
        let mut kv = KvCache::new(3, 2);
        kv.set_hash_lookahead(1);
        kv.record_events();
        let tokens = [1, 2, 3, 4, 5, 6];
        let mut h = Vec::new();
        kv.extend_hashes(&mut h, &tokens);
        assert_eq!(h.len(), 2, "the last block has no token after it yet");
        let mut other = Vec::new();
        kv.extend_hashes(&mut other, &[1, 2, 3, 4, 9]);
        assert_eq!(other[0], h[0]);
        assert_ne!(other[1], h[1], "the same tokens, another next token");
        let ids = kv.allocate(2).unwrap();
        kv.register(&ids, &h, None, &tokens[..5]);
        let events = kv.take_events();
        let [KvEvent::BlockStored { lookahead, .. }] = &events[..] else {
            panic!("{events:?}")
        };
        assert_eq!(lookahead, &vec![vec![3], vec![5]]);
    }

    #[test]
    fn recorded_events_follow_what_is_cached_and_evicted() {
        let mut kv = KvCache::new(3, 2);
        kv.record_events();
        let tokens = [1, 2, 3, 4, 5, 6];
        let mut h = Vec::new();
        extend_hashes(&mut h, &tokens, 2, 0);
        let ids = kv.allocate(3).unwrap();
        kv.register(&ids[..2], &h[..2], None, &tokens[..4]);
        kv.register(&ids[2..], &h[2..], Some(h[1]), &tokens[4..]);
        let events = kv.take_events();
        assert_eq!(events.len(), 2);
        let KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            ..
        } = &events[1]
        else {
            panic!("{events:?}")
        };
        assert_eq!(
            (block_hashes, *parent_block_hash),
            (&vec![h[2]], Some(h[1]))
        );
        assert_eq!(token_ids, &vec![5, 6]);
        kv.free(&ids);
        // Reallocating evicts the tail first: its hash is published as removed.
        kv.allocate(1).unwrap();
        assert_eq!(
            kv.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![h[2]],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            }]
        );
        assert!(kv.take_events().is_empty());
    }

    #[test]
    fn touched_blocks_are_not_evictable() {
        let mut kv = KvCache::new(2, DEFAULT_BLOCK_SIZE);
        let ids = kv.allocate(2).unwrap();
        kv.register(&ids[..1], &[7], None, &[0; DEFAULT_BLOCK_SIZE]);
        kv.free(&ids);
        kv.touch(&kv.match_prefix(&[7]));
        assert_eq!(kv.num_available(), 1);
        assert!((kv.usage() - 0.5).abs() < 1e-9);
    }
}
