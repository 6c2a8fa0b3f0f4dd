//! Finding a worker's event endpoints by asking it: vLLM (0.32 on) lists each data-parallel
//! rank's publisher at `GET /kv_event_sources`, as its resolved `KVEventsConfig`:
//! `{"0": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
//! ...}, "1": {... ports plus one ...}}`, `{}` when it publishes none.
//!
//! vLLM binds its publisher when the endpoint's host is `*` or `::` (and connects out to the
//! subscriber otherwise), so only a bound endpoint can be followed from here: its host becomes the
//! worker's own.

use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use tokio_util::sync::CancellationToken;

use super::EventSource;

/// The path vLLM lists its publishers at.
pub const PATH: &str = "/kv_event_sources";

/// A listing longer than this is not vLLM's.
const LIMIT: usize = 64 * 1024;

/// Why a listing gave no endpoint for a rank.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoSource {
    #[error("the worker publishes no KV events for rank {0}")]
    NotPublished(u32),
    #[error("rank {rank}'s publisher is `{publisher}`, not zmq")]
    NotZmq { rank: u32, publisher: String },
    #[error("rank {rank}'s publisher connects out to {endpoint} rather than binding; give kvroute its endpoint instead")]
    ConnectsOut { rank: u32, endpoint: String },
    #[error("not a listing of KV event sources: {0}")]
    Malformed(String),
}

/// The endpoints of data-parallel rank `rank` in a `/kv_event_sources` body, with the bound
/// wildcard host replaced by `host` (the worker's, as the gateway reaches it).
pub fn source_in(body: &[u8], rank: u32, host: &str) -> Result<EventSource, NoSource> {
    let listing: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| NoSource::Malformed(e.to_string()))?;
    let all = listing
        .as_object()
        .ok_or_else(|| NoSource::Malformed("not a JSON object".into()))?;
    let Some(config) = all.get(&rank.to_string()) else {
        return Err(NoSource::NotPublished(rank));
    };
    let text = |key: &str| config.get(key).and_then(|v| v.as_str());
    if let Some(publisher) = text("publisher").filter(|p| *p != "zmq") {
        return Err(NoSource::NotZmq {
            rank,
            publisher: publisher.to_owned(),
        });
    }
    let endpoint = text("endpoint").ok_or_else(|| NoSource::Malformed("no endpoint".into()))?;
    let at_worker = |endpoint: &str| {
        bound_port(endpoint)
            .map(|port| {
                let host = if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]")
                } else {
                    host.to_owned()
                };
                format!("tcp://{host}:{port}")
            })
            .ok_or_else(|| NoSource::ConnectsOut {
                rank,
                endpoint: endpoint.to_owned(),
            })
    };
    Ok(EventSource {
        endpoint: at_worker(endpoint)?,
        replay: text("replay_endpoint").map(at_worker).transpose()?,
    })
}

/// The port of a TCP endpoint that vLLM binds (its host `*` or `::`, as vLLM decides); `None`
/// for one it would connect out to.
fn bound_port(endpoint: &str) -> Option<&str> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let bound = matches!(host, "*" | "[::]" | "::" | "[*]");
    (bound && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())).then_some(port)
}

/// Asks the worker at `authority` (`host:port`) for rank `rank`'s endpoints until it lists them
/// (every 2 s, then less often up to every 30 s, while the worker is not up or does not list
/// them); `None` once `stop` fires.
pub async fn discover(
    authority: &http::uri::Authority,
    rank: u32,
    stop: &CancellationToken,
) -> Option<EventSource> {
    let mut wait = Duration::from_secs(2);
    let mut said = None::<String>;
    loop {
        let outcome = tokio::select! {
            _ = stop.cancelled() => return None,
            r = tokio::time::timeout(Duration::from_secs(5), listing(authority)) => r,
        };
        let why = match outcome {
            Ok(Ok(body)) => match source_in(&body, rank, authority.host()) {
                Ok(source) => {
                    tracing::info!(worker = %authority, rank, endpoint = %source.endpoint, "KV event endpoints found");
                    return Some(source);
                }
                Err(e) => e.to_string(),
            },
            Ok(Err(e)) => e,
            Err(_) => "no answer within 5 s".to_owned(),
        };
        // Said once per reason, not on every retry.
        if said.as_deref() != Some(why.as_str()) {
            tracing::warn!(worker = %authority, rank, reason = %why, "KV event endpoints not found yet; asking again");
            said = Some(why);
        }
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(Duration::from_secs(30));
    }
}

/// `GET /kv_event_sources` on one fresh connection: the body of a 200 answer.
async fn listing(authority: &http::uri::Authority) -> Result<bytes::Bytes, String> {
    let port = authority.port_u16().unwrap_or(80);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let req = http::Request::get(PATH)
        .header(http::header::HOST, authority.as_str())
        .body(Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string());
    let out = match resp {
        Ok(r) if r.status() == http::StatusCode::OK => Limited::new(r.into_body(), LIMIT)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .map_err(|e| e.to_string()),
        Ok(r) => Err(format!(
            "{PATH} answered {} (vLLM lists its publishers from 0.32 on)",
            r.status()
        )),
        Err(e) => Err(e),
    };
    conn.abort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What vLLM 0.32.0 answered for a server with two data-parallel engines (seen here).
    const TWO_RANKS: &str = r#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:10623","replay_endpoint":"tcp://*:15975","buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":"kv-events"},"1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:10624","replay_endpoint":"tcp://*:15976","buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":"kv-events"}}"#;

    #[test]
    fn each_ranks_bound_endpoints_are_reached_at_the_workers_host() {
        let one = source_in(TWO_RANKS.as_bytes(), 1, "10.0.0.7").unwrap();
        assert_eq!(one.endpoint, "tcp://10.0.0.7:10624");
        assert_eq!(one.replay.as_deref(), Some("tcp://10.0.0.7:15976"));
        let zero = source_in(TWO_RANKS.as_bytes(), 0, "::1").unwrap();
        assert_eq!(zero.endpoint, "tcp://[::1]:10623");
        assert_eq!(
            source_in(TWO_RANKS.as_bytes(), 2, "h"),
            Err(NoSource::NotPublished(2))
        );
        let no_replay = r#"{"0": {"publisher": "zmq", "endpoint": "tcp://[::]:5557"}}"#;
        let s = source_in(no_replay.as_bytes(), 0, "vllm-0.vllm").unwrap();
        assert_eq!(
            (s.endpoint.as_str(), s.replay),
            ("tcp://vllm-0.vllm:5557", None)
        );
    }

    #[test]
    fn what_cannot_be_followed_says_why() {
        assert_eq!(source_in(b"{}", 0, "h"), Err(NoSource::NotPublished(0)));
        let out = r#"{"0": {"publisher": "zmq", "endpoint": "tcp://10.0.0.9:5557"}}"#;
        assert!(matches!(
            source_in(out.as_bytes(), 0, "h"),
            Err(NoSource::ConnectsOut { rank: 0, .. })
        ));
        let null = r#"{"0": {"publisher": "null", "endpoint": "tcp://*:5557"}}"#;
        assert!(matches!(
            source_in(null.as_bytes(), 0, "h"),
            Err(NoSource::NotZmq { .. })
        ));
        for bad in ["not json", "[1]", r#"{"0": {"publisher": "zmq"}}"#] {
            assert!(
                matches!(
                    source_in(bad.as_bytes(), 0, "h"),
                    Err(NoSource::Malformed(_))
                ),
                "{bad}"
            );
        }
    }
}
