//! vLLM's KV cache events: batches encoded by msgspec (the encoder vLLM uses) from structs
//! declared as vLLM declares them decode in every layout vLLM has used, and a feed follows a
//! publisher that speaks vLLM's ZMQ protocol (pyzmq PUB + ROUTER replay): gaps are filled from
//! the replay socket, or the blocks dropped when they cannot be; a restarted worker's blocks go.
//!
//! The Python side (`tests/kv_events/vllm_events.py`) needs `msgspec` and `pyzmq`; when the
//! system's `python3` lacks them they are installed once into a virtualenv under `target/`.

mod common;

use std::{
    io::{BufRead, BufReader, Write},
    path::PathBuf,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::{atomic::Ordering, Arc, OnceLock},
    time::Duration,
};

use kvroute::kv_events::{
    chain, decode_batch, follow, CacheGroup, EventSource, Feed, KvEvent, WorkerBlocks, ROOT,
};
use kvroute::tokenize::block_chain;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use xxhash_rust::xxh3::xxh3_64;

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/kv_events/vllm_events.py"
);

/// A Python with msgspec and pyzmq.
fn python() -> &'static PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let has = |py: &str| {
            Command::new(py)
                .args(["-c", "import msgspec, zmq"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if has("python3") {
            return PathBuf::from("python3");
        }
        let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kv-events-venv");
        let py = venv.join("bin/python");
        if !has(py.to_str().unwrap()) {
            let ok = Command::new("python3")
                .args(["-m", "venv"])
                .arg(&venv)
                .status()
                .is_ok_and(|s| s.success())
                && Command::new(&py)
                    .args(["-m", "pip", "install", "--quiet", "msgspec", "pyzmq"])
                    .status()
                    .is_ok_and(|s| s.success());
            assert!(ok, "could not install msgspec and pyzmq into {venv:?}");
        }
        py
    })
}

/// The Python side, driven one JSON command per line.
struct Py {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Py {
    fn start(args: &[&str]) -> (Self, Value) {
        let mut child = Command::new(python())
            .arg(SCRIPT)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut py = Py {
            child,
            stdin,
            stdout,
        };
        let first = if args[0] == "publish" {
            py.read()
        } else {
            Value::Null
        };
        (py, first)
    }

    fn read(&mut self) -> Value {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    fn ask(&mut self, cmd: Value) -> Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.read()
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
    json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
           "token_ids": tokens, "block_size": 2})
}

/// The key the gateway gives a hash of the given layout: the map layouts carry bytes.
fn key(layout: &str, h: u64) -> u64 {
    if layout == "array" {
        h
    } else {
        let mut b = [0u8; 32];
        b[24..].copy_from_slice(&h.to_be_bytes());
        xxh3_64(&b)
    }
}

#[test]
fn msgspec_encoded_batches_decode_in_every_layout() {
    let (mut py, _) = Py::start(&["encode"]);
    for layout in ["array", "map", "mixed"] {
        let spec = json!({"layout": layout, "events": [
            stored(&[5, 6], None, &[1, 2, 3, 4]),
            stored(&[7], Some(6), &[70_000, 8]),
            {"type": "BlockRemoved", "block_hashes": [5]},
            {"type": "AllBlocksCleared"},
        ]});
        let answer = py.ask(json!({ "encode": spec }));
        let hex = answer["payload"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let batch = decode_batch(&bytes).unwrap_or_else(|e| panic!("{layout}: {e}"));
        assert!(batch.ts > 1.0e9, "{layout}: a wall-clock timestamp");
        assert_eq!(batch.unknown, 0);
        assert_eq!(
            batch.data_parallel_rank,
            (layout != "array").then_some(0),
            "{layout}"
        );
        let k = |h| key(layout, h);
        // The positional layout predates cache groups; vLLM 0.32's stores name theirs.
        let (group, group_idx) = if layout == "array" {
            (CacheGroup::default(), None)
        } else {
            (CacheGroup::full_attention(), Some(0))
        };
        assert_eq!(
            batch.events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![k(5), k(6)],
                    parent_block_hash: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora_id: None,
                    lora_name: None,
                    medium: Some("GPU".into()),
                    group: group.clone(),
                    block_keys: Vec::new(),
                    lookahead: Vec::new(),
                },
                KvEvent::BlockStored {
                    block_hashes: vec![k(7)],
                    parent_block_hash: Some(k(6)),
                    token_ids: vec![70_000, 8],
                    block_size: 2,
                    lora_id: None,
                    lora_name: None,
                    medium: Some("GPU".into()),
                    group: group.clone(),
                    block_keys: Vec::new(),
                    lookahead: Vec::new(),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![k(5)],
                    medium: Some("GPU".into()),
                    group_idx,
                },
                KvEvent::AllBlocksCleared,
            ],
            "{layout}"
        );
    }
}

