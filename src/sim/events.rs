//! The simulated worker's KV cache event publisher, on the wire as vLLM's `ZmqEventPublisher`:
//! a PUB socket sending `[topic, seq (8 bytes, big-endian), EventBatch]` per engine step that
//! had events, and a ROUTER replay socket answering `["", start]` with every buffered batch from
//! `start` on, then `["", -1, ""]`. Batches are encoded in the layout vLLM 0.32.0 sends: a
//! positional `[ts, events, data_parallel_rank]` whose events are maps tagged `type`, fields in
//! vLLM's declaration order, defaults omitted.
//!
//! The block hashes are the simulator's own (`sim::kv::block_hash`), as a real worker's are its
//! own: the gateway never sees how they are made, only the token ids.

use std::collections::VecDeque;

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::kv_events::{EventSource, KvEvent};

/// Batches kept for replay (vLLM's `buffer_steps` default).
pub const BUFFER_STEPS: usize = 10_000;

/// Binds the PUB and ROUTER sockets on `host` (free ports) and returns their endpoints with the
/// sockets, ready for [`run`].
pub async fn bind(host: std::net::IpAddr) -> zeromq::ZmqResult<(EventSource, Sockets)> {
    bind_at(host, 0, 0).await
}

/// [`bind`] for `ranks` data-parallel ranks as vLLM places them: rank r's publisher and replay
/// sockets on rank 0's ports plus r. Rank 0's ports come from the kernel and the others are
/// tried next to them; where one is taken, the whole run is tried again elsewhere.
pub async fn bind_ranks(
    host: std::net::IpAddr,
    ranks: usize,
) -> zeromq::ZmqResult<Vec<(EventSource, Sockets)>> {
    let port_of = |endpoint: &str| -> Option<u16> { endpoint.rsplit_once(':')?.1.parse().ok() };
    for _ in 0..50 {
        let first = bind(host).await?;
        let ports = (
            port_of(&first.0.endpoint),
            first.0.replay.as_deref().and_then(port_of),
        );
        let (Some(publisher_port), Some(replay_port)) = ports else {
            return Err(zeromq::ZmqError::Socket("a bound endpoint without a port"));
        };
        let mut all = vec![first];
        for r in 1..ranks {
            let offset = |port: u16| port.checked_add(u16::try_from(r).ok()?);
            let (Some(p), Some(q)) = (offset(publisher_port), offset(replay_port)) else {
                break;
            };
            match bind_at(host, p, q).await {
                Ok(rank) => all.push(rank),
                Err(_) => break,
            }
        }
        if all.len() == ranks {
            return Ok(all);
        }
    }
    Err(zeromq::ZmqError::Socket(
        "no run of free ports for every rank's event sockets",
    ))
}

/// The publisher and replay sockets bound on the given ports (0: a free one).
async fn bind_at(
    host: std::net::IpAddr,
    publisher_port: u16,
    replay_port: u16,
) -> zeromq::ZmqResult<(EventSource, Sockets)> {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher
        .bind(&format!("tcp://{host}:{publisher_port}"))
        .await?;
    let mut replay = zeromq::RouterSocket::new();
    let replay_endpoint = replay.bind(&format!("tcp://{host}:{replay_port}")).await?;
    Ok((
        EventSource {
            endpoint: endpoint.to_string(),
            replay: Some(replay_endpoint.to_string()),
        },
        Sockets { publisher, replay },
    ))
}

pub struct Sockets {
    publisher: zeromq::PubSocket,
    replay: zeromq::RouterSocket,
}

/// Publishes every batch from `batches` until `cancel`, serving replays meanwhile.
pub async fn run(
    mut sockets: Sockets,
    mut batches: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    cancel: CancellationToken,
) {
    let mut buffer: VecDeque<(i64, Bytes)> = VecDeque::new();
    let mut seq: i64 = 0;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            batch = batches.recv() => {
                let Some(events) = batch else { return };
                let payload = Bytes::from(encode(&events));
                let msg = frames(vec![Bytes::new(), seq_bytes(seq), payload.clone()]);
                if let Err(e) = sockets.publisher.send(msg).await {
                    tracing::debug!(error = %e, "KV event publish failed");
                }
                if buffer.len() == BUFFER_STEPS {
                    buffer.pop_front();
                }
                buffer.push_back((seq, payload));
                seq += 1;
            }
            request = sockets.replay.recv() => {
                let Ok(request) = request else { continue };
                let parts = request.into_vec();
                // [identity, "", start]
                let [identity, _, start] = parts.as_slice() else { continue };
                let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(i64::from_be_bytes) else {
                    continue;
                };
                for (s, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
                    let reply = frames(vec![identity.clone(), Bytes::new(), seq_bytes(*s), payload.clone()]);
                    if sockets.replay.send(reply).await.is_err() {
                        break;
                    }
                }
                let end = frames(vec![identity.clone(), Bytes::new(), seq_bytes(-1), Bytes::new()]);
                let _ = sockets.replay.send(end).await;
            }
        }
    }
}

