"""What the snapshot policy costs in memory and time and what it keeps, on a hybrid model, in one process.

For each length L, two conversations of one caller each, sent once (greedy, 16 tokens) and then changed:
- (d) a 100-token system prompt and an L-token user message (a document), sent again unchanged (a retry);
- (e) an L-token system prompt and a 60-token question, sent again with one token changed 95% of the way into
  the system prompt.
Prints, per length: the tokens (d) stored, the bytes held per stored token (spans and snapshots) and the snapshots
held, the first send's seconds (the cuts at snapshot positions are forward passes of their own), and the tokens
(d) and (e) reused; writes JSON (`--out`).

    .venv/bin/python scripts/snapshot_memory.py --arch granite-moe-hybrid --lengths 1000,2000,8000

The same script runs on an older tree (from that tree's root, `PYTHONPATH=.`) for a before-and-after: it uses
only `SnapshotPolicy.named` and the runner.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cache.arena import Scope, SealCost, new_prefix_cache
from cache.budget import CacheBudget
from cache.snapshot_policy import SnapshotPolicy
from node.engine.loader import load_model
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from node.engine.synthetic import init_model

KEEP_ALL = SealCost(0.0, 1.0, 1, 1)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure(loaded: Any, policy: SnapshotPolicy, length: int, seed: int) -> dict[str, Any]:
    cache = new_prefix_cache(CacheBudget(1 << 40, 1 << 40))
    runner = ModelRunner(loaded, cache, prefill_chunk=256, policy=policy, seal_cost=KEEP_ALL)

    def send(scope: Scope, system: list[int], user: list[int]) -> tuple[int, float]:
        boundaries = (len(system), len(system) + len(user) - 5)  # the user message's start, the generation prompt's
        request = GenerationRequest(scope, system + user, SamplingParams(16, 0.0), boundaries=boundaries)
        started = time.perf_counter()
        result = runner.generate(request, emit=lambda _: None, cancelled=lambda: False)
        return result.cached_read_tokens, time.perf_counter() - started

    retry = Scope(f"retry{seed}", loaded.model_id)
    system, document = tokens(seed, 100), tokens(seed + 1, length)
    _, first_s = send(retry, system, document)
    arena = cache.arena
    stored = cache.cached_tokens(retry)
    held = {"stored_tokens": stored, "bytes_per_token": round(arena.bytes_total / stored),
            "snapshot_bytes_per_token": round(arena.snapshot_bytes / stored),
            "snapshots": len(cache.snapshot_positions(retry)), "first_send_s": round(first_s, 3)}
    retried, _ = send(retry, system, document)
    late = Scope(f"late{seed}", loaded.model_id)
    system, question = tokens(seed + 2, length), tokens(seed + 3, 60)
    send(late, system, question)
    at = int(length * 0.95)
    edited, _ = send(late, system[:at] + [system[at] + 1] + system[at + 1:], question)
    return {**held, "retry_prompt": 100 + length, "retry_reused": retried, "late_edit_at": at,
            "late_edit_reused": edited}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="granite-moe-hybrid")
    parser.add_argument("--lengths", default="1000,2000,8000")
    parser.add_argument("--interval", type=int, default=None, help="--snapshot-interval (default: the tree's)")
    parser.add_argument("--out", default="bench-results/snapshot_memory.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        loaded = load_model(args.arch, init_model(args.arch, Path(workdir) / args.arch))
    interval = args.interval if args.interval is not None else SnapshotPolicy().interval
    policy = SnapshotPolicy.named("ours", interval)
    rows = []
    print(f"{'L':>6} {'stored':>7} {'B/token':>8} {'snap B/token':>12} {'snapshots':>9} {'first s':>8} "
          f"{'retry reused':>12} {'edit at':>7} {'edit reused':>11}")
    for index, length in enumerate(int(n) for n in args.lengths.split(",")):
        row = {"prompt": length, **measure(loaded, policy, length, seed=10 * index)}
        rows.append(row)
        print(f"{length:>6} {row['stored_tokens']:>7} {row['bytes_per_token']:>8} "
              f"{row['snapshot_bytes_per_token']:>12} {row['snapshots']:>9} {row['first_send_s']:>8} "
              f"{row['retry_reused']:>12}/{row['retry_prompt']} {row['late_edit_at']:>7} "
              f"{row['late_edit_reused']:>11}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"arch": args.arch, "interval": interval, "policy": repr(policy), "rows": rows},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
