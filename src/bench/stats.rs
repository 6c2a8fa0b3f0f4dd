//! Per-request samples and the statistics of a run's sustained window.
//!
//! Every latency is measured from the request's *intended* send time: in an open loop that is its
//! scheduled arrival, in a closed loop the moment its client slot freed. A generator that falls
//! behind therefore shows the wait it caused instead of hiding it (coordinated omission). Only
//! requests intended inside the window `[warmup, warmup + duration)` are counted.

use std::collections::BTreeMap;

use serde::Serialize;

/// One request's outcome; times in seconds since the run started.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Sample {
    /// Position in the workload's request stream.
    pub index: u64,
    pub class: String,
    pub intended: f64,
    /// When the request actually went out (later than `intended` if the generator lagged).
    pub sent: f64,
    /// Time of each content event, in order.
    pub token_times: Vec<f64>,
    pub done: f64,
    pub output_tokens: usize,
    pub ok: bool,
    pub cancelled: bool,
    pub error: Option<String>,
    pub slo: Option<(f64, f64)>,
}

impl Sample {
    /// Converts wall-clock times to the target's modelled time (a simulator at `--time-scale k`).
    pub fn scale(&mut self, k: f64) {
        self.intended *= k;
        self.sent *= k;
        self.done *= k;
        for t in &mut self.token_times {
            *t *= k;
        }
    }

    pub fn ttft(&self) -> Option<f64> {
        self.token_times.first().map(|t| t - self.intended)
    }

    pub fn e2e(&self) -> f64 {
        self.done - self.intended
    }

    /// Mean time per output token after the first.
    pub fn tpot(&self) -> Option<f64> {
        let (first, last) = (self.token_times.first()?, self.token_times.last()?);
        (self.token_times.len() > 1).then(|| (last - first) / (self.token_times.len() - 1) as f64)
    }

