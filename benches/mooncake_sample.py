#!/usr/bin/env python3
"""A sample of Mooncake's public conversation trace sized for a 4-worker simulated pool.

Keeps whole conversations: the lines whose first own block id (hash_ids[1]; id 0 is the prefix
every line shares) is a multiple of --every, within the first --minutes of the trace, dropping
requests whose prompt and output exceed --max-len tokens. Reads the trace from the path given
(the FAST'25 release: FAST25-release/traces/conversation_trace.jsonl in kvcache-ai/Mooncake),
writes JSONL to stdout for `kvroute bench compare --trace`.

    python3 benches/mooncake_sample.py conversation_trace.jsonl > sample.jsonl
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
    a = ap.parse_args()
    kept = 0
    with open(a.trace) as f:
        for line in f:
            r = json.loads(line)
            ids = r["hash_ids"]
            if len(ids) < 2 or ids[1] % a.every:
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
