//! The pools a bench runs on: fresh simulated workers with kvroute gateways (or another router)
//! in front, or running workers with their caches emptied; torn down when dropped.

use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{external, loadgen, workers, BenchError, TokenizerFiles, EVENTS_SUFFIX};
use crate::config::{Config, Overrides, TokenizerConfig};
use crate::kv_events::EventSource;
use crate::sim::{self, SimConfig};

/// A fresh simulated pool and a gateway in front of it, torn down on drop.
pub struct Pool {
    /// The gateway's base URL; with replicas, every replica's, comma-separated (as
    /// [`loadgen::LoadSpec::url`] takes them).
    pub gateway: String,
    pub workers: Vec<String>,
    cancel: CancellationToken,
    _tasks: JoinSet<()>,
    /// The router process of an external arm, stopped with the pool.
    _router: Option<external::Router>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The workers a comparison runs on: a fresh simulated pool per arm, or a pool that already
/// runs (real vLLM, say) whose prefix caches are emptied before each arm.
#[derive(Clone, Debug)]
pub enum Target {
    Sim(Box<SimConfig>),
    /// Running workers (base URLs) that serve `POST /reset_prefix_cache` (vLLM does with
    /// `VLLM_SERVER_DEV_MODE=1`; the simulator always does); `time_scale` as in [`super::run_once`]
    /// (1 for real workers).
    Existing {
        workers: Vec<String>,
        time_scale: f64,
        /// Each worker's KV event endpoints, in `workers` order, for `+events` arms.
        kv_events: Vec<Option<EventSource>>,
        tokenizer: Option<TokenizerFiles>,
        /// The data-parallel engines behind each worker's API server, if any.
        data_parallel_size: Option<u32>,
    },
}

impl Target {
    /// How much faster than the wall clock the workers' modelled time runs.
    pub fn time_scale(&self) -> f64 {
        match self {
            Target::Sim(cfg) => cfg.time_scale,
            Target::Existing { time_scale, .. } => *time_scale,
        }
    }
}

/// Starts a pool whose gateway runs `arm`: a policy name, a gateway config file (`.yaml`/`.yml`)
/// whose worker list is replaced by the pool's, or `NAME=COMMAND`, another router
/// ([`external`]).
pub async fn start_pool(sim_cfg: &SimConfig, arm: &str) -> Result<Pool, BenchError> {
    start_pool_replicated(sim_cfg, arm, 1).await
}

/// Like [`start_pool`], with `replicas` gateways (sharing nothing) in front of the same workers.
pub async fn start_pool_replicated(
    sim_cfg: &SimConfig,
    arm: &str,
    replicas: usize,
) -> Result<Pool, BenchError> {
    let cfg = SimConfig {
        port: 0,
        ..sim_cfg.clone()
    };
    let cancel = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let started = sim::start(&cfg, cfg.bind().await?, &cancel, &mut tasks).await?;
    let workers: Vec<String> = started
        .iter()
        .map(|w| format!("http://{}", w.addr))
        .collect();
    let exact = Exact {
        kv_events: started.into_iter().map(|w| w.kv_events).collect(),
        tokenizer: cfg.tokenizer.clone().map(|tokenizer_json| TokenizerFiles {
            tokenizer_json,
            tokenizer_config: cfg.tokenizer_config.clone(),
        }),
        data_parallel_size: cfg.data_parallel_ranks(),
    };
    let gateway = Gateway {
        host: cfg.host,
        replicas,
        time_scale: cfg.time_scale,
    };
    start_gateway(workers, arm, gateway, cancel, tasks, &exact).await
}

/// How the gateways of an arm run: where, how many, and how much faster than the wall clock the
/// workers' modelled time runs.
struct Gateway {
    host: std::net::IpAddr,
    replicas: usize,
    time_scale: f64,
}

/// What an arm's gateway is told beyond the workers' URLs: for `+events` arms, where the events
/// are and how to tokenize; for every kvroute arm, the data-parallel engines behind each worker.
#[derive(Clone, Debug, Default)]
pub struct Exact {
    /// Each worker's KV event endpoints, in pool order.
    pub kv_events: Vec<Option<EventSource>>,
    pub tokenizer: Option<TokenizerFiles>,
    /// Each worker runs this many data-parallel engines, which kvroute's arms route to rank by
    /// rank (other routers are given the workers' URLs).
    pub data_parallel_size: Option<u32>,
}

/// A gateway running `arm` in front of running workers whose prefix caches are emptied first.
pub async fn start_on_existing(
    workers: &[String],
    arm: &str,
    replicas: usize,
    time_scale: f64,
    exact: &Exact,
) -> Result<Pool, BenchError> {
    workers::reset_prefix_caches(workers)
        .await
        .map_err(BenchError::Setup)?;
    let gateway = Gateway {
        host: std::net::Ipv4Addr::LOCALHOST.into(),
        replicas,
        time_scale,
    };
    let cancel = CancellationToken::new();
    start_gateway(
        workers.to_vec(),
        arm,
        gateway,
        cancel,
        JoinSet::new(),
        exact,
    )
    .await
}

async fn start_gateway(
    workers: Vec<String>,
    arm: &str,
    Gateway {
        host,
        replicas,
        time_scale,
    }: Gateway,
    cancel: CancellationToken,
    tasks: JoinSet<()>,
    exact: &Exact,
) -> Result<Pool, BenchError> {
    if let Some((name, template)) = external::parse(arm) {
        let router = external::start(name, template, &workers).await?;
        return Ok(Pool {
            gateway: router.url.clone(),
            workers,
            cancel,
            _tasks: tasks,
            _router: Some(router),
        });
    }
    let (arm, events) = match arm.strip_suffix(EVENTS_SUFFIX) {
        Some(policy) => (policy, true),
        None => (arm, false),
    };
    let is_file = arm.ends_with(".yaml") || arm.ends_with(".yml");
    let base = if is_file {
        Config::parse_file(std::path::Path::new(arm))
    } else {
        Ok(Config::default())
    };
    let config = base
        .and_then(|c| {
            c.with_overrides(Overrides {
                listen: None,
                workers: workers.clone(),
                policy: (!is_file).then(|| arm.to_string()),
                ..Overrides::default()
            })
        })
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    let mut config = config;
    // The workers' time runs `time_scale` times faster than the wall clock, so the gateway's poll
    // of their load runs that much faster too: the age of what it knows about a worker, measured
    // in requests, is then what it would be against workers in real time. Unscaled, a 1 s poll at
    // time scale 5 is a 5 s poll in the workers' time, and a replica's view of the requests
    // other replicas sent is five times staler than in production.
    if time_scale > 0.0 {
        config.load_signals.interval_seconds /= time_scale;
    }
    for w in &mut config.workers {
        w.data_parallel_size = exact
            .data_parallel_size
            .map(crate::config::DataParallelSize::Fixed);
    }
    if events {
        follow_events(&mut config, &workers, exact).await?;
    }
    config
        .validate()
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    // Replicas of an arm whose config has `peers.bind` tell each other their load: each gets a
    // UDP socket of its own on the bench's host, and every replica all of their addresses.
    let mut peers = Vec::new();
    if config.peers.bind.is_some() {
        for _ in 0..replicas.max(1) {
            let socket = std::net::UdpSocket::bind((host, 0))
                .and_then(crate::peers::hand_over)
                .map_err(|e| BenchError::Setup(e.to_string()))?;
            peers.push(socket);
        }
        config.peers.addresses = peers.iter().map(ToString::to_string).collect();
    }
    let mut urls = Vec::new();
    for k in 0..replicas.max(1) {
        if let Some(addr) = peers.get(k) {
            config.peers.bind = Some(*addr);
        }
        let listener = TcpListener::bind((host, 0))
            .await
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        let addr = listener
            .local_addr()
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        urls.push(format!("http://{addr}"));
        spawn_gateway(listener, config.clone(), cancel.clone())?;
    }
    let gateway = urls.join(",");
    Ok(Pool {
        gateway,
        workers,
        cancel,
        _tasks: tasks,
        _router: None,
    })
}

/// Runs one gateway on a thread and runtime of its own until `stop`, as it would run in a
/// process of its own beside the workers: on the bench's runtime its tasks queued with the
/// simulated engines' and the load generator's, so the gateway's work delayed their wake-ups
/// (costing the in-process arms throughput that routers measured as external arms, in their own
/// processes, were not charged), and theirs delayed its decisions and relays.
fn spawn_gateway(
    listener: TcpListener,
    config: Config,
    stop: CancellationToken,
) -> Result<(), BenchError> {
    let listener = listener
        .into_std()
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    crate::server::spawn_on_own_thread("bench-gateway", listener, move |listener| {
        crate::server::serve(listener, config, stop)
    })
    .map_err(|e| BenchError::Setup(e.to_string()))
}

/// Points a `+events` arm's gateway at each worker's KV event endpoints and gives it the workers'
/// tokenizer, under the model name the workers serve.
async fn follow_events(
    config: &mut Config,
    workers: &[String],
    exact: &Exact,
) -> Result<(), BenchError> {
    let files = exact.tokenizer.as_ref().ok_or_else(|| {
        BenchError::Setup(format!(
            "an arm ending in {EVENTS_SUFFIX} needs --tokenizer (the workers' tokenizer.json)"
        ))
    })?;
    if exact.kv_events.iter().all(Option::is_none) {
        return Err(BenchError::Setup(format!(
            "an arm ending in {EVENTS_SUFFIX} needs workers that publish KV events \
             (--pool-kv-events for a running pool)"
        )));
    }
    for (w, source) in config.workers.iter_mut().zip(&exact.kv_events) {
        if let Some(s) = source {
            w.kv_events = Some(s.endpoint.clone());
            w.kv_events_replay = s.replay.clone();
        }
    }
    let base = workers
        .first()
        .ok_or_else(|| BenchError::Setup("no workers".into()))?;
    let model = loadgen::first_model(&loadgen::client(), base).await?;
    config.tokenizers = vec![TokenizerConfig {
        model,
        tokenizer_json: files.tokenizer_json.clone(),
        tokenizer_config: files.tokenizer_config.clone(),
        chat_template: None,
        default_chat_template_kwargs: Default::default(),
    }];
    Ok(())
}
