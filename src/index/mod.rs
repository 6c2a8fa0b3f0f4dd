//! The prefix index: which workers recently received which chained block hashes, bounded in memory.
//!
//! A request's routing key is a chain of block hashes (`routing_key`), so a hash stands for the
//! whole prompt up to the end of its block. The index maps each hash to the few workers that were
//! last sent a prompt through it. Walking a request's chain from the first block gives, for every
//! worker, how many leading blocks it holds: the longest known prefix.
//!
//! Bounds: at most `HOLDERS` workers per block (the least recently touched is replaced), and at
//! most `capacity` blocks, kept as two generations. Blocks are written to the young generation;
//! when it is half the capacity the old generation is dropped whole (its blocks counted as
//! evictions) and the young one takes its place. A block found in the old generation moves back
//! to the young one when it is written again, so what is in use survives: an approximate LRU at
//! O(1) per block with no per-entry list. The memory this takes is reported from the maps'
//! allocated capacity, and `capacity` is chosen from the byte cap so that it stays below it.
//!
//! Evictions on the workers: once a worker's KV capacity is known (polled), each write to it
//! carries the worker's clock of the tokens this gateway has had it write into its cache
//! ([`crate::load::KvClock`]), and
//! the index keeps, per worker, marks of which insert happened at which clock. A block a worker
//! was last sent at least a cache's worth of tokens ago is presumed evicted there (vLLM takes the
//! least recently used free block for each new one) and no longer counts as held by it. Marks
//! are kept at most every 1/[`MARKS`] of the capacity, so a block may outlive its presumed
//! eviction by that much.
//!
//! Restarts: a worker that restarts comes back with an empty cache. Each worker's count of the
//! restarts its polls have seen ([`Restarts`]) is shared with the index: a lookup no longer counts
//! a worker as holding anything it was sent before a restart the index has not yet seen a write
//! after, and the first write after it dates everything before as evicted.
//!
//! One mutex guards both generations: a routing decision takes it once to walk and once to write,
//! each a few hundred nanoseconds for a typical chat prompt.

use std::{
    collections::{HashMap, VecDeque},
    hash::{BuildHasherDefault, Hasher},
    mem::size_of,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
};

use parking_lot::Mutex;

/// Workers remembered per block: enough for a shared system prompt on every worker of a small
/// pool; in a larger pool a hot prefix keeps its most recent holders.
pub const HOLDERS: usize = 8;

/// Inserts the moving mean of a block's gap averages over, about.
const GAP_WINDOW: f32 = 8.0;

/// A worker's identity in the index: the hash of its name, equal on every gateway replica.
pub type WorkerId = u64;

#[derive(Clone, Copy, Debug, Default)]
struct Holders {
    ids: [WorkerId; HOLDERS],
    touched: [u32; HOLDERS],
    /// The moving mean of the inserts between two that went through this block (0 until a
    /// second one has): its share of the traffic is about the inverse. It and `newest` fit in
    /// the padding after `len`, so the entry is no larger for them.
    gap: f32,
    len: u8,
    /// The slot touched last, so that the block's last tick is one read.
    newest: u8,
}

impl Holders {
    fn ids(&self) -> &[WorkerId] {
        &self.ids[..usize::from(self.len)]
    }

    /// The tick of the last insert that went through this block (0 for none).
    fn last(&self) -> u32 {
        if self.len == 0 {
            0
        } else {
            self.touched[usize::from(self.newest)]
        }
    }

    fn touch(&mut self, id: WorkerId, tick: u32) {
        let n = usize::from(self.len);
        if n > 0 {
            // One insert touches a block once, so the gap since the last is at least 1.
            let since = tick.wrapping_sub(self.last()) as f32;
            self.gap = if self.gap == 0.0 {
                since
            } else {
                self.gap + (since - self.gap) / GAP_WINDOW
            };
        }
        let slot = match self.ids[..n].iter().position(|&x| x == id) {
            Some(i) => i,
            None if n < HOLDERS => {
                self.len += 1;
                n
            }
            None => (0..HOLDERS).min_by_key(|&i| self.touched[i]).unwrap_or(0),
        };
        self.ids[slot] = id;
        self.touched[slot] = tick;
        self.newest = slot as u8;
    }

