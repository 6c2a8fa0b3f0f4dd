//! A worker's entry in the config: its URL and name, the data-parallel ranks behind it, and
//! where its KV cache events come from.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Base URL of the worker, e.g. `http://10.0.0.7:8000` (no `/v1`).
    pub url: String,
    /// Stable name used in metrics, the response header and the prefix hash; defaults to the URL's host:port.
    #[serde(default)]
    pub name: Option<String>,
    /// Models this worker serves; empty means any model.
    #[serde(default)]
    pub models: Vec<String>,
    /// A draining worker gets no new requests; its in-flight streams finish.
    #[serde(default)]
    pub draining: bool,
    /// The worker's KV cache event publisher (vLLM's `--kv-events-config` `endpoint`), e.g.
    /// `tcp://10.0.0.7:5557`; overrides `kv_events.port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// Its replay endpoint (`replay_endpoint`), e.g. `tcp://10.0.0.7:5558`; overrides
    /// `kv_events.replay_port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// The worker runs vLLM's `--data-parallel-size` this many engines behind one API server.
    /// vLLM would place each request on an engine by load alone, so each rank is routed to as a
    /// worker of its own ([`WorkerConfig::ranks`]). `auto`: as many as the worker's `/metrics`
    /// shows engines, followed as it changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<DataParallelSize>,
    /// The one data-parallel rank of the server this entry routes to: its requests carry
    /// `X-data-parallel-rank`, its load is read from that engine's series of `/metrics`, and its
    /// KV events come from the endpoints' ports plus the rank, as vLLM offsets them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_rank: Option<u32>,
}

/// The most data-parallel ranks one worker entry may expand into.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 256;

/// How many data-parallel engines run behind a worker's API server: a number, or `auto`, the
/// engines its `/metrics` shows (vLLM labels every engine's series with `engine="<rank>"`), read
/// by the load poll and followed when the server comes back with another count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SizeOrAuto", into = "SizeOrAuto")]
pub enum DataParallelSize {
    Fixed(u32),
    Auto,
}

/// How [`DataParallelSize`] is written: a number or the word `auto`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum SizeOrAuto {
    Size(u32),
    Word(String),
    /// Any other number, refused with the same message as a word that is not `auto`.
    Other(f64),
}

impl TryFrom<SizeOrAuto> for DataParallelSize {
    type Error = String;
    fn try_from(v: SizeOrAuto) -> Result<Self, String> {
        match v {
            SizeOrAuto::Size(n) => Ok(Self::Fixed(n)),
            SizeOrAuto::Word(w) => w.parse(),
            SizeOrAuto::Other(n) => n.to_string().parse(),
        }
    }
}

impl From<DataParallelSize> for SizeOrAuto {
    fn from(v: DataParallelSize) -> Self {
        match v {
            DataParallelSize::Fixed(n) => Self::Size(n),
            DataParallelSize::Auto => Self::Word("auto".into()),
        }
    }
}

impl std::str::FromStr for DataParallelSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            n => n.parse().map(Self::Fixed).map_err(|_| {
                format!("data_parallel_size must be a number of engines or \"auto\", not {s:?}")
            }),
        }
    }
}

impl DataParallelSize {
    /// Why this size cannot be used, if it cannot.
    pub(super) fn check(self) -> Result<(), String> {
        match self {
            Self::Fixed(n) if n == 0 || n > MAX_DATA_PARALLEL_SIZE => Err(format!(
                "data_parallel_size must be 1 to {MAX_DATA_PARALLEL_SIZE} or \"auto\""
            )),
            _ => Ok(()),
        }
    }
}

/// The data-parallel ranks found behind each `auto` worker entry, by its URL: what
/// [`expand_ranks`] gives those entries. An entry with none found, or with ranks not numbered
/// from 0 ([`numbered_from_zero`]), is routed to as one worker.
pub type DetectedRanks = std::collections::HashMap<String, Vec<u32>>;

/// Whether a server's engines (ascending) are ranks 0..N, as when one API server fronts every
/// engine. With vLLM's hybrid or external load balancing a server fronts the engines of its node
/// only (ranks k..k+n in `/metrics`) and reads `X-data-parallel-rank` as an index among them
/// (vLLM 0.32's `input_processor.py` checks it against the local count), so the ranks it shows
/// are not the values to send it.
pub fn numbered_from_zero(ranks: &[u32]) -> bool {
    ranks.iter().zip(0..).all(|(&r, i)| r == i)
}

