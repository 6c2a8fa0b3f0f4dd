//! Reports: a readable table, JSON, and self-contained SVG plots.

use std::fmt::Write;

use serde::Serialize;

use super::stats::{median, Summary};
use super::workers::{WorkerCounters, WorkerGauges};

/// One labelled run: a policy in a comparison, a concurrency in a sweep, or a single run.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    pub label: String,
    pub summary: Summary,
    /// Worker-side counters over the run, when the workers' metrics were reachable.
    pub workers: Option<WorkerCounters>,
    /// The same counters worker by worker.
    pub per_worker: Vec<WorkerReport>,
    /// Routing decisions the target (when it is kvroute) counted during the window, by outcome.
    pub routing: std::collections::BTreeMap<String, f64>,
    /// Cached prompt tokens the target's policy predicted and the workers then reported, over
    /// the answers that reported them (kvroute targets with a learning policy).
    pub cached_tokens: Option<CachedTokens>,
    /// With several gateway replicas: how often they would route the same request alike.
    pub replica_agreement: Option<Agreement>,
    /// Requests the target tokenized to route on KV events, by how (whole, head, untokenized).
    pub tokenized: std::collections::BTreeMap<String, f64>,
    /// TTFTs of the window's successful requests (seconds), for the CDF plot.
    #[serde(skip)]
    pub ttfts: Vec<f64>,
}

/// Replicas asked where the same requests would go, after a run.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Agreement {
    pub probed: usize,
    /// Requests some replica expected cached tokens for.
    pub cached: usize,
    /// Of those, the ones every replica would send to the same worker.
    pub agreed: usize,
}

/// Predicted against reported cached tokens over a run.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CachedTokens {
    pub predicted: f64,
    pub reported: f64,
}

/// One worker's counters over a run.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerReport {
    pub worker: String,
    pub counters: WorkerCounters,
    /// Its KV cache usage and queue, sampled through the window.
    pub gauges: WorkerGauges,
}

impl Run {
    /// The highest KV cache usage any worker showed in the window, `None` without samples.
    pub fn kv_usage_peak(&self) -> Option<f64> {
        self.per_worker
            .iter()
            .filter(|w| w.gauges.samples > 0)
            .map(|w| w.gauges.kv_usage_peak)
            .reduce(f64::max)
    }
}

/// A token count in k / M.
fn si(n: f64) -> String {
    if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

fn ms(s: f64) -> String {
    format!("{:.0}", s * 1e3)
}

/// One cell of a per-worker row: `f` of each worker of the run, joined by `sep`.
fn each_worker(r: &Run, sep: &str, f: &dyn Fn(&WorkerReport) -> String) -> String {
    r.per_worker.iter().map(f).collect::<Vec<_>>().join(sep)
}

/// A cell of a worker's sampled gauges; `None` where it has nothing to show.
type GaugeCell = dyn Fn(&WorkerGauges) -> Option<String>;

/// A run's cell of a row of each worker's sampled gauges: `cell` of each worker, joined by
/// `sep` (a dash where it gives none); `None` where it gives none for any worker, so that a row
/// shows only where some run sampled something and a run that did not reads as a dash.
fn gauge_cells(r: &Run, sep: &str, cell: &GaugeCell) -> Option<String> {
    let cells: Vec<Option<String>> = r.per_worker.iter().map(|w| cell(&w.gauges)).collect();
    cells.iter().any(Option::is_some).then(|| {
        cells
            .into_iter()
            .map(|c| c.unwrap_or_else(|| "-".into()))
            .collect::<Vec<_>>()
            .join(sep)
    })
}

/// The most workload classes the table gives a TTFT each (the JSON has them all).
const MAX_CLASSES_SHOWN: usize = 8;

/// A table under construction: one row per figure, one cell per run.
struct Rows<'a> {
    runs: &'a [Run],
    rows: Vec<(String, Vec<String>)>,
}

impl Rows<'_> {
    fn row(&mut self, name: &str, f: &dyn Fn(&Run) -> String) {
        self.rows
            .push((name.to_string(), self.runs.iter().map(f).collect()));
    }
}

