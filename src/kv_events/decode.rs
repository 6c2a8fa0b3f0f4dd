//! vLLM's KV cache events as they arrive on the wire: one msgpack `EventBatch` per message.
//!
//! vLLM encodes them with msgspec from tagged structs, and the layout has changed over releases:
//! the batch and its events were positional arrays (`array_like`, the tag first:
//! `["BlockStored", hashes, parent, ...]`), then maps (`{"type": "BlockStored", ...}`); a batch
//! seen from vLLM 0.32.0 is an array `[ts, events, dp_rank]` holding map events. Every
//! combination is read here. Trailing fields that are absent (msgspec's `omit_defaults`, or an
//! older release that did not have them) read as their defaults; unknown event types are
//! skipped and counted, so a newer vLLM does not stop the subscriber.
//!
//! A block hash is an integer in older releases and bytes (a SHA-256 digest) in newer ones; both
//! become a `u64` key (the integer itself, or the xxh3 of the bytes).
//!
//! A hybrid model (sliding-window or Mamba layers beside full attention: Gemma 3, GPT-OSS,
//! Qwen3.5, ...) keeps one KV cache group per kind of layer, and vLLM publishes each group's
//! blocks under the same block hashes, told apart by `group_idx`; stores also say the group's
//! kind (`kv_cache_spec_kind`, and a sliding window's size, from vLLM 0.32 on; removals carry
//! only the index). All are read, so that [`super::WorkerBlocks`] can tell the groups apart.

use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64;

/// Where a block lives; routing only cares about the GPU's.
pub const MEDIUM_GPU: &str = "GPU";

/// `kv_cache_spec_kind`s whose blocks decide a prefix hit: the model's full attention (plain,
/// MLA, or with attention sinks). A sliding window keeps only its last blocks and a Mamba group
/// one state, so neither says which prefixes a worker holds.
pub const FULL_ATTENTION_KINDS: &[&str] =
    &["full_attention", "mla_attention", "sink_full_attention"];

/// `kv_cache_spec_kind`s of a sliding window, whose last blocks before a hit point vLLM also
/// needs cached to reuse a prefix up to there.
pub const SLIDING_WINDOW_KINDS: &[&str] = &["sliding_window", "sliding_window_mla"];

/// The KV cache group an event belongs to: vLLM's `group_idx` and, on stores, the group's
/// `kv_cache_spec_kind` and window (`kv_cache_spec_sliding_window`, in tokens). All absent in
/// releases before hybrid models had groups.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheGroup {
    pub idx: Option<i64>,
    pub kind: Option<String>,
    pub sliding_window: Option<u32>,
}

impl CacheGroup {
    /// Group 0 of a model with full attention only, as vLLM 0.32 labels its stores.
    pub fn full_attention() -> Self {
        Self {
            idx: Some(0),
            kind: Some("full_attention".into()),
            sliding_window: None,
        }
    }

    /// The window in tokens of a sliding-window group's store; `None` for other groups (or a
    /// store that does not say its window).
    pub fn window(&self) -> Option<u32> {
        let kind = self.kind.as_deref()?;
        SLIDING_WINDOW_KINDS
            .contains(&kind)
            .then_some(self.sliding_window?)
            .filter(|&w| w > 0)
    }

    /// The group's index, with releases that did not send one counted as group 0 (they had one
    /// group).
    pub fn index(&self) -> i64 {
        self.idx.unwrap_or(0)
    }

