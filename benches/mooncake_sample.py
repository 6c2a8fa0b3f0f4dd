#!/usr/bin/env python3
"""A sample of one of Mooncake's public traces sized for a 4-worker simulated pool.

Keeps whole families of requests: the lines whose block id at --key-block is a multiple of
--every, within the first --minutes of the trace, dropping requests whose prompt and output exceed
--max-len tokens. In the conversation trace every line starts with block 0, so a conversation is
named by its first own block (--key-block 1, the default); in the synthetic trace the first block
already tells the families apart (--key-block 0). Reads the trace from the path given (the FAST'25
release: FAST25-release/traces/conversation_trace.jsonl or synthetic_trace.jsonl in
kvcache-ai/Mooncake), writes JSONL to stdout for `kvroute bench compare --trace`.

    python3 benches/mooncake_sample.py conversation_trace.jsonl > sample.jsonl
    python3 benches/mooncake_sample.py synthetic_trace.jsonl --key-block 0 --every 6 > synthetic.jsonl
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--key-block", type=int, default=1)
    a = ap.parse_args()
    if a.key_block < 0 or a.every < 1:
        ap.error("--key-block must be 0 or more and --every 1 or more")
    kept = 0
    with open(a.trace) as f:
        for line in f:
            r = json.loads(line)
            ids = r["hash_ids"]
            if len(ids) <= a.key_block or ids[a.key_block] % a.every:
                continue
            if r["timestamp"] >= a.minutes * 60_000:
                continue
            if r["input_length"] + r["output_length"] > a.max_len:
                continue
            sys.stdout.write(line)
            kept += 1
    print(f"{kept} requests kept", file=sys.stderr)


if __name__ == "__main__":
    main()
