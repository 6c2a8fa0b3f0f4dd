//! `kvroute bench run | compare | sweep`: the command line of the benchmark.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::loadgen::{Cancel, LoadSpec};
use super::plot;
use super::report::{self, Run};
use super::trace::Trace;
use super::workload::Workload;
use super::{BenchError, DEFAULT_SLO};
use crate::sim::SimConfig;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// One run against any OpenAI-compatible URL (kvroute, vLLM, another router).
    Run {
        /// Base URL of the target (no `/v1`).
        #[arg(long)]
        url: String,
        /// A worker's base URL whose /metrics to read (prefix hits, preemptions); repeatable.
        #[arg(long = "worker-metrics")]
        worker_metrics: Vec<String>,
        #[command(flatten)]
        load: LoadArgs,
    },
    /// One gateway per policy, each on fresh simulated workers (or on the running workers of
    /// --pool, their prefix caches emptied first); the same seeded load through each.
    Compare(CompareArgs),
    /// The same load at several concurrencies (or open-loop rates), to find the knee.
    Sweep {
        #[arg(long)]
        url: String,
        /// Concurrency points, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
        points: Vec<f64>,
        /// Treat the points as open-loop request rates (req/s), capped by --concurrency in flight.
        #[arg(long)]
        rates: bool,
        #[arg(long = "worker-metrics")]
        worker_metrics: Vec<String>,
        #[command(flatten)]
        load: LoadArgs,
    },
}

/// `bench compare`'s arguments.
#[derive(Args)]
pub struct CompareArgs {
    /// Arms to compare, comma-separated: policy names or gateway config files (their worker
    /// lists are replaced by the pool's); the first is the baseline of the ratios. `ARM@N`
    /// runs that arm with N gateway replicas whatever --replicas says, so one run can put one
    /// gateway beside several (e.g. `cache_aware,cache_aware@2`).
    #[arg(long, default_value = "round_robin,prefix", value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Another router as an arm, `NAME=COMMAND` (repeatable): started in front of each
    /// fresh pool with `{port}`, `{workers}` (URLs as separate words) and `{workers_csv}`
    /// filled in, and stopped after its run.
    #[arg(long = "external")]
    pub external: Vec<String>,
    /// Simulated workers per pool.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Simulator preset (`kvroute sim --list-presets`); a comma-separated list gives worker i
    /// the (i mod n)-th, a pool of one model on unlike GPUs.
    #[arg(long, default_value = crate::sim::presets::DEFAULT_PRESET)]
    pub preset: String,
    /// Tokens per KV block of the simulated workers (vLLM's --block-size).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Run the arms on these running workers instead (base URLs, comma-separated; e.g. the
    /// real vLLM pool of tests/vllm/pool.sh): no simulator is started, and each arm begins
    /// with `POST /reset_prefix_cache` on every worker.
    #[arg(long, value_delimiter = ',')]
    pub pool: Vec<String>,
    /// kvroute gateways per arm, sharing nothing, in front of the same workers; requests go
    /// to them in turn, so a conversation's turns alternate between replicas.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub replicas: u16,
    /// The served model's tokenizer.json: simulated workers tokenize with it (as vLLM
    /// serving that model does), and `POLICY+events` arms tokenize requests with it to follow
    /// the workers' KV cache events.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The model's tokenizer_config.json, for its chat template.
    #[arg(long)]
    pub tokenizer_config: Option<PathBuf>,
    /// With --pool: each worker's KV event endpoints, in --pool order, comma-separated, as
    /// `tcp://HOST:PUB` or `tcp://HOST:PUB|tcp://HOST:REPLAY`.
    #[arg(long, value_delimiter = ',')]
    pub pool_kv_events: Vec<String>,
    /// With --pool: each worker runs this many vLLM data-parallel engines behind its API
    /// server (`--data-parallel-size`); kvroute's arms route to each rank as a worker of its
    /// own (`data_parallel_size`), other routers get the workers' URLs. --pool-kv-events then
    /// names rank 0's endpoints. Without --pool, each simulated worker runs this many engines
    /// (as `kvroute sim --data-parallel-size`), vLLM's balancer placing what names no rank.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub pool_data_parallel: Option<u32>,
    /// Run the whole comparison once per seed, comma-separated (fresh pools each time, the
    /// arms' order rotated by each seed), then print each arm's medians over the runs, every
    /// run's figure and the spread of its TTFT p95; replaces --seed.
    #[arg(long, value_delimiter = ',')]
    pub seeds: Vec<u64>,
    #[command(flatten)]
    pub load: LoadArgs,
}

