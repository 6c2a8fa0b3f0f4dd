//! kvroute: a prefix-aware routing gateway for pools of vLLM workers.
//!
//! A request's path through the gateway, one module per stage:
//! [`server`] (router, layers, shutdown) → [`routes`] (thin handlers) → [`routing_key`]
//! (prompt → chained block hashes) → [`policy`] (which worker) → [`proxy`] (send, relay, account)
//! → [`workers`] (the pool). Errors become responses in one table in [`error`]; every metric lives
//! in [`metrics`]; every default in [`config`].
#![forbid(unsafe_code)]

pub mod admission;
pub mod auth;
pub mod bench;
pub mod cli;
pub mod config;
pub mod discovery;
pub mod dispatch;
pub mod error;
pub mod health;
pub mod index;
pub mod kv_events;
pub mod listener;
pub mod load;
pub mod logging;
pub mod loop_copy;
pub mod metrics;
pub mod peers;
pub mod policy;
pub mod proxy;
pub mod reload;
pub mod request_tokens;
pub mod responses;
pub mod routes;
pub mod routing_key;
pub mod server;
pub mod sim;
pub mod tokenize;
pub mod workers;
