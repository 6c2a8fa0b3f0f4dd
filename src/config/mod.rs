//! Gateway configuration: the serde structs, their `Default` (the only home of defaults), and validation.
//!
//! Every default lives in a `Default` impl here or in the `operations`, `routing` and `worker`
//! files (or a serde `default` function beside its field). The CLI only overrides fields that
//! were given; the README's config reference is written from these impls.

use std::{net::SocketAddr, path::Path, time::Duration};

use serde::{Deserialize, Serialize};

mod operations;
mod routing;
mod worker;

pub use operations::{
    AdmissionConfig, AuthConfig, ClientKeyConfig, DiscoveryConfig, HealthConfig, LimitsConfig,
    LoadSignalsConfig, PeersConfig,
};
pub use routing::{
    AbConfig, ArmConfig, CacheAwareParams, PolicyConfig, PrefixParams, RoutingConfig,
    RoutingKeyConfig,
};
pub use worker::{
    expand_ranks, numbered_from_zero, worker_name, DataParallelSize, DetectedRanks, KvEventsConfig,
    WorkerConfig, MAX_DATA_PARALLEL_SIZE,
};

/// Environment variable that overrides the routing policy, so an A/B switch is one value in a Deployment.
pub const POLICY_ENV: &str = "KVROUTE_POLICY";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid config: {0}")]
    Invalid(String),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address the gateway listens on.
    pub listen: SocketAddr,
    /// A second address serving only `/health`, `/ready` and `/metrics`, on a thread of its own:
    /// probes and scrapes are answered while the event loops work through a burst of traffic.
    /// The same routes stay on `listen` too. None: no admin listener.
    pub admin_listen: Option<SocketAddr>,
    /// The vLLM workers behind the gateway.
    pub workers: Vec<WorkerConfig>,
    /// Which routing policy picks a worker, and its parameters.
    pub policy: PolicyConfig,
    /// How the prompt is cut into hashed blocks.
    pub routing_key: RoutingKeyConfig,
    pub timeouts: TimeoutConfig,
    /// Largest accepted request body, in bytes (413 above it).
    pub body_limit_bytes: usize,
    /// Requests in flight a worker may hold; 0 means no limit. Past it, `admission` decides.
    pub max_inflight_per_worker: usize,
    /// Waiting for a slot when every eligible worker is at `max_inflight_per_worker`.
    pub admission: AdmissionConfig,
    /// Client API keys and the key sent to workers.
    pub auth: AuthConfig,
    /// Event loops of `kvroute serve`: threads that each serve their share of the client
    /// connections, with their own connections to the workers; 0: one per core.
    pub threads: usize,
    /// How many other workers a request may be retried on when its worker refused the connection.
    pub connect_retries: usize,
    /// How long a worker that refused a connection is left out of routing, in seconds.
    pub eject_seconds: f64,
    /// How long in-flight requests may run after SIGTERM before the gateway exits, in seconds.
    pub drain_seconds: f64,
    /// Active and passive health checking of workers.
    pub health: HealthConfig,
    /// Polling of the workers' load figures.
    pub load_signals: LoadSignalsConfig,
    /// Connection and read limits on clients.
    pub limits: LimitsConfig,
    /// Where the worker list comes from: this file (`static`), DNS, or the Kubernetes API.
    pub discovery: DiscoveryConfig,
    /// The workers' KV cache events (exact cache state, where workers publish it).
    pub kv_events: KvEventsConfig,
    /// Tokenizers per served model, to compare requests with the blocks workers report.
    pub tokenizers: Vec<TokenizerConfig>,
    /// A weighted split of traffic between policies; when set, it replaces `policy`.
    pub ab: Option<AbConfig>,
    /// Other replicas of the gateway to exchange load with.
    pub peers: PeersConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin_listen: None,
            workers: Vec::new(),
            policy: PolicyConfig::default(),
            routing_key: RoutingKeyConfig::default(),
            timeouts: TimeoutConfig::default(),
            body_limit_bytes: 8 * 1024 * 1024,
            max_inflight_per_worker: 0,
            admission: AdmissionConfig::default(),
            auth: AuthConfig::default(),
            threads: 0,
            connect_retries: 2,
            eject_seconds: 5.0,
            drain_seconds: 30.0,
            health: HealthConfig::default(),
            load_signals: LoadSignalsConfig::default(),
            limits: LimitsConfig::default(),
            discovery: DiscoveryConfig::default(),
            kv_events: KvEventsConfig::default(),
            tokenizers: Vec::new(),
            ab: None,
            peers: PeersConfig::default(),
        }
    }
}