    fn remove(&mut self, id: WorkerId) {
        let n = usize::from(self.len);
        if let Some(i) = self.ids[..n].iter().position(|&x| x == id) {
            self.ids[i] = self.ids[n - 1];
            self.touched[i] = self.touched[n - 1];
            self.len -= 1;
            // The newest moved into the freed slot, or was the one removed: find it again.
            self.newest = (0..usize::from(self.len))
                .max_by_key(|&k| self.touched[k])
                .unwrap_or(0) as u8;
        }
    }
}

/// Block hashes are already uniformly distributed: use them as their own hash.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Map = HashMap<u64, Holders, BuildHasherDefault<Identity>>;

/// Marks kept per worker over one KV capacity: how finely evictions are dated.
pub const MARKS: u64 = 64;

/// Bytes one worker's clock takes at most: its marks, allocated once, and two map slots (a map
/// may allocate up to twice the slots it holds).
const CLOCK_BYTES: usize = (MARKS as usize + 2) * size_of::<(u32, u64)>()
    + 2 * (size_of::<WorkerId>() + size_of::<Clock>() + 1);

/// How many times a worker was seen to restart (its KV cache started over, empty): counted by
/// its load polls ([`crate::load::KvClock`]) and read by every index that lists the worker, so
/// that a lookup sees a restart as soon as a poll has.
#[derive(Clone, Debug, Default)]
pub struct Restarts(Arc<AtomicU32>);

impl Restarts {
    pub fn count(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }

