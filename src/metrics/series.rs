//! The series each worker's requests update, resolved once per worker and arm rather than
//! looked up by their labels on every request.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::{sharded, MetricSet, Metrics};

impl Metrics {
    /// The series one worker's requests update under one arm, looked up once (see
    /// [`WorkerSeries`]).
    pub fn worker_series(&self, policy: &'static str, arm: &str, worker: &str) -> WorkerSeries {
        WorkerSeries {
            policy,
            arm: arm.into(),
            worker: worker.into(),
            arm_header: http::HeaderValue::from_str(arm).ok(),
            ttfb: self.ttfb.with_label_values(&[policy, arm, worker]),
            duration: self.duration.with_label_values(&[policy, arm, worker]),
            answered: Default::default(),
            predicted_cached: OnceLock::new(),
            reported_cached: OnceLock::new(),
            verdicts: Default::default(),
        }
    }
}

/// The series that every request to one worker under one arm updates, resolved once instead of
/// per request (a label lookup hashes every label value and takes a lock). Kept by the `Worker`
/// (see `Worker::series`), so they go when its series are removed. Series a request may never
/// touch (a status, the cached-token counters) are made on first use, as before.
pub struct WorkerSeries {
    pub policy: &'static str,
    pub arm: Arc<str>,
    worker: Box<str>,
    /// The arm's name as the `x-kvroute-arm` response header, when it can be one.
    pub arm_header: Option<http::HeaderValue>,
    pub ttfb: sharded::Histogram,
    pub duration: sharded::Histogram,
    /// `requests` with status 200, by route (`Route as usize`).
    answered: [OnceLock<sharded::Counter>; 4],
    predicted_cached: OnceLock<sharded::Counter>,
    reported_cached: OnceLock<sharded::Counter>,
    /// `cache_predictions` by verdict (close, over, under).
    verdicts: [OnceLock<sharded::Counter>; 3],
}

impl WorkerSeries {
    /// Whether these are the series of `arm`, under `policy`.
    fn is_of(&self, policy: &str, arm: &str) -> bool {
        self.policy == policy && &*self.arm == arm
    }

    /// Counts a request answered with `status` on `route`.
    pub fn count_request(
        &self,
        metrics: &MetricSet,
        route: crate::proxy::Route,
        status: http::StatusCode,
    ) {
        let labels = |status: &str| {
            metrics.requests.with_label_values(&[
                route.as_str(),
                self.policy,
                &self.arm,
                &self.worker,
                status,
            ])
        };
        // A route without a slot (none today) is looked up by its labels, never out of bounds.
        match self.answered.get(route as usize) {
            Some(ok) if status == http::StatusCode::OK => ok.get_or_init(|| labels("200")).inc(),
            _ => labels(status.as_str()).inc(),
        }
    }

    /// Counts one answer's predicted and reported cached tokens.
    pub fn count_cached(&self, metrics: &MetricSet, predicted: u64, reported: u64) {
        let labels = [self.policy, &*self.arm, &*self.worker];
        self.predicted_cached
            .get_or_init(|| metrics.predicted_cached_tokens.with_label_values(&labels))
            .inc_by(predicted);
        self.reported_cached
            .get_or_init(|| metrics.reported_cached_tokens.with_label_values(&labels))
            .inc_by(reported);
    }

    /// Counts one cache prediction against the worker's report: `verdict` is `close`, `over`
    /// or `under`.
    pub fn count_verdict(&self, metrics: &MetricSet, verdict: &'static str) {
        let labels = || {
            metrics
                .cache_predictions
                .with_label_values(&[self.policy, &self.arm, verdict])
        };
        match ["close", "over", "under"]
            .iter()
            .position(|v| *v == verdict)
        {
            Some(i) => self.verdicts[i].get_or_init(labels).inc(),
            None => labels().inc(),
        }
    }
}

/// A worker's [`WorkerSeries`], one per arm it has served (a handful: arms are few, and a reload
/// that keeps an arm's name and policy keeps its series).
#[derive(Default)]
pub struct SeriesByArm {
    /// The first arm's, read with no lock: every request reads it, from every event loop, and a
    /// lock's word is written even to read.
    first: OnceLock<Arc<WorkerSeries>>,
    others: Mutex<Vec<Arc<WorkerSeries>>>,
}

impl std::fmt::Debug for SeriesByArm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SeriesByArm")
    }
}

/// Which of a worker's [`WorkerSeries`] a request counts in. The first arm's is read through the
/// worker, which holds it: a request that held it by its own `Arc` would write the count that
/// every event loop's requests write ([`crate::loop_copy`]).
pub enum SeriesRef {
    First,
    Other(Arc<WorkerSeries>),
}

impl SeriesByArm {
    /// The series of `(policy, arm)`, made on first use, as a request holds it.
    pub fn pick(
        &self,
        metrics: &Metrics,
        policy: &'static str,
        arm: &str,
        worker: &str,
    ) -> SeriesRef {
        // The first arm's is found with no lock, and held with no clone of its `Arc`, whose count
        // every loop would write.
        let first = || self.first.get().is_some_and(|s| s.is_of(policy, arm));
        if first() {
            return SeriesRef::First;
        }
        let mut others = self.others.lock();
        if first() {
            return SeriesRef::First;
        }
        if let Some(s) = others.iter().find(|s| s.is_of(policy, arm)) {
            return SeriesRef::Other(Arc::clone(s));
        }
        let made = Arc::new(metrics.worker_series(policy, arm, worker));
        match self.first.set(made) {
            Ok(()) => SeriesRef::First,
            Err(made) => {
                others.push(Arc::clone(&made));
                SeriesRef::Other(made)
            }
        }
    }

    /// The series `r` names, which [`SeriesByArm::pick`] gave.
    pub fn at<'a>(&'a self, r: &'a SeriesRef) -> &'a WorkerSeries {
        match r {
            SeriesRef::Other(s) => s,
            SeriesRef::First => self
                .first
                .get()
                .expect("a SeriesRef::First comes from a set first series, which stays set"),
        }
    }
}