/// What the command line (or `KVROUTE_POLICY`) says on top of the file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    /// Replaces the file's worker list when not empty.
    pub workers: Vec<String>,
    /// The data-parallel engines behind each of `workers` (`WorkerConfig::data_parallel_size`).
    pub data_parallel_size: Option<DataParallelSize>,
    pub policy: Option<String>,
}

/// A served model's tokenizer, as the worker loads it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    /// The model name requests carry (vLLM's `--served-model-name`).
    pub model: String,
    /// The model's `tokenizer.json`.
    pub tokenizer_json: std::path::PathBuf,
    /// The model's `tokenizer_config.json`, for its chat template (chat requests): a
    /// `chat_template.jinja` beside it first, as `transformers` reads them.
    #[serde(default)]
    pub tokenizer_config: Option<std::path::PathBuf>,
    /// A Jinja chat template to use instead (the file given to vLLM's `--chat-template`).
    #[serde(default)]
    pub chat_template: Option<std::path::PathBuf>,
    /// The workers' `--default-chat-template-kwargs`: template variables each chat request's
    /// own `chat_template_kwargs` override.
    #[serde(default)]
    pub default_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutConfig {
    /// TCP connect to a worker, in seconds.
    pub connect_seconds: f64,
    /// From sending a request to the worker's response headers, in seconds.
    /// (vLLM sends a non-streaming answer's headers only when generation ends.)
    pub first_byte_seconds: f64,
    /// Longest silence between two chunks of a response body, in seconds.
    pub idle_stream_seconds: f64,
    /// A keep-alive connection to a worker unused for this long is closed and never sent on, in
    /// seconds. Keep it below the workers' own keep-alive timeout (vLLM closes an idle connection
    /// after 5 s, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`): a request written as the worker closes its
    /// end is lost, and a proxy cannot tell whether the worker began it.
    pub worker_idle_seconds: f64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        Self {
            connect_seconds: 2.0,
            first_byte_seconds: 600.0,
            idle_stream_seconds: 120.0,
            worker_idle_seconds: 4.0,
        }
    }
}

impl TimeoutConfig {
    pub fn connect(&self) -> Duration {
        Duration::from_secs_f64(self.connect_seconds)
    }
    pub fn first_byte(&self) -> Duration {
        Duration::from_secs_f64(self.first_byte_seconds)
    }
    pub fn idle_stream(&self) -> Duration {
        Duration::from_secs_f64(self.idle_stream_seconds)
    }
    pub fn worker_idle(&self) -> Duration {
        Duration::from_secs_f64(self.worker_idle_seconds)
    }
}

