//! The bench's plots: a TTFT CDF per run, and throughput and TTFT against a sweep's points, as
//! standalone SVG documents.

use std::fmt::Write;

use super::report::Run;
use super::stats::Summary;

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// A TTFT CDF per run, as a standalone SVG.
pub fn ttft_cdf_svg(runs: &[Run]) -> String {
    let max = runs
        .iter()
        .flat_map(|r| r.ttfts.iter().copied())
        .fold(0.0, f64::max)
        .max(1e-3);
    let series: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|r| {
            let mut v = r.ttfts.clone();
            v.sort_by(f64::total_cmp);
            let n = v.len().max(1) as f64;
            let pts = v
                .iter()
                .enumerate()
                .map(|(i, t)| (t * 1e3, (i + 1) as f64 / n))
                .collect();
            (r.label.clone(), pts)
        })
        .collect();
    svg_lines(
        "TTFT CDF",
        "TTFT (ms)",
        "share of requests",
        max * 1e3,
        1.0,
        &series,
    )
}

/// Throughput and TTFT p95 against concurrency, for a sweep (two panels in one SVG).
pub fn sweep_svg(points: &[(usize, Summary)]) -> String {
    let rate: Vec<(f64, f64)> = points
        .iter()
        .map(|(c, s)| (*c as f64, s.req_per_s))
        .collect();
    let ttft: Vec<(f64, f64)> = points
        .iter()
        .map(|(c, s)| (*c as f64, s.ttft.p95 * 1e3))
        .collect();
    let xmax = rate.iter().map(|p| p.0).fold(1.0, f64::max);
    let top = svg_lines(
        "throughput",
        "concurrency",
        "req/s",
        xmax,
        rate.iter().map(|p| p.1).fold(1e-3, f64::max),
        &[("req/s".into(), rate)],
    );
    let bottom = svg_lines(
        "TTFT p95",
        "concurrency",
        "ms",
        xmax,
        ttft.iter().map(|p| p.1).fold(1e-3, f64::max),
        &[("TTFT p95".into(), ttft)],
    );
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"800\">\
         <g>{}</g><g transform=\"translate(0,400)\">{}</g></svg>\n",
        inner(&top),
        inner(&bottom)
    )
}

fn inner(svg: &str) -> &str {
    let start = svg.find('>').map_or(0, |i| i + 1);
    let end = svg.rfind("</svg>").unwrap_or(svg.len());
    &svg[start..end]
}

fn svg_lines(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    xmax: f64,
    ymax: f64,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let (w, h, l, r, t, b) = (640.0, 400.0, 70.0, 20.0, 40.0, 50.0);
    let x = |v: f64| l + v / xmax * (w - l - r);
    let y = |v: f64| h - b - v / ymax * (h - t - b);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\
         <rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\
         <text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">{title}</text>\
         <line x1=\"{l}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\
         <line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{}\" stroke=\"black\"/>\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{xlabel}</text>\
         <text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{ylabel}</text>",
        w / 2.0,
        h - b,
        w - r,
        h - b,
        h - b,
        (l + w - r) / 2.0,
        h - 12.0,
        (t + h - b) / 2.0,
        (t + h - b) / 2.0,
    );
    for k in 0..=4 {
        let f = k as f64 / 4.0;
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\
             <text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            x(f * xmax),
            h - b + 16.0,
            fmt_tick(f * xmax),
            l - 6.0,
            y(f * ymax) + 4.0,
            fmt_tick(f * ymax)
        );
    }
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|(a, b)| format!("{:.1},{:.1}", x(*a), y(*b)))
            .collect();
        let _ = write!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\
             <text x=\"{}\" y=\"{}\" fill=\"{color}\">{}</text>",
            path.join(" "),
            l + 10.0,
            t + 16.0 * (i + 1) as f64,
            escape(label)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_tick(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::super::report::sample_run as run;
    use super::*;

    #[test]
    fn svg_plots_one_line_per_run_and_escapes_labels() {
        let svg = ttft_cdf_svg(&[run("a<b", 1.0, 0.3), run("c", 1.0, 0.4)]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a&lt;b") && !svg.contains("a<b"));
        let sweep = sweep_svg(&[(1, Summary::default()), (8, Summary::default())]);
        assert_eq!(sweep.matches("<polyline").count(), 2);
        assert_eq!(sweep.matches("<svg").count(), 1, "one document, two panels");
    }
}
