//! `least_conn`: each request goes to the usable worker with the fewest requests in flight
//! through this gateway.
//!
//! Algorithm: a linear scan for the minimum in-flight count, ties broken by a rotating start so
//! equal workers share the load (from a random point, so replicas do not rotate in step). O(n) per request. No parameters. Follows load, ignores prefixes.
//! Each gateway replica counts only its own requests.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use super::{least_loaded, Outcome, Policy, Selection};
use crate::{routing_key::RequestInfo, workers::Worker};

#[derive(Debug)]
pub struct LeastConn {
    tie_break: AtomicUsize,
}

impl Default for LeastConn {
    fn default() -> Self {
        Self {
            tie_break: super::random_cursor(),
        }
    }
}

impl Policy for LeastConn {
    fn name(&self) -> &'static str {
        "least_conn"
    }

    fn select(&self, workers: &[Arc<Worker>], _req: &RequestInfo) -> Option<Selection> {
        let start = self.tie_break.fetch_add(1, Ordering::Relaxed);
        least_loaded(workers, start % workers.len().max(1))
            .map(|index| Selection::new(index, Outcome::Preferred))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::test_workers;

    #[test]
    fn follows_load() {
        let ws = test_workers(3);
        let lc = LeastConn::default();
        let _busy: Vec<_> = (0..3)
            .map(|_| ws[0].acquire())
            .chain((0..1).map(|_| ws[2].acquire()))
            .collect();
        assert_eq!(lc.select(&ws, &RequestInfo::unkeyed()).unwrap().index, 1);
        // Holding each pick levels the loads: from 3,0,1 five more picks make 3,3,3.
        let mut held = Vec::new();
        for _ in 0..5 {
            let i = lc.select(&ws, &RequestInfo::unkeyed()).unwrap().index;
            held.push(ws[i].acquire());
        }
        let loads: Vec<_> = ws.iter().map(|w| w.inflight()).collect();
        assert_eq!(loads, [3, 3, 3]);
    }

    #[test]
    fn ties_rotate() {
        let ws = test_workers(4);
        let lc = LeastConn::default();
        let picks: std::collections::HashSet<_> = (0..4)
            .map(|_| lc.select(&ws, &RequestInfo::unkeyed()).unwrap().index)
            .collect();
        assert_eq!(picks.len(), 4);
    }
}
