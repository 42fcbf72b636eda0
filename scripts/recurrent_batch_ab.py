"""A/B the decode step of B sequences of a model with recurrent layers: one transformers forward per sequence (how
such models stepped before their states were stacked) against one batched forward whose recurrent layers step
the sequences' states stacked along the batch (`node/engine/batch_forward.py`), each with Mamba-2 mixers' decode
step run by upstream (transformers' recurrent update) and by `mamba2.ssd_recurrence` (what the node runs on a
CPU), one thread, in one process.

    .venv/bin/python scripts/recurrent_batch_ab.py [--arch bamba] [--size default] [--context 1024]
        [--batches 1,2,4,8,16] [--runs 7]

Each of B sequences is prefilled to `--context` tokens (lengths differ by a few tokens) in its own lane, once for
each way; then the four ways alternate, each running one decode step of all B sequences, and the script prints
the median milliseconds per step and the largest logit difference of every way against the first (one by one,
upstream's step), relative to the largest logit. Models without Mamba-2 mixers run the same code both ways.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cache.lanes import Lanes
from node.engine import mamba2
from node.engine.batch_forward import BatchedDecode, batch_blocker
from node.engine.loader import load_model
from node.engine.synthetic import init_model


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="bamba", help="a family or architecture of `tenzro models init`")
    parser.add_argument("--size", default="default")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as home:
        loaded = load_model(args.arch, init_model(args.arch, Path(home) / args.arch, size=args.size))
    assert loaded.state is not None and batch_blocker(loaded.model) is None
    batched = BatchedDecode(loaded.model)
    lanes = Lanes(loaded.state.working_cache)
    vocab = int(loaded.model.config.get_text_config(decoder=True).vocab_size)
    params = sum(p.numel() for p in loaded.model.parameters())
    print(f"{args.arch} ({args.size}, {params / 1e6:.0f} M parameters), context {args.context}, 1 thread")
    ways = [(False, False), (True, False), (False, True), (True, True)]
    """(batched, decode step by the recurrence)."""
    print(f"{'batch':>5} {'one by one ms':>14} {'batched ms':>11} {'one by one, rec ms':>19} {'batched, rec ms':>16} "
          f"{'batched tok/s':>14} {'batched, rec tok/s':>19} {'rel diff':>9}")
    share = dict(mamba2.SEQUENTIAL_SHARE)
    for batch in (int(b) for b in args.batches.split(",")):
        generator = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(100, vocab, (args.context + 3 * row,), generator=generator).tolist()
                   for row in range(batch)]
        sets = []
        for base in range(0, len(ways) * batch, batch):
            caches = []
            for row, prompt in enumerate(prompts):
                cache, _ = lanes.new_cache(base + row, len(prompt) + args.runs + 2)
                for start in range(0, len(prompt) - 1, 256):
                    loaded.forward.prefill(prompt[start:min(start + 256, len(prompt) - 1)], start, cache)
                caches.append(cache)
            sets.append(caches)
        tokens = [prompt[-1] for prompt in prompts]
        positions = [len(prompt) - 1 for prompt in prompts]
        times: list[list[float]] = [[] for _ in ways]
        worst = 0.0
        for step in range(args.runs):
            at = [position + step for position in positions]
            got = []
            for (together, recurrence), caches, spent in zip(ways, sets, times, strict=True):
                mamba2.SEQUENTIAL_SHARE.clear()
                if recurrence:
                    mamba2.SEQUENTIAL_SHARE.update(share)
                started = time.perf_counter()
                if together:
                    got.append(batched.step(tokens, at, caches, loaded.device))
                else:
                    got.append(torch.stack([loaded.forward.prefill([token], p, cache).logits()
                                            for token, p, cache in zip(tokens, at, caches, strict=True)]))
                spent.append(time.perf_counter() - started)
            mamba2.SEQUENTIAL_SHARE.update(share)
            scale = max(1.0, float(got[0].abs().max()))
            worst = max(worst, *(float((other - got[0]).abs().max()) / scale for other in got[1:]))
        ms = [statistics.median(spent) * 1e3 for spent in times]
        print(f"{batch:>5} {ms[0]:>14.1f} {ms[1]:>11.1f} {ms[2]:>19.1f} {ms[3]:>16.1f} {batch / ms[1] * 1e3:>14.1f} "
              f"{batch / ms[3] * 1e3:>19.1f} {worst:>9.1e}")
        for lane in range(len(ways) * batch):
            lanes.wipe(lane, 0, args.context + 3 * batch + args.runs + 2)


if __name__ == "__main__":
    main()
