//! The `kvroute` command line: `serve`, `sim` and `demo`, each a thin call into the library.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use clap::{Args, Parser, Subcommand};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, Overrides, POLICY_ENV};
use crate::sim::{self, presets, SimConfig};

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "Prefix-aware routing gateway for vLLM pools"
)]
pub struct Cli {
    /// Log lines as text (coloured only on a terminal) or as JSON objects.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t,
        env = "KVROUTE_LOG_FORMAT"
    )]
    log_format: crate::logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process, so the size of its largest variant (the benchmark's flags) costs
// nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// YAML config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Validate the config and exit.
        #[arg(long)]
        check: bool,
        /// Listen address (overrides the file).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Admin listen address: `/health`, `/ready` and `/metrics` on a thread of their own
        /// (overrides the file's `admin_listen`).
        #[arg(long)]
        admin_listen: Option<SocketAddr>,
        /// Worker base URLs, repeatable or several after one flag (replace the file's list).
        #[arg(long = "worker", num_args = 1..)]
        workers: Vec<String>,
        /// Each --worker runs vLLM's --data-parallel-size this many engines behind its API
        /// server: route to each rank as a worker of its own (`data_parallel_size`). `auto`: as
        /// many as each worker's /metrics shows.
        #[arg(long, requires = "workers")]
        data_parallel_size: Option<crate::config::DataParallelSize>,
        /// Routing policy: round_robin, least_conn, prefix or cache_aware (overrides the file).
        #[arg(long, env = POLICY_ENV)]
        policy: Option<String>,
    },
    /// Run simulated vLLM workers; prints one URL a line once they accept connections.
    Sim(SimArgs),
    /// Exit 0 if URL answers 2xx within 3 s (for container health checks without a shell or curl).
    Healthcheck {
        #[arg(long, default_value = "http://127.0.0.1:8080/health")]
        url: String,
    },
    /// Measure: load generation, policy comparison and sweeps.
    #[command(subcommand)]
    Bench(crate::bench::cli::BenchCommand),
    /// Run simulated workers and the gateway in front of them, in one process.
    Demo {
        #[command(flatten)]
        sim: SimArgs,
        /// Gateway listen address.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Routing policy for the gateway (the default is `serve`'s: cache_aware).
        #[arg(long, env = POLICY_ENV, default_value = "cache_aware")]
        policy: String,
    },
}

#[derive(Args)]
struct SimArgs {
    /// YAML file with any of the simulator settings; flags override it.
    #[arg(long = "sim-config")]
    config: Option<PathBuf>,
    /// Number of workers.
    #[arg(long)]
    workers: Option<usize>,
    /// First port (worker i gets port + i); 0 picks free ports.
    #[arg(long)]
    port: Option<u16>,
    /// Engine preset (see --list-presets); a comma-separated list gives worker i the (i mod n)-th,
    /// a pool of one model on unlike GPUs (e.g. `l4-qwen2.5-7b,l40s-qwen2.5-7b`).
    #[arg(long)]
    preset: Option<String>,
    /// Run modelled time this many times faster than the wall clock.
    #[arg(long)]
    time_scale: Option<f64>,
    /// Tokens per KV block (vLLM's --block-size); the KV capacity in tokens is kept.
    #[arg(long)]
    block_size: Option<usize>,
    /// Keep generating after a client disconnects (models a server that does not abort).
    #[arg(long)]
    no_abort_on_disconnect: bool,
    /// Fault: share of requests answered 500.
    #[arg(long)]
    error_rate: Option<f64>,
    /// Fault: delay before a request is looked at.
    #[arg(long)]
    added_latency_ms: Option<u64>,
    /// Fault: never answer.
    #[arg(long)]
    hang: bool,
    /// Fault: drop the connection after this many streamed tokens.
    #[arg(long)]
    drop_after_tokens: Option<usize>,
    /// Apply the faults to this worker only.
    #[arg(long)]
    fault_worker: Option<usize>,
    /// Publish KV cache events as vLLM does with --kv-events-config (ZMQ, free ports; printed
    /// after each worker's URL as `tcp://PUB tcp://REPLAY`).
    #[arg(long)]
    kv_events: bool,
    /// Hash each KV block with this many tokens after it, as vLLM 0.33 does with EAGLE-style
    /// speculative decoding (1 there): stores then carry them as `lookahead_token_ids`.
    #[arg(long)]
    hash_lookahead: Option<usize>,
    /// Tokenize as a vLLM worker serving this model does: its `tokenizer.json` (KV blocks then
    /// carry the model's token ids, so a gateway with the same tokenizer can follow them).
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// The model's `tokenizer_config.json`, for its chat template.
    #[arg(long)]
    tokenizer_config: Option<std::path::PathBuf>,
    /// Keep Responses API answers in each worker's memory, as vLLM does with
    /// VLLM_ENABLE_RESPONSES_API_STORE=1, so previous_response_id and GET /v1/responses/{id} work.
    #[arg(long)]
    responses_store: bool,
    /// Run this many data-parallel engines behind each worker's API server, as vLLM's
    /// --data-parallel-size: a request goes to the rank its X-data-parallel-rank header names,
    /// or where vLLM's balancer puts it; rank r's KV events on the printed ports plus r.
    #[arg(long)]
    data_parallel_size: Option<usize>,
    /// List the presets and exit.
    #[arg(long)]
    list_presets: bool,
}