    /// Whether a store of this group holds full-attention blocks: by its kind where it says one,
    /// else by being group 0 (a release that labels groups only by index: the first).
    pub fn is_full_attention(&self) -> bool {
        match &self.kind {
            Some(kind) => FULL_ATTENTION_KINDS.contains(&kind.as_str()),
            None => self.index() == 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        /// The LoRA adapter the blocks were computed under (vLLM's served name of it).
        lora_name: Option<String>,
        medium: Option<String>,
        group: CacheGroup,
        /// Per block, what its `extra_keys` add to its hash, as a value mixed into its parent's
        /// chain hash ([`block_key`]); empty where no block has any.
        block_keys: Vec<Option<u64>>,
        /// Per block, the tokens after it that vLLM hashed in with it (`lookahead_token_ids`,
        /// from vLLM 0.33 with EAGLE-style speculative decoding): such a block is reused only by
        /// a prompt that goes on with the same tokens. Empty when the store carries none.
        lookahead: Vec<Vec<u32>>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        /// Removals carry the index only.
        group_idx: Option<i64>,
    },
    AllBlocksCleared,
}

impl KvEvent {
    /// Whether the event concerns the GPU cache (no medium: releases before tiers existed).
    pub fn on_gpu(&self) -> bool {
        let medium = match self {
            KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } => medium,
            KvEvent::AllBlocksCleared => return true,
        };
        medium.as_deref().is_none_or(|m| m == MEDIUM_GPU)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
    /// Events of a type this decoder does not know, left out of `events`.
    pub unknown: usize,
    /// Events of a known type that could not be read, left out of `events`: the rest of the
    /// batch still applies (a step's batch carries every tier's and group's events).
    pub malformed: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("malformed event batch: {0}")]
    Shape(&'static str),
}

type Result<T> = std::result::Result<T, DecodeError>;

/// Decodes one `EventBatch` payload (the third frame of a published message).
pub fn decode_batch(mut payload: &[u8]) -> Result<EventBatch> {
    let value =
        rmpv::decode::read_value(&mut payload).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (
            field(&value, "ts"),
            field(&value, "events"),
            field(&value, "data_parallel_rank"),
        ),
        _ => return Err(DecodeError::Shape("a batch is an array or a map")),
    };
    let ts = ts
        .and_then(Value::as_f64)
        .ok_or(DecodeError::Shape("batch without a timestamp"))?;
    let list = events
        .and_then(Value::as_array)
        .ok_or(DecodeError::Shape("batch without an event list"))?;
    let mut batch = EventBatch {
        ts,
        events: Vec::with_capacity(list.len()),
        data_parallel_rank: rank.and_then(Value::as_i64),
        unknown: 0,
        malformed: 0,
    };
    for event in list {
        match decode_event(event) {
            Ok(Some(e)) => batch.events.push(e),
            Ok(None) => batch.unknown += 1,
            Err(e) => {
                tracing::debug!(error = %e, "KV event skipped");
                batch.malformed += 1;
            }
        }
    }
    Ok(batch)
}

/// The value under `key` in a msgpack map.
fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .filter(|v| !v.is_nil())
}

/// An event's fields, by name, whichever its layout.
enum Fields<'a> {
    /// After the tag, in declaration order.
    Positional(&'a [Value], &'static [&'static str]),
    Named(&'a Value),
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Positional(items, names) => {
                let at = names.iter().position(|n| *n == name)?;
                items.get(at + 1).filter(|v| !v.is_nil())
            }
            Fields::Named(map) => field(map, name),
        }
    }

    fn hashes(&self) -> Result<Vec<u64>> {
        self.get("block_hashes")
            .and_then(Value::as_array)
            .ok_or(DecodeError::Shape("event without block hashes"))?
            .iter()
            .map(block_hash)
            .collect()
    }

    fn medium(&self) -> Option<String> {
        self.get("medium")
            .and_then(Value::as_str)
            .map(str::to_owned)
    }
}

/// Field names in declaration order, as vLLM's structs declare them (0.34.0), up to the last one
/// read here (later fields, added by newer releases, are not needed for routing).
const STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
const REMOVED: &[&str] = &["block_hashes", "medium", "group_idx"];

/// One event, positional or mapped; `None` for a type this decoder does not know.
fn decode_event(value: &Value) -> Result<Option<KvEvent>> {
    let (tag, f) = match value {
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or(DecodeError::Shape("positional event without its tag"))?;
            let names = match tag {
                "BlockStored" => STORED,
                "BlockRemoved" => REMOVED,
                _ => &[],
            };
            (tag, Fields::Positional(items, names))
        }
        Value::Map(_) => (
            field(value, "type")
                .and_then(Value::as_str)
                .ok_or(DecodeError::Shape("event without a `type` tag"))?,
            Fields::Named(value),
        ),
        _ => return Err(DecodeError::Shape("an event is an array or a map")),
    };
    Ok(Some(match tag {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: f.hashes()?,
            parent_block_hash: f.get("parent_block_hash").map(block_hash).transpose()?,
            token_ids: token_ids(
                f.get("token_ids")
                    .ok_or(DecodeError::Shape("BlockStored without token ids"))?,
            )?,
            block_size: f
                .get("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                // 0 in the placeholder stores of vLLM's offloading tiers, which carry no tokens.
                .ok_or(DecodeError::Shape("BlockStored without a block size"))?,
            lora_id: f.get("lora_id").and_then(Value::as_i64),
            lora_name: f
                .get("lora_name")
                .and_then(Value::as_str)
                .map(str::to_owned),
            medium: f.medium(),
            block_keys: block_keys(&f),
            group: CacheGroup {
                idx: f.get("group_idx").and_then(Value::as_i64),
                kind: f
                    .get("kv_cache_spec_kind")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                sliding_window: f
                    .get("kv_cache_spec_sliding_window")
                    .and_then(Value::as_u64)
                    .and_then(|w| u32::try_from(w).ok()),
            },
            lookahead: match f.get("lookahead_token_ids") {
                None => Vec::new(),
                Some(v) => v
                    .as_array()
                    .ok_or(DecodeError::Shape("lookahead token ids are not a list"))?
                    .iter()
                    .map(token_ids)
                    .collect::<Result<_>>()?,
            },
        },
        "BlockRemoved" => KvEvent::BlockRemoved {
            block_hashes: f.hashes()?,
            medium: f.medium(),
            group_idx: f.get("group_idx").and_then(Value::as_i64),
        },
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        _ => return Ok(None),
    }))
}