impl WorkerConfig {
    pub fn from_url(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: None,
            models: Vec::new(),
            draining: false,
            kv_events: None,
            kv_events_replay: None,
            data_parallel_size: None,
            data_parallel_rank: None,
        }
    }

    /// The workers this entry routes to: with `data_parallel_size` N, one entry per rank 0..N
    /// (named `<name>/dp<rank>`, each with `data_parallel_rank` set); with `auto`, one per rank
    /// in `detected` (when more than one is); else itself.
    pub fn ranks(&self, detected: &DetectedRanks) -> Vec<WorkerConfig> {
        let ranks: Vec<u32> = match self.data_parallel_size {
            _ if self.data_parallel_rank.is_some() => Vec::new(),
            Some(DataParallelSize::Fixed(n)) => (0..n).collect(),
            Some(DataParallelSize::Auto) => match detected.get(&self.url) {
                Some(found) if found.len() > 1 && numbered_from_zero(found) => found.clone(),
                _ => Vec::new(),
            },
            None => Vec::new(),
        };
        if ranks.is_empty() {
            return vec![self.clone()];
        }
        ranks
            .into_iter()
            .map(|rank| WorkerConfig {
                name: self.name.as_ref().map(|n| format!("{n}/dp{rank}")),
                // An `auto` entry's ranks keep saying so: the pool follows their count.
                data_parallel_size: self
                    .data_parallel_size
                    .filter(|s| *s == DataParallelSize::Auto),
                data_parallel_rank: Some(rank),
                ..self.clone()
            })
            .collect()
    }

    /// Whether this entry's ranks are read from the worker (`data_parallel_size: auto`): the
    /// entry itself, or one of the ranks [`WorkerConfig::ranks`] found for it.
    pub fn detects_ranks(&self) -> bool {
        self.data_parallel_size == Some(DataParallelSize::Auto)
    }
}

/// `cfgs` with every data-parallel entry expanded into its ranks ([`WorkerConfig::ranks`], the
/// `auto` ones as `detected` says); borrowed when none is.
pub fn expand_ranks<'a>(
    cfgs: &'a [WorkerConfig],
    detected: &DetectedRanks,
) -> std::borrow::Cow<'a, [WorkerConfig]> {
    if cfgs
        .iter()
        .all(|c| c.data_parallel_size.is_none() || c.data_parallel_rank.is_some())
    {
        return std::borrow::Cow::Borrowed(cfgs);
    }
    std::borrow::Cow::Owned(cfgs.iter().flat_map(|c| c.ranks(detected)).collect())
}

/// Following the workers' KV cache events (vLLM's ZMQ publisher).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// The publisher's port on every worker's host (discovered workers included); a worker's own
    /// `kv_events` endpoint takes precedence. Unset: only workers that name an endpoint.
    pub port: Option<u16>,
    /// The replay port on every worker's host.
    pub replay_port: Option<u16>,
    /// Workers given no endpoints (by `port` or their own) are asked for theirs at vLLM's
    /// `GET /kv_event_sources` (vLLM 0.32 on), until they list them.
    pub discover: bool,
}

impl KvEventsConfig {
    /// Where `worker`'s events come from: the endpoints configured for it, else (with
    /// `discover`) the worker's own listing, else nowhere.
    pub fn events_for(&self, worker: &WorkerConfig) -> Option<crate::kv_events::EventsFrom> {
        use crate::kv_events::EventsFrom;
        match self.source_for(worker) {
            Some(source) => Some(EventsFrom::At(source)),
            None => self.discover.then(|| EventsFrom::Ask {
                rank: worker.data_parallel_rank.unwrap_or(0),
            }),
        }
    }

    /// Where `worker` publishes its events, if configured.
    pub fn source_for(&self, worker: &WorkerConfig) -> Option<crate::kv_events::EventSource> {
        let host = || {
            let uri: http::Uri = worker.url.parse().ok()?;
            uri.host().map(str::to_owned)
        };
        let at = |port: u16| Some(format!("tcp://{}:{port}", host()?));
        let endpoint = worker.kv_events.clone().or_else(|| at(self.port?))?;
        let replay = worker
            .kv_events_replay
            .clone()
            .or_else(|| at(self.replay_port?));
        // Each data-parallel rank publishes on the configured ports plus its rank.
        let rank = worker.data_parallel_rank.unwrap_or(0);
        Some(crate::kv_events::EventSource {
            endpoint: offset_port(&endpoint, rank),
            replay: replay.map(|r| offset_port(&r, rank)),
        })
    }
}

/// `endpoint` (`tcp://host:port`) with its port moved up by `by`, as vLLM moves a
/// data-parallel rank's publisher; unchanged when `by` is 0 or there is no numeric port.
fn offset_port(endpoint: &str, by: u32) -> String {
    let moved = (by > 0)
        .then(|| {
            let (base, port) = endpoint.rsplit_once(':')?;
            let port = port.parse::<u32>().ok()?.checked_add(by)?;
            Some(format!("{base}:{port}"))
        })
        .flatten();
    moved.unwrap_or_else(|| endpoint.to_owned())
}

/// The name a worker goes by: its configured name, else the URL's authority (with `/dp<rank>` for
/// one data-parallel rank of a server).
pub fn worker_name(w: &WorkerConfig) -> String {
    if let Some(n) = &w.name {
        return n.clone();
    }
    let authority = w
        .url
        .parse::<http::Uri>()
        .ok()
        .and_then(|u| u.authority().map(|a| a.to_string()))
        .unwrap_or_else(|| w.url.clone());
    match w.data_parallel_rank {
        Some(rank) => format!("{authority}/dp{rank}"),
        None => authority,
    }
}
