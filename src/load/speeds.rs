//! Workers rated by speed: each worker's time per prefill token against the pool's median, so a
//! pool of unlike GPUs serving one model is priced in each one's own time.

use std::sync::{atomic::Ordering, Arc};

use super::{step_clock::SpeedReading, StepClock};
use crate::workers::Worker;

/// Times per prefill token closer to the pool's median than this factor count as the median's:
/// a fit moves by some percent between alike workers, and a pool of one GPU type is priced as it
/// was without speeds. Unlike GPUs differ by more (an L40S takes about a third of an L4's time).
pub const SPEED_DEADBAND: f64 = 1.25;

/// A worker is rated by the median of its last this many polls' readings: a fit strays now and
/// then for a while (seen on a pool of one GPU type: one worker at 17 us a token, its neighbours
/// at 76; under the mixed workload with two gateway replicas, each one's fit thrown by the
/// other's 2,048-token prompts, about 4x off for some 25 polls on end, which a rating moved a
/// twentieth of the way each poll followed out to 2x), and that should not send a worker the
/// pool's traffic. A GPU of another type reads apart at every poll and is rated within half a
/// window, or within [`FIRST_RATINGS`] polls of its first reading.
pub(super) const RATINGS: usize = 64;

/// A worker's first rating comes from this many readings: until a worker has been read at all,
/// polls that give no reading add nothing, so a gateway that has just started (a replica in a
/// rollout) rates its workers a few polls after their fits settle instead of once their readings
/// outnumber the polls it waited through. Placed while every worker reads 1, the conversations
/// of two replicas on 2 simulated L4s and 2 L40Ss started at the pool's median speed and stayed
/// (`docs/measurements.md`, "Replicas rated from their first polls").
const FIRST_RATINGS: usize = 8;

/// Workers are rated while no more than this share of the requests in flight on the pool, as
/// polled, are other than this gateway's ([`rate_speeds`]).
pub const ALONE_SHARE: f64 = 0.25;

impl StepClock {
    /// Adds a poll's reading of this worker beside the pool's median, `None` for a poll that
    /// could not read it (no settled fit, no pool to compare with), which counts as 1 once the
    /// worker has been read before and not at all until then; its rating becomes the median of
    /// the last [`RATINGS`] readings, 1 until there are [`FIRST_RATINGS`].
    fn rate(&self, seen: Option<f64>) {
        let mut readings = self.readings.lock();
        if seen.is_none() && readings.is_empty() {
            return;
        }
        if readings.len() == RATINGS {
            readings.pop_front();
        }
        readings.push_back(seen.unwrap_or(1.0));
        let ratio = if readings.len() >= FIRST_RATINGS {
            crate::bench::stats::median(readings.make_contiguous()).unwrap_or(1.0)
        } else {
            1.0
        };
        self.ratio.store(ratio.to_bits(), Ordering::Relaxed);
    }
}