/// A hybrid model's worker in the shape vLLM 0.32 publishes Gemma 3's (seen from a CPU vLLM
/// serving a two-layer Gemma 3): its sliding-window group (0, a window of 4 tokens here, so a
/// hit needs the 2 blocks before it) stores only the last blocks of a prompt, before the
/// full-attention group (1) stores them all, under the same hashes; encoded by msgspec from
/// vLLM 0.32's structs. A prefix counts as far as vLLM would reuse it: to where the window's
/// blocks are held too.
#[test]
fn a_hybrid_models_sliding_window_group_limits_the_prefix_as_vllm_does() {
    let (mut py, _) = Py::start(&["encode"]);
    let mut blocks = WorkerBlocks::new(100);
    let mut apply = |blocks: &mut WorkerBlocks, events: Value| {
        let answer = py.ask(json!({"encode": {"layout": "mixed", "events": events}}));
        for e in decode_batch(&unhex(answer["payload"].as_str().unwrap()))
            .unwrap()
            .events
        {
            blocks.apply(&e);
        }
    };
    let in_group = |mut e: Value, idx: u64, kind: &str| {
        e["group_idx"] = json!(idx);
        if e["type"] == "BlockStored" {
            e["kind"] = json!(kind);
            if kind == "sliding_window" {
                e["sliding_window"] = json!(4);
            }
        }
        e
    };
    let removed = |h: u64| json!({"type": "BlockRemoved", "block_hashes": [h]});
    let prompt = [1, 2, 3, 4, 5, 6];
    apply(
        &mut blocks,
        json!([
            in_group(stored(&[6, 7], None, &prompt), 0, "sliding_window"),
            in_group(stored(&[5, 6, 7], None, &prompt), 1, "full_attention"),
        ]),
    );
    let a = chain(ROOT, &[1, 2]);
    let b = chain(a, &[3, 4]);
    let c = chain(b, &[5, 6]);
    assert_eq!(blocks.prefix_depth(&[a, b, c]), 3, "the prompt itself");
    let other = chain(b, &[9, 9]);
    assert_eq!(
        blocks.prefix_depth(&[a, b, other]),
        0,
        "its first two blocks under another ending: vLLM reuses none"
    );
    assert_eq!((blocks.len(), blocks.other_groups), (3, 0));
    // A Mamba group's events are not modelled: counted and left out.
    apply(
        &mut blocks,
        json!([in_group(stored(&[8], None, &[1, 2]), 2, "mamba")]),
    );
    assert_eq!(blocks.other_groups, 1);
    // The window's group evicts the prompt's last block: nothing of it is reusable, though
    // full attention holds every block.
    apply(
        &mut blocks,
        json!([in_group(removed(7), 0, "sliding_window")]),
    );
    assert_eq!((blocks.prefix_depth(&[a, b, c]), blocks.len()), (0, 3));
    apply(
        &mut blocks,
        json!([in_group(removed(7), 1, "full_attention")]),
    );
    assert_eq!(blocks.len(), 2);
}

/// A store's extra keys, as vLLM 0.32 publishes them, are in the block's hash as they are in
/// vLLM's: a salted prompt is held for requests with the same salt only, an adapter's blocks for
/// requests for that adapter, and a block with an image (and the blocks after it) for no text
/// request.
#[test]
fn extra_keys_decoded_from_msgspec_key_blocks_as_vllm_does() {
    use kvroute::kv_events::{adapter_root, salted_root};
    use kvroute::tokenize::block_chain_from;
    let (mut py, _) = Py::start(&["encode"]);
    let mut blocks = WorkerBlocks::new(100);
    let mut keyed = |hashes: &[u64], tokens: &[u32], keys: Value, lora: Value| {
        let mut e = stored(hashes, None, tokens);
        e["extra_keys"] = keys;
        e["lora_name"] = lora;
        let answer = py.ask(json!({"encode": {"layout": "map", "events": [e]}}));
        for e in decode_batch(&unhex(answer["payload"].as_str().unwrap()))
            .unwrap()
            .events
        {
            blocks.apply(&e);
        }
    };
    // Salted: the salt on the first block only, as vLLM keys it; under an adapter, its name
    // first on every block.
    keyed(
        &[1, 2],
        &[1, 2, 3, 4],
        json!([["tenant-a"], null]),
        json!(null),
    );
    keyed(
        &[3, 4],
        &[5, 6, 7, 8],
        json!([["my-adapter", "tenant-b"], ["my-adapter"]]),
        json!("my-adapter"),
    );
    // An image in the second block.
    keyed(
        &[5, 6],
        &[9, 9, 9, 9],
        json!([null, [["img-1", 0]]]),
        json!(null),
    );
    let held = |root: u64, tokens: &[u32]| blocks.prefix_depth(&block_chain_from(root, tokens, 2));
    assert_eq!(held(salted_root(b"tenant-a"), &[1, 2, 3, 4]), 2);
    assert_eq!(held(ROOT, &[1, 2, 3, 4]), 0, "unsalted");
    assert_eq!(
        held(salted_root(b"tenant-b"), &[1, 2, 3, 4]),
        0,
        "another salt"
    );
    // Under the adapter, from the adapter's root (salted here): not the base model's blocks.
    assert_eq!(
        held(salted_root(b"tenant-b"), &[5, 6, 7, 8]),
        0,
        "the base model's"
    );
    assert_eq!(
        held(
            adapter_root(b"my-adapter", salted_root(b"tenant-b")),
            &[5, 6, 7, 8]
        ),
        2
    );
    assert!(blocks.adapters.contains("my-adapter"));
    assert_eq!(held(ROOT, &[9, 9, 9, 9]), 1, "up to the image");
}

/// vLLM 0.33 added `lookahead_token_ids` to its stores: with EAGLE-style speculative decoding
/// each block's hash covers the token after it, so vLLM reuses a block only for a prompt that
/// goes on with that token. Encoded by msgspec from 0.34.0's struct, in both layouts that carry
/// map events, the tokens are read and a prompt's blocks count only as far as vLLM would reuse
/// them.
#[test]
fn lookahead_tokens_decoded_from_msgspec_limit_a_prefix_as_vllm_reuses_it() {
    let (mut py, _) = Py::start(&["encode"]);
    for layout in ["map", "mixed"] {
        let mut e = stored(&[1, 2], None, &[1, 2, 3, 4]);
        e["lookahead_token_ids"] = json!([[3], [5]]);
        let answer = py.ask(json!({"encode": {"layout": layout, "events": [e]}}));
        let batch = decode_batch(&unhex(answer["payload"].as_str().unwrap())).unwrap();
        assert_eq!(batch.malformed + batch.unknown, 0, "{layout}");
        let KvEvent::BlockStored { lookahead, .. } = &batch.events[0] else {
            panic!("{layout}: {:?}", batch.events);
        };
        assert_eq!(lookahead, &vec![vec![3], vec![5]], "{layout}");
        let mut blocks = WorkerBlocks::new(100);
        blocks.apply(&batch.events[0]);
        let depth =
            |tokens: &[u32]| blocks.reusable_depth(&block_chain(tokens, 2), tokens, 2, false);
        assert_eq!(depth(&[1, 2, 3, 4, 5, 6]), 2, "{layout}");
        assert_eq!(
            depth(&[1, 2, 3, 4, 6, 5]),
            1,
            "{layout}: goes on with another token"
        );
        assert_eq!(depth(&[1, 2, 3, 4]), 1, "{layout}: ends after the block");
    }
}