#[derive(Args, Clone)]
pub struct LoadArgs {
    /// prefix-repetition, random, multi-turn, chat, zipf or mixed.
    #[arg(long, default_value = "prefix-repetition")]
    workload: String,
    /// A YAML file describing the workload (overrides --workload).
    #[arg(long)]
    workload_file: Option<PathBuf>,
    /// Replay a JSONL trace instead (Mooncake format or OpenAI request bodies); lines with
    /// timestamps are sent at them (open loop, at most --concurrency in flight).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Replay a timed trace this many times faster than it was recorded.
    #[arg(long, default_value_t = 1.0)]
    trace_speedup: f64,
    /// Clients in flight (closed loop), or the cap on in-flight requests with --rate.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Open loop: Poisson arrivals at this many per wall-clock second (with simulated workers at
    /// --time-scale k the report, in modelled time, shows k times fewer). In multi-turn and chat an
    /// arrival starts a conversation, whose turns then follow one another.
    #[arg(long)]
    rate: Option<f64>,
    /// Mean think time, wall-clock seconds: each client pauses this long on average
    /// (exponentially distributed, the same pauses for every target) before its next request,
    /// and in closed loop before its first, so clients do not move in step. In open loop, between
    /// a conversation's turns. 0: none.
    #[arg(long, default_value_t = 0.0)]
    think_time: f64,
    /// Vary output lengths: each request asks for the workload's length times a factor drawn
    /// uniformly from 1 ± this (the same draws for every target; the mean is unchanged), as real
    /// answers vary, so requests that start together on a worker do not end in the same step.
    /// 0: every request the workload's length. Not with --trace, whose lines carry their own.
    #[arg(long, default_value_t = 0.0)]
    output_range: f64,
    /// The API requests go through: `completions` (the workload's own, /v1/completions or
    /// /v1/chat/completions) or `responses` (/v1/responses: a chat's system message as
    /// instructions, its history as input items).
    #[arg(long, default_value = "completions")]
    api: String,
    /// Closed loop: start the clients evenly spread over this many wall-clock seconds instead of
    /// all at once (at most --warmup, so the window sees them all). Clients that start in one
    /// instant fall into step, and a policy that keeps each conversation on one worker keeps them
    /// so for a while; a ramp lets the window measure the steady state. 0: all at once.
    #[arg(long, default_value_t = 0.0)]
    ramp_up: f64,
    /// Send each request with this header naming its conversation (`<seed>-<conversation>`; an
    /// independent request is one of its own), for routers that route by session, e.g. the
    /// production-stack router's `--routing-logic session --session-key NAME` or vllm-router's
    /// `consistent_hash` and `sticky_least_loaded` (`x-session-id`).
    #[arg(long)]
    session_header: Option<String>,
    /// Seconds before the measured window.
    #[arg(long, default_value_t = 10.0)]
    warmup: f64,
    /// Seconds of the measured window.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Stop after this many requests: every target gets the same stream, request for request
    /// (use a window long enough to hold them).
    #[arg(long)]
    requests: Option<u64>,
    /// Model name; the first of the target's /v1/models when unset.
    #[arg(long)]
    model: Option<String>,
    /// Share of requests whose client disconnects after --cancel-after tokens.
    #[arg(long, default_value_t = 0.0)]
    cancel_fraction: f64,
    #[arg(long, default_value_t = 8)]
    cancel_after: usize,
    /// SLO on time to first token, ms (classes of the mixed workload carry their own).
    #[arg(long, default_value_t = DEFAULT_SLO.0)]
    slo_ttft_ms: f64,
    /// SLO on time per output token, ms.
    #[arg(long, default_value_t = DEFAULT_SLO.1)]
    slo_tpot_ms: f64,
    /// The target's simulated workers run modelled time this many times faster than the wall clock
    /// (compare starts them so); figures are reported in modelled time. Warm-up, duration and the
    /// request timeout stay in wall-clock seconds.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Write the runs as JSON here (with `compare --seeds`, every seed's runs in turn).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write an SVG plot here (TTFT CDF; throughput and TTFT against the sweep points).
    #[arg(long)]
    svg: Option<PathBuf>,
}

