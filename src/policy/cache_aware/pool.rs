//! The pool's load as one routing decision reads it: usable workers and requests in flight, from
//! a sample of at most [`SAMPLED`] workers, taken at most once per decision and only when asked.

use std::{cell::OnceCell, sync::Arc};

use super::pass::SAMPLED;
use crate::workers::Worker;

/// The usable workers among some of the pool's, and their requests in flight: this gateway's
/// (`local`) and in all by the last poll (`queued`, other replicas' included).
#[derive(Clone, Copy, Default)]
pub(super) struct PoolLoad {
    /// Workers looked at, usable or not.
    pub(super) seen: usize,
    pub(super) usable: usize,
    pub(super) local: usize,
    pub(super) queued: usize,
}

impl PoolLoad {
    pub(super) fn of<'a>(workers: impl Iterator<Item = &'a Arc<Worker>>) -> Self {
        workers.fold(Self::default(), |sum, w| {
            let seen = sum.seen + 1;
            if !w.is_usable() {
                return Self { seen, ..sum };
            }
            let local = w.inflight();
            Self {
                seen,
                usable: sum.usable + 1,
                local: sum.local + local,
                queued: sum.queued + w.load.queued(local),
            }
        })
    }

    /// The load of [`sample`]`(workers)`.
    pub(super) fn sampled(workers: &[Arc<Worker>]) -> Self {
        Self::of(sample(workers))
    }

    /// The mean requests in flight per usable worker.
    pub(super) fn mean(self) -> f64 {
        if self.usable == 0 {
            0.0
        } else {
            self.queued as f64 / self.usable as f64
        }
    }

    /// This gateway's requests in flight over a pool of `n` workers, from the sample's.
    pub(super) fn local_in(self, n: usize) -> f64 {
        if self.seen == 0 {
            0.0
        } else {
            self.local as f64 * n as f64 / self.seen as f64
        }
    }
}

/// At most [`SAMPLED`] of `workers`, evenly spread (all of them in a pool of up to that many):
/// what a decision needs of the whole pool's load (its mean, other replicas' share) is an
/// average, and a full sum is about 1.3 us of a decision at 1,024 workers (criterion).
fn sample(workers: &[Arc<Worker>]) -> impl Iterator<Item = &Arc<Worker>> {
    workers
        .iter()
        .step_by(workers.len().div_ceil(SAMPLED).max(1))
}

/// The pool's load for one decision, sampled when first asked: `spread_share` needs this
/// gateway's requests in flight and the mean (so with it on, every keyed decision asks), the
/// idle credit the mean, and the home's credit other replicas' share of it.
pub(super) struct PoolSample<'a> {
    workers: &'a [Arc<Worker>],
    load: OnceCell<PoolLoad>,
    share: OnceCell<f64>,
}

impl<'a> PoolSample<'a> {
    pub(super) fn new(workers: &'a [Arc<Worker>]) -> Self {
        Self {
            workers,
            load: OnceCell::new(),
            share: OnceCell::new(),
        }
    }

    pub(super) fn load(&self) -> PoolLoad {
        *self.load.get_or_init(|| PoolLoad::sampled(self.workers))
    }

    /// Other replicas' share `f` of the requests the workers had at recent polls
    /// ([`crate::load::Traffic`]: over many polls, since one poll at light load finds the other
    /// replicas' requests or none), from the same sample of workers as [`Self::load`]. 0 for a
    /// gateway alone: the poll counts its own requests as it went out and came back.
    pub(super) fn share(&self) -> f64 {
        *self.share.get_or_init(|| {
            let (others, all) = sample(self.workers)
                .filter(|w| w.is_usable())
                .map(|w| w.traffic.sums())
                .fold((0.0, 0.0), |(o, a), (wo, wa)| (o + wo, a + wa));
            if all > 0.0 {
                others / all
            } else {
                0.0
            }
        })
    }

    /// How far other replicas decide where a prompt goes: `min(1, 2f)` for their share `f`
    /// ([`Self::share`]).
    pub(super) fn others(&self) -> f64 {
        (2.0 * self.share()).min(1.0)
    }
}