fn seq_bytes(seq: i64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

fn frames(parts: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(parts).expect("at least one frame")
}

/// One `EventBatch` in vLLM 0.32.0's layout.
pub fn encode(events: &[KvEvent]) -> Vec<u8> {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(event).collect()),
        Value::from(0),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec");
    out
}

fn event(e: &KvEvent) -> Value {
    let field = |k: &str, v: Value| (Value::from(k), v);
    let hashes = |h: &[u64]| Value::Array(h.iter().map(|&x| Value::from(x)).collect());
    let medium = |m: &Option<String>| m.as_deref().map_or(Value::Nil, Value::from);
    Value::Map(match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            medium: m,
            group,
            block_keys: _,
            lookahead,
        } => vec![
            field("type", Value::from("BlockStored")),
            field("block_hashes", hashes(block_hashes)),
            field(
                "parent_block_hash",
                parent_block_hash.map_or(Value::Nil, Value::from),
            ),
            field(
                "token_ids",
                Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
            ),
            field("block_size", Value::from(*block_size)),
            field("lora_id", lora_id.map_or(Value::Nil, Value::from)),
            field("medium", medium(m)),
            field(
                "lora_name",
                lora_name.as_deref().map_or(Value::Nil, Value::from),
            ),
            // vLLM 0.32 lists each block's extra hash keys (LoRA, images, salt), `nil` for a
            // block of plain text; then the group, where there is one (fields left at their
            // default are left out, as msgspec's `omit_defaults` does).
            field(
                "extra_keys",
                Value::Array(vec![Value::Nil; block_hashes.len()]),
            ),
        ]
        .into_iter()
        .chain(group.idx.map(|i| field("group_idx", Value::from(i))))
        .chain(
            group
                .kind
                .as_deref()
                .map(|k| field("kv_cache_spec_kind", Value::from(k))),
        )
        .chain(
            group
                .sliding_window
                .map(|w| field("kv_cache_spec_sliding_window", Value::from(w))),
        )
        // vLLM 0.33's lookahead tokens, one list per block, where blocks are hashed with them.
        .chain((!lookahead.is_empty()).then(|| {
            let ids = |t: &Vec<u32>| Value::Array(t.iter().map(|&x| Value::from(x)).collect());
            field(
                "lookahead_token_ids",
                Value::Array(lookahead.iter().map(ids).collect()),
            )
        }))
        .collect(),
        KvEvent::BlockRemoved {
            block_hashes,
            medium: m,
            group_idx,
        } => vec![
            field("type", Value::from("BlockRemoved")),
            field("block_hashes", hashes(block_hashes)),
            field("medium", medium(m)),
        ]
        .into_iter()
        .chain(group_idx.map(|i| field("group_idx", Value::from(i))))
        .collect(),
        KvEvent::AllBlocksCleared => vec![field("type", Value::from("AllBlocksCleared"))],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::decode_batch;

    #[test]
    fn what_is_encoded_decodes_the_same() {
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX],
                parent_block_hash: Some(7),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: None,
                lora_name: None,
                medium: Some("GPU".into()),
                group: crate::kv_events::CacheGroup::full_attention(),
                block_keys: Vec::new(),
                lookahead: Vec::new(),
            },
            // Hashed with the token after each block (vLLM 0.33's lookahead).
            KvEvent::BlockStored {
                block_hashes: vec![9],
                parent_block_hash: Some(u64::MAX),
                token_ids: vec![5, 6],
                block_size: 2,
                lora_id: None,
                lora_name: None,
                medium: Some("GPU".into()),
                group: crate::kv_events::CacheGroup::full_attention(),
                block_keys: Vec::new(),
                lookahead: vec![vec![7]],
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![1],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            },
            KvEvent::AllBlocksCleared,
        ];
        let batch = decode_batch(&encode(&events)).unwrap();
        assert_eq!(batch.events, events);
        assert_eq!(batch.data_parallel_rank, Some(0));
    }
}