impl LoadArgs {
    fn spec(&self, url: String) -> Result<LoadSpec, BenchError> {
        let workload = match (&self.trace, &self.workload_file) {
            (Some(t), _) => {
                if self.trace_speedup.is_nan() || self.trace_speedup <= 0.0 {
                    return Err(BenchError::Setup("--trace-speedup must be positive".into()));
                }
                let mut trace = Trace::from_file(t).map_err(BenchError::Setup)?;
                trace.speedup = self.trace_speedup;
                Workload::Trace(trace)
            }
            (None, Some(p)) => {
                crate::config::read_yaml(p).map_err(|e| BenchError::Setup(e.to_string()))?
            }
            (None, None) => Workload::by_name(&self.workload).ok_or_else(|| {
                BenchError::Setup(format!(
                    "unknown workload `{}` (known: {})",
                    self.workload,
                    Workload::NAMES
                ))
            })?,
        };
        // Seconds that `Duration::from_secs_f64` takes without panicking, and more than enough.
        let seconds = |v: f64| v.is_finite() && (0.0..1e9).contains(&v);
        let ok = seconds(self.duration)
            && self.duration > 0.0
            && seconds(self.warmup)
            && seconds(self.think_time)
            && seconds(self.request_timeout)
            && self.request_timeout > 0.0
            && self.concurrency > 0
            && self.time_scale.is_finite()
            && self.time_scale > 0.0
            && self.rate.is_none_or(|r| r.is_finite() && r > 0.0)
            && (0.0..=1.0).contains(&self.cancel_fraction)
            && (0.0..1.0).contains(&self.output_range);
        if !ok {
            return Err(BenchError::Setup(
                "--duration, --request-timeout, --time-scale, --rate and --concurrency must be positive numbers, --warmup and --think-time not negative, --cancel-fraction in [0, 1], --output-range in [0, 1)".into(),
            ));
        }
        if !(seconds(self.ramp_up) && self.ramp_up <= self.warmup) {
            return Err(BenchError::Setup(
                "--ramp-up must be a number of seconds from 0 to --warmup".into(),
            ));
        }
        let timed = matches!(&workload, Workload::Trace(t) if t.is_timed());
        if self.ramp_up > 0.0 && (self.rate.is_some() || timed) {
            return Err(BenchError::Setup(
                "--ramp-up spreads the start of a closed loop's clients; an open loop (--rate, a timed --trace) has no clients to start".into(),
            ));
        }
        if self.output_range > 0.0 && self.trace.is_some() {
            return Err(BenchError::Setup(
                "--output-range applies to the built-in workloads; a trace's lines carry their own output lengths".into(),
            ));
        }
        let api = super::loadgen::Api::by_name(&self.api).ok_or_else(|| {
            BenchError::Setup(format!(
                "unknown --api `{}` (known: completions, responses)",
                self.api
            ))
        })?;
        let session_header = match &self.session_header {
            Some(name) => Some(http::HeaderName::try_from(name.as_str()).map_err(|_| {
                BenchError::Setup(format!("--session-header `{name}` is not a header name"))
            })?),
            None => None,
        };
        Ok(LoadSpec {
            api,
            session_header,
            url,
            model: self.model.clone(),
            workload,
            seed: self.seed,
            concurrency: self.concurrency,
            rate: self.rate,
            think: Duration::from_secs_f64(self.think_time),
            ramp_up: Duration::from_secs_f64(self.ramp_up),
            warmup: Duration::from_secs_f64(self.warmup),
            duration: Duration::from_secs_f64(self.duration),
            cancel: (self.cancel_fraction > 0.0).then_some(Cancel {
                fraction: self.cancel_fraction,
                after_tokens: self.cancel_after,
            }),
            request_timeout: Duration::from_secs_f64(self.request_timeout),
            max_requests: self.requests,
            output_range: self.output_range,
        })
    }

    fn slo(&self) -> (f64, f64) {
        (self.slo_ttft_ms, self.slo_tpot_ms)
    }