    pub fn bump(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// One worker's KV clock as the index saw it: which insert happened at which clock.
#[derive(Debug, Default)]
struct Clock {
    /// `(tick, tokens written)` at inserts, oldest first, at least a [`MARKS`]th of the capacity
    /// apart, spanning at most one capacity.
    marks: VecDeque<(u32, u64)>,
    /// Inserts to this worker up to this tick are presumed evicted.
    evicted_through: Option<u32>,
    /// The worker's restart count and its value at the last insert: while they differ, the
    /// worker has restarted since and holds nothing the index lists.
    restarts: Option<(Restarts, u32)>,
}

impl Clock {
    /// The last tick whose inserts are presumed gone from the worker, with the index at `tick`.
    fn evicted_through(&self, tick: u32) -> Option<u32> {
        match &self.restarts {
            Some((r, seen)) if r.count() != *seen => Some(tick),
            _ => self.evicted_through,
        }
    }

    /// An insert at `tick` to a worker with `restarts`: if it restarted since the last insert
    /// (or before the first, as far as this clock knows), every earlier insert is gone.
    fn restarted(&mut self, tick: u32, restarts: &Restarts) {
        let now = restarts.count();
        match &mut self.restarts {
            Some((_, seen)) if *seen == now => return,
            Some((_, seen)) => *seen = now,
            None => {
                self.restarts = Some((restarts.clone(), now));
                if now == 0 {
                    return;
                }
            }
        }
        self.evicted_through = Some(tick.wrapping_sub(1));
        self.marks.clear();
    }

    /// An insert at `tick` with the worker's clock at `now` and its cache holding `capacity`.
    fn advance(&mut self, tick: u32, now: u64, capacity: u64) {
        while let Some(&(t, at)) = self.marks.front() {
            if now.saturating_sub(at) < capacity {
                break;
            }
            self.evicted_through = Some(t);
            self.marks.pop_front();
        }
        // Skipping a mark dates the inserts since the last one later: they are presumed evicted
        // a little late, never early. The marks stay within their first allocation.
        let step = (capacity / MARKS).max(1);
        match self.marks.back() {
            Some(&(_, at)) if now < at.saturating_add(step) => {}
            _ if self.marks.len() >= MARKS as usize + 2 => {}
            _ => {
                if self.marks.capacity() == 0 {
                    self.marks.reserve_exact(MARKS as usize + 2);
                }
                self.marks.push_back((tick, now));
            }
        }
    }
}

type Clocks = HashMap<WorkerId, Clock, BuildHasherDefault<Identity>>;

/// Bytes one slot of a map takes: key, value and hashbrown's control byte.
const SLOT_BYTES: usize = size_of::<u64>() + size_of::<Holders>() + 1;

struct Generations {
    young: Map,
    old: Map,
    tick: u32,
    evictions: u64,
    clocks: Clocks,
}

/// The workers' eviction ticks looked up during one walk, on the stack: a walk meets a few
/// holders many times over.
#[derive(Default)]
struct Seen {
    workers: [(WorkerId, Option<u32>); 16],
    len: usize,
}

impl Generations {
    /// Whether `id`, listed on a block at `tick`, is presumed to hold it still.
    fn holds(&self, seen: &mut Seen, id: WorkerId, tick: u32) -> bool {
        if self.clocks.is_empty() {
            return true;
        }
        let evicted = match seen.workers[..seen.len].iter().find(|&&(w, _)| w == id) {
            Some(&(_, e)) => e,
            None => {
                let e = self
                    .clocks
                    .get(&id)
                    .and_then(|c| c.evicted_through(self.tick));
                if seen.len < seen.workers.len() {
                    seen.workers[seen.len] = (id, e);
                    seen.len += 1;
                }
                e
            }
        };
        evicted.is_none_or(|e| (tick.wrapping_sub(e) as i32) > 0)
    }
}

/// How deep each worker's known prefix of one request goes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Matches {
    /// `(worker, blocks)` for every worker holding at least the first block.
    pub depths: Vec<(WorkerId, usize)>,
    /// Leading blocks whose holder lists are all full. In a pool larger than [`HOLDERS`], such a
    /// prefix has been sent to more workers than the index can name, and it is presumed held by
    /// every worker: what a gateway could not list is what another replica, or an earlier holder
    /// crowded out of the list, sent there. (In a pool of at most `HOLDERS`, a full list names
    /// every worker anyway.)
    pub everyone: usize,
    /// Leading blocks that one of the last `window` prompts written to the index went through
    /// (see [`PrefixIndex::matches`]): with `window` the number of workers, a prefix drawing
    /// about a worker's share of the traffic or more.
    pub recent: usize,
    /// Leading blocks that draw so much of the traffic that their holders are too few for it
    /// (see [`PrefixIndex::matches`]); 0 unless asked for.
    pub popular: usize,
}

impl Matches {
    /// How many leading blocks the index lists `id` as holding (not counting [`Self::everyone`]).
    pub fn depth_of(&self, id: WorkerId) -> usize {
        self.depths
            .iter()
            .find(|&&(w, _)| w == id)
            .map_or(0, |&(_, d)| d)
    }

    pub fn deepest(&self) -> usize {
        self.depths
            .iter()
            .map(|&(_, d)| d)
            .max()
            .unwrap_or(0)
            .max(self.everyone)
    }
}

pub struct PrefixIndex {
    inner: Mutex<Generations>,
    /// Blocks kept at most, over both generations.
    capacity: usize,
    /// Workers' KV clocks kept at most (a sixteenth of the cap); past this many (a pool that
    /// churned through pods), all are dropped and relearnt from the next writes.
    clocks_max: usize,
    max_bytes: usize,
}

/// What the index holds, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexStats {
    pub blocks: usize,
    pub bytes: usize,
    pub evictions: u64,
}

