//! Operating the pool: health checking and worker discovery settings.

use serde::{Deserialize, Serialize};

/// Health checking. Active checks GET `path` on every worker each `interval_seconds` (0 turns
/// them off); a worker is marked down after `unhealthy_threshold` failures in a row and up again
/// after `healthy_threshold` successes. Passively, `passive_failures` 5xx answers in a row eject
/// a worker for `eject_seconds` (a refused connection ejects it at once).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    pub interval_seconds: f64,
    pub timeout_seconds: f64,
    pub path: String,
    pub unhealthy_threshold: u32,
    pub healthy_threshold: u32,
    pub passive_failures: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_seconds: 5.0,
            timeout_seconds: 2.0,
            path: "/health".into(),
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            passive_failures: 3,
        }
    }
}

/// What one client may hold. `max_connections` open connections at most (more wait in the listen
/// backlog of `listen_backlog`); request headers must arrive within `header_read_timeout_seconds`
/// and a request body within `body_read_timeout_seconds` (408 after).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    pub max_connections: usize,
    pub listen_backlog: u32,
    pub header_read_timeout_seconds: f64,
    pub body_read_timeout_seconds: f64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_connections: 8192,
            listen_backlog: 4096,
            header_read_timeout_seconds: 10.0,
            body_read_timeout_seconds: 30.0,
        }
    }
}

/// Admission control, when `max_inflight_per_worker` is set and every worker a request could go
/// to holds that many: up to `queue_size` requests wait (first come, first served) for a slot,
/// each at most `max_wait_seconds`; a request that finds the queue full or waits too long is
/// answered 503 with `Retry-After`. `queue_size` 0 answers 503 at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    pub queue_size: usize,
    pub max_wait_seconds: f64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            queue_size: 0,
            max_wait_seconds: 5.0,
        }
    }
}

impl AdmissionConfig {
    pub fn max_wait(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.max_wait_seconds)
    }
}

/// Client authentication. With `client_keys`, every `/v1/` request must carry
/// `Authorization: Bearer <key>` with one of them (401 otherwise); a key's `max_inflight` (0: no
/// limit) caps that client's requests in flight (429 beyond it). `worker_key_env` names the
/// environment variable holding the key the gateway sends to workers (vLLM's `--api-key`): when
/// set, it replaces whatever `Authorization` the client sent, so client keys never reach workers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    pub client_keys: Vec<ClientKeyConfig>,
    pub worker_key_env: Option<String>,
}

/// One client's key: given inline (`key`) or, better, read from the environment (`key_env`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientKeyConfig {
    /// Who the key belongs to (the `client` label of the metrics).
    pub name: String,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub key_env: Option<String>,
    #[serde(default)]
    pub max_inflight: usize,
}

/// Polling of the workers' own load figures (vLLM's `/metrics`) for the policies that weigh them.
/// `interval_seconds` 0 turns it off; a poll that fails or times out makes the policies fall
/// back to this gateway's own accounting for that worker until the next one succeeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadSignalsConfig {
    pub interval_seconds: f64,
    pub timeout_seconds: f64,
    pub path: String,
}

impl Default for LoadSignalsConfig {
    fn default() -> Self {
        Self {
            interval_seconds: 1.0,
            timeout_seconds: 1.0,
            path: "/metrics".into(),
        }
    }
}

/// Replicas of the gateway telling each other the load they put on each worker, so that a
/// request one sends is priced by the others within moments rather than at the next load poll
/// (and then only as a count). Each replica sends, over UDP from `bind`, what changed of what it
/// has in flight on every worker as soon as it changes (then waits `interval_seconds` before it
/// looks again; all of it each second) to every address `addresses` resolve to, re-resolved
/// every `resolve_seconds`: in Kubernetes, one headless Service name that resolves to every
/// replica (a replica ignores its own datagrams). What a peer said expires after
/// `expire_seconds` without word from it. No `bind`: off. The datagrams are neither signed nor
/// encrypted: bind to an address only the replicas reach. Read at start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeersConfig {
    pub bind: Option<std::net::SocketAddr>,
    pub addresses: Vec<String>,
    pub interval_seconds: f64,
    pub resolve_seconds: f64,
    pub expire_seconds: f64,
}

impl Default for PeersConfig {
    fn default() -> Self {
        Self {
            bind: None,
            addresses: Vec::new(),
            interval_seconds: 0.001,
            resolve_seconds: 5.0,
            expire_seconds: 3.0,
        }
    }
}

/// Worker discovery. `static` uses `workers`; `dns` re-resolves `host` (e.g. a headless Service)
/// every `interval_seconds` and uses every address on `port`; `kubernetes` watches the
/// EndpointSlices of `service` in `namespace` and uses the Ready, non-terminating endpoints on
/// `port_name` (or `port`). With `data_parallel_size`, every worker found runs that many vLLM
/// data-parallel engines behind its API server and is routed to rank by rank (as a worker entry's
/// `data_parallel_size`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DiscoveryConfig {
    #[default]
    Static,
    Dns {
        host: String,
        port: u16,
        #[serde(default = "default_interval")]
        interval_seconds: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_parallel_size: Option<super::DataParallelSize>,
    },
    Kubernetes {
        #[serde(default = "default_namespace")]
        namespace: String,
        service: String,
        #[serde(default)]
        port_name: Option<String>,
        #[serde(default)]
        port: Option<u16>,
        /// API server base URL. Unset: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`
        /// in a pod, else `http://127.0.0.1:8001` (`kubectl proxy`).
        #[serde(default)]
        api_url: Option<String>,
        /// CA bundle that signs the API server's certificate (https only).
        #[serde(default = "default_ca_file")]
        ca_file: String,
        /// Bearer token, re-read on every list and watch (projected tokens rotate); skipped when
        /// the file does not exist.
        #[serde(default = "default_token_file")]
        token_file: String,
        /// Each watch asks the API server to end it after this long (`timeoutSeconds`) and is
        /// resumed from its last resourceVersion; one that carries nothing for this long and
        /// 5 s more (kube-rs's margin) counts as a half-dead connection and is resumed too.
        #[serde(default = "default_watch_timeout")]
        watch_timeout_seconds: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_parallel_size: Option<super::DataParallelSize>,
    },
}

impl DiscoveryConfig {
    /// The data-parallel engines behind each discovered worker's API server, if set.
    pub fn data_parallel_size(&self) -> Option<super::DataParallelSize> {
        match self {
            DiscoveryConfig::Static => None,
            DiscoveryConfig::Dns {
                data_parallel_size, ..
            }
            | DiscoveryConfig::Kubernetes {
                data_parallel_size, ..
            } => *data_parallel_size,
        }
    }
}

fn default_interval() -> f64 {
    5.0
}

fn default_watch_timeout() -> f64 {
    290.0
}

fn default_ca_file() -> String {
    "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt".into()
}

fn default_token_file() -> String {
    "/var/run/secrets/kubernetes.io/serviceaccount/token".into()
}

fn default_namespace() -> String {
    "default".into()
}
