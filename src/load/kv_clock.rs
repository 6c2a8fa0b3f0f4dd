//! A worker's KV cache as a clock of the tokens written into it: what a policy presumes evicted,
//! and the restarts the polls see.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{now_us, Polled};
use crate::index::Restarts;

/// A worker's KV cache as a clock of the tokens written into it, so that a policy that learns
/// the cache from its own requests can presume what the worker has since evicted: vLLM reuses
/// the least recently used free block for each new one, so a block not used again is gone once
/// about a cache's worth of tokens has been written after it ([`crate::index`]).
///
/// The clock counts what this gateway sent (each prompt's uncached part, as the decision
/// predicted it, and what the answer shows beyond that: generated tokens, prompt tokens that
/// were not cached after all), not the worker's own counters of every replica's traffic. A
/// replica sees its share of the writes and the same share of the requests that refresh a block
/// (vLLM moves a block it reuses to the back of the eviction queue): dated by every replica's
/// writes, what the other replicas keep using would age as if nobody did, and it is presumed
/// evicted too soon (measured with two replicas on Mooncake's synthetic trace: 0.70x the cached
/// tokens reported, against 1.04x for one gateway; `docs/measurements.md`). Counted this way,
/// traffic that does not pass through this gateway makes presumed evictions come late, never
/// early.
///
/// The polls also watch for restarts: a worker that restarted (its process start time changed,
/// or its prompt token counter fell) has an empty cache, and the indexes stop counting it as
/// holding anything it was sent before ([`Restarts`]).
#[derive(Debug, Default)]
pub struct KvClock {
    /// Tokens the cache holds, from `vllm:cache_config_info`; 0 while unknown.
    capacity: AtomicU64,
    /// Tokens this gateway expects the worker to have written for it.
    sent: AtomicU64,
    restarts: Restarts,
    /// At the last poll that showed them, as `f64` bits (0 while never shown): the worker's
    /// prompt token counter and its process's start time.
    prompt_tokens: AtomicU64,
    started: AtomicU64,
    /// Tokens written lately: a sum that decays by `e` every [`RECENT_TAU_US`], as `f64` bits,
    /// and when it last moved ([`now_us`]). What conversations live on the worker, roughly.
    recent: AtomicU64,
    recent_at: AtomicU64,
}

/// The time constant of [`KvClock::recent`]: a minute.
pub const RECENT_TAU_US: u64 = 60_000_000;

impl KvClock {
    /// Tokens this gateway has had the worker write lately (decaying by `e` a minute), at `now`
    /// ([`now_us`]).
    pub fn recent(&self, now: u64) -> f64 {
        let sum = f64::from_bits(self.recent.load(Ordering::Relaxed));
        let at = self.recent_at.load(Ordering::Relaxed);
        sum * (-(now.saturating_sub(at) as f64) / RECENT_TAU_US as f64).exp()
    }

    /// Adds `tokens` to the recent sum. Two writers at once may lose one's tokens: a moving sum,
    /// cheaper than a retry loop.
    fn add_recent(&self, tokens: u64) {
        let now = now_us();
        let next = self.recent(now) + tokens as f64;
        self.recent.store(next.to_bits(), Ordering::Relaxed);
        self.recent_at.store(now, Ordering::Relaxed);
    }

    /// Tokens the worker's KV cache holds, once a poll has shown it.
    pub fn capacity(&self) -> Option<u64> {
        Some(self.capacity.load(Ordering::Relaxed)).filter(|&c| c > 0)
    }

    /// Counts `tokens` this gateway expects the worker to write (a prompt's uncached part, an
    /// answer's generated tokens).
    pub fn add(&self, tokens: u64) {
        if tokens > 0 {
            self.sent.fetch_add(tokens, Ordering::Relaxed);
            self.add_recent(tokens);
        }
    }

