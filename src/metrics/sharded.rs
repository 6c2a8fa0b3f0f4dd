//! Counters, gauges and histograms that each event loop updates in a shard of its own, summed
//! when `/metrics` is scraped.
//!
//! Every proxied request updates series that all event loops share: its worker's latency
//! histograms and in-flight gauge, its answer's counter, its routing decision's counter. With
//! `prometheus`' own types each update is an atomic read-modify-write (four for a histogram) on a
//! cache line the other loop has just written, and moving a line between two cores costs tens of
//! nanoseconds, several times the update itself. Here a series is one cache-line-aligned cell per
//! shard, and a thread writes only its own shard's (event loop `i` writes shard `i`; see
//! [`pin_thread`]), so the line stays in that core's cache. Sums are exact whatever thread
//! writes where: a shard two threads share only costs what the shared line did before.
//!
//! A scrape reads the shards one after the other, not as one snapshot: a request counted while
//! it reads may be in one series and not yet in another, as with any set of separate counters.
//! A histogram's count is the sum of its buckets, read together, so its buckets always add up
//! to its count; its sum may lag by the observations made during the read.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;
use prometheus::core::{Collector, Desc};
use prometheus::proto;

/// Shards per series: one per core, up to 16 (memory grows with it: a histogram series is
/// 192 bytes a shard).
static SHARDS: LazyLock<usize> = LazyLock::new(|| {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 16)
});

/// Where threads that never called [`pin_thread`] take their shard from, in turn.
static NEXT_UNPINNED: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Gives the calling thread the shard of event loop `index`, so that two loops on two cores
/// write different cells. Other threads (the admin listener's, the blocking pool's, tests') are
/// given shards in turn on first use.
pub fn pin_thread(index: usize) {
    SHARD.with(|s| s.set(Some(index % *SHARDS)));
}

fn shard() -> usize {
    SHARD.with(|s| {
        s.get().unwrap_or_else(|| {
            let i = NEXT_UNPINNED.fetch_add(1, Relaxed) % *SHARDS;
            s.set(Some(i));
            i
        })
    })
}

/// One cell alone on its cache line.
#[derive(Default)]
#[repr(align(64))]
struct Padded(AtomicU64);

fn cells() -> Arc<[Padded]> {
    (0..*SHARDS).map(|_| Padded::default()).collect()
}

fn total(cells: &[Padded]) -> u64 {
    cells
        .iter()
        .fold(0u64, |sum, c| sum.wrapping_add(c.0.load(Relaxed)))
}

/// A monotonic counter (`IntCounter`).
#[derive(Clone)]
pub struct Counter(Arc<[Padded]>);

impl Default for Counter {
    fn default() -> Self {
        Self(cells())
    }
}

impl Counter {
    pub fn inc(&self) {
        self.inc_by(1);
    }

    pub fn inc_by(&self, n: u64) {
        self.0[shard()].0.fetch_add(n, Relaxed);
    }

    pub fn get(&self) -> u64 {
        total(&self.0)
    }
}

/// A gauge moved up and down (`IntGauge`): each shard holds its thread's net change, which may
/// be negative when a value raised on one thread is lowered on another.
#[derive(Clone)]
pub struct Gauge(Arc<[Padded]>);

impl Default for Gauge {
    fn default() -> Self {
        Self(cells())
    }
}

impl Gauge {
    pub fn inc(&self) {
        self.0[shard()].0.fetch_add(1, Relaxed);
    }

    pub fn dec(&self) {
        self.0[shard()].0.fetch_sub(1, Relaxed);
    }

    pub fn get(&self) -> i64 {
        // Shards' net changes, added with wrap-around: a negative one is its two's complement.
        total(&self.0) as i64
    }
}

/// Bounds a histogram may have (a bucket past the last counts what is above them all).
const MAX_BOUNDS: usize = 22;

/// One shard of a histogram: its buckets and its sum, on three cache lines of its own.
#[repr(align(64))]
struct HistogramShard {
    buckets: [AtomicU64; MAX_BOUNDS + 1],
    /// An `f64`'s bits.
    sum: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<HistogramShard>() == 192);

impl Default for HistogramShard {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }
}

/// A histogram over fixed upper bounds.
#[derive(Clone)]
pub struct Histogram(Arc<HistogramCells>);

struct HistogramCells {
    bounds: &'static [f64],
    shards: Box<[HistogramShard]>,
}

impl Histogram {
    /// At most [`MAX_BOUNDS`] ascending bounds.
    fn new(bounds: &'static [f64]) -> Self {
        assert!(bounds.len() <= MAX_BOUNDS, "too many histogram buckets");
        assert!(bounds.is_sorted(), "histogram bounds out of order");
        Self(Arc::new(HistogramCells {
            bounds,
            shards: (0..*SHARDS).map(|_| HistogramShard::default()).collect(),
        }))
    }