impl PrefixIndex {
    /// An index that never takes more than `max_bytes` (at least one block per generation).
    pub fn with_max_bytes(max_bytes: usize) -> Self {
        // A map may allocate up to twice the slots it holds (power-of-two growth, 7/8 load):
        // four slots of allowance per block keeps both generations under the cap.
        // The workers' KV clocks have a sixteenth of the cap; the blocks the rest.
        let clocks_max = max_bytes / 16 / CLOCK_BYTES;
        let capacity = ((max_bytes - clocks_max * CLOCK_BYTES) / (4 * SLOT_BYTES)).max(2);
        Self {
            inner: Mutex::new(Generations {
                young: Map::default(),
                old: Map::default(),
                tick: 0,
                evictions: 0,
                clocks: Clocks::default(),
            }),
            capacity,
            clocks_max,
            max_bytes,
        }
    }

    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Generations> {
        // parking_lot's lock is not poisoned by a panic while held, and none is needed: such a
        // panic cannot leave a half-written entry, every write being one `Copy` value.
        self.inner.lock()
    }

    /// For each worker, how many of `hashes`' leading blocks it holds. A block records only its
    /// last [`HOLDERS`] holders, so a worker missing from a block whose list is full may still
    /// hold it: the hashes are chained, and a worker listed further on was sent the whole prefix
    /// before it. Missing from a list with room, a worker's match ends there (it never held the
    /// block, or the block was removed). Stops at the first block nobody holds, or that extends
    /// nobody's match and has room.
    ///
    /// Also how many leading blocks one of the last `window` inserts went through
    /// ([`Matches::recent`]): one sample of how hot the prefix is. A prefix with a share `s` of
    /// the traffic shows as recent with probability `1 - (1 - s)^window`.
    ///
    /// And, with `spread` above 0, how many leading blocks are popular ([`Matches::popular`]):
    /// those whose holders times the moving mean of the inserts between two through them is
    /// under `spread`, i.e. whose share of the traffic `s` asks for more than `holders` workers
    /// at `s × spread` holders. A block not gone through for four of its mean gaps is not.
    pub fn matches(&self, hashes: &[u64], window: u32, spread: f32) -> Matches {
        let g = self.lock();
        let mut depths: Vec<(WorkerId, usize)> = Vec::new();
        let mut recent = 0;
        let mut popular = 0;
        // The first of the run of blocks with full holder lists that ends just before this one:
        // a match that stopped at or after it may resume.
        let mut full_since = 0;
        let mut everyone = 0;
        let mut clocks = Seen::default();
        for (i, h) in hashes.iter().enumerate() {
            let Some(entry) = g.young.get(h).or_else(|| g.old.get(h)) else {
                break;
            };
            let mut extended = false;
            // Holders presumed to hold it still (see the module's doc on evictions).
            let mut live = 0u8;
            for (&id, &touched) in entry.ids().iter().zip(&entry.touched) {
                if !g.holds(&mut clocks, id, touched) {
                    continue;
                }
                live += 1;
                match depths.iter_mut().find(|(w, _)| *w == id) {
                    Some((_, d)) if *d == i || *d >= full_since => {
                        *d = i + 1;
                        extended = true;
                    }
                    Some(_) => {}
                    None if full_since == 0 => {
                        depths.push((id, i + 1));
                        extended = true;
                    }
                    None => {}
                }
            }
            if live == 0 {
                break;
            }
            if recent == i && window > 0 && g.tick.wrapping_sub(entry.last()) < window {
                recent = i + 1;
            }
            if popular == i && spread > 0.0 && entry.gap > 0.0 {
                let since = g.tick.wrapping_sub(entry.last()) as f32;
                if f32::from(live) * entry.gap < spread && since <= 4.0 * entry.gap {
                    popular = i + 1;
                }
            }
            let full = usize::from(live) >= HOLDERS;
            if full && everyone == i {
                everyone = i + 1;
            }
            if !full {
                full_since = i + 1;
                if !extended {
                    break;
                }
            }
        }
        Matches {
            depths,
            everyone,
            recent,
            popular,
        }
    }

    /// Records that `worker` was sent a prompt through all of `hashes`.
    pub fn insert(&self, hashes: &[u64], worker: WorkerId) {
        self.insert_at(hashes, worker, None, None);
    }

