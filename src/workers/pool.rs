//! The pool: the current set of workers, rebuilt from the configured (or discovered) list and
//! the data-parallel ranks found behind its `auto` entries, and swapped in one store.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::{LoopSet, Worker};
use crate::{
    admission::SlotFreed,
    config::{worker_name, WorkerConfig},
    loop_copy::LoopCopy,
    metrics::Metrics,
};

/// The workers of a pool at one moment.
pub type WorkerSet = Vec<Arc<Worker>>;

/// The current worker set, replaced as a whole.
pub struct Pool {
    set: ArcSwap<WorkerSet>,
    /// Signalled by every worker of the pool when it releases a slot (admission control).
    pub freed: Arc<SlotFreed>,
    /// Where workers that join publish their KV cache events.
    kv_events: crate::config::KvEventsConfig,
    /// The list last applied, before its ranks are expanded, and the ranks found behind its
    /// `data_parallel_size: auto` entries: the pool is rebuilt from them when those change.
    /// Held across a reconcile, so one list is applied at a time.
    listed: parking_lot::Mutex<Listed>,
}

#[derive(Default)]
struct Listed {
    cfgs: Vec<WorkerConfig>,
    ranks: crate::config::DetectedRanks,
}

impl Pool {
    pub fn new(workers: Vec<Arc<Worker>>) -> Self {
        Self {
            set: ArcSwap::from_pointee(workers),
            freed: Arc::default(),
            kv_events: Default::default(),
            listed: Default::default(),
        }
    }

    /// A pool of `cfgs`, following the KV cache events of the workers `kv_events` locates.
    pub fn from_config(
        cfgs: &[WorkerConfig],
        metrics: &Metrics,
        kv_events: &crate::config::KvEventsConfig,
    ) -> Result<Self, String> {
        let pool = Self {
            kv_events: kv_events.clone(),
            ..Self::new(Vec::new())
        };
        pool.reconcile(cfgs, metrics)?;
        Ok(pool)
    }

    /// Makes the pool hold exactly `cfgs`, keeping the `Worker` (in-flight count, health) of every
    /// worker whose name and URL are unchanged, and swapping the set in one store. Workers that
    /// left are marked draining: streams still on them finish, nothing new is sent. Returns how
    /// many workers were added and removed.
    pub fn reconcile(
        &self,
        cfgs: &[WorkerConfig],
        metrics: &Metrics,
    ) -> Result<(usize, usize), String> {
        let mut listed = self.listed.lock();
        let applied = self.apply(cfgs, &listed.ranks, metrics)?;
        listed.cfgs = cfgs.to_vec();
        // Only the entries still listed keep what was found behind them.
        listed
            .ranks
            .retain(|url, _| cfgs.iter().any(|c| c.detects_ranks() && c.url == *url));
        Ok(applied)
    }

    /// Records the data-parallel ranks that the worker of the `auto` entry `url` shows (its
    /// engines' labels in `/metrics`), and when they differ from what the pool routes to, rebuilds
    /// the pool from the last list: a server found to run several engines becomes a worker per
    /// rank, and one that comes back with another count is followed. `None` when nothing changed.
    pub fn ranks_seen(
        &self,
        url: &str,
        ranks: &[u32],
        metrics: &Metrics,
    ) -> Option<Result<(usize, usize), String>> {
        let mut listed = self.listed.lock();
        if !listed
            .cfgs
            .iter()
            .any(|c| c.detects_ranks() && c.url == url)
        {
            return None; // the entry left the list since the poll began
        }
        // One engine, or none shown: the server is routed to as one worker.
        let before = listed.ranks.get(url).map_or(&[][..], Vec::as_slice);
        if ranks.len() <= 1 && before.is_empty() || before == ranks {
            return None;
        }
        let mut next = listed.ranks.clone();
        if ranks.len() <= 1 {
            next.remove(url);
        } else {
            next.insert(url.to_owned(), ranks.to_vec());
        }
        let applied = self.apply(&listed.cfgs, &next, metrics);
        if applied.is_ok() {
            listed.ranks = next;
        }
        Some(applied)
    }

    /// [`Pool::reconcile`]'s work, for `cfgs` with the `auto` entries' ranks as `ranks` says.
    fn apply(
        &self,
        cfgs: &[WorkerConfig],
        ranks: &crate::config::DetectedRanks,
        metrics: &Metrics,
    ) -> Result<(usize, usize), String> {
        let old = self.snapshot();
        let cfgs = crate::config::expand_ranks(cfgs, ranks);
        let cfgs = &cfgs[..];
        let mut next = Vec::with_capacity(cfgs.len());
        let mut added = 0;
        for c in cfgs {
            let name = worker_name(c);
            let kept = old.iter().find(|w| {
                w.name == name
                    && w.data_parallel_rank.as_ref().map(|r| r.0) == c.data_parallel_rank
                    && w.ranks_of.is_some() == c.detects_ranks()
                    && c.url
                        .parse::<http::Uri>()
                        .ok()
                        .and_then(|u| u.authority().cloned())
                        .as_ref()
                        == Some(&w.authority)
            });
            let w = match kept {
                Some(w) => {
                    w.set_draining(c.draining);
                    Arc::clone(w)
                }
                None => {
                    added += 1;
                    let events = self.kv_events.events_for(c);
                    Arc::new(Worker::in_pool(
                        c,
                        metrics,
                        Arc::clone(&self.freed),
                        events,
                    )?)
                }
            };
            w.publish_health();
            next.push(w);
        }
        let mut removed = 0;
        for w in old.iter() {
            if !next.iter().any(|n| Arc::ptr_eq(n, w)) {
                removed += 1;
                w.set_draining(true);
            }
        }
        metrics.workers.set(next.len() as i64);
        self.replace(next);
        Ok((added, removed))
    }