    pub fn observe(&self, v: f64) {
        let cells = &*self.0;
        // The first bound `v` is at or under; past them all (NaN too), the last bucket.
        let i = if v.is_nan() {
            cells.bounds.len()
        } else {
            cells.bounds.partition_point(|&b| b < v)
        };
        let shard = &cells.shards[shard()];
        shard.buckets[i].fetch_add(1, Relaxed);
        // One writer per shard in the common case, so the exchange succeeds the first time.
        let _ = shard.sum.fetch_update(Relaxed, Relaxed, |bits| {
            Some((f64::from_bits(bits) + v).to_bits())
        });
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0
            .shards
            .iter()
            .flat_map(|s| &s.buckets)
            .map(|b| b.load(Relaxed))
            .sum()
    }

    fn proto(&self) -> proto::Histogram {
        let cells = &*self.0;
        let mut per_bucket = [0u64; MAX_BOUNDS + 1];
        let mut sum = 0.0;
        for shard in cells.shards.iter() {
            for (n, b) in per_bucket.iter_mut().zip(&shard.buckets) {
                *n += b.load(Relaxed);
            }
            sum += f64::from_bits(shard.sum.load(Relaxed));
        }
        let mut h = proto::Histogram::default();
        let mut below = 0;
        h.set_bucket(
            cells
                .bounds
                .iter()
                .zip(per_bucket)
                .map(|(&bound, n)| {
                    below += n;
                    let mut b = proto::Bucket::default();
                    b.set_upper_bound(bound);
                    b.set_cumulative_count(below);
                    b
                })
                .collect(),
        );
        h.set_sample_count(per_bucket[..=cells.bounds.len()].iter().sum());
        h.set_sample_sum(sum);
        h
    }
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Counter({})", self.get())
    }
}

impl std::fmt::Debug for Gauge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gauge({})", self.get())
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Histogram(count {})", self.count())
    }
}

/// What a family's series are, and how each becomes a sample.
pub trait Series: Clone + Send + Sync + 'static {
    const TYPE: proto::MetricType;
    fn sample(&self, into: &mut proto::Metric);
}

impl Series for Counter {
    const TYPE: proto::MetricType = proto::MetricType::COUNTER;
    fn sample(&self, into: &mut proto::Metric) {
        let mut c = proto::Counter::default();
        c.set_value(self.get() as f64);
        into.set_counter(c);
    }
}

impl Series for Gauge {
    const TYPE: proto::MetricType = proto::MetricType::GAUGE;
    fn sample(&self, into: &mut proto::Metric) {
        let mut g = proto::Gauge::default();
        g.set_value(self.get() as f64);
        into.set_gauge(g);
    }
}

impl Series for Histogram {
    const TYPE: proto::MetricType = proto::MetricType::HISTOGRAM;
    fn sample(&self, into: &mut proto::Metric) {
        into.set_histogram(self.proto());
    }
}

/// A metric's series by label values, as `prometheus`' `MetricVec`: looked up by label values
/// (a lock and a hash), so that hot paths resolve a series once and keep it.
pub struct Family<S>(Arc<FamilyInner<S>>);

impl<S> Clone for Family<S> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

struct FamilyInner<S> {
    desc: Desc,
    labels: Vec<String>,
    make: Box<dyn Fn() -> S + Send + Sync>,
    series: Mutex<HashMap<Box<[Box<str>]>, S>>,
}

pub type CounterVec = Family<Counter>;
pub type GaugeVec = Family<Gauge>;
pub type HistogramVec = Family<Histogram>;

impl CounterVec {
    pub fn counters(name: &str, help: &str, labels: &[&str]) -> Self {
        Self::with(name, help, labels, Counter::default)
    }
}

impl GaugeVec {
    pub fn gauges(name: &str, help: &str, labels: &[&str]) -> Self {
        Self::with(name, help, labels, Gauge::default)
    }
}

impl HistogramVec {
    pub fn histograms(name: &str, help: &str, labels: &[&str], bounds: &'static [f64]) -> Self {
        Self::with(name, help, labels, move || Histogram::new(bounds))
    }
}

impl<S: Series> Family<S> {
    fn with(
        name: &str,
        help: &str,
        labels: &[&str],
        make: impl Fn() -> S + Send + Sync + 'static,
    ) -> Self {
        let labels: Vec<String> = labels.iter().map(|&l| l.to_owned()).collect();
        let desc = Desc::new(name.into(), help.into(), labels.clone(), HashMap::new())
            .expect("static metric definition");
        Self(Arc::new(FamilyInner {
            desc,
            labels,
            make: Box::new(make),
            series: Mutex::new(HashMap::new()),
        }))
    }

    /// The series of these label values (in the family's label order), made on first use.
    pub fn with_label_values(&self, values: &[&str]) -> S {
        assert_eq!(
            values.len(),
            self.0.labels.len(),
            "label values for {}",
            self.0.desc.fq_name
        );
        let key: Box<[Box<str>]> = values.iter().map(|&v| v.into()).collect();
        let mut series = self.0.series.lock();
        series.entry(key).or_insert_with(|| (self.0.make)()).clone()
    }

    /// Drops the series of these label values; a handle kept elsewhere still counts, unseen.
    pub fn remove_label_values(&self, values: &[&str]) {
        self.0
            .series
            .lock()
            .retain(|k, _| !k.iter().map(|v| &**v).eq(values.iter().copied()));
    }