/// A list of token ids.
fn token_ids(v: &Value) -> Result<Vec<u32>> {
    v.as_array()
        .ok_or(DecodeError::Shape("token ids are not a list"))?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or(DecodeError::Shape("a token id is not a u32"))
        })
        .collect()
}

/// Each block's key from a store's `extra_keys` (one entry per block, `nil` for plain text) and
/// its LoRA adapter: a prompt's first block under an adapter starts from the adapter's root
/// ([`super::adapter_root`]), as vLLM hashes the adapter into every block (the blocks after it
/// chain from it, so they need no key of their own). Empty where no block has a key.
fn block_keys(f: &Fields) -> Vec<Option<u64>> {
    let lora = f.get("lora_name").and_then(Value::as_str);
    let entries = f.get("extra_keys").and_then(Value::as_array);
    if lora.is_none() && entries.is_none_or(|e| e.iter().all(Value::is_nil)) {
        return Vec::new(); // plain text, the common store: nothing to key
    }
    let starts = f.get("parent_block_hash").is_none();
    let blocks = f
        .get("block_hashes")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let keys: Vec<Option<u64>> = (0..blocks)
        .map(|i| {
            let own = entries
                .and_then(|e| e.get(i))
                .and_then(Value::as_array)
                .and_then(|keys| block_key(keys, lora));
            match lora {
                Some(name) if i == 0 && starts => Some(super::adapter_root(
                    name.as_bytes(),
                    own.unwrap_or(super::ROOT),
                )),
                _ => own,
            }
        })
        .collect();
    if keys.iter().all(Option::is_none) {
        Vec::new()
    } else {
        keys
    }
}

/// What one block's extra keys add to its hash, as vLLM 0.32 publishes them (untagged, in the
/// order LoRA name, `(image id, offset)` pairs, cache salt, prompt-embedding digests): the
/// LoRA name is left out (the adapter keys the prompt's root instead, see `block_keys`); a
/// lone string left is the request's `cache_salt`, which a request naming the same salt
/// reproduces ([`super::salted_root`]); anything else (an image, an embedding) gets a key that no
/// text request makes, so its blocks and those after it never match one. `None`: the block is
/// plain text.
pub fn block_key(keys: &[Value], lora_name: Option<&str>) -> Option<u64> {
    let keys = match (keys.first().and_then(Value::as_str), lora_name) {
        (Some(first), Some(lora)) if first == lora => &keys[1..],
        _ => keys,
    };
    match keys {
        [] => None,
        [Value::String(s)] => Some(super::salted_root(s.as_bytes())),
        other => {
            let mut bytes = Vec::new();
            for k in other {
                // Writing to a Vec cannot fail.
                let _ = rmpv::encode::write_value(&mut bytes, k);
            }
            Some(xxh3_64(&bytes) | 1)
        }
    }
}

