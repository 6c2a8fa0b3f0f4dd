//! Whose traffic a worker serves, over many polls: how much of it is other replicas'.

use std::sync::atomic::{AtomicU64, Ordering};

/// Polls the moving sums run over, about: at the default 1 s interval, half a minute.
pub const TRAFFIC_POLLS: f64 = 32.0;

/// Requests a worker had at each poll, this gateway's and others' (other replicas', other
/// clients'), summed over about the last `TRAFFIC_POLLS` polls, older polls weighing less.
///
/// One poll's count is what a routing decision would otherwise read, and at light load it says
/// little: with two replicas and a request or two in flight, one poll finds only the other
/// replica's requests (a share of 1) and the next finds none (0, alone), and a replica that
/// decides as if alone on the polls that find nothing places a conversation's turns by load where
/// the other replica sends them home. Summed over polls, two replicas each read about half at any
/// load. A poll that finds the worker idle adds nothing to either sum and decays both, so the
/// share outlives a quiet spell; a gateway whose traffic the worker has always carried alone
/// reads 0.
#[derive(Debug, Default)]
pub struct Traffic {
    /// Others' requests, as `f64` bits.
    others: AtomicU64,
    /// Everyone's, this gateway's included, as `f64` bits.
    all: AtomicU64,
}

impl Traffic {
    /// One poll: `others` requests beyond this gateway's `local` ones. Only the poll loop writes.
    pub fn polled(&self, others: f64, local: f64) {
        let keep = 1.0 - 1.0 / TRAFFIC_POLLS;
        let next = |sum: &AtomicU64, add: f64| {
            let now = f64::from_bits(sum.load(Ordering::Relaxed));
            sum.store((now * keep + add).to_bits(), Ordering::Relaxed);
        };
        next(&self.others, others.max(0.0));
        next(&self.all, others.max(0.0) + local.max(0.0));
    }

    /// The moving sums: others' requests and everyone's.
    pub fn sums(&self) -> (f64, f64) {
        (
            f64::from_bits(self.others.load(Ordering::Relaxed)),
            f64::from_bits(self.all.load(Ordering::Relaxed)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(t: &Traffic) -> f64 {
        let (others, all) = t.sums();
        others / all
    }

    #[test]
    fn a_replica_at_light_load_reads_its_share_across_polls_that_each_say_little() {
        let t = Traffic::default();
        // Two replicas, one request in flight now and then: this gateway's, the other's, none.
        for k in 0..300 {
            match k % 3 {
                0 => t.polled(0.0, 1.0),
                1 => t.polled(1.0, 0.0),
                _ => t.polled(0.0, 0.0),
            }
        }
        assert!((share(&t) - 0.5).abs() < 0.05, "{}", share(&t));
        // A quiet spell decays both sums alike: the share stays.
        for _ in 0..100 {
            t.polled(0.0, 0.0);
        }
        assert!((share(&t) - 0.5).abs() < 0.05, "{}", share(&t));
    }

    #[test]
    fn a_lone_gateway_reads_no_others_and_a_departed_replica_fades() {
        let t = Traffic::default();
        assert_eq!(t.sums(), (0.0, 0.0));
        for _ in 0..50 {
            t.polled(0.0, 3.0);
        }
        assert_eq!(share(&t), 0.0);
        for _ in 0..50 {
            t.polled(3.0, 3.0);
        }
        assert!(share(&t) > 0.4);
        // The other replica leaves: its part falls below a tenth within a few windows.
        for _ in 0..(4.0 * TRAFFIC_POLLS) as usize {
            t.polled(0.0, 3.0);
        }
        assert!(share(&t) < 0.1, "{}", share(&t));
    }
}