impl SimArgs {
    fn resolve(self, demo: bool) -> Result<SimConfig, sim::SimError> {
        let mut c = match &self.config {
            Some(p) => SimConfig::from_file(p)?,
            None if demo => SimConfig {
                port: 0,
                ..SimConfig::default()
            },
            None => SimConfig::default(),
        };
        c.workers = self.workers.unwrap_or(c.workers);
        c.port = self.port.unwrap_or(c.port);
        c.preset = self.preset.unwrap_or(c.preset);
        c.time_scale = self.time_scale.unwrap_or(c.time_scale);
        c.block_size = self.block_size.or(c.block_size);
        c.abort_on_disconnect &= !self.no_abort_on_disconnect;
        c.faults.error_rate = self.error_rate.unwrap_or(c.faults.error_rate);
        c.faults.added_latency_ms = self.added_latency_ms.unwrap_or(c.faults.added_latency_ms);
        c.faults.hang |= self.hang;
        c.faults.drop_after_tokens = self.drop_after_tokens.or(c.faults.drop_after_tokens);
        c.fault_worker = self.fault_worker.or(c.fault_worker);
        c.kv_events |= self.kv_events;
        c.hash_lookahead = self.hash_lookahead.unwrap_or(c.hash_lookahead);
        c.tokenizer = self.tokenizer.or(c.tokenizer);
        c.tokenizer_config = self.tokenizer_config.or(c.tokenizer_config);
        c.responses_store |= self.responses_store;
        c.data_parallel_size = self.data_parallel_size.unwrap_or(c.data_parallel_size);
        c.validate()?;
        Ok(c)
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    crate::logging::init(cli.log_format);
    match cli.command {
        Command::Serve {
            config,
            check,
            listen,
            admin_listen,
            workers,
            data_parallel_size,
            policy,
        } => serve(
            config,
            Overrides {
                listen,
                admin_listen,
                workers,
                data_parallel_size,
                policy,
            },
            check,
        ),
        Command::Sim(args) => sim_workers(args),
        Command::Healthcheck { url } => run(healthcheck(url)),
        Command::Bench(cmd) => run(async move { crate::bench::cli::run(cmd).await.map_err(io) }),
        Command::Demo {
            sim: args,
            listen,
            policy,
        } => {
            let cfg = match args.resolve(true) {
                Ok(c) => c,
                Err(e) => return usage_error(e),
            };
            run(demo(cfg, listen, policy))
        }
    }
}

/// `kvroute serve`: loads the config (with the command line's overrides), and either checks it
/// (`--check`) or serves it on one event loop per thread, reloading on change.
fn serve(path: Option<PathBuf>, overrides: Overrides, check: bool) -> ExitCode {
    let config = match Config::load(path.as_deref(), overrides.clone()) {
        Ok(c) => c,
        Err(e) => return usage_error(e),
    };
    // Taken right after loading, so an edit made from now on is picked up.
    let poll = std::time::Duration::from_secs(2);
    let source = path.map(|p| crate::reload::Source::new(p, overrides, poll));
    if check {
        // With an `ab` section the arms decide, not `policy`.
        let routing = match &config.ab {
            None => format!("policy {}", config.policy.name()),
            Some(_) => format!(
                "ab arms {}",
                crate::policy::arms::Arms::new(&config.policy, config.ab.as_ref()).describe()
            ),
        };
        let workers = crate::config::expand_ranks(&config.workers, &Default::default()).len();
        let auto = config.workers.iter().filter(|w| w.detects_ranks()).count();
        let auto = match auto {
            0 => String::new(),
            n => format!(" ({n} with their data-parallel ranks read from the worker)"),
        };
        // The tokenizers are loaded as serving would load them: a file that is missing or does
        // not parse fails the check, not the start-up.
        let tokenizers = match crate::server::load_tokenizers(&config) {
            Ok(t) => t,
            Err(e) => return usage_error(e),
        };
        println!("config ok: {routing}, {workers} worker(s){auto}");
        let mut models: Vec<_> = tokenizers.iter().collect();
        models.sort_by(|a, b| a.0.cmp(b.0));
        for (model, t) in models {
            println!("tokenizer for model `{model}`: {}", t.summary());
        }
        return ExitCode::SUCCESS;
    }
    let loops = match config.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // The calling thread is the first event loop: a single-threaded runtime, like the others.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    run_on(rt, async move {
        let listener = crate::listener::bind(config.listen, config.limits.listen_backlog)?;
        let hup = source
            .as_ref()
            .and_then(|_| crate::reload::install_hangup());
        let shutdown = shutdown_token();
        // Handed to a runtime of its own, so as a std socket.
        let admin = match config.admin_listen {
            Some(addr) => {
                Some(crate::listener::bind(addr, config.limits.listen_backlog)?.into_std()?)
            }
            None => None,
        };
        // One line on stdout once the socket accepts connections and the signal handlers are in
        // place (useful with port 0).
        println!("kvroute listening on http://{}", listener.local_addr()?);
        if let Some(admin) = &admin {
            println!("kvroute admin on http://{}", admin.local_addr()?);
        }
        crate::server::serve_reloading(listener, admin, loops, config, source, hup, shutdown).await
    })
}