    pub fn snapshot(&self) -> Arc<Vec<Arc<Worker>>> {
        self.set.load_full()
    }

    /// The current workers through an event loop's handle on them ([`crate::loop_copy`]): what
    /// a request holds while it is routed and answered.
    pub fn snapshot_in(&self, copy: &LoopCopy<WorkerSet, LoopSet>) -> Arc<LoopSet> {
        copy.get(&self.set)
    }

    pub fn replace(&self, workers: Vec<Arc<Worker>>) {
        self.set.store(Arc::new(workers));
    }

    pub fn any_usable(&self) -> bool {
        self.set.load().iter().any(|w| w.is_usable())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DataParallelSize;
    use crate::workers::{test_configs, test_pool};

    /// The pool follows the ranks an `auto` entry's server shows: one worker until several are
    /// seen, then one per rank (each naming its rank), and back to one when the server returns
    /// with a single engine, or with engines not numbered from 0; the same ranks again change
    /// nothing, and ranks reported for an entry no longer listed are ignored.
    #[test]
    fn an_auto_entry_becomes_a_worker_per_rank_seen_and_follows_their_count() {
        let metrics = Metrics::new();
        let entry = |url: &str, size| WorkerConfig {
            data_parallel_size: size,
            ..WorkerConfig::from_url(url)
        };
        let listed = vec![
            entry("http://a:1", Some(DataParallelSize::Auto)),
            entry("http://b:1", None),
        ];
        let pool = Pool::from_config(&listed, &metrics, &Default::default()).unwrap();
        let names = || -> Vec<String> { pool.snapshot().iter().map(|w| w.name.clone()).collect() };
        assert_eq!(names(), ["a:1", "b:1"]);
        let first = pool.snapshot();
        assert_eq!(first[0].ranks_of.as_deref(), Some("http://a:1"));
        assert_eq!(first[1].ranks_of, None);
        assert!(pool.ranks_seen("http://a:1", &[0], &metrics).is_none());

        let applied = pool.ranks_seen("http://a:1", &[0, 1], &metrics);
        assert_eq!(applied, Some(Ok((2, 1))));
        assert_eq!(names(), ["a:1/dp0", "a:1/dp1", "b:1"]);
        assert!(first[0].is_draining(), "the server's one worker drains");
        let ranks: Vec<_> = pool
            .snapshot()
            .iter()
            .map(|w| w.data_parallel_rank.as_ref().map(|r| r.0))
            .collect();
        assert_eq!(ranks, [Some(0), Some(1), None]);
        assert!(pool.snapshot()[1].ranks_of.is_some());
        assert!(pool.ranks_seen("http://a:1", &[0, 1], &metrics).is_none());
        assert_eq!(metrics.workers.get(), 3);

        // A list applied later (discovery, reload) keeps what was seen behind a listed entry.
        let kept = pool.snapshot();
        assert_eq!(pool.reconcile(&listed, &metrics), Ok((0, 0)));
        assert!(Arc::ptr_eq(&kept[1], &pool.snapshot()[1]));

        assert_eq!(
            pool.ranks_seen("http://a:1", &[0, 1, 2], &metrics),
            Some(Ok((1, 0)))
        );
        assert_eq!(names(), ["a:1/dp0", "a:1/dp1", "a:1/dp2", "b:1"]);
        assert_eq!(
            pool.ranks_seen("http://a:1", &[0], &metrics),
            Some(Ok((1, 3)))
        );
        assert_eq!(names(), ["a:1", "b:1"]);

        // A node's share of a hybrid deployment (engines 2 and 3): seen, but one worker still.
        assert_eq!(
            pool.ranks_seen("http://a:1", &[2, 3], &metrics),
            Some(Ok((0, 0)))
        );
        assert_eq!(names(), ["a:1", "b:1"]);
        assert!(pool.ranks_seen("http://a:1", &[2, 3], &metrics).is_none());
        assert_eq!(
            pool.ranks_seen("http://a:1", &[0, 1], &metrics),
            Some(Ok((2, 1)))
        );

        assert!(pool.ranks_seen("http://b:1", &[0, 1], &metrics).is_none());
        pool.reconcile(&listed[1..], &metrics).unwrap();
        assert!(pool.ranks_seen("http://a:1", &[0, 1], &metrics).is_none());
        assert_eq!(names(), ["b:1"]);
    }

    #[test]
    fn reconcile_keeps_unchanged_workers_adds_new_and_drains_the_departed() {
        let metrics = Metrics::new();
        let pool = test_pool(&["http://a:1", "http://b:1"], &metrics);
        let before = pool.snapshot();
        let _guard = before[1].acquire();
        let (added, removed) = pool
            .reconcile(&test_configs(&["http://b:1", "http://c:1"]), &metrics)
            .unwrap();
        assert_eq!((added, removed), (1, 1));
        let after = pool.snapshot();
        assert!(
            Arc::ptr_eq(&after[0], &before[1]),
            "b kept, with its in-flight count"
        );
        assert_eq!(after[0].inflight(), 1);
        assert_eq!(after[1].name, "c:1");
        assert!(
            before[0].is_draining() && !before[0].is_usable(),
            "a drains"
        );
        assert_eq!(metrics.workers.get(), 2);
    }
}