impl Config {
    /// The config the gateway runs with: the file's (or the defaults), then the overrides, validated.
    pub fn load(path: Option<&Path>, overrides: Overrides) -> Result<Self, ConfigError> {
        let base = match path {
            Some(p) => Self::parse_file(p)?,
            None => Self::default(),
        };
        let config = base.with_overrides(overrides)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads a YAML file without validating it. Unknown keys are errors.
    pub fn parse_file(path: &Path) -> Result<Self, ConfigError> {
        read_yaml(path)
    }

    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = serde_saphyr::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<config>".into(),
            message: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    pub fn with_overrides(mut self, o: Overrides) -> Result<Self, ConfigError> {
        if let Some(listen) = o.listen {
            self.listen = listen;
        }
        if let Some(admin) = o.admin_listen {
            self.admin_listen = Some(admin);
        }
        if !o.workers.is_empty() {
            self.workers = o
                .workers
                .into_iter()
                .map(|url| WorkerConfig {
                    data_parallel_size: o.data_parallel_size,
                    ..WorkerConfig::from_url(url)
                })
                .collect();
        }
        if let Some(name) = o.policy {
            // One policy named on the command line or in KVROUTE_POLICY ends any A/B split.
            self.policy = self.policy.with_name(&name)?;
            self.ab = None;
        }
        Ok(self)
    }

    /// Checks what serde cannot: ranges, URLs, duplicate names.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.admin_listen == Some(self.listen) && self.listen.port() != 0 {
            return Err(ConfigError::Invalid(format!(
                "admin_listen must be another address than listen ({})",
                self.listen
            )));
        }
        self.validate_workers().map_err(ConfigError::Invalid)?;
        if self.routing_key.block_bytes == 0 || self.routing_key.max_blocks == 0 {
            return Err(ConfigError::Invalid(
                "routing_key.block_bytes and routing_key.max_blocks must be at least 1".into(),
            ));
        }
        self.validate_policy(&self.policy)
            .map_err(ConfigError::Invalid)?;
        self.validate_times().map_err(ConfigError::Invalid)?;
        crate::auth::Auth::from_config(&self.auth).map_err(ConfigError::Invalid)?;
        self.validate_operations().map_err(ConfigError::Invalid)?;
        if let Some(ab) = &self.ab {
            self.validate_ab(ab).map_err(ConfigError::Invalid)?;
        }
        self.discovery.validate().map_err(ConfigError::Invalid)?;
        Ok(())
    }

    /// The worker list: some worker unless discovery finds them, data-parallel ranks that fit
    /// their sizes, `http://host:port` URLs, and unique names once ranks are expanded.
    fn validate_workers(&self) -> Result<(), String> {
        if self.workers.is_empty() && self.discovery == DiscoveryConfig::Static {
            return Err(
                "at least one worker is required (workers: [{url: ...}] or --worker URL)".into(),
            );
        }
        let mut names = std::collections::HashSet::new();
        for w in &self.workers {
            if let Some(Err(e)) = w.data_parallel_size.map(DataParallelSize::check) {
                return Err(format!("worker {:?}: {e}", w.url));
            }
            match (w.data_parallel_size, w.data_parallel_rank) {
                (Some(DataParallelSize::Auto), Some(_)) => {
                    return Err(format!(
                        "worker {:?}: data_parallel_rank needs a data_parallel_size in numbers, not auto",
                        w.url
                    ))
                }
                (Some(DataParallelSize::Fixed(n)), Some(r)) if r >= n => {
                    return Err(format!(
                        "worker {:?}: data_parallel_rank {r} is not below data_parallel_size {n}",
                        w.url
                    ))
                }
                (None, Some(r)) if r >= MAX_DATA_PARALLEL_SIZE => {
                    return Err(format!(
                        "worker {:?}: data_parallel_rank must be below {MAX_DATA_PARALLEL_SIZE}",
                        w.url
                    ))
                }
                _ => {}
            }
        }
        for w in expand_ranks(&self.workers, &DetectedRanks::new()).iter() {
            let uri: http::Uri = match w.url.parse() {
                Ok(u) => u,
                Err(e) => return Err(format!("worker url {:?}: {e}", w.url)),
            };
            if uri.scheme_str() != Some("http") || uri.authority().is_none() {
                return Err(format!(
                    "worker url {:?} must be http://host:port (https is not supported yet)",
                    w.url
                ));
            }
            let name = worker_name(w);
            if !names.insert(name.clone()) {
                return Err(format!(
                    "two workers are named {name:?}; names must be unique"
                ));
            }
        }
        Ok(())
    }

    /// Every timeout and time span a positive number of seconds, and the event loops' count.
    fn validate_times(&self) -> Result<(), String> {
        let t = &self.timeouts;
        for (name, v) in [
            ("timeouts.connect_seconds", t.connect_seconds),
            ("timeouts.first_byte_seconds", t.first_byte_seconds),
            ("timeouts.idle_stream_seconds", t.idle_stream_seconds),
            ("timeouts.worker_idle_seconds", t.worker_idle_seconds),
            ("eject_seconds", self.eject_seconds),
            ("drain_seconds", self.drain_seconds),
        ] {
            if !(v.is_finite() && v > 0.0 && v < 1e7) {
                return Err(format!("{name} must be a positive number of seconds"));
            }
        }
        if self.threads > 1024 {
            return Err("threads must be at most 1024 (0: one per core)".into());
        }
        let adm = &self.admission;
        if !(adm.max_wait_seconds.is_finite()
            && adm.max_wait_seconds > 0.0
            && adm.max_wait_seconds < 1e6)
        {
            return Err("admission.max_wait_seconds must be a positive number of seconds".into());
        }
        Ok(())
    }

    /// The request body limit, health checks, connection limits and the load poll.
    fn validate_operations(&self) -> Result<(), String> {
        if self.body_limit_bytes == 0 {
            return Err("body_limit_bytes must be at least 1".into());
        }
        let h = &self.health;
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !(h.interval_seconds == 0.0 || positive(h.interval_seconds))
            || !positive(h.timeout_seconds)
            || h.unhealthy_threshold == 0
            || h.healthy_threshold == 0
            || h.passive_failures == 0
            || !h.path.starts_with('/')
        {
            return Err("health: interval_seconds >= 0, timeout_seconds > 0, thresholds >= 1, path starting with /".into());
        }
        let lim = &self.limits;
        if lim.max_connections == 0
            || lim.listen_backlog == 0
            || !positive(lim.header_read_timeout_seconds)
            || !positive(lim.body_read_timeout_seconds)
            || lim.header_read_timeout_seconds > 1e6
            || lim.body_read_timeout_seconds > 1e6
        {
            return Err(
                "limits: max_connections and listen_backlog >= 1, read timeouts positive seconds"
                    .into(),
            );
        }
        let l = &self.load_signals;
        if !(l.interval_seconds == 0.0 || positive(l.interval_seconds))
            || !positive(l.timeout_seconds)
            || !l.path.starts_with('/')
        {
            return Err(
                "load_signals: interval_seconds >= 0, timeout_seconds > 0, path starting with /"
                    .into(),
            );
        }
        let auto = self.workers.iter().any(WorkerConfig::detects_ranks)
            || self.discovery.data_parallel_size() == Some(DataParallelSize::Auto);
        if auto && l.interval_seconds == 0.0 {
            return Err("data_parallel_size: auto reads the engines from the load poll of /metrics: load_signals.interval_seconds must be above 0".into());
        }
        let p = &self.peers;
        if p.bind.is_some()
            && !(positive(p.interval_seconds)
                && positive(p.resolve_seconds)
                && positive(p.expire_seconds)
                && p.addresses.iter().all(|a| {
                    a.rsplit_once(':')
                        .is_some_and(|(h, port)| !h.is_empty() && port.parse::<u16>().is_ok())
                }))
        {
            return Err("peers: interval_seconds, resolve_seconds and expire_seconds > 0, addresses as host:port".into());
        }
        Ok(())
    }

    /// A policy's own parameters, and those that depend on the routing key.
    fn validate_policy(&self, policy: &PolicyConfig) -> Result<(), String> {
        match policy {
            PolicyConfig::CacheAware(p) => p.validate(),
            PolicyConfig::Prefix(p) => {
                if p.key_blocks == 0 || p.key_blocks > self.routing_key.max_blocks {
                    return Err(format!(
                        "policy.key_blocks must be between 1 and routing_key.max_blocks ({})",
                        self.routing_key.max_blocks
                    ));
                }
                if !(p.load_factor.is_finite() && p.load_factor >= 1.0) {
                    return Err("policy.load_factor must be a number >= 1.0".into());
                }
                Ok(())
            }
            PolicyConfig::RoundRobin | PolicyConfig::LeastConn => Ok(()),
        }
    }

    /// The A/B section: at least two uniquely and safely named arms with positive weights and
    /// valid policies, and a valid sticky header.
    fn validate_ab(&self, ab: &AbConfig) -> Result<(), String> {
        if ab.arms.len() < 2 {
            return Err("ab.arms needs at least two arms".into());
        }
        let mut seen = std::collections::HashSet::new();
        for a in &ab.arms {
            let ok_name = !a.name.is_empty()
                && a.name.len() <= 32
                && a.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !ok_name || !seen.insert(a.name.as_str()) {
                return Err(format!(
                    "ab arm name {:?} must be unique, [A-Za-z0-9_-], at most 32 characters",
                    a.name
                ));
            }
            if !(a.weight.is_finite() && a.weight > 0.0) {
                return Err(format!("ab arm {:?}: weight must be positive", a.name));
            }
            self.validate_policy(&a.policy)
                .map_err(|e| format!("ab arm {:?}: {e}", a.name))?;
        }
        if let Some(h) = &ab.sticky_header {
            if http::HeaderName::try_from(h.as_str()).is_err() {
                return Err(format!("ab.sticky_header {h:?} is not a header name"));
            }
        }
        Ok(())
    }
}