    fn write(&self, runs: &[Run], svg: impl FnOnce() -> String) -> std::io::Result<()> {
        if let Some(p) = &self.json {
            let json = serde_json::to_string_pretty(runs).map_err(std::io::Error::other)?;
            std::fs::write(p, json)?;
        }
        if let Some(p) = &self.svg {
            std::fs::write(p, svg())?;
        }
        Ok(())
    }
}

/// The run's header. `seeds` are `compare --seeds`, which replace `--seed` when given.
fn describe(spec: &LoadSpec, seeds: &[u64]) -> String {
    let timed = matches!(&spec.workload, Workload::Trace(t) if t.is_timed());
    let arrival = match spec.rate {
        _ if timed => format!(
            "trace replay at its timestamps, at most {} in flight",
            spec.concurrency
        ),
        Some(r) => format!(
            "open loop {r} req/s, at most {} in flight",
            spec.concurrency
        ),
        None => format!("closed loop, concurrency {}", spec.concurrency),
    };
    let arrival = if spec.think.is_zero() {
        arrival
    } else {
        format!("{arrival}, think time {:?} (mean)", spec.think)
    };
    let arrival = if spec.output_range > 0.0 {
        format!(
            "{arrival}, output lengths ± {:.0}%",
            spec.output_range * 100.0
        )
    } else {
        arrival
    };
    let seeds = match seeds {
        [] => format!("seed {}", spec.seed),
        [one] => format!("seed {one}"),
        many => {
            let list: Vec<String> = many.iter().map(u64::to_string).collect();
            format!("seeds {}", list.join(", "))
        }
    };
    format!(
        "workload {:?}\n{arrival}, {seeds}, warm-up {:?}, window {:?}\n",
        spec.workload, spec.warmup, spec.duration
    )
}

pub async fn run(cmd: BenchCommand) -> Result<(), BenchError> {
    let io = |e: std::io::Error| BenchError::Setup(e.to_string());
    match cmd {
        BenchCommand::Run {
            url,
            worker_metrics,
            load,
        } => {
            let spec = load.spec(url.clone())?;
            print!("{}", describe(&spec, &[]));
            let (run, _) =
                super::run_once(&url, &spec, &worker_metrics, load.slo(), load.time_scale).await?;
            let runs = vec![run];
            println!("\n{}", report::table(&runs));
            load.write(&runs, || plot::ttft_cdf_svg(&runs)).map_err(io)
        }
        BenchCommand::Compare(args) => compare(args).await,
        BenchCommand::Sweep {
            url,
            points,
            rates,
            worker_metrics,
            load,
        } => {
            let spec = load.spec(url)?;
            print!("{}", describe(&spec, &[]));
            let runs = super::sweep(
                &spec,
                &points,
                rates,
                &worker_metrics,
                load.slo(),
                load.time_scale,
            )
            .await?;
            println!("\n{}", report::table(&runs));
            let pts: Vec<(usize, super::stats::Summary)> = points
                .iter()
                .zip(&runs)
                .map(|(p, r)| (*p as usize, r.summary.clone()))
                .collect();
            load.write(&runs, || plot::sweep_svg(&pts)).map_err(io)
        }
    }
}

