//! `round_robin`: each request goes to the next worker in order.
//!
//! Algorithm: a shared counter modulo the pool size; an unusable worker is skipped for the next
//! usable one (outcome `spilled`). The counter starts at a random point, so that replicas do not
//! deal in step ([`super::random_cursor`]). O(1) per request when all workers are usable, O(n)
//! at worst. No parameters. Ignores the prompt, so it throws away KV-cache locality: the
//! baseline to beat.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use super::{Outcome, Policy, Selection};
use crate::{routing_key::RequestInfo, workers::Worker};

#[derive(Debug)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Default for RoundRobin {
    fn default() -> Self {
        Self {
            next: super::random_cursor(),
        }
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, workers: &[Arc<Worker>], _req: &RequestInfo) -> Option<Selection> {
        let n = workers.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| workers[i].is_usable())
            .map(|index| {
                let outcome = if index == start {
                    Outcome::Preferred
                } else {
                    Outcome::Spilled
                };
                Selection::new(index, outcome)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::test_workers;
    use std::time::Duration;

    #[test]
    fn cycles_evenly() {
        let ws = test_workers(3);
        let rr = RoundRobin::default();
        let mut counts = [0; 3];
        for _ in 0..300 {
            counts[rr.select(&ws, &RequestInfo::unkeyed()).unwrap().index] += 1;
        }
        assert_eq!(counts, [100, 100, 100]);
    }

    #[test]
    fn gateways_do_not_all_begin_their_rounds_at_one_worker() {
        // Sixteen gateways over four workers all beginning at one worker: 4 in 4^16 by chance.
        let ws = test_workers(4);
        let firsts: Vec<_> = (0..16)
            .map(|_| {
                let rr = RoundRobin::default();
                rr.select(&ws, &RequestInfo::unkeyed()).unwrap().index
            })
            .collect();
        assert!(firsts.iter().any(|&f| f != firsts[0]), "{firsts:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn skips_ejected_workers() {
        let ws = test_workers(3);
        ws[1].eject_for(Duration::from_secs(10));
        let rr = RoundRobin::default();
        let picks: Vec<_> = (0..6)
            .map(|_| rr.select(&ws, &RequestInfo::unkeyed()).unwrap())
            .collect();
        assert!(picks.iter().all(|s| s.index != 1));
        // Two of six turns start at the ejected worker, wherever the cursor began.
        let spilled = picks.iter().filter(|s| s.outcome == Outcome::Spilled);
        assert_eq!(spilled.count(), 2);
        for w in &ws {
            w.eject_for(Duration::from_secs(10));
        }
        assert!(rr.select(&ws, &RequestInfo::unkeyed()).is_none());
    }
}
