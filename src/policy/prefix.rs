//! `prefix`: consistent, load-bounded placement of prompt prefixes, so requests that share a
//! prefix land on the worker that already holds its KV cache.
//!
//! Algorithm: rendezvous (highest-random-weight) hashing. The key is the chained hash of the
//! prompt's first `key_blocks` blocks; each worker scores `xxh3(key, seed = hash(worker name))`
//! and the highest score is preferred. The order depends only on the key and the worker names,
//! so every gateway replica makes the same choice with no shared state, and removing a worker
//! moves only the keys it held (each key's order among the others is unchanged).
//!
//! Bounded load: with `T` requests in flight on the usable workers and `n` of them, a worker may
//! take the request only while `inflight + 1 <= ceil(load_factor × (T + 1) / n)`. The preferred
//! worker takes it when usable and within bound (`preferred`); otherwise the next
//! `spill_candidates` usable workers in hash order are tried (`spilled`); otherwise the
//! least-loaded usable worker takes it (`least_conn_fallback`), which is within bound whenever
//! any worker is.
//!
//! Cost: O(n) hashes per request on the fast path; O(n log n) when the first choice is refused.
//! Parameters: `key_blocks`, `load_factor` (>= 1), `spill_candidates`.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{least_loaded, Outcome, Policy, Selection};
use crate::{config::PrefixParams, routing_key::RequestInfo, workers::Worker};

#[derive(Debug)]
pub struct Prefix {
    params: PrefixParams,
    tie_break: AtomicUsize,
}

impl Prefix {
    pub fn new(params: PrefixParams) -> Self {
        Self {
            params,
            tie_break: super::random_cursor(),
        }
    }

    fn score(key: u64, worker: &Worker) -> u64 {
        xxh3_64_with_seed(&key.to_le_bytes(), worker.id_hash)
    }

    /// The highest in-flight count a worker may reach by taking one more request.
    fn bound(&self, workers: &[Arc<Worker>]) -> usize {
        let (total, n) = workers
            .iter()
            .filter(|w| w.is_usable())
            .fold((0usize, 0usize), |(t, n), w| (t + w.inflight(), n + 1));
        if n == 0 {
            return 0;
        }
        (self.params.load_factor * (total + 1) as f64 / n as f64).ceil() as usize
    }

    fn fallback(&self, workers: &[Arc<Worker>]) -> Option<Selection> {
        let start = self.tie_break.fetch_add(1, Ordering::Relaxed) % workers.len().max(1);
        least_loaded(workers, start).map(|index| Selection::new(index, Outcome::LeastConnFallback))
    }
}

