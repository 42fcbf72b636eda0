"""How far greedy replies with reuse agree with replies without it in a lower precision, per family.

The reuse matrix (`tests/node/test_reuse_matrix.py`) asks for token-for-token equality in float32. In bfloat16 a
resumed prompt's keys and values are the ones a full pass computed, but the chunks that compute the rest differ in
length from one pass's, and bfloat16 rounds their sums differently, so a reply may drift from the reply without
reuse after some tokens. This script counts, per family, how many of the matrix's requests (three appended turns,
a shared system prompt, an edited history: five requests) reply token for token alike with reuse on and off, and at
which reply token the first difference falls, engine to engine in one process (no HTTP), sealing on.

    python scripts/dtype_agreement.py --device cuda --dtype bfloat16 --out bench-results/bf16-agreement.json

A family whose load-time reuse check fails in this precision is served without reuse: it is reported so, not
counted as agreeing. Prints a table; writes JSON.
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
from node.engine.loader import load_model
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from node.engine.synthetic import init_model
from node.openai_schema import Message
from node.service import ModelService

FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "mixtral", "olmoe", "qwen2-moe", "mamba", "mamba2", "jamba",
            "bamba", "falcon-h1", "granite-moe-hybrid", "lfm2", "qwen3-next"]
SYSTEM = ("You are the planning assistant of a warehouse robot fleet. Answer with short, exact steps. " * 3).strip()
KEEP_ALL = SealCost(0.0, 1.0, 1, 1)
"""Every entry kept sealed, whatever this machine measures (the figures are agreement, not speed)."""


def conversations(reply: Any) -> list[list[Message]]:
    """The matrix's five requests; `reply(messages)` answers one (the reuse node's reply goes into the history, as
    the matrix's test does)."""
    history = [Message("system", SYSTEM)]
    asked = []
    for turn in range(3):
        history.append(Message("user", f"Step {turn}: move pallet {turn * 7} to dock {turn + 2}."))
        asked.append(list(history))
        history.append(Message("assistant", reply(list(history))))
    asked.append([Message("system", SYSTEM), Message("user", "Count the docks.")])
    edited = list(history[:-1])
    edited[1] = Message("user", "Step 0: move pallet 99 to dock 1.")
    asked.append(edited)
    return asked


def family_agreement(family: str, root: Path, device: str, dtype: str, new_tokens: int) -> dict[str, Any]:
    loaded = load_model(family, init_model(family, root / family, size="small"), device=device, dtype=dtype)
    if loaded.state is None:
        return {"family": family, "reuse": False, "reason": loaded.reuse_blocker}
    cache = new_prefix_cache(CacheBudget(1 << 30, 1 << 30))
    on, off = ModelRunner(loaded, cache, seal_cost=KEEP_ALL), ModelRunner(loaded, None)
    service = ModelService(loaded, on, None, None)  # type: ignore[arg-type]  # prompts only
    results: list[dict[str, Any]] = []

    def run(runner: ModelRunner, messages: list[Message]) -> tuple[list[int], str, int]:
        prompt = service.chat_prompt(tuple(messages))
        request = GenerationRequest(Scope("alice", family), prompt.ids, SamplingParams(new_tokens, 0.0),
                                    boundaries=prompt.rendered.boundaries)
        result = runner.generate(request, lambda _: None, lambda: False)
        return result.output_ids, result.text, result.cached_read_tokens

    def reply(messages: list[Message]) -> str:
        ids, text, cached = run(on, messages)
        expected, _, _ = run(off, messages)
        first = next((i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b),
                     None if ids == expected else min(len(ids), len(expected)))
        results.append({"cached_tokens": cached, "first_difference": first})
        return text

    asked = conversations(reply)
    for messages in asked[3:]:
        reply(messages)
    agree = sum(result["first_difference"] is None for result in results)
    return {"family": family, "reuse": True, "requests": len(results), "agree": agree,
            "first_differences": [result["first_difference"] for result in results],
            "cached_tokens": [result["cached_tokens"] for result in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default="bench-results/dtype-agreement.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tenzro-agreement-") as tmp:
        for family in args.families.split(","):
            row = family_agreement(family, Path(tmp), args.device, args.dtype, args.new_tokens)
            rows.append(row)
            if row["reuse"]:
                print(f"{family:20} {row['agree']}/{row['requests']} agree; first differences at reply tokens "
                      f"{row['first_differences']}", flush=True)
            else:
                print(f"{family:20} served without reuse in {args.dtype}: {row['reason']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "dtype": args.dtype, "new_tokens": args.new_tokens,
                               "seconds": round(time.perf_counter() - started, 1), "families": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