/// `kvroute sim`: simulated workers until a signal, each announced on a line of stdout (its
/// URL, and its KV-event endpoints when it publishes them).
fn sim_workers(args: SimArgs) -> ExitCode {
    if args.list_presets {
        list_presets();
        return ExitCode::SUCCESS;
    }
    let cfg = match args.resolve(false) {
        Ok(c) => c,
        Err(e) => return usage_error(e),
    };
    run(async move {
        let shutdown = shutdown_token();
        let mut tasks = JoinSet::new();
        let workers = sim::start(&cfg, cfg.bind().await.map_err(io)?, &shutdown, &mut tasks)
            .await
            .map_err(io)?;
        for w in &workers {
            match &w.kv_events {
                Some(ev) => println!(
                    "http://{} {} {}",
                    w.addr,
                    ev.endpoint,
                    ev.replay.as_deref().unwrap_or("")
                ),
                None => println!("http://{}", w.addr),
            }
        }
        tasks.join_all().await;
        Ok(())
    })
}

/// `kvroute healthcheck`: succeeds when `url` answers 2xx within 3 s (for container probes).
async fn healthcheck(url: String) -> std::io::Result<()> {
    let client = crate::proxy::http_client(&Config::default());
    let uri: http::Uri = url.parse().map_err(io)?;
    let req = http::Request::get(uri)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .map_err(io)?;
    let resp = tokio::time::timeout(std::time::Duration::from_secs(3), client.request(req))
        .await
        .map_err(io)?
        .map_err(io)?;
    if resp.status().is_success() {
        Ok(())
    } else {
        Err(io(format!("{url}: HTTP {}", resp.status())))
    }
}

/// N simulated workers and the gateway in front of them.
async fn demo(cfg: SimConfig, listen: SocketAddr, policy: String) -> std::io::Result<()> {
    let shutdown = shutdown_token();
    let mut tasks = JoinSet::new();
    let addrs = sim::spawn(&cfg, cfg.bind().await.map_err(io)?, &shutdown, &mut tasks)
        .await
        .map_err(io)?;
    let overrides = Overrides {
        listen: Some(listen),
        workers: addrs.iter().map(|a| format!("http://{a}")).collect(),
        policy: Some(policy),
        ..Overrides::default()
    };
    let config = Config::default().with_overrides(overrides).map_err(io)?;
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let url = format!("http://{}", listener.local_addr()?);
    let model = cfg.engine_params().map_err(io)?.model;
    println!(
        "kvroute {url} (policy {}) in front of {} simulated worker(s), preset {}:",
        config.policy.name(),
        addrs.len(),
        cfg.preset
    );
    for a in &addrs {
        println!("  worker http://{a}");
    }
    println!("\nTry a streaming chat request:\n");
    println!(
        "curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' -d \
         '{{\"model\": \"{model}\", \"stream\": true, \"max_tokens\": 32, \"messages\": \
         [{{\"role\": \"system\", \"content\": \"You are a helpful assistant.\"}}, \
         {{\"role\": \"user\", \"content\": \"Say hello.\"}}]}}'\n"
    );
    println!(
        "Metrics: curl {url}/metrics   (workers: curl http://{}/metrics)",
        addrs[0]
    );
    let served = crate::server::serve(listener, config, shutdown.clone()).await;
    shutdown.cancel();
    tasks.join_all().await;
    served
}

fn list_presets() {
    for p in presets::PRESETS {
        let e = (p.params)();
        println!(
            "{}\n  {}\n  model {}, {} KV blocks x 16 tokens, max_num_seqs {}, step {} ms + {} ms/prompt token\n  source: {}\n",
            p.name,
            p.describes,
            e.model,
            e.num_gpu_blocks,
            e.max_num_seqs,
            e.cost.step_base_ms,
            e.cost.prefill_ms_per_token,
            p.source
        );
    }
}

fn io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

fn usage_error(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("kvroute: {e}");
    ExitCode::from(2)
}

fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        crate::server::shutdown_signal().await;
        t.cancel();
    });
    token
}

fn run(fut: impl std::future::Future<Output = std::io::Result<()>>) -> ExitCode {
    run_on(tokio::runtime::Runtime::new(), fut)
}

/// Runs `fut` to its end on `rt`, or says why the runtime could not start.
fn run_on(
    rt: std::io::Result<tokio::runtime::Runtime>,
    fut: impl std::future::Future<Output = std::io::Result<()>>,
) -> ExitCode {
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    finish(rt.block_on(fut))
}

fn finish(r: std::io::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute: {e}");
            ExitCode::FAILURE
        }
    }
}