/// A block hash as a `u64`: integers as they are (negative ones by their bits), bytes hashed.
fn block_hash(v: &Value) -> Result<u64> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or(DecodeError::Shape("block hash out of range")),
        Value::Binary(b) => Ok(xxh3_64(b)),
        _ => Err(DecodeError::Shape("a block hash is an integer or bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(&[0xc1]).is_err());
        assert!(decode_batch(&encode(&Value::from(3))).is_err());
        let not_a_list = Value::Array(vec![Value::F64(1.0), Value::from(3)]);
        assert!(decode_batch(&encode(&not_a_list)).is_err());
    }

    /// One event that cannot be read is skipped and counted; the batch's others still apply,
    /// since a step's batch carries every cache group's and tier's events together.
    #[test]
    fn a_malformed_event_is_skipped_and_the_rest_of_its_batch_kept() {
        let batch = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                Value::Array(vec![Value::from("BlockStored")]),
                Value::from(7),
                Value::Array(vec![Value::from("AllBlocksCleared")]),
            ]),
        ]);
        let b = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);
        assert_eq!((b.malformed, b.unknown), (2, 0));
    }

    #[test]
    fn unknown_event_types_are_counted_and_skipped() {
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                Value::Array(vec![Value::from("SomethingNew"), Value::from(1)]),
                Value::Array(vec![Value::from("AllBlocksCleared")]),
            ]),
        ]);
        let b = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);
        assert_eq!(b.unknown, 1);
        assert_eq!(b.data_parallel_rank, None);
    }

    #[test]
    fn positional_events_carry_their_cache_group_where_vllm_put_it() {
        // Tag, then the fields in vLLM's declaration order: `group_idx` is the ninth field of a
        // store and the third of a removal, the kind the tenth of a store.
        let mut store = vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::from(5)]),
            Value::Nil,
            Value::Array(vec![Value::from(1), Value::from(2)]),
            Value::from(2),
            Value::Nil,
            Value::from("GPU"),
            Value::Nil,
            Value::Nil,
            Value::from(1),
            Value::from("sliding_window"),
            Value::from(1024),
        ];
        let removal = Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(vec![Value::from(5)]),
            Value::from("GPU"),
            Value::from(1),
        ]);
        let batch = |store: Vec<Value>| {
            let v = Value::Array(vec![
                Value::F64(1.0),
                Value::Array(vec![Value::Array(store), removal.clone()]),
            ]);
            decode_batch(&encode(&v)).unwrap().events
        };
        let events = batch(store.clone());
        let KvEvent::BlockStored { group, .. } = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(
            *group,
            CacheGroup {
                idx: Some(1),
                kind: Some("sliding_window".into()),
                sliding_window: Some(1024),
            }
        );
        assert_eq!(group.window(), Some(1024));
        assert!(!group.is_full_attention());
        assert!(matches!(
            events[1],
            KvEvent::BlockRemoved {
                group_idx: Some(1),
                ..
            }
        ));
        // Past the window: locality, ownership, session, then the lookahead tokens (0.33).
        let mut ahead = store.clone();
        ahead.extend([Value::Nil, Value::Nil, Value::from("s")]);
        ahead.push(Value::Array(vec![Value::Array(vec![Value::from(3)])]));
        let KvEvent::BlockStored { lookahead, .. } = &batch(ahead)[0] else {
            panic!()
        };
        assert_eq!(lookahead, &vec![vec![3]]);
        // An older release's store ends at `medium`: group 0, full attention by default.
        store.truncate(7);
        let KvEvent::BlockStored { group, .. } = &batch(store)[0] else {
            panic!()
        };
        assert_eq!(*group, CacheGroup::default());
        assert!(group.is_full_attention());
    }

    #[test]
    fn a_blocks_extra_keys_key_it_by_salt_or_beyond_any_text_request() {
        let s = |x: &str| Value::from(x);
        assert_eq!(block_key(&[], None), None);
        assert_eq!(
            block_key(&[s("lora-a")], Some("lora-a")),
            None,
            "the adapter"
        );
        let salted = Some(super::super::salted_root(b"t1"));
        assert_eq!(block_key(&[s("t1")], None), salted);
        assert_eq!(block_key(&[s("lora-a"), s("t1")], Some("lora-a")), salted);
        // A LoRA name the event does not name is not stripped: not the salt's key.
        assert_ne!(block_key(&[s("lora-a"), s("t1")], None), salted);
        let image = Value::Array(vec![s("img"), Value::from(0)]);
        let k = block_key(std::slice::from_ref(&image), None);
        assert!(k.is_some() && k != salted && k != Some(0));
        let other = Value::Array(vec![s("img2"), Value::from(0)]);
        assert_ne!(k, block_key(&[other], None), "images apart");
    }

    #[test]
    fn full_attention_is_told_by_kind_and_without_one_by_being_group_0() {
        let g = |idx: Option<i64>, kind: Option<&str>| CacheGroup {
            idx,
            kind: kind.map(str::to_owned),
            sliding_window: None,
        };
        for kind in FULL_ATTENTION_KINDS {
            assert!(g(Some(2), Some(kind)).is_full_attention(), "{kind}");
        }
        for kind in [
            "sliding_window",
            "sliding_window_mla",
            "mamba",
            "chunked_local_attention",
            "new_kind",
        ] {
            assert!(!g(Some(0), Some(kind)).is_full_attention(), "{kind}");
        }
        assert!(g(None, None).is_full_attention());
        assert!(g(Some(0), None).is_full_attention());
        assert!(!g(Some(1), None).is_full_attention());
    }
}