    /// [`Self::insert`], with the worker's KV clock after this prompt and its KV capacity in
    /// tokens, when known ([`crate::load::KvClock::stamp`]): what it was sent a capacity's worth
    /// of tokens before is presumed evicted from then on; and with its restart count, when
    /// watched: what it was sent before a restart is gone.
    pub fn insert_at(
        &self,
        hashes: &[u64],
        worker: WorkerId,
        kv: Option<(u64, u64)>,
        restarts: Option<&Restarts>,
    ) {
        let mut g = self.lock();
        g.tick = g.tick.wrapping_add(1);
        let tick = g.tick;
        if (kv.is_some() || restarts.is_some()) && self.clocks_max > 0 {
            if g.clocks.len() >= self.clocks_max && !g.clocks.contains_key(&worker) {
                g.clocks = Clocks::default();
            }
            let clock = g.clocks.entry(worker).or_default();
            if let Some(r) = restarts {
                clock.restarted(tick, r);
            }
            if let Some((now, capacity)) = kv {
                clock.advance(tick, now, capacity);
            }
        }
        for &h in hashes {
            let g = &mut *g;
            match g.young.get_mut(&h) {
                Some(e) => e.touch(worker, tick),
                None => {
                    let mut e = g.old.remove(&h).unwrap_or_default();
                    e.touch(worker, tick);
                    g.young.insert(h, e);
                    if g.young.len() >= self.capacity / 2 {
                        let young = std::mem::take(&mut g.young);
                        let old = std::mem::replace(&mut g.old, young);
                        g.evictions += old.len() as u64;
                    }
                }
            }
        }
    }

    /// Forgets that `worker` holds `hashes` (a request that never reached it).
    pub fn remove(&self, hashes: &[u64], worker: WorkerId) {
        let mut g = self.lock();
        for h in hashes {
            let g = &mut *g;
            for map in [&mut g.young, &mut g.old] {
                if let Some(e) = map.get_mut(h) {
                    e.remove(worker);
                    if e.len == 0 {
                        map.remove(h);
                    }
                }
            }
        }
    }

    pub fn stats(&self) -> IndexStats {
        let g = self.lock();
        IndexStats {
            blocks: g.young.len() + g.old.len(),
            bytes: (g.young.capacity() + g.old.capacity()) * SLOT_BYTES
                + g.clocks.capacity() * (size_of::<WorkerId>() + size_of::<Clock>() + 1)
                + g.clocks.values().map(|c| c.marks.capacity()).sum::<usize>()
                    * size_of::<(u32, u64)>(),
            evictions: g.evictions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn longest_prefix_per_worker() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        idx.insert(&[1, 2, 3, 4], 10);
        idx.insert(&[1, 2, 7], 20);
        let m = idx.matches(&[1, 2, 3, 9], 1, 0.0);
        assert_eq!(m.depth_of(10), 3);
        assert_eq!(m.depth_of(20), 2);
        assert_eq!(m.depth_of(30), 0);
        assert_eq!(m.deepest(), 3);
        assert_eq!(m.everyone, 0, "no list is full");
        assert_eq!(idx.matches(&[5, 1], 1, 0.0).depths, []);
    }

    #[test]
    fn a_hole_in_the_chain_ends_that_workers_match() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        idx.insert(&[1, 2, 3], 10);
        idx.remove(&[2], 10);
        assert_eq!(idx.matches(&[1, 2, 3], 1, 0.0).depth_of(10), 1);
    }