/// vLLM 0.32's offloading tiers publish in the same step's batch as the GPU's, some of their
/// stores placeholders (no tokens, block size 0, medium `CPU`): they are read and left out, and
/// the GPU's blocks of that batch still count.
#[test]
fn an_offloading_tiers_placeholder_does_not_cost_the_batchs_gpu_blocks() {
    let (mut py, _) = Py::start(&["encode"]);
    let mut placeholder = stored(&[9], None, &[]);
    placeholder["block_size"] = json!(0);
    placeholder["medium"] = json!("CPU");
    let answer = py.ask(json!({"encode": {"layout": "mixed", "events": [
        stored(&[5], None, &[1, 2]),
        placeholder,
        stored(&[6], Some(5), &[3, 4]),
    ]}}));
    let batch = decode_batch(&unhex(answer["payload"].as_str().unwrap())).unwrap();
    assert_eq!(
        (batch.events.len(), batch.malformed, batch.unknown),
        (3, 0, 0)
    );
    let mut blocks = WorkerBlocks::new(100);
    for e in &batch.events {
        blocks.apply(e);
    }
    let a = chain(ROOT, &[1, 2]);
    assert_eq!(blocks.prefix_depth(&[a, chain(a, &[3, 4])]), 2);
    assert_eq!(blocks.len(), 2);
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

/// Starts a feed on the publisher and waits until it has seen a heartbeat: connected.
async fn connected_feed(first: &Value) -> (Arc<Feed>, CancellationToken) {
    let source = EventSource {
        endpoint: format!("tcp://127.0.0.1:{}", first["port"]),
        replay: first["replay_port"]
            .as_u64()
            .map(|p| format!("tcp://127.0.0.1:{p}")),
    };
    let feed = Arc::new(Feed::new(10_000));
    let stop = CancellationToken::new();
    tokio::spawn({
        let (feed, stop) = (Arc::clone(&feed), stop.clone());
        async move { follow(source, &feed, stop).await }
    });
    eventually(|| feed.stats.batches.load(Ordering::Relaxed) > 0).await;
    (feed, stop)
}

async fn eventually(mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not met within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn publish(py: &mut Py, event: Value, live: bool) {
    py.ask(json!({"publish": {"layout": "mixed", "events": [event]}, "live": live}));
}

#[tokio::test]
async fn a_gap_is_filled_from_the_replay_socket() {
    let (mut py, first) = Py::start(&["publish", "--replay"]);
    let (feed, stop) = connected_feed(&first).await;
    let (a, b) = (chain(ROOT, &[1, 2]), chain(chain(ROOT, &[1, 2]), &[3, 4]));
    let c = chain(b, &[5, 6]);
    let d = chain(c, &[7, 8]);
    publish(&mut py, stored(&[11, 12], None, &[1, 2, 3, 4]), true);
    // Kept for replay but never sent live: the feed sees the next one's sequence jump.
    publish(&mut py, stored(&[13], Some(12), &[5, 6]), false);
    publish(&mut py, stored(&[14], Some(13), &[7, 8]), true);
    eventually(|| feed.blocks().prefix_depth(&[a, b, c, d]) == 4).await;
    let s = &feed.stats;
    assert_eq!(s.gaps.load(Ordering::Relaxed), 1);
    assert_eq!(s.replays_ok.load(Ordering::Relaxed), 1);
    assert_eq!(s.replays_failed.load(Ordering::Relaxed), 0);
    assert_eq!(feed.blocks().skipped, 0);
    stop.cancel();
}

/// A feed that joins a publisher after it has sent blocks (a gateway started after its workers,
/// a new replica) catches up from the replay socket instead of knowing only what comes next.
#[tokio::test]
async fn a_late_subscriber_catches_up_from_the_replay_socket() {
    let (mut py, first) = Py::start(&["publish", "--replay"]);
    // Published before anyone subscribed: gone from the wire, kept in the replay buffer.
    publish(&mut py, stored(&[11, 12], None, &[1, 2, 3, 4]), true);
    publish(&mut py, stored(&[13], Some(12), &[5, 6]), true);
    let (feed, stop) = connected_feed(&first).await;
    let a = chain(ROOT, &[1, 2]);
    let b = chain(a, &[3, 4]);
    let c = chain(b, &[5, 6]);
    eventually(|| feed.blocks().prefix_depth(&[a, b, c]) == 3).await;
    assert!(feed.stats.caught_up.load(Ordering::Relaxed) >= 2);
    assert_eq!(feed.stats.gaps.load(Ordering::Relaxed), 0);
    stop.cancel();
}

#[tokio::test]
async fn without_replay_a_gap_drops_the_blocks_and_a_restart_clears_them() {
    let (mut py, first) = Py::start(&["publish"]);
    let (feed, stop) = connected_feed(&first).await;
    let a = chain(ROOT, &[1, 2]);
    publish(&mut py, stored(&[11], None, &[1, 2]), true);
    eventually(|| feed.blocks().holds(a)).await;
    publish(&mut py, stored(&[12], Some(11), &[3, 4]), false);
    publish(&mut py, stored(&[13], Some(12), &[5, 6]), true);
    eventually(|| feed.stats.replays_failed.load(Ordering::Relaxed) == 1).await;
    // The state was unknown: dropped; the block whose parent was lost could not be placed.
    assert!(feed.blocks().is_empty());
    assert_eq!(feed.blocks().skipped, 1);
    let x = chain(ROOT, &[9, 9]);
    publish(&mut py, stored(&[21], None, &[9, 9]), true);
    eventually(|| feed.blocks().holds(x)).await;
    // The worker restarts: its sequence starts over, and its cache is empty.
    py.ask(json!({"restart": true}));
    eventually(|| feed.stats.restarts.load(Ordering::Relaxed) == 1).await;
    let y = chain(ROOT, &[4, 4]);
    publish(&mut py, stored(&[31], None, &[4, 4]), true);
    eventually(|| feed.blocks().holds(y)).await;
    assert!(
        !feed.blocks().holds(x),
        "the restarted worker's old blocks are gone"
    );
    stop.cancel();
}

#[tokio::test]
async fn the_gateway_follows_each_workers_events_and_exports_them() {
    use common::{config_for, gateway, metric, metrics_text, upstream};
    let (mut py, first) = Py::start(&["publish", "--replay"]);
    let up = upstream("w0", &[]).await;
    let mut cfg = config_for(&[&up], "round_robin");
    cfg.workers[0].kv_events = Some(format!("tcp://127.0.0.1:{}", first["port"]));
    cfg.workers[0].kv_events_replay = Some(format!("tcp://127.0.0.1:{}", first["replay_port"]));
    let gw = gateway(cfg).await;
    let series = |name: &str| format!("{name}{{worker=\"w0\"}}");
    // Connected once the heartbeats are counted.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metric(
        &metrics_text(gw.addr).await,
        &series("kvroute_kv_event_batches_total"),
    )
    .unwrap_or(0.0)
        == 0.0
    {
        assert!(tokio::time::Instant::now() < deadline, "no events counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    publish(&mut py, stored(&[11, 12], None, &[1, 2, 3, 4]), true);
    publish(&mut py, stored(&[13], Some(12), &[5, 6]), false);
    publish(&mut py, stored(&[14], Some(13), &[7, 8]), true);
    let blocks = common::wait_metric(
        gw.addr,
        &series("kvroute_kv_event_blocks"),
        4.0,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(blocks, Some(4.0));
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(
            &m,
            r#"kvroute_kv_event_gaps_total{result="replayed",worker="w0"}"#
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, &series("kvroute_kv_event_errors_total")),
        Some(0.0)
    );
    // A sliding-window group's store of the same blocks is counted apart and changes nothing.
    let mut window = stored(&[15], Some(14), &[9, 9]);
    window["group_idx"] = json!(1);
    window["kind"] = json!("sliding_window");
    publish(&mut py, window, true);
    let other = common::wait_metric(
        gw.addr,
        &series("kvroute_kv_event_other_group_events_total"),
        1.0,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(other, Some(1.0));
    let m = metrics_text(gw.addr).await;
    assert_eq!(metric(&m, &series("kvroute_kv_event_blocks")), Some(4.0));
}

#[test]
fn the_simulators_batches_decode_with_vllms_msgspec_structs() {
    let events = vec![
        KvEvent::BlockStored {
            block_hashes: vec![3, u64::MAX],
            parent_block_hash: Some(9),
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            group: CacheGroup::full_attention(),
            block_keys: Vec::new(),
            lookahead: Vec::new(),
        },
        // A worker hashing each block with the token after it (`hash_lookahead`).
        KvEvent::BlockStored {
            block_hashes: vec![5],
            parent_block_hash: Some(u64::MAX),
            token_ids: vec![5, 6],
            block_size: 2,
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            group: CacheGroup::full_attention(),
            block_keys: Vec::new(),
            lookahead: vec![vec![7]],
        },
        KvEvent::BlockRemoved {
            block_hashes: vec![3],
            medium: Some("GPU".into()),
            group_idx: Some(0),
        },
        KvEvent::AllBlocksCleared,
    ];
    let hex: String = kvroute::sim::events::encode(&events)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let (mut py, _) = Py::start(&["encode"]);
    let got = py.ask(json!({ "decode": hex }));
    assert!(got.get("error").is_none(), "{got}");
    assert_eq!(got["dp_rank"], 0);
    assert_eq!(
        got["events"],
        json!([
            {"type": "BlockStored", "block_hashes": [3, u64::MAX], "parent_block_hash": 9,
             "token_ids": [1, 2, 3, 4], "block_size": 2, "medium": "GPU",
             "extra_keys": [null, null], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
            {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": u64::MAX,
             "token_ids": [5, 6], "block_size": 2, "medium": "GPU", "extra_keys": [null],
             "group_idx": 0, "kv_cache_spec_kind": "full_attention", "lookahead_token_ids": [[7]]},
            {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ])
    );
}

/// Simulated workers, stopped with the token.
use common::start_sims;

#[tokio::test]
async fn a_simulated_worker_publishes_the_blocks_it_caches_and_their_clearing() {
    let cfg = kvroute::sim::SimConfig {
        workers: 1,
        port: 0,
        time_scale: 50.0,
        kv_events: true,
        ..Default::default()
    };
    let (sims, cancel, _tasks) = start_sims(&cfg).await;
    let worker = sims[0].addr;
    let source = sims[0].kv_events.clone().expect("event endpoints");
    let feed = Arc::new(Feed::new(100_000));
    tokio::spawn({
        let (feed, stop) = (Arc::clone(&feed), cancel.clone());
        async move { follow(source, &feed, stop).await }
    });
    let complete = |prompt: String| async move {
        let body = json!({"prompt": prompt, "max_tokens": 1}).to_string();
        let r = common::request(worker, "POST", "/v1/completions", body.as_bytes()).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    };
    // A SUB socket misses what is published before it joined: prompt until batches arrive.
    let mut k = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while feed.stats.batches.load(Ordering::Relaxed) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no events");
        // Long enough to fill blocks: a prompt shorter than a block publishes nothing.
        complete(format!("warm-up prompt number {k} ").repeat(20)).await;
        k += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let prompt = (0..120)
        .map(|i| format!("word{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let t = common::request(
        worker,
        "POST",
        "/tokenize",
        json!({ "prompt": prompt }).to_string().as_bytes(),
    )
    .await;
    let tokens = common::token_ids(&t);
    let chained = block_chain(&tokens, kvroute::sim::kv::DEFAULT_BLOCK_SIZE);
    assert!(chained.len() >= 4, "{} tokens", tokens.len());
    complete(prompt).await;
    eventually(|| feed.blocks().prefix_depth(&chained) == chained.len()).await;
    let r = common::request(worker, "POST", "/reset_prefix_cache", b"").await;
    assert_eq!(r.status, 200);
    complete("after the reset ".repeat(20)).await;
    eventually(|| feed.blocks().prefix_depth(&chained) == 0).await;
    assert_eq!(feed.stats.decode_errors.load(Ordering::Relaxed), 0);
    assert_eq!(feed.stats.gaps.load(Ordering::Relaxed), 0);
    cancel.cancel();
}

fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(p)
}

/// A `cache_aware` gateway in front of `sims` (named `w0`, `w1`, ...), following each one's KV
/// events and tokenizing `model`'s requests with the given files; no load polling.
fn followed_with_tokenizer(
    sims: &[kvroute::sim::SimWorker],
    model: &str,
    tokenizer_json: PathBuf,
    tokenizer_config: PathBuf,
) -> kvroute::config::Config {
    let mut config = kvroute::config::Config {
        workers: sims
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let src = s.kv_events.clone().unwrap();
                kvroute::config::WorkerConfig {
                    name: Some(format!("w{i}")),
                    kv_events: Some(src.endpoint),
                    kv_events_replay: src.replay,
                    ..kvroute::config::WorkerConfig::from_url(format!("http://{}", s.addr))
                }
            })
            .collect(),
        tokenizers: vec![kvroute::config::TokenizerConfig {
            model: model.to_owned(),
            tokenizer_json,
            tokenizer_config: Some(tokenizer_config),
            chat_template: None,
            default_chat_template_kwargs: Default::default(),
        }],
        ..kvroute::config::Config::default()
    }
    .with_overrides(kvroute::config::Overrides {
        policy: Some("cache_aware".into()),
        ..Default::default()
    })
    .unwrap();
    config.load_signals.interval_seconds = 0.0;
    config
}

/// Simulated workers that tokenize with a model's tokenizer.json publish blocks of that model's
/// token ids; a gateway tokenizing with the same files finds a conversation that another client
/// served on worker 1 (behind the gateway's back) and routes its next turn there, predicting the
/// cached tokens the worker then reports.
#[tokio::test]
async fn a_simulated_worker_with_a_models_tokenizer_is_routed_to_by_its_events() {
    use common::{gateway, metric, metrics_text, request};
    let (tokenizer_json, tokenizer_config) = (
        repo("tests/tokenize/tiny-tokenizer.json"),
        repo("tests/vllm/model/tokenizer_config.json"),
    );
    let cfg = kvroute::sim::SimConfig {
        workers: 2,
        port: 0,
        time_scale: 50.0,
        kv_events: true,
        tokenizer: Some(tokenizer_json.clone()),
        tokenizer_config: Some(tokenizer_config.clone()),
        ..Default::default()
    };
    let (sims, cancel, _tasks) = start_sims(&cfg).await;
    let model = cfg.engine_params().unwrap().model;
    let messages = |turns: usize| {
        let mut m = vec![json!({"role": "system", "content": "You route requests. ".repeat(30)})];
        for t in 0..turns {
            m.push(json!({"role": "user", "content": format!("Question {t}: where is my cache? ").repeat(12)}));
            m.push(
                json!({"role": "assistant", "content": format!("Answer {t} is here. ").repeat(8)}),
            );
        }
        m.push(json!({"role": "user", "content": "And now?"}));
        Value::from(m)
    };
    // The worker tokenizes as the gateway's tokenizer does (the model's files, encoded whole).
    let ours =
        kvroute::tokenize::ModelTokenizer::load(&tokenizer_json, Some(&tokenizer_config)).unwrap();
    let t = request(
        sims[1].addr,
        "POST",
        "/tokenize",
        json!({ "messages": messages(2) }).to_string().as_bytes(),
    )
    .await;
    assert_eq!(common::token_ids(&t), ours.chat(&messages(2)).unwrap());

    let config = followed_with_tokenizer(&sims, &model, tokenizer_json, tokenizer_config);
    let gw = gateway(config).await;
    let chat = |addr: std::net::SocketAddr, messages: Value| {
        let body = json!({"model": model, "messages": messages, "max_tokens": 2});
        async move {
            request(
                addr,
                "POST",
                "/v1/chat/completions",
                body.to_string().as_bytes(),
            )
            .await
        }
    };
    // The feeds join late (ZMQ): prompt both workers directly until each has a batch counted.
    let batches = |m: &str, w: &str| {
        metric(
            m,
            &format!("kvroute_kv_event_batches_total{{worker=\"{w}\"}}"),
        )
        .unwrap_or(0.0)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for k in 0.. {
        let m = metrics_text(gw.addr).await;
        if batches(&m, "w0") > 0.0 && batches(&m, "w1") > 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "feeds never joined: {m}"
        );
        for s in &sims {
            let warm = json!([{"role": "user", "content": format!("warm-up {k} ").repeat(40)}]);
            assert_eq!(chat(s.addr, warm).await.status, 200);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Two turns of a conversation served by worker 1 directly.
    let direct = chat(sims[1].addr, messages(2)).await;
    assert_eq!(direct.status, 200);
    let held = |m: &str| metric(m, "kvroute_kv_event_blocks{worker=\"w1\"}").unwrap_or(0.0);
    let want = direct.json()["usage"]["prompt_tokens"].as_u64().unwrap() as f64
        / kvroute::sim::kv::DEFAULT_BLOCK_SIZE as f64;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while held(&metrics_text(gw.addr).await) < want.floor() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker 1's blocks never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its third turn through the gateway, which never saw the first two.
    let r = chat(gw.addr, messages(3)).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-kvroute-worker"), Some("w1"));
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let m = metrics_text(gw.addr).await;
    assert_eq!(
        metric(
            &m,
            r#"kvroute_routing_decisions_total{arm="cache_aware",outcome="exact_match",policy="cache_aware"}"#
        ),
        Some(1.0),
        "{m}"
    );
    let predicted = metric(
        &m,
        r#"kvroute_predicted_cached_tokens_total{arm="cache_aware",policy="cache_aware",worker="w1"}"#,
    )
    .unwrap();
    assert!(
        cached >= 256,
        "the worker reused the conversation: {cached} cached tokens"
    );
    // Where `/debug/route` says the request `field: value` to `/v1/{path}` would go.
    let route = |path: &'static str, field: &'static str, value: Value| {
        let body = json!({"model": model, field: value}).to_string();
        async move {
            let r = request(
                gw.addr,
                "POST",
                &format!("/debug/route/v1/{path}"),
                body.as_bytes(),
            )
            .await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            r.json()
        }
    };
    // A completion's string prompt is tokenized too; a prompt of token ids is routed without.
    let ask = |prompt: Value| route("completions", "prompt", prompt);
    let text = ask(json!("Route this \"quoted\" request. ".repeat(10))).await;
    assert_eq!(text["tokenized"], true, "{text}");
    assert_eq!(ask(json!([1, 2, 3])).await["tokenized"], false);
    assert_eq!(
        predicted, cached as f64,
        "the events predicted the worker's cache exactly"
    );
    // A new conversation with a longer first message: the system prompt is held by worker 1 and
    // cached by the gateway's tokenizer, the message is new. Routing encodes only its head, and
    // the rest is encoded afterwards off the request's path, so the same request asked again is
    // tokenized whole from the cache, and goes to the same place with the same prediction.
    let long = json!([
        messages(0)[0].clone(),
        {"role": "user", "content": "A new document about caches and routing. ".repeat(16)},
    ]);
    let route = |m: Value| route("chat/completions", "messages", m);
    let exact = ours.chat(&long).unwrap().len() as f64;
    let heads = |m: &str| metric(m, r#"kvroute_tokenized_requests_total{how="head"}"#);
    let heads_before = heads(&metrics_text(gw.addr).await);
    let head = route(long.clone()).await;
    let encoded = head["tokens_encoded"].as_f64().unwrap();
    assert!(encoded < exact - 100.0, "{head}: {exact} tokens in all");
    let estimate = head["prompt_tokens"].as_f64().unwrap();
    assert!((estimate / exact - 1.0).abs() < 0.2, "{head}: {exact}");
    assert_eq!(
        heads(&metrics_text(gw.addr).await),
        Some(heads_before.unwrap_or(0.0) + 1.0)
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let whole = loop {
        let again = route(long.clone()).await;
        if again["tokens_encoded"].as_f64() == Some(exact) {
            break again;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the message was never cached: {again}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(whole["prompt_tokens"].as_f64(), Some(exact));
    for k in ["worker", "outcome", "predicted_cached_tokens"] {
        assert_eq!(head[k], whole[k], "{k}: {head} vs {whole}");
    }
    assert_eq!(head["outcome"], "exact_match", "{head}");
    cancel.cancel();
}

/// A worker that hashes each block with the token after it (vLLM 0.33 with EAGLE-style
/// speculative decoding; the simulator's `hash_lookahead`) publishes those tokens, and the
/// gateway's prediction follows what it then reuses: for a prompt that leaves the held one right
/// after a block, one block less than the blocks the two share; for one that leaves it inside a
/// block, every block before. Real HTTP to one simulated worker, its events over ZMQ.
#[tokio::test]
async fn a_worker_hashing_the_next_token_is_predicted_as_it_reuses() {
    use common::{gateway, metric, metrics_text, request};
    let (tokenizer_json, tokenizer_config) = (
        repo("tests/tokenize/tiny-tokenizer.json"),
        repo("tests/vllm/model/tokenizer_config.json"),
    );
    let cfg = kvroute::sim::SimConfig {
        workers: 1,
        port: 0,
        time_scale: 50.0,
        kv_events: true,
        hash_lookahead: 1,
        tokenizer: Some(tokenizer_json.clone()),
        tokenizer_config: Some(tokenizer_config.clone()),
        ..Default::default()
    };
    let (sims, cancel, _tasks) = start_sims(&cfg).await;
    let model = cfg.engine_params().unwrap().model;
    let block = kvroute::sim::kv::DEFAULT_BLOCK_SIZE;
    let ours =
        kvroute::tokenize::ModelTokenizer::load(&tokenizer_json, Some(&tokenizer_config)).unwrap();
    let shared = |a: &str, b: &str| {
        let (a, b) = (ours.prompt(a).unwrap(), ours.prompt(b).unwrap());
        a.iter().zip(&b).take_while(|(x, y)| x == y).count()
    };
    // A held prompt, and two that leave it: one right after a block, one inside a block.
    let text = |n: usize, tail: &str| format!("{}{tail}", "Cache me if you can. ".repeat(n));
    let held = |n: usize| {
        text(
            n,
            "Then a long tail that only the first prompt has, in full.",
        )
    };
    let other = |n: usize| text(n, "Otherwise a different ending.");
    let (n, at_boundary) = (4..80)
        .map(|n| (n, shared(&held(n), &other(n))))
        .find(|&(_, d)| d % block == 0 && d >= 3 * block)
        .expect("some length leaves the prompt at a block's end");
    let (m, inside) = (4..80)
        .map(|m| (m, shared(&held(n), &other(m))))
        .find(|&(_, d)| d % block > 1 && d >= 3 * block)
        .expect("some length leaves it inside a block");

    let config = followed_with_tokenizer(&sims, &model, tokenizer_json, tokenizer_config);
    let gw = gateway(config).await;
    let complete = |path: &'static str, prompt: String| {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 2}).to_string();
        let addr = gw.addr;
        async move { request(addr, "POST", path, body.as_bytes()).await }
    };
    let blocks = |m: &str| metric(m, "kvroute_kv_event_blocks{worker=\"w0\"}").unwrap_or(0.0);
    // The feed joins late (ZMQ): prompt until blocks are counted, then the held prompt until
    // its blocks are.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for k in 0.. {
        if blocks(&metrics_text(gw.addr).await) > 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the feed never joined"
        );
        let warm = format!("warm-up {k} ").repeat(40);
        assert_eq!(complete("/v1/completions", warm).await.status, 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = blocks(&metrics_text(gw.addr).await);
    let r = complete("/v1/completions", held(n)).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let own = (ours.prompt(&held(n)).unwrap().len() - 1) / block;
    while blocks(&metrics_text(gw.addr).await) < before + own as f64 {
        assert!(
            tokio::time::Instant::now() < deadline + Duration::from_secs(10),
            "the held prompt's blocks never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for (prompt, shared, want) in [
        (other(n), at_boundary, at_boundary - block),
        (other(m), inside, inside / block * block),
    ] {
        let routed = complete("/debug/route/v1/completions", prompt.clone()).await;
        let predicted = routed.json()["predicted_cached_tokens"].as_u64();
        let r = complete("/v1/completions", prompt).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        assert_eq!(cached, Some(want as u64), "{shared} tokens shared");
        assert_eq!(predicted, cached, "{shared} tokens shared");
    }
    cancel.cancel();
}

/// A gateway given no event endpoints but told to discover them asks each worker at vLLM's
/// `GET /kv_event_sources` (which the simulated worker serves as vLLM 0.32 does: the bound
/// publisher's host a wildcard) and follows what it lists at the worker's own host; a worker that
/// lists nothing (`{}`) is asked again later, and has no events meanwhile.
#[tokio::test]
async fn a_gateway_finds_each_workers_event_endpoints_by_asking_it() {
    use common::{gateway, metric, metrics_text, request};
    let publishing = kvroute::sim::SimConfig {
        workers: 1,
        port: 0,
        time_scale: 50.0,
        kv_events: true,
        ..Default::default()
    };
    let silent = kvroute::sim::SimConfig {
        kv_events: false,
        ..publishing.clone()
    };
    let (with, cancel, _tasks) = start_sims(&publishing).await;
    let (without, cancel_too, _more) = start_sims(&silent).await;
    let listing = request(with[0].addr, "GET", "/kv_event_sources", b"")
        .await
        .json();
    let port = |e: &str| e.rsplit_once(':').unwrap().1.to_owned();
    let source = with[0].kv_events.clone().unwrap();
    assert_eq!(
        listing["0"]["endpoint"],
        format!("tcp://*:{}", port(&source.endpoint))
    );
    assert_eq!(listing["0"]["publisher"], "zmq");
    let nothing = request(without[0].addr, "GET", "/kv_event_sources", b"").await;
    assert_eq!(nothing.json(), json!({}));

    let mut config = kvroute::config::Config {
        workers: [("w0", with[0].addr), ("w1", without[0].addr)]
            .into_iter()
            .map(|(name, addr)| kvroute::config::WorkerConfig {
                name: Some(name.into()),
                ..kvroute::config::WorkerConfig::from_url(format!("http://{addr}"))
            })
            .collect(),
        ..kvroute::config::Config::default()
    }
    .with_overrides(kvroute::config::Overrides {
        policy: Some("cache_aware".into()),
        ..Default::default()
    })
    .unwrap();
    config.kv_events.discover = true;
    config.load_signals.interval_seconds = 0.0;
    let gw = gateway(config).await;
    let series = |m: &str, name: &str, w: &str| metric(m, &format!("{name}{{worker=\"{w}\"}}"));
    // The feed joins late (ZMQ): prompt the worker directly until its blocks are counted.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for k in 0.. {
        let m = metrics_text(gw.addr).await;
        if series(&m, "kvroute_kv_event_blocks", "w0").unwrap_or(0.0) > 0.0 {
            let none = series(&m, "kvroute_kv_event_batches_total", "w1").unwrap_or(0.0);
            assert_eq!(none, 0.0, "{m}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the discovered feed never joined: {m}"
        );
        let body = json!({"prompt": format!("discover {k} ").repeat(40), "max_tokens": 1});
        let r = request(
            with[0].addr,
            "POST",
            "/v1/completions",
            body.to_string().as_bytes(),
        )
        .await;
        assert_eq!(r.status, 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    cancel_too.cancel();
}

/// A simulated server with two data-parallel engines publishes each rank's events on rank 0's
/// ports plus the rank and lists them at `/kv_event_sources`; a gateway that routes to the ranks
/// (`data_parallel_size: 2`, or `auto`, reading them from the server's `/metrics`), given rank
/// 0's endpoints or asking for them, follows both feeds and
/// sends the next request of a prefix that one rank served (named in `X-data-parallel-rank`,
/// behind the gateway's back) to that rank, which reports reusing what the gateway predicted;
/// the other rank, with a cache of its own, reuses none of it.
#[tokio::test]
async fn a_data_parallel_simulated_server_is_routed_to_the_rank_its_events_name() {
    use common::{gateway, metric, metrics_text, request, request_with};
    let tokenizer_json = repo("tests/tokenize/tiny-tokenizer.json");
    let cfg = kvroute::sim::SimConfig {
        workers: 1,
        port: 0,
        time_scale: 50.0,
        kv_events: true,
        tokenizer: Some(tokenizer_json.clone()),
        data_parallel_size: 2,
        ..Default::default()
    };
    let (sims, cancel, _tasks) = start_sims(&cfg).await;
    let model = cfg.engine_params().unwrap().model;
    let worker = sims[0].addr;
    let source = sims[0].kv_events.clone().unwrap();
    let port = |e: &str| e.rsplit_once(':').unwrap().1.parse::<u16>().unwrap();
    let listing = request(worker, "GET", "/kv_event_sources", b"")
        .await
        .json();
    for rank in 0..2u16 {
        let at = |p: u16| format!("tcp://*:{}", p + rank);
        let listed = &listing[rank.to_string()];
        assert_eq!(listed["endpoint"], at(port(&source.endpoint)), "{listing}");
        let replay = port(source.replay.as_deref().unwrap());
        assert_eq!(listed["replay_endpoint"], at(replay), "{listing}");
    }
    let complete = |addr: std::net::SocketAddr, prompt: String, rank: Option<&'static str>| {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 1}).to_string();
        async move {
            let headers: Vec<(&str, &str)> = rank
                .map(|r| ("x-data-parallel-rank", r))
                .into_iter()
                .collect();
            let r = request_with(addr, "POST", "/v1/completions", &headers, body.as_bytes()).await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            r
        }
    };
    let cached = |r: &common::RawResponse| {
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    use kvroute::config::DataParallelSize::{Auto, Fixed};
    for (mode, words, size) in [
        ("given", "alpha", Fixed(2)),
        ("discovered", "omega", Fixed(2)),
        ("auto", "delta", Auto),
    ] {
        let given = mode == "given";
        let url = format!("http://{worker}");
        let given = given.then_some(&source);
        let config =
            common::data_parallel_events_config(url, size, given, &model, tokenizer_json.clone());
        let gw = gateway(config).await;
        let limit = Duration::from_secs(10);
        let workers = common::wait_metric(gw.addr, "kvroute_workers", 2.0, limit).await;
        assert_eq!(workers, Some(2.0), "{mode}: a worker per rank");
        let name = |rank: &str| format!("{worker}/dp{rank}");
        let series = |m: &str, metric_name: &str, rank: &str| {
            metric(m, &format!("{metric_name}{{worker=\"{}\"}}", name(rank))).unwrap_or(0.0)
        };
        // The feeds join late (ZMQ): prompt each rank directly until each has a batch counted.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        for k in 0.. {
            let m = metrics_text(gw.addr).await;
            if ["0", "1"]
                .iter()
                .all(|r| series(&m, "kvroute_kv_event_batches_total", r) > 0.0)
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{mode}: the ranks' feeds never joined: {m}"
            );
            for rank in ["0", "1"] {
                complete(
                    worker,
                    format!("{mode} warm-up {k} ").repeat(20),
                    Some(rank),
                )
                .await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for (rank, other) in [("1", "0"), ("0", "1")] {
            let prefix = format!("{words} {rank} the prefix this rank holds ").repeat(20);
            complete(worker, format!("{prefix} first"), Some(rank)).await;
            let next =
                json!({"model": model, "prompt": format!("{prefix} second"), "max_tokens": 1});
            let limit = Duration::from_secs(10);
            common::until_routed_to(gw.addr, &next, &name(rank), 1, limit).await;
            let r = complete(gw.addr, format!("{prefix} second"), None).await;
            assert_eq!(r.header("x-kvroute-worker"), Some(name(rank).as_str()));
            let reused = cached(&r);
            assert!(reused > 0, "{mode}: rank {rank} reused the prefix");
            let m = metrics_text(gw.addr).await;
            let predicted = metric(
                &m,
                &format!(
                    r#"kvroute_predicted_cached_tokens_total{{arm="cache_aware",policy="cache_aware",worker="{}"}}"#,
                    name(rank)
                ),
            );
            let reported = metric(
                &m,
                &format!(
                    r#"kvroute_reported_cached_tokens_total{{arm="cache_aware",policy="cache_aware",worker="{}"}}"#,
                    name(rank)
                ),
            );
            assert_eq!(predicted, Some(reused as f64), "{mode}, rank {rank}: {m}");
            assert_eq!(reported, Some(reused as f64), "{mode}, rank {rank}: {m}");
            let elsewhere = complete(worker, format!("{prefix} third"), Some(other)).await;
            assert_eq!(cached(&elsewhere), 0, "rank {other}'s cache is its own");
        }
        gw.shutdown.cancel();
    }
    cancel.cancel();
}
