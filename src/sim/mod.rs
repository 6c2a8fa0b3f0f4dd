//! A simulated vLLM worker: vLLM's HTTP API over a modelled engine, for tests, demos and benchmarks
//! without a GPU.
//!
//! One worker is: [`api`] (HTTP shapes, faults) → [`request`] (vLLM's fields and validation) →
//! [`worker`] (the engine loop in scaled time) → [`engine`] (scheduler and cost model) → [`kv`]
//! (paged prefix cache), with its own [`tokenizer`] and [`metrics`]. Parameters come from a named
//! preset in [`presets`]. A worker may run several engines behind its one API server, as vLLM's
//! data parallelism does ([`data_parallel`]).

mod answer;
pub mod api;
pub mod data_parallel;
pub mod engine;
pub mod events;
pub mod kv;
pub mod metrics;
pub mod presets;
pub mod replay;
pub mod request;
pub mod responses;
pub mod tokenizer;
pub mod worker;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use engine::Engine;
use presets::EngineParams;

/// Faults to inject, for reliability tests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Share of generation requests answered with a 500 (0..1), decided per request by a seeded roll.
    pub error_rate: f64,
    /// Delay before a generation request is looked at.
    pub added_latency_ms: u64,
    /// Accept connections but never answer (generation and `/health`).
    pub hang: bool,
    /// Close the connection mid-stream after this many tokens, without `[DONE]`.
    pub drop_after_tokens: Option<usize>,
}

