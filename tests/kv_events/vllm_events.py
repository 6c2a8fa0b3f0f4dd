#!/usr/bin/env python3
"""vLLM's KV cache events, encoded by msgspec (the encoder vLLM uses) from structs declared with
vLLM's field order and tagging, and published the way vLLM's ZMQ publisher does it.

Three layouts:
  array  positional batch, positional tagged events (vLLM before 0.26; integer block hashes)
  map    batch and events as maps, `type`-tagged (vLLM's current source; bytes block hashes)
  mixed  positional batch `[ts, events, dp_rank]` holding map events (seen from vLLM 0.32.0)

The map structs are declared as vLLM 0.34.0 declares them: stores name their KV cache group
(`group_idx`) and its kind (`kv_cache_spec_kind`), removals the group's index only; a store
may carry each block's `lookahead_token_ids` (from 0.33; left out unless the SPEC gives them,
as vLLM leaves them out without lookahead hashes, so the messages are 0.32.0's otherwise). An event
of the SPEC may give "group_idx" (default 0) and, for a store, "kind" (default
"full_attention") and "sliding_window" (the window in tokens, for a sliding-window kind), as a hybrid model's worker publishes one group's blocks beside another's;
a store may give "extra_keys" (one list or null per block, untagged as vLLM 0.32 publishes
them: LoRA name, [image id, offset] pairs, cache salt) and "lora_name"; any event "medium"
(default "GPU": "CPU" for an offloading tier's).

Commands, one JSON object per line on stdin; answers on stdout:
  {"encode": SPEC}                    -> {"payload": HEX}
  {"decode": HEX}                     -> the batch as vLLM 0.32's structs read it (mixed layout)
  {"publish": SPEC, "live": B, "buffer": B}
                                      -> {"seq": N}   (live: sent on PUB; buffer: kept for replay)
  {"restart": true}                   -> {"restarted": true}   (sequence and buffer start over)
SPEC = {"layout": ..., "events": [{"type": "BlockStored", "block_hashes": [int, ...],
        "parent_block_hash": int|null, "token_ids": [...], "block_size": n}, ...]}

`publish [--replay]` binds PUB (and ROUTER) to free ports on 127.0.0.1, prints
{"port": P, "replay_port": R|null}, and sends an empty batch every 50 ms while idle, so that a subscriber can tell
it is connected (ZMQ drops what a PUB socket sends before a SUB has joined).
"""

import argparse
import json
import select
import sys
import time
from collections import deque
from typing import Any, Optional, Union

import msgspec

# --- vLLM before 0.26: everything positional, integer hashes -------------------------------


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class ArrayRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class ArrayCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


# --- vLLM's current source: maps, `type`-tagged, bytes hashes -------------------------------

Hash = Union[bytes, int]


class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class MixedBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[list[int]]] = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


def as_bytes(h):
    """The map layout carries hashes as bytes, as current vLLM does (a 32-byte digest)."""
    return None if h is None else int(h).to_bytes(32, "big")


def build(spec):
    layout = spec["layout"]
    events = []
    for e in spec["events"]:
        kind = e["type"]
        if layout == "array":
            if kind == "BlockStored":
                events.append(ArrayStored(e["block_hashes"], e.get("parent_block_hash"), e["token_ids"],
                                          e["block_size"], None, "GPU"))
            elif kind == "BlockRemoved":
                events.append(ArrayRemoved(e["block_hashes"], "GPU"))
            else:
                events.append(ArrayCleared())
        else:
            group = e.get("group_idx", 0)
            if kind == "BlockStored":
                window = e.get("sliding_window")
                keys = e.get("extra_keys") or [None] * len(e["block_hashes"])
                events.append(MapStored([as_bytes(h) for h in e["block_hashes"]],
                                        as_bytes(e.get("parent_block_hash")), e["token_ids"],
                                        e["block_size"], None, e.get("medium", "GPU"),
                                        e.get("lora_name"),
                                        extra_keys=[None if k is None else tuple(
                                            tuple(x) if isinstance(x, list) else x for x in k)
                                            for k in keys],
                                        group_idx=group,
                                        kv_cache_spec_kind=e.get("kind", "full_attention"),
                                        kv_cache_spec_sliding_window=window,
                                        lookahead_token_ids=e.get("lookahead_token_ids")))
            elif kind == "BlockRemoved":
                events.append(MapRemoved([as_bytes(h) for h in e["block_hashes"]],
                                         e.get("medium", "GPU"), group_idx=group))
            else:
                events.append(MapCleared())
    ts = time.time()
    if layout == "array":
        return ArrayBatch(ts, events)
    if layout == "map":
        return MapBatch(ts, events, 0)
    return MixedBatch(ts, events, 0)


class MixedKVBatch(MixedBatch):
    """A batch whose events msgspec must validate as vLLM's event types."""
    events: list[Union[MapStored, MapRemoved, MapCleared]]


def summary(batch):
    """A decoded batch as JSON: hashes as integers (the simulator sends integers)."""
    out = []
    for e in batch.events:
        d = {"type": e.__struct_config__.tag}
        for f in e.__struct_fields__:
            v = getattr(e, f)
            if v is not None:
                d[f] = v
        out.append(d)
    return {"ts": batch.ts, "dp_rank": batch.data_parallel_rank, "events": out}


def answer(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def encode_only():
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(MixedKVBatch)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "decode" in cmd:
            try:
                answer(summary(dec.decode(bytes.fromhex(cmd["decode"]))))
            except msgspec.ValidationError as e:
                answer({"error": str(e)})
        else:
            answer({"payload": enc.encode(build(cmd["encode"])).hex()})


def publish(replay):
    import zmq

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = None
    if replay:
        router = ctx.socket(zmq.ROUTER)
        replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    enc = msgspec.msgpack.Encoder()
    buffer = deque(maxlen=10_000)
    seq = 0

    def send(batch, live=True, keep=True):
        nonlocal seq
        payload = enc.encode(batch)
        if live:
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        if keep:
            buffer.append((seq, payload))
        seq += 1
        return seq - 1

    answer({"port": port, "replay_port": replay_port if replay else None})
    while True:
        if router is not None and router.poll(0):
            client, _, start = router.recv_multipart()
            start = int.from_bytes(start, "big")
            for s, payload in buffer:
                if s >= start:
                    router.send_multipart((client, b"", s.to_bytes(8, "big"), payload))
            router.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not ready:
            send(MapBatch(time.time(), [], 0))  # idle heartbeat: an empty batch
            continue
        line = sys.stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        if "restart" in cmd:
            seq = 0
            buffer.clear()
            answer({"restarted": True})
        else:
            s = send(build(cmd["publish"]), cmd.get("live", True), cmd.get("buffer", True))
            answer({"seq": s})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["encode", "publish"])
    ap.add_argument("--replay", action="store_true", help="also serve replays (ROUTER)")
    a = ap.parse_args()
    if a.mode == "encode":
        encode_only()
    else:
        publish(a.replay)


if __name__ == "__main__":
    main()