impl DiscoveryConfig {
    /// What each way of finding workers needs.
    fn validate(&self) -> Result<(), String> {
        if let Some(Err(e)) = self.data_parallel_size().map(DataParallelSize::check) {
            return Err(format!("discovery.{e}"));
        }
        match self {
            DiscoveryConfig::Static => {}
            DiscoveryConfig::Dns {
                host,
                interval_seconds,
                ..
            } => {
                if host.is_empty() || !(interval_seconds.is_finite() && *interval_seconds > 0.0) {
                    return Err("discovery.dns needs a host and a positive interval_seconds".into());
                }
            }
            DiscoveryConfig::Kubernetes {
                service,
                port_name,
                port,
                watch_timeout_seconds,
                ..
            } => {
                if service.is_empty() || (port_name.is_none() && port.is_none()) {
                    return Err(
                        "discovery.kubernetes needs a service and a port_name or port".into(),
                    );
                }
                if !(*watch_timeout_seconds >= 1.0 && *watch_timeout_seconds < 1e6) {
                    return Err("discovery.watch_timeout_seconds must be at least 1 second".into());
                }
            }
        }
        Ok(())
    }
}

/// Reads and deserialises one YAML file (gateway, simulator and workload files alike), naming the
/// file in every error; unknown keys are rejected by the target types.
pub fn read_yaml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    serde_saphyr::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `config/cache_aware.yaml` says that every value in it is the default: it is the policy
    /// `Default` gives, so neither can change without the other.
    #[test]
    fn the_example_cache_aware_config_shows_the_defaults() {
        let c = Config::from_yaml(include_str!("../../config/cache_aware.yaml")).unwrap();
        assert_eq!(c.policy, PolicyConfig::default());
    }

    #[test]
    fn defaults_fill_a_minimal_file() {
        let c = Config::from_yaml("workers: [{url: 'http://127.0.0.1:9000'}]").unwrap();
        assert_eq!(
            c.policy,
            PolicyConfig::CacheAware(CacheAwareParams::default())
        );
        assert_eq!(c.body_limit_bytes, Config::default().body_limit_bytes);
        assert_eq!(worker_name(&c.workers[0]), "127.0.0.1:9000");
    }

    #[test]
    fn a_data_parallel_worker_is_routed_to_rank_by_rank() {
        let c = Config::from_yaml(
            "workers:\n\
             - {url: 'http://10.0.0.7:8000', data_parallel_size: 3}\n\
             - {url: 'http://10.0.0.8:8000', name: big, data_parallel_size: 2, kv_events: 'tcp://10.0.0.8:5557'}\n\
             - {url: 'http://10.0.0.9:8000'}\n\
             kv_events: {port: 5557, replay_port: 5558}",
        )
        .unwrap();
        let all = expand_ranks(&c.workers, &DetectedRanks::new());
        let names: Vec<String> = all.iter().map(worker_name).collect();
        assert_eq!(
            names,
            [
                "10.0.0.7:8000/dp0",
                "10.0.0.7:8000/dp1",
                "10.0.0.7:8000/dp2",
                "big/dp0",
                "big/dp1",
                "10.0.0.9:8000"
            ]
        );
        let ranks: Vec<Option<u32>> = all.iter().map(|w| w.data_parallel_rank).collect();
        assert_eq!(ranks, [Some(0), Some(1), Some(2), Some(0), Some(1), None]);
        // Each rank publishes on the configured ports plus its rank, as vLLM offsets them.
        let source = |i: usize| c.kv_events.source_for(&all[i]).unwrap();
        assert_eq!(source(0).endpoint, "tcp://10.0.0.7:5557");
        assert_eq!(source(2).endpoint, "tcp://10.0.0.7:5559");
        assert_eq!(source(2).replay.as_deref(), Some("tcp://10.0.0.7:5560"));
        assert_eq!(source(4).endpoint, "tcp://10.0.0.8:5558");
        assert_eq!(source(5).endpoint, "tcp://10.0.0.9:5557");
        // Without data parallelism the list is the configured one, not a copy.
        let plain = [WorkerConfig::from_url("http://a:1")];
        assert!(matches!(
            expand_ranks(&plain, &DetectedRanks::new()),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn data_parallel_sizes_and_ranks_are_checked() {
        for (worker, says) in [
            (
                "{url: 'http://a:1', data_parallel_size: 0}",
                "data_parallel_size must be",
            ),
            (
                "{url: 'http://a:1', data_parallel_size: 100000}",
                "data_parallel_size must be",
            ),
            (
                "{url: 'http://a:1', data_parallel_size: 2, data_parallel_rank: 2}",
                "is not below",
            ),
            (
                "{url: 'http://a:1', data_parallel_rank: 300}",
                "must be below",
            ),
        ] {
            let e = Config::from_yaml(&format!("workers: [{worker}]")).unwrap_err();
            assert!(e.to_string().contains(says), "{worker}: {e}");
        }
        // Two entries for the same rank of one server are one worker twice.
        let e = Config::from_yaml(
            "workers: [{url: 'http://a:1', data_parallel_rank: 1}, {url: 'http://a:1', data_parallel_size: 2}]",
        )
        .unwrap_err();
        assert!(e.to_string().contains("a:1/dp1"), "{e}");
    }

    #[test]
    fn a_data_parallel_size_is_a_number_or_auto() {
        let c = Config::from_yaml(
            "workers:\n\
             - {url: 'http://a:1', data_parallel_size: auto, name: a}\n\
             - {url: 'http://b:1', data_parallel_size: 2}\n\
             - {url: 'http://c:1', data_parallel_size: auto}",
        )
        .unwrap();
        let sizes: Vec<_> = c.workers.iter().map(|w| w.data_parallel_size).collect();
        use DataParallelSize::{Auto, Fixed};
        assert_eq!(sizes, [Some(Auto), Some(Fixed(2)), Some(Auto)]);
        // Until a worker's engines are seen, an `auto` entry is one worker; then one per rank
        // seen, each still marked `auto` so the pool follows the count.
        let none = expand_ranks(&c.workers, &DetectedRanks::new());
        let names: Vec<String> = none.iter().map(worker_name).collect();
        assert_eq!(names, ["a", "b:1/dp0", "b:1/dp1", "c:1"]);
        let seen = DetectedRanks::from([("http://a:1".to_owned(), vec![0, 1, 2])]);
        let all = expand_ranks(&c.workers, &seen);
        let names: Vec<String> = all.iter().map(worker_name).collect();
        assert_eq!(
            names,
            ["a/dp0", "a/dp1", "a/dp2", "b:1/dp0", "b:1/dp1", "c:1"]
        );
        let auto: Vec<bool> = all.iter().map(WorkerConfig::detects_ranks).collect();
        assert_eq!(auto, [true, true, true, false, false, true]);
        // Engines not numbered from 0 (a node of a hybrid deployment) leave the entry whole.
        let hybrid = DetectedRanks::from([("http://a:1".to_owned(), vec![2, 3])]);
        assert_eq!(
            expand_ranks(&c.workers, &hybrid)[0].name.as_deref(),
            Some("a")
        );
        assert!(numbered_from_zero(&[0, 1, 2]) && !numbered_from_zero(&[1, 2]));
        // Written back as it was given.
        let written =
            |w: &WorkerConfig| serde_json::to_value(w).unwrap()["data_parallel_size"].clone();
        assert_eq!(written(&c.workers[0]), "auto");
        assert_eq!(written(&c.workers[1]), 2);

        for (yaml, says) in [
            (
                "workers: [{url: 'http://a:1', data_parallel_size: many}]",
                "a number of engines or \"auto\"",
            ),
            (
                "workers: [{url: 'http://a:1', data_parallel_size: -2}]",
                "a number of engines or \"auto\", not \"-2\"",
            ),
            (
                "workers: [{url: 'http://a:1', data_parallel_size: auto, data_parallel_rank: 1}]",
                "not auto",
            ),
            (
                "workers: [{url: 'http://a:1', data_parallel_size: auto}]\nload_signals: {interval_seconds: 0}",
                "load_signals.interval_seconds must be above 0",
            ),
            (
                "discovery: {kind: dns, host: vllm, port: 8000, data_parallel_size: auto}\nload_signals: {interval_seconds: 0}",
                "load_signals.interval_seconds must be above 0",
            ),
        ] {
            let e = Config::from_yaml(yaml).unwrap_err();
            assert!(e.to_string().contains(says), "{yaml}: {e}");
        }
        assert_eq!("auto".parse(), Ok(Auto));
        assert_eq!("4".parse(), Ok(Fixed(4)));
    }

    #[test]
    fn admin_listen_must_be_another_address_than_listen() {
        let e = Config::from_yaml(
            "workers: [{url: 'http://a:1'}]\nlisten: 0.0.0.0:9\nadmin_listen: 0.0.0.0:9",
        )
        .unwrap_err();
        assert!(e.to_string().contains("admin_listen"), "{e}");
        let ok = Config::from_yaml(
            "workers: [{url: 'http://a:1'}]\nlisten: 0.0.0.0:9\nadmin_listen: 0.0.0.0:10",
        )
        .unwrap();
        assert_eq!(ok.admin_listen, Some("0.0.0.0:10".parse().unwrap()));
    }

    #[test]
    fn each_check_of_workers_times_and_operations_refuses_with_its_message() {
        let w = "workers: [{url: 'http://a:1'}]";
        for (yaml, message) in [
            ("workers: []".to_string(), "at least one worker is required"),
            (
                "workers: [{url: 'https://a:1'}]".into(),
                "must be http://host:port",
            ),
            (
                "workers: [{url: 'http://a:1', name: x}, {url: 'http://b:1', name: x}]".into(),
                "two workers are named \"x\"",
            ),
            (
                format!("{w}\ntimeouts: {{connect_seconds: 0}}"),
                "timeouts.connect_seconds must be",
            ),
            (format!("{w}\ndrain_seconds: -1"), "drain_seconds must be"),
            (
                format!("{w}\nthreads: 1025"),
                "threads must be at most 1024",
            ),
            (
                format!("{w}\nadmission: {{max_wait_seconds: 0}}"),
                "admission.max_wait_seconds",
            ),
            (
                format!("{w}\nbody_limit_bytes: 0"),
                "body_limit_bytes must be at least 1",
            ),
            (
                format!("{w}\nhealth: {{unhealthy_threshold: 0}}"),
                "health: interval_seconds",
            ),
            (
                format!("{w}\nlimits: {{max_connections: 0}}"),
                "limits: max_connections",
            ),
            (
                format!("{w}\nload_signals: {{path: metrics}}"),
                "load_signals: interval_seconds",
            ),
            (
                format!("{w}\npeers: {{bind: '127.0.0.1:7946', addresses: [no-port]}}"),
                "peers: interval_seconds",
            ),
            (
                format!("{w}\npeers: {{bind: '127.0.0.1:7946', interval_seconds: 0}}"),
                "peers: interval_seconds",
            ),
        ] {
            let e = Config::from_yaml(&yaml).unwrap_err().to_string();
            assert!(e.contains(message), "{yaml:?}: {e}");
        }
        Config::from_yaml(w).unwrap();
        let peered = Config::from_yaml(&format!(
            "{w}\npeers: {{bind: '0.0.0.0:7946', addresses: ['kvroute-peers.default.svc:7946']}}"
        ))
        .unwrap();
        assert_eq!(peered.peers.interval_seconds, 0.001);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let e = Config::from_yaml("workers: [{url: 'http://a:1'}]\nlisten_port: 3").unwrap_err();
        assert!(e.to_string().contains("listen_port"), "{e}");
        let e =
            Config::from_yaml("workers: [{url: 'http://a:1'}]\npolicy: {kind: prefix, blocks: 3}")
                .unwrap_err();
        assert!(e.to_string().contains("blocks"), "{e}");
    }

    #[test]
    fn policy_params_parse_and_validate() {
        let c = Config::from_yaml(
            "workers: [{url: 'http://a:1'}]\npolicy: {kind: prefix, load_factor: 2.0, key_blocks: 2}",
        )
        .unwrap();
        let PolicyConfig::Prefix(p) = c.policy else {
            panic!("not prefix")
        };
        assert_eq!(
            (p.load_factor, p.key_blocks, p.spill_candidates),
            (2.0, 2, 1)
        );
        assert!(Config::from_yaml(
            "workers: [{url: 'http://a:1'}]\npolicy: {kind: prefix, load_factor: 0.5}"
        )
        .is_err());
        assert!(
            Config::from_yaml("workers: [{url: 'http://a:1'}]\npolicy: {kind: fastest}").is_err()
        );
    }

    #[test]
    fn an_arms_policy_is_checked_as_the_top_level_one_and_the_error_names_the_arm() {
        let arms = |second: &str| {
            format!(
                "workers: [{{url: 'http://a:1'}}]\nab: {{arms: [{{name: a, weight: 1, policy: {{kind: round_robin}}}}, {{name: b, weight: 1, policy: {second}}}]}}"
            )
        };
        assert!(Config::from_yaml(&arms("{kind: prefix, key_blocks: 2}")).is_ok());
        let e = Config::from_yaml(&arms("{kind: prefix, load_factor: 0.5}")).unwrap_err();
        assert!(
            e.to_string()
                .contains("ab arm \"b\": policy.load_factor must be a number >= 1.0"),
            "{e}"
        );
        let e = Config::from_yaml(&arms("{kind: prefix, key_blocks: 0}")).unwrap_err();
        assert!(
            e.to_string().contains("ab arm \"b\": policy.key_blocks"),
            "{e}"
        );
    }

    #[test]
    fn invalid_workers_are_rejected() {
        assert!(Config::from_yaml("workers: []").is_err());
        assert!(Config::from_yaml("workers: [{url: 'ftp://a:1'}]").is_err());
        assert!(Config::from_yaml("workers: [{url: 'http://a:1'}, {url: 'http://a:1'}]").is_err());
    }

    #[test]
    fn overrides_beat_the_file_and_are_validated() {
        let file = Config::from_yaml(
            "workers: [{url: 'http://a:1'}]\npolicy: {kind: prefix, key_blocks: 2}",
        )
        .unwrap();
        let c = file
            .clone()
            .with_overrides(Overrides {
                listen: Some("0.0.0.0:9".parse().unwrap()),
                workers: vec!["http://b:2".into(), "http://c:3".into()],
                policy: Some("round_robin".into()),
                ..Overrides::default()
            })
            .unwrap();
        assert_eq!(c.listen.port(), 9);
        assert_eq!(c.workers.len(), 2);
        assert_eq!(c.policy, PolicyConfig::RoundRobin);
        let same = file.clone().with_overrides(Overrides::default()).unwrap();
        assert_eq!(same, file);
        assert!(
            Config::load(None, Overrides::default()).is_err(),
            "no workers"
        );
    }

    #[test]
    fn with_name_keeps_params_of_the_same_policy_only() {
        let p = PolicyConfig::Prefix(PrefixParams {
            key_blocks: 2,
            ..Default::default()
        });
        assert_eq!(p.clone().with_name("prefix").unwrap(), p);
        assert_eq!(
            p.clone().with_name("least_conn").unwrap(),
            PolicyConfig::LeastConn
        );
        assert!(p.with_name("random").is_err());
    }
}