    /// Tokens this gateway has had the worker write into its KV cache so far.
    pub fn now(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Counts `tokens` (see [`Self::add`]) and returns the clock after them with the capacity,
    /// when the capacity is known.
    pub fn stamp(&self, tokens: u64) -> Option<(u64, u64)> {
        self.add(tokens);
        self.capacity().map(|c| (self.now(), c))
    }

    /// The worker's prompt token counter at the last poll that showed it (0 until one has).
    pub fn polled_prompt_tokens(&self) -> f64 {
        f64::from_bits(self.prompt_tokens.load(Ordering::Relaxed))
    }

    /// The restarts its polls have seen, for the indexes.
    pub fn restarts(&self) -> &Restarts {
        &self.restarts
    }

    /// Records a poll's capacity, and whether the worker restarted since the last poll that
    /// showed its counters (then `true`, and its restart count moves on). A failed poll changes
    /// nothing: the last known capacity still holds, and a restart during an outage shows at the
    /// next poll that answers.
    pub fn store(&self, p: Option<&Polled>) -> bool {
        let Some(p) = p else {
            return false;
        };
        if p.kv_capacity >= 1.0 {
            self.capacity.store(p.kv_capacity as u64, Ordering::Relaxed);
        }
        // The last value shown, replaced by `now` (0 before any was shown).
        let last = |slot: &AtomicU64, now: f64| {
            f64::from_bits(slot.swap(now.to_bits(), Ordering::Relaxed))
        };
        let fell = p
            .prompt_tokens
            .is_some_and(|now| now < last(&self.prompt_tokens, now));
        // The start time is whole seconds plus a fraction from the kernel's clock ticks: it
        // reads the same at every poll of one process.
        let started = p.started.is_some_and(|now| {
            let before = last(&self.started, now);
            before > 0.0 && (now - before).abs() >= 1.0
        });
        let restarted = fell || started;
        if restarted {
            self.restarts.bump();
        }
        restarted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::parse_vllm_metrics;

    #[test]
    fn the_kv_clock_counts_what_this_gateway_had_the_worker_write() {
        let c = KvClock::default();
        assert_eq!(c.stamp(100), None, "no capacity known yet");
        c.add(20);
        assert_eq!(c.now(), 120);
        c.store(Some(&Polled {
            kv_capacity: 4096.0,
            ..Polled::default()
        }));
        assert_eq!(c.stamp(300), Some((420, 4096)));
        c.store(None);
        c.store(Some(&Polled::default()));
        assert_eq!(c.capacity(), Some(4096), "a failed or blank poll keeps it");
    }

    #[test]
    fn the_recent_writes_decay_by_e_each_time_constant() {
        let c = KvClock::default();
        assert_eq!(c.recent(now_us()), 0.0);
        c.add(1_000);
        let then = now_us();
        let fresh = c.recent(then);
        assert!((999.0..=1_000.0).contains(&fresh), "{fresh}");
        let later = c.recent(then + RECENT_TAU_US);
        let e = std::f64::consts::E;
        assert!((later - 1_000.0 / e).abs() < 1.0, "{later}");
    }

    #[test]
    fn a_restart_shows_as_a_new_start_time_or_a_counter_that_fell() {
        let text = "vllm:num_requests_running{engine=\"0\"} 0.0\n\
            vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 700.0\n\
            vllm:prompt_tokens_total{engine=\"1\",model_name=\"m\"} 300.0\n\
            vllm:prompt_tokens_created{engine=\"0\",model_name=\"m\"} 1.7e9\n\
            process_start_time_seconds 1.76427538912e+09\n";
        let p = parse_vllm_metrics(text, None).unwrap();
        assert_eq!(p.prompt_tokens, Some(1000.0));
        assert_eq!(p.started, Some(1_764_275_389.12));
        let polled = |prompt_tokens: Option<f64>, started: Option<f64>| Polled {
            prompt_tokens,
            started,
            ..Polled::default()
        };
        let c = KvClock::default();
        assert!(
            !c.store(Some(&polled(Some(1000.0), Some(100.5)))),
            "first sight"
        );
        assert!(!c.store(Some(&polled(Some(1500.0), Some(100.5)))));
        assert!(!c.store(None), "a failed poll");
        assert!(!c.store(Some(&polled(None, None))), "counters not shown");
        assert_eq!(c.restarts().count(), 0);
        // Back after an outage with a counter below the last one seen.
        assert!(c.store(Some(&polled(Some(20.0), None))));
        assert_eq!(c.restarts().count(), 1);
        assert!(!c.store(Some(&polled(Some(20.0), Some(100.5)))));
        // A new process that has already served more than the old one had: its start time.
        assert!(c.store(Some(&polled(Some(5000.0), Some(260.0)))));
        assert_eq!(c.restarts().count(), 2);
        assert!(!c.store(Some(&polled(Some(5001.0), Some(260.0)))));
    }
}
