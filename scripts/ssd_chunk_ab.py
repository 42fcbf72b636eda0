"""The chunked SSD scan's chunk size against the prefill's piece size, on a Mamba-2 hybrid, in one process.

Prefill of one prompt (cold, reuse off, one greedy token) with every Mamba-2 mixer's `chunk_size` set to each value
and the prefill cut into pieces of each size (`prefill_chunk`; the snapshot grid cuts at its spacing too). Prints
the median seconds of `--runs` and writes JSON (`--out`).

    .venv/bin/python scripts/ssd_chunk_ab.py --arch granite-moe-hybrid --tokens 2048 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cache.arena import Scope
from node.engine.loader import load_model
from node.engine.mamba2 import MIXER_SPECS
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from node.engine.synthetic import init_model

CASES = ((256, 256), (256, 128), (128, 128), (128, 256), (64, 128), (256, 512), (128, 512))
"""(scan chunk size, prefill piece)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="granite-moe-hybrid")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench-results/ssd_chunk_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        loaded = load_model(args.arch, init_model(args.arch, Path(workdir) / args.arch))
    mixers = [module for module in loaded.model.modules() if type(module) in MIXER_SPECS]
    prompt = torch.randint(100, 30000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    print(f"{len(mixers)} Mamba-2 mixers; {args.tokens} tokens; median of {args.runs}")
    for chunk, piece in CASES:
        for mixer in mixers:
            mixer.chunk_size = chunk
        runner = ModelRunner(loaded, None, prefill_chunk=piece)
        seconds = []
        for _ in range(args.runs):
            started = time.perf_counter()
            runner.generate(GenerationRequest(Scope("ab", args.arch), prompt, SamplingParams(1, 0.0)),
                            emit=lambda _: None, cancelled=lambda: False)
            seconds.append(time.perf_counter() - started)
        rows.append({"chunk_size": chunk, "piece": piece, "median_s": round(statistics.median(seconds), 3)})
        print(f"scan chunk {chunk:>4}, pieces of {piece:>4}: {rows[-1]['median_s']:.3f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"arch": args.arch, "tokens": args.tokens, "runs": args.runs, "rows": rows}, indent=2)
                   + "\n")


if __name__ == "__main__":
    main()