/// Runs side by side, one column each, with each run's ratio to the first on the rate and TTFT rows.
pub fn table(runs: &[Run]) -> String {
    let mut t = Rows {
        runs,
        rows: Vec::new(),
    };
    client_rows(&mut t);
    worker_rows(&mut t);
    gateway_rows(&mut t);
    lost_work_rows(&mut t);
    if runs.len() > 1 {
        let base = &runs[0].summary;
        t.row(&format!("req/s vs {}", runs[0].label), &|r| {
            ratio(r.summary.req_per_s, base.req_per_s)
        });
        t.row(&format!("TTFT p95 vs {}", runs[0].label), &|r| {
            ratio(r.summary.ttft.p95, base.ttft.p95)
        });
    }
    let head: Vec<String> = runs.iter().map(|r| r.label.clone()).collect();
    render(&head, &t.rows)
}

/// Work the workers lost: preemptions, and tokens generated after their client had gone.
fn lost_work_rows(t: &mut Rows) {
    t.row("worker preemptions", &|r| {
        r.workers
            .as_ref()
            .map_or("-".into(), |w| format!("{:.0}", w.preemptions))
    });
    t.row("tokens after disconnect", &|r| {
        r.workers
            .as_ref()
            .map_or("-".into(), |w| format!("{:.0}", w.tokens_after_disconnect))
    });
}

/// What the load generator measured: counts, rates, latencies and goodput.
fn client_rows(t: &mut Rows) {
    let runs = t.runs;
    t.row("requests (window)", &|r| r.summary.requests.to_string());
    t.row("errors / cancelled", &|r| {
        format!("{} / {}", r.summary.errors, r.summary.cancelled)
    });
    t.row("req/s", &|r| format!("{:.2}", r.summary.req_per_s));
    t.row("output tok/s", &|r| {
        format!("{:.0}", r.summary.output_tok_per_s)
    });
    t.row("TTFT p50 / p95 / p99 ms", &|r| {
        let t = &r.summary.ttft;
        format!("{} / {} / {}", ms(t.p50), ms(t.p95), ms(t.p99))
    });
    // A workload of a few classes (`mixed`): each one's TTFT, p50 / p95, in class order. A
    // prefix-repetition run has a class per prefix (200 of them would make every row of the
    // table thousands of characters wide): those are left to the JSON.
    let classes = |r: &Run| r.summary.ttft_by_class.len();
    if runs.iter().any(|r| classes(r) > 1) && runs.iter().all(|r| classes(r) <= MAX_CLASSES_SHOWN) {
        t.row("TTFT p50 / p95 ms by class", &|r| {
            r.summary
                .ttft_by_class
                .iter()
                .map(|(class, t)| format!("{class} {} / {}", ms(t.p50), ms(t.p95)))
                .collect::<Vec<_>>()
                .join(", ")
        });
    }
    t.row("ITL p50 / p99 ms", &|r| {
        format!("{} / {}", ms(r.summary.itl.p50), ms(r.summary.itl.p99))
    });
    t.row("TPOT p95 ms", &|r| ms(r.summary.tpot.p95));
    t.row("e2e p50 / p99 ms", &|r| {
        format!("{} / {}", ms(r.summary.e2e.p50), ms(r.summary.e2e.p99))
    });
    t.row("goodput (SLO met)", &|r| {
        format!(
            "{:.0}%, {:.2} req/s",
            r.summary.goodput * 100.0,
            r.summary.goodput_per_s
        )
    });
}

