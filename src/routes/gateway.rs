//! What the gateway answers itself: the workers' models merged, liveness, readiness and the
//! Prometheus exposition.

use std::time::Duration;

use axum::{
    extract::State,
    http::header,
    response::{IntoResponse, Response},
    Json,
};
use bytes::Bytes;
use http_body_util::BodyExt;

use super::AppState;
use crate::error::ApiError;

/// `GET /v1/models`: the union of every usable worker's models, without duplicates.
pub async fn models(State(s): State<AppState>) -> Response {
    let up = &s.upstreams;
    let snapshot = up.pool.snapshot();
    let asks = snapshot
        .iter()
        .filter(|w| w.is_usable())
        .map(|w| async move {
            let uri = format!("{}://{}/v1/models", w.scheme, w.authority);
            let req = http::Request::get(uri)
                .body(http_body_util::Full::new(Bytes::new()))
                .ok()?;
            let resp = tokio::time::timeout(Duration::from_secs(10), up.client.request(req))
                .await
                .ok()?
                .ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let bytes = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
                .await
                .ok()?
                .ok()?
                .to_bytes();
            serde_json::from_slice::<serde_json::Value>(&bytes).ok()
        });
    let answers: Vec<_> = futures_util::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect();
    if answers.is_empty() {
        return ApiError::NoWorker.into_response();
    }
    let mut seen = std::collections::HashSet::new();
    let data: Vec<serde_json::Value> = answers
        .iter()
        .filter_map(|a| a.get("data").and_then(|d| d.as_array()))
        .flatten()
        .filter(|m| {
            m.get("id")
                .and_then(|id| id.as_str())
                .is_some_and(|id| seen.insert(id.to_owned()))
        })
        .cloned()
        .collect();
    Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// `GET /health`: the process is alive.
pub async fn health() -> Response {
    Json(serde_json::json!({"status": "ok"})).into_response()
}

/// `GET /ready`: at least one worker is usable.
pub async fn ready(State(s): State<AppState>) -> Response {
    if s.upstreams.pool.any_usable() {
        Json(serde_json::json!({"status": "ready"})).into_response()
    } else {
        ApiError::NoWorker.into_response()
    }
}

/// `GET /metrics`: the Prometheus text exposition.
pub async fn metrics(State(s): State<AppState>) -> Response {
    let metrics = &s.upstreams.metrics;
    metrics
        .queue_depth
        .set(s.upstreams.pool.freed.waiting() as i64);
    metrics
        .responses_remembered
        .set(i64::try_from(s.responses.len()).unwrap_or(i64::MAX));
    for arm in s.arms.load().iter() {
        if let Some(stats) = arm.policy.index_stats() {
            metrics.publish_index(arm.policy.name(), &arm.name, stats);
        }
        if let Some(share) = arm.policy.reuse_share() {
            metrics
                .reuse_share
                .with_label_values(&[arm.policy.name(), &arm.name])
                .set(share);
        }
        if let Some(share) = arm.policy.continuing_share() {
            metrics
                .continuing_share
                .with_label_values(&[arm.policy.name(), &arm.name])
                .set(share);
        }
        if let Some(share) = arm.policy.unseen_reuse_share() {
            metrics
                .unseen_reuse_share
                .with_label_values(&[arm.policy.name(), &arm.name])
                .set(share);
        }
    }
    for w in s.upstreams.pool.snapshot().iter() {
        if let Some(feed) = &w.events {
            metrics.publish_feed(&w.name, feed);
        }
        metrics.publish_steps(&w.name, w.steps.fit(), w.steps.slowness());
        let pending = w.load.pending_prefill();
        let done = w.steps.prefill_done(crate::load::now_us(), pending);
        metrics.publish_prefill(&w.name, pending, done);
        if s.upstreams.config.peers.bind.is_some() {
            metrics.publish_peer_load(&w.name, w.load.peer_inflight(), w.load.peer_tokens().0);
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.upstreams.metrics.render(),
    )
        .into_response()
}
