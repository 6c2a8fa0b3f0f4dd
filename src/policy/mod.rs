//! Routing policies: one small synchronous trait, one factory from the config enum, one file per algorithm.
//!
//! A policy sees the workers that serve the request's model and the request's routing key, and
//! names one of them. It must not block or allocate much: it runs on every request.

use std::sync::Arc;

use crate::{config::PolicyConfig, routing_key::RequestInfo, workers::Worker};

pub mod arms;
mod least_conn;
mod prefix;
mod round_robin;

pub use least_conn::LeastConn;
pub use prefix::Prefix;
pub use round_robin::RoundRobin;

/// How a worker was chosen; counted in `kvroute_routing_decisions_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The policy's first choice.
    Preferred,
    /// The first choice was unusable or over its load bound; a later candidate took it.
    Spilled,
    /// No candidate in the policy's own order would do; the least-loaded worker took it.
    LeastConnFallback,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Preferred => "preferred",
            Outcome::Spilled => "spilled",
            Outcome::LeastConnFallback => "least_conn_fallback",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Index into the slice the policy was given.
    pub index: usize,
    pub outcome: Outcome,
}

pub trait Policy: Send + Sync + 'static {
    /// The config name, used as the `policy` label.
    fn name(&self) -> &'static str;

    /// Picks one of `workers` for `req`, or `None` when none is usable.
    fn select(&self, workers: &[Arc<Worker>], req: &RequestInfo) -> Option<Selection>;
}

/// The one place a policy is built from its config.
pub fn build(cfg: &PolicyConfig) -> Box<dyn Policy> {
    match cfg {
        PolicyConfig::RoundRobin => Box::new(RoundRobin::default()),
        PolicyConfig::LeastConn => Box::new(LeastConn::default()),
        PolicyConfig::Prefix(p) => Box::new(Prefix::new(p.clone())),
    }
}

/// The usable worker with the fewest requests in flight; ties go to the first at or after `start`
/// (callers rotate `start` so ties do not all land on worker 0).
pub fn least_loaded(workers: &[Arc<Worker>], start: usize) -> Option<usize> {
    let n = workers.len();
    (0..n)
        .map(|k| (start + k) % n)
        .filter(|&i| workers[i].is_usable())
        .min_by_key(|&i| workers[i].inflight())
}