/// What the workers' own metrics say: prefix hits, spread, TTFT and sampled gauges per worker.
fn worker_rows(t: &mut Rows) {
    let runs = t.runs;
    t.row("worker prefix hit rate", &|r| {
        r.workers
            .as_ref()
            .map_or("-".into(), |w| format!("{:.1}%", w.hit_rate() * 100.0))
    });
    t.row("requests per worker", &|r| {
        each_worker(r, " / ", &|w| format!("{:.0}", w.counters.requests))
    });
    t.row("hit rate per worker", &|r| {
        each_worker(r, " / ", &|w| {
            format!("{:.0}%", w.counters.hit_rate() * 100.0)
        })
    });
    t.row("TTFT mean per worker (its metrics), ms", &|r| {
        each_worker(r, " / ", &|w| {
            w.counters
                .mean_ttft()
                .map_or("-".into(), |t| format!("{:.0}", t * 1e3))
        })
    });
    // Sampled gauges: a tail from one worker that ran out of KV cache (100%, requests waiting
    // for blocks) reads differently from one of a long queue with room to spare.
    let kv = |g: &WorkerGauges| {
        let mean = g.kv_usage_mean()?;
        Some(format!(
            "{:.0}/{:.0}%",
            mean * 100.0,
            g.kv_usage_peak * 100.0
        ))
    };
    let waiting = |g: &WorkerGauges| (g.samples > 0).then(|| format!("{:.0}", g.waiting_peak));
    // A kvroute target's own view of each worker (its policy prices prefill): the prefill
    // backlog it believed queued there and how much of it the step clock took as done by the
    // step under way; and that clock's fitted time per prefill token, typical and lowest (a
    // lowest far under the typical is a fit that strayed and counted prefill done too soon).
    let backlog = |g: &WorkerGauges| {
        let (mean, done) = g.pending_prefill_mean()?;
        Some(format!(
            "{}/{} ({})",
            si(mean),
            si(g.pending_prefill_peak),
            si(done)
        ))
    };
    let fitted = |g: &WorkerGauges| {
        let (median, low) = g.step_per_token_spread()?;
        Some(format!("{median:.0} ({low:.0})"))
    };
    let gauge_rows: [(&str, &str, &GaugeCell); 4] = [
        ("KV usage mean / peak per worker", " · ", &kv),
        ("requests waiting, peak per worker", " / ", &waiting),
        (
            "pending prefill mean / peak (step-done), gateway",
            " · ",
            &backlog,
        ),
        (
            "fitted us / prefill token median (min), gateway",
            " · ",
            &fitted,
        ),
    ];
    for (name, sep, cell) in gauge_rows {
        if runs.iter().any(|r| gauge_cells(r, sep, cell).is_some()) {
            t.row(name, &|r| {
                gauge_cells(r, sep, cell).unwrap_or_else(|| "-".into())
            });
        }
    }
}