/// `bench compare`: every arm on its own fresh pool (or the emptied running one), once per seed,
/// then the medians over seeds when there are several.
async fn compare(args: CompareArgs) -> Result<(), BenchError> {
    let (load, replicas) = (&args.load, args.replicas);
    if let Some(bad) = args
        .external
        .iter()
        .find(|e| super::external::parse(e).is_none())
    {
        return Err(BenchError::Setup(format!(
            "--external `{bad}`: expected NAME=COMMAND with arguments"
        )));
    }
    let wants_events = super::wants_events(&args.policies);
    let policies: Vec<String> = args
        .policies
        .iter()
        .chain(&args.external)
        .cloned()
        .collect();
    let mut spec = load.spec(String::new())?;
    print!("{}", describe(&spec, &args.seeds));
    let target = compare_target(&args, wants_events)?;
    for arm in &policies {
        super::arm_replicas(arm, 1)?;
    }
    if replicas > 1 {
        println!("{replicas} gateway replicas per kvroute arm, requests sent in turn\n");
    }
    let seeds = match args.seeds.is_empty() {
        true => vec![spec.seed],
        false => args.seeds.clone(),
    };
    let mut all: Vec<Vec<Run>> = Vec::new();
    for &seed in &seeds {
        spec.seed = seed;
        if seeds.len() > 1 {
            println!("== seed {seed}\n");
        }
        let order: Vec<&str> = super::arm_order(policies.len(), seed)
            .into_iter()
            .map(|i| policies[i].as_str())
            .collect();
        println!(
            "arms run in the order {} (rotated by the seed, so that runs over \
             consecutive seeds give every arm every position)\n",
            order.join(", ")
        );
        let (runs, limit) =
            super::compare_replicated(&target, &policies, &spec, load.slo(), usize::from(replicas))
                .await?;
        println!("{}", report::table(&runs));
        print!("{}", super::limit_line(limit, &runs));
        all.push(runs);
    }
    if all.len() > 1 {
        let seeds: Vec<String> = seeds.iter().map(u64::to_string).collect();
        println!(
            "\n== medians over seeds {} [each run, in seed order]\n\n{}",
            seeds.join(", "),
            report::across_seeds(&all)
        );
    }
    let runs: Vec<Run> = all.into_iter().flatten().collect();
    let last: Vec<Run> = runs[runs.len().saturating_sub(policies.len())..].to_vec();
    load.write(&runs, || plot::ttft_cdf_svg(&last))
        .map_err(|e| BenchError::Setup(e.to_string()))
}

/// What `bench compare` runs its arms on: fresh simulated pools, or the running workers of
/// `--pool` (with their event endpoints and tokenizer, if given).
fn compare_target(args: &CompareArgs, wants_events: bool) -> Result<super::Target, BenchError> {
    let time_scale = args.load.time_scale;
    if args.pool.is_empty() {
        let sim = SimConfig {
            workers: args.workers,
            preset: args.preset.clone(),
            block_size: args.block_size,
            time_scale,
            kv_events: wants_events,
            tokenizer: args.tokenizer.clone(),
            tokenizer_config: args.tokenizer_config.clone(),
            data_parallel_size: args.pool_data_parallel.map_or(1, |n| n as usize),
            ..SimConfig::default()
        };
        sim.validate()?;
        println!(
            "pool: {} simulated worker(s), preset {}, time scale {time_scale}; fresh per policy\n",
            args.workers, sim.preset
        );
        return Ok(super::Target::Sim(Box::new(sim)));
    }
    let (pool, events) = (&args.pool, &args.pool_kv_events);
    println!(
        "pool: {} running worker(s), prefix caches reset before each policy\n",
        pool.len()
    );
    if !events.is_empty() && events.len() != pool.len() {
        return Err(BenchError::Setup(format!(
            "--pool-kv-events names {} endpoint(s) for {} worker(s)",
            events.len(),
            pool.len()
        )));
    }
    Ok(super::Target::Existing {
        workers: pool.clone(),
        time_scale,
        kv_events: events
            .iter()
            .map(|e| {
                let (endpoint, replay) = match e.split_once('|') {
                    Some((p, r)) => (p.to_owned(), Some(r.to_owned())),
                    None => (e.clone(), None),
                };
                Some(crate::kv_events::EventSource { endpoint, replay })
            })
            .collect(),
        tokenizer: args
            .tokenizer
            .clone()
            .map(|tokenizer_json| super::TokenizerFiles {
                tokenizer_json,
                tokenizer_config: args.tokenizer_config.clone(),
            }),
        data_parallel_size: args.pool_data_parallel,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Load {
        #[command(flatten)]
        load: LoadArgs,
    }

    fn spec(args: &[&str]) -> LoadSpec {
        let args = std::iter::once("load").chain(args.iter().copied());
        Load::parse_from(args).load.spec(String::new()).unwrap()
    }

    #[test]
    fn the_header_names_the_seeds_given_rather_than_the_seed_flag() {
        let s = spec(&["--seed", "7"]);
        assert!(describe(&s, &[]).contains(", seed 7, "));
        assert!(describe(&s, &[2]).contains(", seed 2, "));
        let many = describe(&s, &[1, 2, 3]);
        assert!(many.contains(", seeds 1, 2, 3, "), "{many}");
        assert!(!many.contains("seed 7"), "{many}");
    }
}