    #[test]
    fn a_worker_crowded_out_of_a_shared_blocks_holders_still_matches_through_its_own() {
        // Worker 0 was sent the shared prefix and its own turn; then eight others were sent the
        // shared prefix, which now lists them and not worker 0.
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        idx.insert(&[1, 2, 3, 10, 11], 0);
        for w in 1..=HOLDERS as u64 {
            idx.insert(&[1, 2, 3], w);
        }
        let m = idx.matches(&[1, 2, 3, 10, 11, 12], 1, 0.0);
        assert_eq!(m.depth_of(0), 5, "its own blocks imply the prefix");
        assert_eq!(m.depth_of(1), 3);
        assert_eq!(m.everyone, 3, "a prefix on more workers than a list holds");
        assert_eq!(
            idx.matches(&[1, 2, 3, 10], 1, 0.0).depth_of(99),
            0,
            "not listed anywhere"
        );
        // A hole where the list has room still ends the match.
        idx.remove(&[10], 0);
        assert_eq!(idx.matches(&[1, 2, 3, 10, 11], 1, 0.0).depth_of(0), 0);
    }

    #[test]
    fn recent_counts_the_leading_blocks_one_of_the_last_inserts_went_through() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        idx.insert(&[1, 2, 3], 10); // a conversation under the shared prefix [1, 2]
        for k in 0..3u64 {
            idx.insert(&[1, 2, 100 + k], 20 + k); // three more, on other workers
        }
        // The shared prefix was in the last insert; the first conversation's block 3, three
        // inserts before it.
        let m = idx.matches(&[1, 2, 3, 4], 3, 0.0);
        assert_eq!((m.recent, m.deepest()), (2, 3));
        assert_eq!(
            idx.matches(&[1, 2, 3, 4], 4, 0.0).recent,
            3,
            "a wider window"
        );
        assert_eq!(
            idx.matches(&[1, 2, 3, 4], 0, 0.0).recent,
            0,
            "no window, no sample"
        );
        // A prefix nobody has sent since: not recent, though held.
        for k in 0..4u64 {
            idx.insert(&[700, 800 + k], 30);
        }
        let m = idx.matches(&[1, 2, 3], 4, 0.0);
        assert_eq!((m.recent, m.depth_of(10)), (0, 3));
    }

    #[test]
    fn a_block_is_popular_while_its_holders_are_too_few_for_its_share_of_the_inserts() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        // Block 1 goes through one insert in four, always to worker 10; the others are unique.
        for k in 0..64u64 {
            if k % 4 == 0 {
                idx.insert(&[1, 2 + k], 10);
            } else {
                idx.insert(&[1000 + k], 20);
            }
        }
        // One holder at a gap of 4: popular while the spread is over 4, not at 3.
        assert_eq!(idx.matches(&[1, 5000], 0, 4.5).popular, 1);
        assert_eq!(idx.matches(&[1, 5000], 0, 3.5).popular, 0);
        assert_eq!(idx.matches(&[1, 5000], 0, 0.0).popular, 0, "not asked");
        // A second holder halves what the same spread allows.
        idx.insert(&[1, 9999], 11);
        assert_eq!(
            idx.matches(&[1], 0, 6.0).popular,
            0,
            "2 holders x gap ~4 > 6"
        );
        assert_eq!(idx.matches(&[1], 0, 9.0).popular, 1);
        // Not gone through for over four of its gaps: no longer popular.
        for k in 0..20u64 {
            idx.insert(&[7000 + k], 20);
        }
        assert_eq!(idx.matches(&[1], 0, 9.0).popular, 0);
    }

    #[test]
    fn a_blocks_gap_and_newest_slot_take_no_room_beyond_its_holders_and_their_ticks() {
        // ids and ticks are 96 bytes; `len`, `newest` and the gap fit in the 8 that alignment
        // adds after them anyway.
        assert_eq!(
            std::mem::size_of::<Holders>(),
            std::mem::size_of::<[WorkerId; HOLDERS]>() + std::mem::size_of::<[u32; HOLDERS]>() + 8,
        );
    }

    #[test]
    fn a_removed_holders_tick_no_longer_counts_as_the_blocks_last() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        idx.insert(&[1], 10);
        idx.insert(&[1], 20); // the last insert through block 1
        assert_eq!(idx.matches(&[1], 1, 0.0).recent, 1);
        idx.remove(&[1], 20); // that request failed: block 1 was last used an insert earlier
        assert_eq!(idx.matches(&[1], 1, 0.0).recent, 0);
        assert_eq!(idx.matches(&[1], 2, 0.0).recent, 1);
    }

    #[test]
    fn a_block_keeps_its_most_recent_holders() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        for w in 0..(HOLDERS as u64 + 3) {
            idx.insert(&[1], w);
        }
        let m = idx.matches(&[1], 1, 0.0);
        assert_eq!(m.depths.len(), HOLDERS);
        assert_eq!(m.depth_of(0), 0, "the least recent was replaced");
        assert_eq!(m.depth_of(HOLDERS as u64 + 2), 1);
    }

    #[test]
    fn in_use_blocks_survive_generations_and_stale_ones_go() {
        let idx = PrefixIndex::with_max_bytes(64 * 4 * SLOT_BYTES); // 64 blocks
        idx.insert(&[u64::MAX], 1);
        for k in 0..1000u64 {
            idx.insert(&[k], 2);
            idx.insert(&[u64::MAX], 1); // kept warm
        }
        assert_eq!(idx.matches(&[u64::MAX], 1, 0.0).depth_of(1), 1);
        assert_eq!(
            idx.matches(&[0], 1, 0.0).depth_of(2),
            0,
            "cold block evicted"
        );
        let s = idx.stats();
        assert!(s.blocks <= 64 && s.evictions > 900, "{s:?}");
    }

    #[test]
    fn what_a_worker_was_sent_a_kv_cache_ago_is_presumed_evicted_there() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        // Worker 10 holds 1,000 tokens of cache; prompts of 300 new tokens each.
        let kv = |now: u64| Some((now, 1000));
        idx.insert_at(&[1, 2], 10, kv(300), None);
        idx.insert_at(&[1, 2], 20, kv(300), None); // another worker, its own clock
        idx.insert_at(&[3], 10, kv(600), None);
        idx.insert_at(&[4], 10, kv(900), None);
        assert_eq!(
            idx.matches(&[1, 2], 1, 0.0).depth_of(10),
            2,
            "within its cache"
        );
        idx.insert_at(&[5], 10, kv(1300), None);
        let m = idx.matches(&[1, 2], 1, 0.0);
        assert_eq!(m.depth_of(10), 0, "1,000 tokens written since");
        assert_eq!(m.depth_of(20), 2, "the other worker's clock did not move");
        assert_eq!(idx.matches(&[3], 1, 0.0).depth_of(10), 1);
        // Sent again, it is fresh again.
        idx.insert_at(&[1, 2], 10, kv(1400), None);
        assert_eq!(idx.matches(&[1, 2], 1, 0.0).depth_of(10), 2);
        // Nobody holds block 3 any more: the walk ends there for everyone.
        idx.insert_at(&[6], 10, kv(1700), None);
        assert_eq!(idx.matches(&[3], 1, 0.0).depths, []);
        // Without a clock (no capacity known), nothing is presumed evicted.
        idx.insert(&[8], 30);
        for k in 0..100 {
            idx.insert(&[1000 + k], 30);
        }
        assert_eq!(idx.matches(&[8], 1, 0.0).depth_of(30), 1);
    }

    #[test]
    fn what_a_worker_was_sent_before_it_restarted_is_not_held_once_a_poll_saw_the_restart() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        let (r10, r20) = (Restarts::default(), Restarts::default());
        idx.insert_at(&[1, 2], 10, None, Some(&r10));
        idx.insert_at(&[1, 2], 20, None, Some(&r20));
        idx.insert_at(&[3], 10, Some((300, 1000)), Some(&r10));
        assert_eq!(idx.matches(&[1, 2], 1, 0.0).depth_of(10), 2);
        r10.bump();
        // A lookup sees it at once, before anything is written to the worker again.
        let m = idx.matches(&[1, 2], 1, 0.0);
        assert_eq!(m.depth_of(10), 0, "restarted: its cache is empty");
        assert_eq!(m.depth_of(20), 2, "the other worker did not restart");
        assert_eq!(idx.matches(&[3], 1, 0.0).depths, []);
        // Written to again: what it is sent from now on is held, what it had before is not,
        // and its KV clock starts over from this write.
        idx.insert_at(&[4], 10, Some((400, 1000)), Some(&r10));
        assert_eq!(idx.matches(&[4], 1, 0.0).depth_of(10), 1);
        assert_eq!(idx.matches(&[3], 1, 0.0).depths, []);
        idx.insert_at(&[1, 2], 10, Some((500, 1000)), Some(&r10));
        assert_eq!(idx.matches(&[1, 2], 1, 0.0).depth_of(10), 2);
        idx.insert_at(&[5], 10, Some((1450, 1000)), Some(&r10));
        let m = idx.matches(&[4], 1, 0.0);
        assert_eq!(
            m.depth_of(10),
            0,
            "written a capacity ago, after the restart"
        );
        assert_eq!(idx.matches(&[1, 2], 1, 0.0).depth_of(10), 2);
        // An index that first meets a worker after it restarted knows nothing older of it.
        let late = PrefixIndex::with_max_bytes(1 << 20);
        late.insert(&[7], 10);
        late.insert_at(&[8], 10, None, Some(&r10));
        assert_eq!(late.matches(&[7], 1, 0.0).depths, []);
        assert_eq!(late.matches(&[8], 1, 0.0).depth_of(10), 1);
    }

    #[test]
    fn an_evicted_holder_does_not_fill_a_blocks_list() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        for w in 0..HOLDERS as u64 {
            idx.insert_at(&[1], w, Some((100, 1000)), None);
        }
        assert_eq!(
            idx.matches(&[1], 0, 0.0).everyone,
            1,
            "every listed worker holds it"
        );
        idx.insert_at(&[2], 0, Some((1100, 1000)), None);
        let m = idx.matches(&[1], 0, 0.0);
        assert_eq!((m.everyone, m.depths.len()), (0, HOLDERS - 1));
    }

    #[test]
    fn a_workers_marks_stay_within_their_count_and_date_evictions_late_not_early() {
        let idx = PrefixIndex::with_max_bytes(1 << 20);
        // Many small prompts: marks are kept a 64th of the capacity apart at most.
        for k in 0..10_000u64 {
            idx.insert_at(&[k], 10, Some((k * 3, 6400)), None);
        }
        {
            let g = idx.lock();
            let marks = &g.clocks[&10].marks;
            assert!(marks.len() <= MARKS as usize + 2, "{}", marks.len());
        }
        // The clock is at 29,997: block 9,000 (written at 27,000) is within the cache, block
        // 7,000 (21,000) is not.
        assert_eq!(idx.matches(&[9_000], 1, 0.0).depth_of(10), 1);
        assert_eq!(idx.matches(&[7_000], 1, 0.0).depth_of(10), 0);
        let s = idx.stats();
        assert!(s.bytes <= idx.max_bytes(), "{s:?}");
    }

    proptest! {
        #[test]
        fn never_exceeds_its_byte_cap(cap_kib in 4usize..256, writes in proptest::collection::vec((any::<u64>(), 0u64..16, 1usize..40), 1..300)) {
            let idx = PrefixIndex::with_max_bytes(cap_kib * 1024);
            for (k, (start, worker, len)) in writes.into_iter().enumerate() {
                let chain: Vec<u64> = (0..len as u64).map(|i| start.wrapping_add(i)).collect();
                // Workers' KV clocks count against the cap too.
                idx.insert_at(&chain, worker, Some((k as u64 * 7, 1000)), None);
                let s = idx.stats();
                prop_assert!(s.bytes <= idx.max_bytes(), "{s:?} > {}", idx.max_bytes());
            }
        }
    }
}
