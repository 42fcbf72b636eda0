"""The prefix index's lookup cost with keyed digests against plain id tuples, side by side in one process.

For each prompt length: a scope holding `--entries` stored prompts that share a system prefix, then one lookup
of a new prompt that agrees with one of them for all but its last 64 tokens, as the engine does it (`digest`,
then `acquire` and `release`). Prints the medians and writes JSON (`--out`).

    .venv/bin/python scripts/index_lookup.py --lengths 1024,8192 --runs 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cache.budget import CacheBudget
from cache.prefix_cache import PrefixCache
from cache.radix_tree import RadixTree
from cache.scope import Scope
from cache.token_digest import TokenDigester


class NullStore:
    """Handles are (start, end) pairs: the index's own cost, nothing of the arena's."""

    bytes_total = 0

    def put(self, scope: Scope, start: int, end: int, span: Any) -> tuple[int, int]:
        return (start, end)

    def split(self, handle: tuple[int, int], offset: int) -> tuple[tuple[int, int], tuple[int, int]]:
        return (handle[0], handle[0] + offset), (handle[0] + offset, handle[1])

    def has_snapshot(self, handle: Any) -> bool:
        return False

    def bytes_of_caller(self, caller: str) -> int:
        return 0


def median_ms(work: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000.0


def measure(length: int, entries: int, runs: int, rng: random.Random) -> dict[str, float]:
    shared = [rng.randrange(32000) for _ in range(length // 2)]
    stored = [shared + [rng.randrange(32000) for _ in range(length - len(shared))] for _ in range(entries)]
    prompt = stored[0][:length - 64] + [rng.randrange(32000) for _ in range(64)]
    cache = PrefixCache(CacheBudget(1 << 40, 1 << 40), NullStore())  # type: ignore[arg-type]
    scope = Scope("alice", "m")
    for tokens in stored:
        cache.store(scope, tokens, lambda start, end: None)
    plain: RadixTree[tuple[int, int]] = RadixTree(NullStore().split, iter(range(10**9)).__next__)
    for tokens in stored:
        plain.insert(tuple(tokens), lambda start, end: (start, end))

    def digested() -> int:
        lease = cache.acquire(scope, cache.digest(scope, prompt), len(prompt) - 1, anywhere=True)
        cache.release(lease)
        return lease.length

    assert digested() == plain.match(tuple(prompt)).length == length - 64
    digester = TokenDigester()
    return {"length": length, "entries": entries,
            "plain_ms": median_ms(lambda: plain.match(tuple(prompt)), runs),
            "digest_only_ms": median_ms(lambda: digester.run(prompt), runs),
            "digested_ms": median_ms(digested, runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,8192")
    parser.add_argument("--entries", type=int, default=8)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("index_lookup.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(7)
    rows = []
    for length in map(int, args.lengths.split(",")):
        row = measure(length, args.entries, args.runs, rng)
        rows.append(row)
        print(f"{length:>6} tokens: plain tuples {row['plain_ms']:.3f} ms, keyed digests {row['digested_ms']:.3f} ms "
              f"(of which digesting {row['digest_only_ms']:.3f} ms), median of {args.runs}")
    args.out.write_text(json.dumps({"runs": args.runs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