impl Policy for Prefix {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn select(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection> {
        let Some(key) = req.key_at_depth(self.params.key_blocks) else {
            return self.fallback(workers);
        };
        let bound = self.bound(workers);
        let fits = |w: &Worker| w.is_usable() && w.inflight() < bound;

        let top = (0..workers.len()).max_by_key(|&i| (Self::score(key, &workers[i]), i))?;
        if fits(&workers[top]) {
            return Some(Selection::new(top, Outcome::Preferred));
        }
        let mut order: Vec<(u64, usize)> = workers
            .iter()
            .enumerate()
            .filter(|&(i, w)| i != top && w.is_usable())
            .map(|(i, w)| (Self::score(key, w), i))
            .collect();
        order.sort_unstable_by(|a, b| b.cmp(a));
        let tries = self.params.spill_candidates + usize::from(!workers[top].is_usable());
        if let Some(&(_, index)) = order.iter().take(tries).find(|&&(_, i)| fits(&workers[i])) {
            return Some(Selection::new(index, Outcome::Spilled));
        }
        self.fallback(workers)
    }

    /// Its choice depends on the key and the loads only: peeking is choosing.
    fn peek(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection> {
        self.select(workers, req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::test_workers;
    use proptest::prelude::*;
    use std::{collections::HashMap, time::Duration};

    fn key(k: u64) -> RequestInfo {
        RequestInfo::keyed(vec![k], 256)
    }

    fn policy(load_factor: f64) -> Prefix {
        Prefix::new(PrefixParams {
            load_factor,
            ..PrefixParams::default()
        })
    }

    fn pick(p: &Prefix, ws: &[Arc<Worker>], k: u64) -> String {
        ws[p.select(ws, &key(k)).unwrap().index].name.clone()
    }

    #[test]
    fn sticky_per_key_and_spread_across_keys() {
        let ws = test_workers(4);
        let p = policy(1.5);
        let mut per_worker: HashMap<String, usize> = HashMap::new();
        for k in 0..4000u64 {
            let first = pick(&p, &ws, k);
            assert_eq!(first, pick(&p, &ws, k));
            *per_worker.entry(first).or_default() += 1;
        }
        assert_eq!(per_worker.len(), 4);
        assert!(
            per_worker.values().all(|&c| (800..1200).contains(&c)),
            "{per_worker:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_ejected_worker_spills_to_the_next_in_hash_order() {
        let ws = test_workers(5);
        let p = policy(1.5);
        let k = 42;
        let first = p.select(&ws, &key(k)).unwrap().index;
        ws[first].eject_for(Duration::from_secs(5));
        let second = p.select(&ws, &key(k)).unwrap();
        assert_eq!(second.outcome, Outcome::Spilled);
        // The next in hash order is what the pool without the ejected worker would prefer.
        let without: Vec<_> = ws
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != first)
            .map(|(_, w)| w.clone())
            .collect();
        assert_eq!(ws[second.index].name, pick(&p, &without, k));
    }

    #[test]
    fn overload_spills_then_falls_back() {
        let ws = test_workers(3);
        let p = policy(1.0);
        let k = 7;
        let first = p.select(&ws, &key(k)).unwrap().index;
        let _held: Vec<_> = (0..4).map(|_| ws[first].acquire()).collect();
        let s = p.select(&ws, &key(k)).unwrap();
        assert_ne!(s.index, first);
        assert_eq!(s.outcome, Outcome::Spilled);
        let _more: Vec<_> = (0..4).map(|_| ws[s.index].acquire()).collect();
        let f = p.select(&ws, &key(k)).unwrap();
        assert_eq!(f.outcome, Outcome::LeastConnFallback);
        assert!(f.index != first && f.index != s.index);
    }

    #[test]
    fn adding_a_fifth_worker_to_four_moves_about_a_fifth_of_prefixes_all_onto_it() {
        let five = test_workers(5);
        let four = &five[..4];
        let p = policy(1.5);
        let n = 10_000u64;
        let mut moved = 0;
        for k in 0..n {
            let (before, after) = (pick(&p, four, k), pick(&p, &five, k));
            if before != after {
                moved += 1;
                assert_eq!(after, five[4].name, "a moved key goes to the new worker");
            }
        }
        let share = moved as f64 / n as f64;
        assert!((0.17..0.23).contains(&share), "{share}");
    }

    proptest! {
        #[test]
        fn choice_is_valid_and_deterministic(n in 1usize..40, k in any::<u64>()) {
            let ws = test_workers(n);
            let (a, b) = (policy(1.5), policy(1.5)); // two replicas, no shared state
            let sa = a.select(&ws, &key(k)).unwrap();
            prop_assert!(sa.index < n);
            prop_assert_eq!(sa, b.select(&ws, &key(k)).unwrap());
        }

        #[test]
        fn removing_a_worker_moves_only_its_keys(n in 2usize..20, removed in 0usize..20, keys in proptest::collection::vec(any::<u64>(), 200)) {
            let removed = removed % n;
            let ws = test_workers(n);
            let rest: Vec<_> = ws.iter().enumerate().filter(|&(i, _)| i != removed).map(|(_, w)| w.clone()).collect();
            let p = policy(1.5);
            for k in keys {
                let before = pick(&p, &ws, k);
                let after = pick(&p, &rest, k);
                if before != ws[removed].name {
                    prop_assert_eq!(before, after);
                }
            }
        }

        #[test]
        fn bound_is_not_exceeded_while_another_worker_is_under_it(
            loads in proptest::collection::vec(0usize..12, 2..8), k in any::<u64>(), c in 1.0f64..3.0,
        ) {
            let ws = test_workers(loads.len());
            let _held: Vec<_> = ws.iter().zip(&loads).flat_map(|(w, &l)| (0..l).map(|_| w.acquire()).collect::<Vec<_>>()).collect();
            let p = policy(c);
            let bound = p.bound(&ws);
            let chosen = &ws[p.select(&ws, &key(k)).unwrap().index];
            let someone_under = ws.iter().any(|w| w.inflight() < bound);
            if someone_under {
                prop_assert!(chosen.inflight() < bound, "chose load {} with bound {}", chosen.inflight(), bound);
            }
        }
    }
}