    fn inter_token(&self) -> impl Iterator<Item = f64> + '_ {
        self.token_times.windows(2).map(|w| w[1] - w[0])
    }

    fn meets(&self, default_slo: (f64, f64)) -> bool {
        let (ttft_ms, tpot_ms) = self.slo.unwrap_or(default_slo);
        self.ok
            && self.ttft().is_some_and(|t| t * 1e3 <= ttft_ms)
            && self.tpot().is_none_or(|t| t * 1e3 <= tpot_ms)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles; all zero for no data.
    pub fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |p: f64| {
            let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
            v[rank.clamp(1, v.len()) - 1]
        };
        Self {
            p50: at(50.0),
            p95: at(95.0),
            p99: at(99.0),
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// What the sustained window measured. Latencies in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    pub window_seconds: f64,
    pub requests: usize,
    pub succeeded: usize,
    pub errors: usize,
    pub cancelled: usize,
    pub req_per_s: f64,
    pub output_tok_per_s: f64,
    pub ttft: Percentiles,
    pub itl: Percentiles,
    pub tpot: Percentiles,
    pub e2e: Percentiles,
    /// Share of the window's requests that succeeded within their TTFT and TPOT SLOs.
    pub goodput: f64,
    /// Requests per second of the window that succeeded within their SLOs (errors and refusals
    /// miss them): what an overloaded pool still delivers.
    pub goodput_per_s: f64,
    /// Largest lag between a request's intended and actual send time (the generator's own delay).
    pub max_send_lag: f64,
    /// TTFT of the completed requests of each workload class (`mixed`'s four, a trace's one),
    /// by class name: a policy can win the mean mix and lose its short questions.
    pub ttft_by_class: BTreeMap<String, Percentiles>,
}

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

pub fn summarize(samples: &[Sample], warmup: f64, duration: f64, slo: (f64, f64)) -> Summary {
    let window: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.intended >= warmup && s.intended < warmup + duration)
        .collect();
    let done: Vec<&&Sample> = window.iter().filter(|s| s.ok && !s.cancelled).collect();
    let n = window.len();
    Summary {
        window_seconds: duration,
        requests: n,
        succeeded: done.len(),
        errors: window.iter().filter(|s| !s.ok).count(),
        cancelled: window.iter().filter(|s| s.cancelled).count(),
        req_per_s: done.len() as f64 / duration,
        output_tok_per_s: done.iter().map(|s| s.output_tokens).sum::<usize>() as f64 / duration,
        ttft: Percentiles::of(done.iter().filter_map(|s| s.ttft()).collect()),
        itl: Percentiles::of(done.iter().flat_map(|s| s.inter_token()).collect()),
        tpot: Percentiles::of(done.iter().filter_map(|s| s.tpot()).collect()),
        e2e: Percentiles::of(done.iter().map(|s| s.e2e()).collect()),
        goodput: if n == 0 {
            0.0
        } else {
            window
                .iter()
                .filter(|s| !s.cancelled && s.meets(slo))
                .count() as f64
                / window.iter().filter(|s| !s.cancelled).count().max(1) as f64
        },
        goodput_per_s: window
            .iter()
            .filter(|s| !s.cancelled && s.meets(slo))
            .count() as f64
            / duration,
        max_send_lag: window
            .iter()
            .map(|s| s.sent - s.intended)
            .fold(0.0, f64::max),
        ttft_by_class: {
            let mut by: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            for s in &done {
                if let Some(t) = s.ttft() {
                    by.entry(s.class.clone()).or_default().push(t);
                }
            }
            by.into_iter()
                .map(|(class, v)| (class, Percentiles::of(v)))
                .collect()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(intended: f64, sent: f64, tokens: &[f64]) -> Sample {
        Sample {
            class: "c".into(),
            intended,
            sent,
            token_times: tokens.to_vec(),
            done: *tokens.last().unwrap_or(&sent),
            output_tokens: tokens.len(),
            ok: true,
            ..Sample::default()
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p95, p.p99), (50.0, 95.0, 99.0));
        assert_eq!(p.mean, 50.5);
        assert_eq!(Percentiles::of(vec![3.0]).p99, 3.0);
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
    }

    #[test]
    fn latency_counts_from_the_intended_time_not_the_late_send() {
        // Sent 2 s late (the generator fell behind): TTFT must include those 2 s.
        let s = sample(1.0, 3.0, &[3.1, 3.2, 3.3]);
        assert!((s.ttft().unwrap() - 2.1).abs() < 1e-9);
        assert!((s.e2e() - 2.3).abs() < 1e-9);
        assert!((s.tpot().unwrap() - 0.1).abs() < 1e-9);
        let sum = summarize(&[s], 0.0, 10.0, (5000.0, 1000.0));
        assert!((sum.max_send_lag - 2.0).abs() < 1e-9);
    }

    #[test]
    fn only_the_sustained_window_counts() {
        let samples = vec![
            sample(0.5, 0.5, &[9.0]), // warm-up: its huge TTFT must not count
            sample(2.0, 2.0, &[2.1]),
            sample(3.0, 3.0, &[3.2]),
            sample(12.5, 12.5, &[20.0]), // after the window
        ];
        let s = summarize(&samples, 1.0, 10.0, (150.0, 100.0));
        assert_eq!(s.requests, 2);
        assert!((s.ttft.p99 - 0.2).abs() < 1e-9);
        assert!((s.req_per_s - 0.2).abs() < 1e-9);
        // 0.1 s and 0.2 s TTFT against a 150 ms SLO: half meet it.
        assert!((s.goodput - 0.5).abs() < 1e-9);
        assert!(
            (s.goodput_per_s - 0.1).abs() < 1e-9,
            "one of the two, over 10 s"
        );
    }

    #[test]
    fn errors_and_cancellations_are_counted_apart_from_latency() {
        let mut failed = sample(2.0, 2.0, &[]);
        failed.ok = false;
        let mut cancelled = sample(2.0, 2.0, &[2.5, 2.6]);
        cancelled.cancelled = true;
        let s = summarize(
            &[failed, cancelled, sample(2.0, 2.0, &[2.1])],
            0.0,
            10.0,
            (1e6, 1e6),
        );
        assert_eq!(
            (s.requests, s.errors, s.cancelled, s.succeeded),
            (3, 1, 1, 1)
        );
        assert!((s.ttft.p50 - 0.1).abs() < 1e-9);
        assert!((s.goodput - 0.5).abs() < 1e-9, "the error misses its SLO");
    }

    #[test]
    fn ttft_is_also_summarized_per_class() {
        let mut long = sample(2.0, 2.0, &[2.9]);
        long.class = "long".into();
        let mut failed = sample(2.0, 2.0, &[]);
        failed.class = "failed".into();
        failed.ok = false;
        let s = summarize(
            &[
                sample(2.0, 2.0, &[2.1]),
                sample(3.0, 3.0, &[3.3]),
                long,
                failed,
            ],
            0.0,
            10.0,
            (1e6, 1e6),
        );
        let classes: Vec<&str> = s.ttft_by_class.keys().map(String::as_str).collect();
        assert_eq!(
            classes,
            ["c", "long"],
            "a class with no completed request has no TTFT"
        );
        assert!((s.ttft_by_class["c"].p95 - 0.3).abs() < 1e-9);
        assert!((s.ttft_by_class["long"].p50 - 0.9).abs() < 1e-9);
    }
}