/// `kvroute sim` settings: a file may set all of them, flags override.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    pub workers: usize,
    pub host: std::net::IpAddr,
    /// First port; worker i listens on port + i. 0 picks free ports.
    pub port: u16,
    /// The engine preset; a comma-separated list gives worker i the (i mod n)-th of them, a pool of
    /// one model on unlike GPUs (every preset must serve the same model with the same block size).
    pub preset: String,
    /// Overrides the preset's engine wholesale when set (every worker's).
    pub engine: Option<EngineParams>,
    /// Tokens per KV block instead of the engine's (as vLLM's `--block-size`); the KV capacity in
    /// tokens stays the same, so the block count scales inversely.
    pub block_size: Option<usize>,
    /// Modelled time runs this many times faster than the wall clock.
    pub time_scale: f64,
    /// As vLLM: drop a request from the batch when its connection closes.
    pub abort_on_disconnect: bool,
    pub faults: Faults,
    /// Which worker the faults apply to; all of them when unset.
    pub fault_worker: Option<usize>,
    /// Seeds response ids and fault rolls.
    pub seed: u64,
    /// Publish KV cache events as vLLM does with `--kv-events-config` (ZMQ PUB and replay
    /// sockets on free ports of `host`).
    pub kv_events: bool,
    /// Hash each KV block with this many tokens after it, as vLLM 0.33 does with EAGLE, EAGLE-3
    /// or MTP speculative decoding (1 there; 0, the default, for none): a block is then reused
    /// only by a prompt that goes on with the same tokens, and its stores carry them
    /// (`lookahead_token_ids`). The drafter itself is not modelled.
    pub hash_lookahead: usize,
    /// Tokenize with this model `tokenizer.json` instead of the simulator's own split, as a vLLM
    /// worker serving that model does (its KV blocks then carry the model's token ids).
    pub tokenizer: Option<std::path::PathBuf>,
    /// The model's `tokenizer_config.json`, for its chat template (chat requests).
    pub tokenizer_config: Option<std::path::PathBuf>,
    /// Keep Responses API answers in each worker's memory, as vLLM does with
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1` (off by default, as in vLLM), so that
    /// `previous_response_id` and `GET /v1/responses/{id}` work on the worker that made them.
    pub responses_store: bool,
    /// Data-parallel engines behind each worker's API server, as vLLM's `--data-parallel-size`:
    /// each a rank with its own KV cache, metrics series and event ports (the first rank's plus
    /// the rank), a request placed by its `X-data-parallel-rank` header or else by vLLM's
    /// balancer ([`data_parallel`]).
    pub data_parallel_size: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: 2,
            host: std::net::Ipv4Addr::LOCALHOST.into(),
            port: 8001,
            preset: presets::DEFAULT_PRESET.into(),
            engine: None,
            block_size: None,
            time_scale: 1.0,
            abort_on_disconnect: true,
            faults: Faults::default(),
            fault_worker: None,
            seed: 0,
            kv_events: false,
            hash_lookahead: 0,
            tokenizer: None,
            tokenizer_config: None,
            responses_store: false,
            data_parallel_size: 1,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    File(#[from] crate::config::ConfigError),
    #[error("invalid simulator config: {0}")]
    Invalid(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

impl SimConfig {
    pub fn from_file(path: &Path) -> Result<Self, SimError> {
        Ok(crate::config::read_yaml(path)?)
    }

    /// The first worker's engine (every worker's unless `preset` lists several).
    pub fn engine_params(&self) -> Result<EngineParams, SimError> {
        self.engine_params_for(0)
    }

    /// The preset names `preset` lists, in order.
    fn preset_names(&self) -> impl Iterator<Item = &str> {
        self.preset.split(',').map(str::trim)
    }

    /// Worker `i`'s engine: the (i mod n)-th of the `n` presets listed, unless `engine` overrides.
    pub fn engine_params_for(&self, i: usize) -> Result<EngineParams, SimError> {
        let p = match &self.engine {
            Some(p) => p.clone(),
            None => {
                let names: Vec<&str> = self.preset_names().collect();
                let name = names[i % names.len()];
                (presets::find(name)
                    .ok_or_else(|| {
                        SimError::Invalid(format!(
                            "unknown preset `{name}` (known: {})",
                            presets::names()
                        ))
                    })?
                    .params)()
            }
        };
        let mut p = p;
        if p.block_size == 0 || self.block_size == Some(0) {
            return Err(SimError::Invalid("block_size must be positive".into()));
        }
        if let Some(b) = self.block_size {
            p.num_gpu_blocks = p.num_gpu_blocks * p.block_size / b;
            p.block_size = b;
        }
        if p.num_gpu_blocks * p.block_size < p.max_model_len {
            return Err(SimError::Invalid(format!(
                "{} KV blocks of {} tokens cannot hold one max_model_len={} sequence",
                p.num_gpu_blocks, p.block_size, p.max_model_len
            )));
        }
        if p.max_num_seqs == 0 || p.max_num_batched_tokens == 0 {
            return Err(SimError::Invalid(
                "max_num_seqs and max_num_batched_tokens must be positive".into(),
            ));
        }
        Ok(p)
    }

    pub fn validate(&self) -> Result<EngineParams, SimError> {
        if self.workers == 0 {
            return Err(SimError::Invalid("workers must be at least 1".into()));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(SimError::Invalid("time_scale must be positive".into()));
        }
        if !(0.0..=1.0).contains(&self.faults.error_rate) {
            return Err(SimError::Invalid(
                "faults.error_rate must be in 0..1".into(),
            ));
        }
        if !(1..=256).contains(&self.data_parallel_size) {
            return Err(SimError::Invalid(
                "data_parallel_size must be 1 to 256".into(),
            ));
        }
        if self.tokenizer_config.is_some() && self.tokenizer.is_none() {
            return Err(SimError::Invalid(
                "tokenizer_config needs tokenizer (the model's tokenizer.json)".into(),
            ));
        }
        let first = self.engine_params()?;
        for i in 1..self.preset_names().count() {
            let p = self.engine_params_for(i)?;
            if p.model != first.model || p.block_size != first.block_size {
                return Err(SimError::Invalid(format!(
                    "presets `{}` mix models or block sizes ({} and {}, {} and {} tokens): a pool \
                     serves one model, and its cache is counted in blocks of one size",
                    self.preset, first.model, p.model, first.block_size, p.block_size
                )));
            }
        }
        Ok(first)
    }

    /// KV blocks over the whole pool (each worker's, times its data-parallel engines).
    pub fn pool_gpu_blocks(&self) -> Result<usize, SimError> {
        let mut blocks = 0;
        for i in 0..self.workers {
            blocks += self.engine_params_for(i)?.num_gpu_blocks * self.data_parallel_size;
        }
        Ok(blocks)
    }

    /// The data-parallel engines behind each worker, where there are several.
    pub fn data_parallel_ranks(&self) -> Option<u32> {
        (self.data_parallel_size > 1).then_some(self.data_parallel_size as u32)
    }

    /// What the workers tokenize with.
    pub fn load_tokenizer(&self) -> Result<tokenizer::SimTokenizer, SimError> {
        match &self.tokenizer {
            None => Ok(tokenizer::SimTokenizer::Own),
            Some(path) => tokenizer::SimTokenizer::load(path, self.tokenizer_config.as_deref())
                .map_err(|e| SimError::Invalid(e.to_string())),
        }
    }

    /// Binds every worker's listener (port + i, or free ports when port is 0).
    pub async fn bind(&self) -> Result<Vec<TcpListener>, SimError> {
        let mut out = Vec::with_capacity(self.workers);
        for i in 0..self.workers {
            let port = if self.port == 0 {
                0
            } else {
                self.port.saturating_add(i as u16)
            };
            let addr = SocketAddr::new(self.host, port);
            out.push(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| SimError::Bind { addr, source })?,
            );
        }
        Ok(out)
    }
}

/// A running simulated worker.
#[derive(Clone, Debug)]
pub struct SimWorker {
    pub addr: SocketAddr,
    /// Its KV cache event endpoints, when it publishes them: rank 0's where it runs several
    /// data-parallel engines (rank r's are on these ports plus r, as vLLM places them).
    pub kv_events: Option<crate::kv_events::EventSource>,
}

/// Serves one simulated worker per listener until `cancel` fires. Every task is owned by `tasks`.
pub async fn spawn(
    cfg: &SimConfig,
    listeners: Vec<TcpListener>,
    cancel: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Result<Vec<SocketAddr>, SimError> {
    Ok(start(cfg, listeners, cancel, tasks)
        .await?
        .into_iter()
        .map(|w| w.addr)
        .collect())
}

/// [`spawn`], returning each worker's KV event endpoints too.
pub async fn start(
    cfg: &SimConfig,
    listeners: Vec<TcpListener>,
    cancel: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Result<Vec<SimWorker>, SimError> {
    cfg.validate()?;
    let tokenizer = cfg.load_tokenizer()?;
    let mut workers = Vec::with_capacity(listeners.len());
    for (i, listener) in listeners.into_iter().enumerate() {
        let params = cfg.engine_params_for(i)?;
        let addr = listener.local_addr().map_err(|source| SimError::Bind {
            addr: SocketAddr::new(cfg.host, 0),
            source,
        })?;
        let sockets = if cfg.kv_events {
            events::bind_ranks(cfg.host, cfg.data_parallel_size)
                .await
                .map_err(|e| SimError::Invalid(format!("KV event sockets: {e}")))?
        } else {
            Vec::new()
        };
        let sources: Vec<_> = sockets.iter().map(|(source, _)| source.clone()).collect();
        let mut sockets = sockets.into_iter();
        let registry = prometheus::Registry::new();
        let mut ranks = Vec::with_capacity(cfg.data_parallel_size);
        let mut loops = Vec::with_capacity(cfg.data_parallel_size);
        for rank in 0..cfg.data_parallel_size {
            let mut engine = Engine::new(params.clone());
            engine.set_tokenizer(tokenizer.clone());
            engine.set_hash_lookahead(cfg.hash_lookahead);
            let publish = match sockets.next() {
                Some((_, sockets)) => {
                    engine.record_kv_events();
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    tasks.spawn(events::run(sockets, rx, cancel.clone()));
                    Some(tx)
                }
                None => None,
            };
            let metrics = Arc::new(metrics::SimMetrics::of_rank(&params, rank, &registry));
            let (handle, engine_task) = worker::spawn(
                engine,
                metrics.clone(),
                worker::LoopOptions {
                    time_scale: cfg.time_scale,
                    abort_on_disconnect: cfg.abort_on_disconnect,
                    kv_events: publish,
                },
                cancel.clone(),
            );
            ranks.push(data_parallel::Rank {
                engine: handle,
                metrics,
            });
            loops.push(engine_task);
        }
        workers.push(SimWorker {
            addr,
            kv_events: sources.first().cloned(),
        });
        let metrics = ranks[0].metrics.clone();
        let engines = data_parallel::Engines::new(ranks, cfg.time_scale);
        let faults = match cfg.fault_worker {
            Some(w) if w != i => Faults::default(),
            _ => cfg.faults.clone(),
        };
        let state = Arc::new(
            api::WorkerState::new(
                engines,
                metrics,
                params.model.clone(),
                params.max_model_len,
                faults,
                engine::splitmix(cfg.seed ^ i as u64),
                tokenizer.clone(),
            )
            .with_responses_store(cfg.responses_store)
            .with_kv_event_sources(&sources),
        );
        let app = api::router(state);
        let stop = cancel.clone();
        // No drain on shutdown: a worker told to hang would hold it forever, and a simulated
        // worker has nothing to save.
        tasks.spawn(async move {
            tokio::select! {
                served = axum::serve(crate::server::no_delay(listener), app) => {
                    if let Err(e) = served {
                        tracing::warn!(%addr, "simulated worker stopped: {e}");
                    }
                }
                _ = stop.cancelled() => {}
            }
            for engine_task in loops {
                engine_task.abort();
            }
        });
    }
    Ok(workers)
}