/// What a kvroute target's own metrics say: routing outcomes, tokenizing, its predictions of
/// cached tokens and whether its replicas agreed.
fn gateway_rows(t: &mut Rows) {
    let runs = t.runs;
    t.row("routing outcomes", &|r| {
        let total: f64 = r.routing.values().sum();
        if total <= 0.0 {
            return "-".into();
        }
        r.routing
            .iter()
            .filter(|(_, n)| **n > 0.0)
            .map(|(o, n)| format!("{o} {:.0}%", n / total * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    });
    // A gateway exports the series from the start; only one with a tokenizer counts anything.
    let tokenized = |r: &Run| r.tokenized.values().any(|n| *n > 0.0);
    if runs.iter().any(tokenized) {
        t.row("tokenized: whole / head", &|r| {
            let n = |how: &str| r.tokenized.get(how).copied().unwrap_or(0.0);
            match tokenized(r) {
                false => "-".into(),
                true => format!("{:.0} / {:.0}", n("whole"), n("head")),
            }
        });
    }
    t.row("predicted / reported cached", &|r| match r.cached_tokens {
        Some(c) if c.reported > 0.0 => format!(
            "{} / {} ({:.2}x)",
            si(c.predicted),
            si(c.reported),
            c.predicted / c.reported
        ),
        _ => "-".into(),
    });
    if runs.iter().any(|r| r.replica_agreement.is_some()) {
        t.row("replicas agree (cached)", &|r| match r.replica_agreement {
            Some(a) if a.cached > 0 => format!(
                "{:.1}% of {}",
                a.agreed as f64 / a.cached as f64 * 100.0,
                a.cached
            ),
            Some(a) => format!("none of {} cached", a.probed),
            None => "-".into(),
        });
    }
}

/// Each arm's figures over several runs of one comparison (one per seed, `runs[seed][arm]`, the
/// arms in the same order in each): the median and, in brackets, every run's figure in seed
/// order; then the worst run's TTFT p95 over the best's, and the medians' ratios to the first arm.
pub fn across_seeds(runs: &[Vec<Run>]) -> String {
    let arms = runs.first().map_or(0, Vec::len);
    let column = |arm: usize, f: &dyn Fn(&Run) -> Option<f64>| -> Vec<f64> {
        runs.iter()
            .filter_map(|seed| seed.get(arm).and_then(f))
            .collect()
    };
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |name: &str, f: &dyn Fn(&Run) -> Option<f64>, show: &dyn Fn(f64) -> String| {
        let cells: Vec<String> = (0..arms)
            .map(|arm| {
                let v = column(arm, f);
                match median(&v) {
                    Some(m) => {
                        let each: Vec<String> = v.iter().map(|x| show(*x)).collect();
                        format!("{} [{}]", show(m), each.join(", "))
                    }
                    None => "-".into(),
                }
            })
            .collect();
        rows.push((name.to_owned(), cells));
    };
    let ms = |s: f64| ms(s);
    row("req/s", &|r| Some(r.summary.req_per_s), &|v| {
        format!("{v:.2}")
    });
    row("TTFT p95 ms", &|r| Some(r.summary.ttft.p95), &ms);
    row("TPOT p95 ms", &|r| Some(r.summary.tpot.p95), &ms);
    row(
        "worker prefix hit rate",
        &|r| r.workers.as_ref().map(WorkerCounters::hit_rate),
        &|v| format!("{:.1}%", v * 100.0),
    );
    row(
        "predicted / reported cached",
        &|r| {
            r.cached_tokens
                .filter(|c| c.reported > 0.0)
                .map(|c| c.predicted / c.reported)
        },
        &|v| format!("{v:.2}x"),
    );
    row(
        "replicas agree (cached)",
        &|r| {
            r.replica_agreement
                .filter(|a| a.cached > 0)
                .map(|a| a.agreed as f64 / a.cached as f64)
        },
        &|v| format!("{:.1}%", v * 100.0),
    );
    row(
        "KV usage peak (fullest worker)",
        &Run::kv_usage_peak,
        &|v| format!("{:.0}%", v * 100.0),
    );
    let rps = |r: &Run| Some(r.summary.req_per_s);
    let tail = |r: &Run| Some(r.summary.ttft.p95);
    let spread = (0..arms)
        .map(|arm| {
            let v = column(arm, &tail);
            let (lo, hi) = v
                .iter()
                .fold((f64::MAX, 0.0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
            ratio(hi, lo)
        })
        .collect();
    rows.push(("TTFT p95 worst / best run".into(), spread));
    if arms > 1 {
        let base = &runs[0][0].label;
        let of =
            |arm: usize, f: &dyn Fn(&Run) -> Option<f64>| median(&column(arm, f)).unwrap_or(0.0);
        rows.push((
            format!("median req/s vs {base}"),
            (0..arms).map(|a| ratio(of(a, &rps), of(0, &rps))).collect(),
        ));
        rows.push((
            format!("median TTFT p95 vs {base}"),
            (0..arms)
                .map(|a| ratio(of(a, &tail), of(0, &tail)))
                .collect(),
        ));
    }
    let head: Vec<String> = runs
        .first()
        .map(|r| r.iter().map(|r| r.label.clone()).collect())
        .unwrap_or_default();
    render(&head, &rows)
}

/// A markdown table: `head` names the columns, each row a name and one cell per column.
fn render(head: &[String], rows: &[(String, Vec<String>)]) -> String {
    let width0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..head.len())
        .map(|i| {
            rows.iter()
                .map(|r| r.1[i].len())
                .chain([head[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let line = |out: &mut String, first: &str, cells: &[String]| {
        let _ = write!(out, "| {first:<width0$} |");
        for (c, w) in cells.iter().zip(&widths) {
            let _ = write!(out, " {c:>w$} |");
        }
        out.push('\n');
    };
    line(&mut out, "", head);
    let _ = write!(out, "|{}|", "-".repeat(width0 + 2));
    for w in &widths {
        let _ = write!(out, "{}:|", "-".repeat(w + 1));
    }
    out.push('\n');
    for (name, cells) in rows {
        line(&mut out, name, cells);
    }
    out
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        "-".into()
    }
}

/// A run with only a rate, a TTFT p95 and three TTFTs, for tests of what shows runs.
#[cfg(test)]
pub(super) fn sample_run(label: &str, rate: f64, p95: f64) -> Run {
    Run {
        label: label.into(),
        summary: Summary {
            req_per_s: rate,
            ttft: crate::bench::stats::Percentiles {
                p95,
                ..crate::bench::stats::Percentiles::default()
            },
            ..Summary::default()
        },
        workers: None,
        per_worker: Vec::new(),
        routing: Default::default(),
        cached_tokens: None,
        replica_agreement: None,
        tokenized: Default::default(),
        ttfts: vec![0.1, 0.2, p95],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::stats::Percentiles;

    use sample_run as run;

    #[test]
    fn across_seeds_gives_each_arms_median_its_runs_and_its_p95_spread() {
        let seeds = vec![
            vec![run("round_robin", 10.0, 0.6), run("cache_aware", 14.0, 0.9)],
            vec![run("round_robin", 12.0, 0.5), run("cache_aware", 13.0, 0.3)],
            vec![
                run("round_robin", 11.0, 0.7),
                run("cache_aware", 15.0, 0.45),
            ],
        ];
        let t = across_seeds(&seeds);
        let find = |name: &str| t.lines().find(|l| l.contains(name)).unwrap();
        assert!(find("round_robin").contains("cache_aware"), "{t}");
        let rps = find("| req/s");
        assert!(rps.contains("11.00 [10.00, 12.00, 11.00]"), "{rps}");
        assert!(rps.contains("14.00 [14.00, 13.00, 15.00]"), "{rps}");
        let p95 = find("TTFT p95 ms");
        assert!(p95.contains("600 [600, 500, 700]"), "{p95}");
        assert!(p95.contains("450 [900, 300, 450]"), "{p95}");
        // Worst over best run: 700 / 500 and 900 / 300.
        let spread = find("worst / best");
        assert!(
            spread.contains("1.40x") && spread.contains("3.00x"),
            "{spread}"
        );
        // Ratios of the medians: 14 / 11 and 450 / 600.
        assert!(find("median req/s vs round_robin").contains("1.27x"), "{t}");
        assert!(
            find("median TTFT p95 vs round_robin").contains("0.75x"),
            "{t}"
        );
        // Rows without figures show a dash, and every row has the same number of cells.
        assert!(find("predicted / reported").contains('-'), "{t}");
        let cells = |l: &str| l.matches('|').count();
        assert!(t
            .lines()
            .all(|l| cells(l) == cells(t.lines().next().unwrap())));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn each_workers_mean_ttft_is_its_sum_over_its_count_in_ms() {
        let mut r = run("cache_aware", 1.0, 0.1);
        let worker = |ttft_seconds: f64, ttft_count: f64| WorkerReport {
            worker: "w".into(),
            counters: WorkerCounters {
                ttft_seconds,
                ttft_count,
                ..Default::default()
            },
            gauges: WorkerGauges::default(),
        };
        r.per_worker = vec![worker(3.0, 25.0), worker(0.0, 0.0)];
        let t = table(&[r]);
        let row = t
            .lines()
            .find(|l| l.contains("TTFT mean per worker"))
            .unwrap();
        assert!(row.contains("120 / -"), "{row}");
    }

    #[test]
    fn sampled_gauges_and_the_gateways_view_show_per_worker_and_the_fullest_worker_across_seeds() {
        let with = |label: &str, peaks: &[(u32, f64, f64)]| {
            let mut r = run(label, 1.0, 0.1);
            r.per_worker = peaks
                .iter()
                .map(|&(samples, peak, waiting)| WorkerReport {
                    worker: "w".into(),
                    counters: WorkerCounters::default(),
                    gauges: WorkerGauges {
                        samples,
                        kv_usage_sum: f64::from(samples) * peak / 2.0,
                        kv_usage_peak: peak,
                        waiting_peak: waiting,
                        ..WorkerGauges::default()
                    },
                })
                .collect();
            r
        };
        // Without samples (workers not read) the rows stay out of the table.
        assert!(!table(&[with("least_conn", &[(0, 0.0, 0.0)])]).contains("KV usage"));
        let t = table(&[
            with("least_conn", &[(0, 0.0, 0.0)]),
            with(
                "cache_aware",
                &[(10, 0.5, 0.0), (10, 1.0, 12.0), (0, 0.0, 0.0)],
            ),
        ]);
        let find = |name: &str| t.lines().find(|l| l.contains(name)).unwrap();
        let kv = find("KV usage mean / peak");
        assert!(kv.contains("25/50% · 50/100% · -"), "{t}");
        assert!(find("waiting, peak").contains("0 / 12 / -"), "{t}");
        // The unsampled arm's cell is a dash, not a row of zeros.
        assert_eq!(kv.split('|').nth(2).map(str::trim), Some("-"), "{t}");
        // Across seeds, the fullest worker of each run.
        let seeds = vec![
            vec![with("cache_aware", &[(10, 0.5, 0.0), (10, 0.6, 0.0)])],
            vec![with("cache_aware", &[(10, 1.0, 9.0), (10, 0.4, 0.0)])],
            vec![with("cache_aware", &[(10, 0.7, 0.0), (0, 0.0, 0.0)])],
        ];
        let t = across_seeds(&seeds);
        let peak = t.lines().find(|l| l.contains("fullest worker")).unwrap();
        assert!(peak.contains("70% [60%, 100%, 70%]"), "{t}");
        // A kvroute target's backlog: mean / peak (mean counted done by the step), per worker,
        // only where some worker had any.
        let unsampled = table(&[with("cache_aware", &[(10, 0.5, 0.0)])]);
        assert!(!unsampled.contains("pending prefill") && !unsampled.contains("fitted"));
        let mut r = with("cache_aware", &[(10, 0.5, 0.0), (10, 0.5, 0.0)]);
        r.per_worker[0].gauges = WorkerGauges {
            gateway_samples: 4,
            pending_prefill_sum: 4.0 * 1500.0,
            pending_prefill_peak: 12_400.0,
            step_done_sum: 4.0 * 300.0,
            step_per_token_us: vec![76.0, 24.0, 75.0, 75.4],
            ..r.per_worker[0].gauges.clone()
        };
        r.per_worker[1].gauges.gateway_samples = 4;
        let t = table(&[r]);
        let row = t.lines().find(|l| l.contains("pending prefill")).unwrap();
        assert!(row.contains("1.5k/12.4k (300) · -"), "{t}");
        let row = t.lines().find(|l| l.contains("fitted us")).unwrap();
        assert!(row.contains("75 (24) · -"), "{t}");
    }

    #[test]
    fn the_tokenized_row_shows_only_where_a_gateway_tokenized_something() {
        let mut zero = run("cache_aware", 1.0, 0.1);
        zero.tokenized = [("whole".into(), 0.0), ("head".into(), 0.0)].into();
        assert!(!table(&[run("round_robin", 1.0, 0.1), zero.clone()]).contains("tokenized"));
        let mut some = run("cache_aware+events", 1.0, 0.1);
        some.tokenized = [("whole".into(), 12.0), ("head".into(), 3.0)].into();
        let t = table(&[zero, some]);
        let row = t.lines().find(|l| l.contains("tokenized")).unwrap();
        assert!(row.contains("12 / 3") && row.contains(" - "), "{row}");
    }

    #[test]
    fn the_class_row_shows_only_for_workloads_of_several_classes() {
        let one = |class: &str, p50: f64, p95: f64| {
            let mut r = run("least_conn", 1.0, p95);
            r.summary.ttft_by_class.insert(
                class.into(),
                Percentiles {
                    p50,
                    p95,
                    ..Percentiles::default()
                },
            );
            r
        };
        assert!(!table(&[one("chat", 0.1, 0.2)]).contains("by class"));
        let mut mixed = one("long-short", 0.8, 1.2);
        mixed.summary.ttft_by_class.insert(
            "short-short".into(),
            Percentiles {
                p50: 0.09,
                p95: 0.3,
                ..Percentiles::default()
            },
        );
        let t = table(&[one("chat", 0.1, 0.2), mixed]);
        let row = t.lines().find(|l| l.contains("by class")).unwrap();
        assert!(
            row.contains("long-short 800 / 1200, short-short 90 / 300")
                && row.contains("chat 100 / 200"),
            "{row}"
        );
        // A class per prefix of 200 prefixes: no row, and the table keeps its width.
        let mut many = one("prefix-0", 0.1, 0.2);
        for p in 1..200 {
            many.summary
                .ttft_by_class
                .insert(format!("prefix-{p}"), Percentiles::default());
        }
        let t = table(&[many]);
        assert!(!t.contains("by class"));
        assert!(t.lines().all(|l| l.len() < 200), "{t}");
    }

    #[test]
    fn table_puts_runs_side_by_side_with_ratios_to_the_first() {
        let t = table(&[run("round_robin", 6.5, 1.8), run("prefix", 13.0, 0.5)]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("round_robin") && lines[0].contains("prefix"));
        let ratio = lines
            .iter()
            .find(|l| l.contains("req/s vs round_robin"))
            .unwrap();
        assert!(
            ratio.contains("1.00x") && ratio.contains("2.00x"),
            "{ratio}"
        );
        let ttft = lines.iter().find(|l| l.contains("TTFT p95 vs")).unwrap();
        assert!(ttft.contains("0.28x"), "{ttft}");
        // Every row has the same number of cells.
        let cells = |l: &str| l.matches('|').count();
        assert!(lines.iter().all(|l| cells(l) == cells(lines[0])));
    }
}