/// Rates each worker's [`StepClock::slowness`] by its fitted time per prefill token over the
/// median of the fitted workers' (no reading where its fit has not settled or fewer than two
/// workers have one; at most 4 times off), the median of its last `RATINGS` readings
/// (`FIRST_RATINGS` at least; see `StepClock::rate`); a rating within [`SPEED_DEADBAND`] of 1
/// reads as 1. What a worker's queue and misses cost in time, for a pool of unlike GPUs serving
/// one model.
///
/// Whose fit: while this gateway has the pool to itself, its own ([`StepClock::fit`]). Where
/// the polled load shows more than [`ALONE_SHARE`] of the requests in flight are someone else's
/// (other replicas', clients going to the workers directly), and for `RATINGS` polls after
/// that, the fit against the workers' own counters ([`StepClock::polled`]): a worker's steps
/// then carry others' prefill too, which this gateway's own fit takes for its own prompts' cost
/// (under the mixed workload with two replicas on 4 simulated L4s, ratings from it left the
/// deadband for seconds on end and one run of three collapsed, p95 TTFT 2.3x), and the
/// counters count it, read only while it can tell (`StepClock::pool_reading`): a poll that
/// cannot leaves the worker's rating as it was. While nothing is in flight no reading is taken.
pub fn rate_speeds(workers: &[Arc<Worker>]) {
    let (local, others) = workers.iter().fold((0, 0), |(local, others), w| {
        (local + w.inflight(), others + w.load.queued(0))
    });
    if local + others == 0 {
        return;
    }
    // Beside others, and for a window of polls after them (their requests come and go), each
    // worker's time per token as fitted against its own counters. One choice for the whole pool
    // (a worker added since takes it up too): readings of the two kinds are not to be mixed in
    // one median. Kept on the workers' clocks, the function having no state of its own.
    let shared = others as f64 > ALONE_SHARE * (local + others) as f64;
    let beside = if shared {
        RATINGS as u32
    } else {
        let left = |w: &Arc<Worker>| w.steps.beside.load(Ordering::Relaxed);
        workers
            .iter()
            .map(left)
            .max()
            .unwrap_or(0)
            .saturating_sub(1)
    };
    let readings: Vec<SpeedReading> = workers
        .iter()
        .map(|w| {
            w.steps.beside.store(beside, Ordering::Relaxed);
            if beside > 0 {
                w.steps.pool_reading()
            } else {
                w.steps
                    .settled_per_token()
                    .map_or(SpeedReading::Unknown, SpeedReading::PerToken)
            }
        })
        .collect();
    let fitted: Vec<f64> = readings
        .iter()
        .filter_map(|r| match r {
            SpeedReading::PerToken(per_token) => Some(*per_token),
            _ => None,
        })
        .collect();
    let median = if fitted.len() >= 2 {
        crate::bench::stats::median(&fitted).unwrap_or(0.0)
    } else {
        0.0
    };
    for (w, reading) in workers.iter().zip(readings) {
        // A reading more than four times off the median is more likely a bad fit than a GPU:
        // it counts as four times. A fit too uncertain to read leaves the rating as it was.
        let seen = match reading {
            SpeedReading::Unsure => continue,
            SpeedReading::PerToken(per_token) if median > 0.0 => {
                Some((per_token / median).clamp(0.25, 4.0))
            }
            _ => None,
        };
        w.steps.rate(seen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{
        step_clock::{
            tests::{fit_against_counters, spread_steps},
            STEP_WINDOW,
        },
        Polled,
    };

    #[test]
    fn workers_are_rated_by_their_time_per_token_beside_the_pools_median() {
        // Per prefill token: two workers at 10 us, one at 11 (within the deadband), one at 30 (a
        // GPU a third as fast), one never timed, and one at 30 timed over too few steps for its
        // fit to have settled.
        let ws = crate::workers::test_workers(6);
        let mix = [0, 128, 0, 512, 256, 0, 0, 1024];
        let timed = [(10, 200), (10, 200), (11, 200), (30, 200), (0, 0), (30, 20)];
        for (w, (per_token, steps)) in ws.iter().zip(timed) {
            let mut t = 1_000;
            for x in mix.iter().copied().cycle().take(steps) {
                t += 20_000 + per_token * x;
                w.steps.frame(t, x, || 0);
                w.steps.frame(t + 50, 0, || 0);
            }
        }
        // Nothing in flight: no reading is taken.
        for _ in 0..RATINGS {
            rate_speeds(&ws);
        }
        assert_eq!(ws[3].steps.slowness(), 1.0);
        let _inflight: Vec<_> = ws.iter().map(|w| w.acquire()).collect();
        // Rated from its first few readings on.
        for _ in 0..FIRST_RATINGS - 1 {
            rate_speeds(&ws);
        }
        assert_eq!(ws[3].steps.slowness(), 1.0);
        rate_speeds(&ws);
        let slowness: Vec<f64> = ws.iter().map(|w| w.steps.slowness()).collect();
        // The median of 10, 10, 11 and 30 is 10.5: the slow one is about 2.9 times it.
        assert_eq!(slowness[..3], [1.0, 1.0, 1.0]);
        assert!((slowness[3] - 30.0 / 10.5).abs() < 0.15, "{slowness:?}");
        assert_eq!(slowness[4], 1.0);
        assert!(ws[5].steps.fit().is_some());
        assert_eq!(slowness[5], 1.0);
        // A window of readings later, one fitted worker has no pool to be compared with: once
        // read, it goes back to 1 over the polls that cannot read it.
        for _ in 0..RATINGS {
            rate_speeds(&ws);
        }
        for _ in 0..RATINGS / 2 - 1 {
            rate_speeds(&ws[3..]);
        }
        assert!(ws[3].steps.slowness() > 2.5);
        rate_speeds(&ws[3..]);
        rate_speeds(&ws[3..]);
        assert_eq!(ws[3].steps.slowness(), 1.0);
        // Rated again, then beside another replica: the polls show two requests on each worker
        // for this gateway's one. The steps this gateway timed then carry the other's prefill
        // too, and its own fits no longer count: with no fit against the workers' counters,
        // every reading is 1 until the rating is.
        for _ in 0..RATINGS {
            rate_speeds(&ws);
        }
        assert!(ws[3].steps.slowness() > 2.5);
        let polled = Polled {
            running: 2.0,
            ..Polled::default()
        };
        for w in &ws {
            w.polled(Some(polled), w.inflight(), 0);
        }
        for _ in 0..RATINGS / 2 + 1 {
            rate_speeds(&ws);
        }
        assert_eq!(ws[3].steps.slowness(), 1.0);
        // Fitted against their counters (the slow one at 30 us a token, the others at 10 and
        // 11): rated apart again, by those fits.
        for (w, per_token) in ws.iter().zip([10, 10, 11, 30, 10, 10]) {
            fit_against_counters(&w.steps, 20_000, per_token, 3, STEP_WINDOW as usize);
        }
        for _ in 0..RATINGS / 2 + 1 {
            rate_speeds(&ws);
        }
        let slowness: Vec<f64> = ws.iter().map(|w| w.steps.slowness()).collect();
        assert_eq!(slowness[..3], [1.0, 1.0, 1.0]);
        assert!((slowness[3] - 3.0).abs() < 0.15, "{slowness:?}");
    }

    #[test]
    fn after_other_replicas_leave_the_pool_is_rated_from_the_counters_for_a_window_of_polls() {
        // By the counters, worker 3 takes three times the others' time per token; by this
        // gateway's own fits all four look alike (worker 3's prompts all its own, the others'
        // a third: their own fits take the other replica's prefill for theirs). Worker 4 joins
        // later: its own fit nine times too slow, its counters' fit like the others'.
        let ws = crate::workers::test_workers(5);
        for (w, (per_token, share)) in ws.iter().zip([(10, 3), (10, 3), (10, 3), (30, 1), (10, 9)])
        {
            fit_against_counters(&w.steps, 20_000, per_token, share, STEP_WINDOW as usize);
        }
        let (four, _inflight) = (&ws[..4], ws.iter().map(|w| w.acquire()).collect::<Vec<_>>());
        let others = |running: f64| {
            for w in &ws {
                let polled = Polled {
                    running,
                    ..Polled::default()
                };
                w.polled(Some(polled), w.inflight(), 0);
            }
        };
        // Beside another replica.
        others(2.0);
        for _ in 0..RATINGS / 2 + 1 {
            rate_speeds(four);
        }
        assert!((ws[3].steps.slowness() - 3.0).abs() < 0.15);
        // It leaves: for a window of polls the counters still rate the pool, worker 4 (joined
        // now) included.
        others(1.0);
        for _ in 0..RATINGS - 1 {
            rate_speeds(&ws);
        }
        assert!((ws[3].steps.slowness() - 3.0).abs() < 0.15);
        assert_eq!(ws[4].steps.slowness(), 1.0);
        // Then this gateway's own fits, by which worker 4 is slow and worker 3 like the others.
        for _ in 0..RATINGS / 2 + 2 {
            rate_speeds(&ws);
        }
        assert_eq!(ws[3].steps.slowness(), 1.0);
        assert!(ws[4].steps.slowness() > 2.5, "{}", ws[4].steps.slowness());
    }

    /// Beside another replica at light load, a worker's pool fit is too uncertain to read
    /// (its prefill lost in the spread of its steps): no worker is rated apart, though one's
    /// fit is three times the others'. Busy, the same worker is.
    #[test]
    fn workers_whose_pool_fits_are_unsure_are_not_rated_apart() {
        for (thin, slow) in [(40, false), (1, true)] {
            let ws = crate::workers::test_workers(4);
            for (w, per_token) in ws.iter().zip([50, 50, 50, 150]) {
                spread_steps(&w.steps, per_token, thin);
            }
            let _inflight: Vec<_> = ws.iter().map(|w| w.acquire()).collect();
            for w in &ws {
                let polled = Polled {
                    running: 2.0,
                    ..Polled::default()
                };
                w.polled(Some(polled), w.inflight(), 0);
            }
            for _ in 0..RATINGS {
                rate_speeds(&ws);
            }
            let slowness: Vec<f64> = ws.iter().map(|w| w.steps.slowness()).collect();
            if slow {
                assert_eq!(slowness[..3], [1.0, 1.0, 1.0]);
                assert!((slowness[3] - 3.0).abs() < 0.3, "{slowness:?}");
            } else {
                assert_eq!(slowness, [1.0; 4]);
            }
        }
    }

    #[test]
    fn a_rating_holds_through_a_fit_that_strays_for_a_while() {
        let clock = StepClock::default();
        for _ in 0..RATINGS {
            clock.rate(Some(1.0));
        }
        // Four times the median for almost half a window of polls on end: a fit thrown off (as
        // two replicas' long prompts did), not a slower GPU.
        for _ in 0..RATINGS / 2 - 1 {
            clock.rate(Some(4.0));
        }
        assert_eq!(clock.slowness(), 1.0);
        // Slower at every poll for more than half the window: a GPU of another type.
        clock.rate(Some(3.0));
        clock.rate(Some(3.0));
        assert_eq!(clock.slowness(), 3.0);
        for _ in 0..RATINGS {
            clock.rate(Some(0.3));
        }
        assert_eq!(clock.slowness(), 0.3);
    }

    #[test]
    fn a_worker_is_rated_from_its_first_readings_however_long_it_went_unread() {
        let clock = StepClock::default();
        // Polls while its fit settles: no reading, and they do not count.
        for _ in 0..RATINGS {
            clock.rate(None);
        }
        // Rated from its eighth reading: eight polls, not half a window of them.
        for _ in 0..7 {
            clock.rate(Some(3.0));
        }
        assert_eq!(clock.slowness(), 1.0);
        clock.rate(Some(3.0));
        assert_eq!(clock.slowness(), 3.0);
        // Once read, a poll that cannot read it counts as 1 (its fit gone, or its pool).
        for _ in 0..9 {
            clock.rate(None);
        }
        assert_eq!(clock.slowness(), 1.0);
    }
}