    /// Drops every series whose labels include all of `labels` (name → value).
    pub fn remove_matching(&self, labels: &HashMap<&str, &str>) {
        let at: Vec<(usize, &str)> = labels
            .iter()
            .filter_map(|(name, &value)| {
                Some((self.0.labels.iter().position(|l| l == name)?, value))
            })
            .collect();
        if at.len() < labels.len() {
            return; // a label this family does not have: nothing of it matches
        }
        self.0
            .series
            .lock()
            .retain(|k, _| !at.iter().all(|&(i, v)| &*k[i] == v));
    }

    fn family(&self) -> proto::MetricFamily {
        let inner = &*self.0;
        // Label pairs sorted by name, as `prometheus` writes them.
        let mut order: Vec<usize> = (0..inner.labels.len()).collect();
        order.sort_by_key(|&i| &inner.labels[i]);
        let metrics = inner
            .series
            .lock()
            .iter()
            .map(|(values, series)| {
                let pairs = order
                    .iter()
                    .map(|&i| {
                        let mut p = proto::LabelPair::default();
                        p.set_name(inner.labels[i].clone());
                        p.set_value(values[i].to_string());
                        p
                    })
                    .collect();
                let mut m = proto::Metric::from_label(pairs);
                series.sample(&mut m);
                m
            })
            .collect();
        let mut f = proto::MetricFamily::default();
        f.set_name(inner.desc.fq_name.clone());
        f.set_help(inner.desc.help.clone());
        f.set_field_type(S::TYPE);
        f.set_metric(metrics);
        f
    }
}

impl<S: Series> Collector for Family<S> {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.0.desc]
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        vec![self.family()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(c: impl Collector + 'static) -> String {
        let registry = prometheus::Registry::new();
        registry.register(Box::new(c)).unwrap();
        let mut out = Vec::new();
        prometheus::Encoder::encode(
            &prometheus::TextEncoder::new(),
            &registry.gather(),
            &mut out,
        )
        .unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn updates_from_many_threads_add_up_exactly() {
        let counters = CounterVec::counters("c_total", "help", &["a"]);
        let gauges = GaugeVec::gauges("g", "help", &["a"]);
        let (c, g) = (
            counters.with_label_values(&["x"]),
            gauges.with_label_values(&["x"]),
        );
        std::thread::scope(|s| {
            for t in 0..8 {
                let (c, g) = (c.clone(), g.clone());
                s.spawn(move || {
                    pin_thread(t);
                    for _ in 0..10_000 {
                        c.inc();
                        g.inc();
                    }
                });
            }
        });
        // A gauge raised on one thread and lowered on another still sums right.
        std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..30_000 {
                    g.dec();
                }
            });
        });
        assert_eq!(c.get(), 80_000);
        assert_eq!(g.get(), 50_000);
        assert!(render(counters).contains("c_total{a=\"x\"} 80000\n"));
        assert!(render(gauges).contains("g{a=\"x\"} 50000\n"));
    }

    #[test]
    fn a_histogram_renders_as_prometheus_would() {
        const BOUNDS: &[f64] = &[0.5, 1.0, 10.0];
        let ours = HistogramVec::histograms("h", "help", &["worker", "arm"], BOUNDS);
        let theirs = prometheus::HistogramVec::new(
            prometheus::HistogramOpts::new("h", "help").buckets(BOUNDS.to_vec()),
            &["worker", "arm"],
        )
        .unwrap();
        for (i, v) in [0.25, 0.5, 0.75, 3.0, 10.0, 11.0, 1e9]
            .into_iter()
            .enumerate()
        {
            pin_thread(i);
            ours.with_label_values(&["w", "a"]).observe(v);
            theirs.with_label_values(&["w", "a"]).observe(v);
        }
        ours.with_label_values(&["w2", "b"]).observe(0.5);
        theirs.with_label_values(&["w2", "b"]).observe(0.5);
        assert_eq!(ours.with_label_values(&["w", "a"]).count(), 7);
        assert_eq!(render(ours), render(theirs));
    }

    #[test]
    fn series_are_removed_by_value_or_by_a_label_they_carry() {
        let c = CounterVec::counters("r_total", "help", &["route", "worker"]);
        for (route, worker) in [("chat", "a"), ("chat", "b"), ("completions", "a")] {
            c.with_label_values(&[route, worker]).inc();
        }
        c.remove_matching(&HashMap::from([("worker", "a")]));
        let text = render(c.clone());
        assert!(
            text.contains("r_total{route=\"chat\",worker=\"b\"} 1\n"),
            "{text}"
        );
        assert!(!text.contains("worker=\"a\""), "{text}");
        c.remove_label_values(&["chat", "b"]);
        assert!(!render(c.clone()).contains("r_total{"));
        // A label the family lacks matches nothing.
        c.with_label_values(&["chat", "b"]).inc();
        c.remove_matching(&HashMap::from([("nope", "b")]));
        assert!(render(c).contains("worker=\"b\""));
    }
}
