"""A/B the decode step of B sequences: the native kernels one sequence after another against transformers' batched
forward (`node/engine/batch_forward.py`), with the linear layers' oneDNN-packed weights (`cpu_layout.py`) and
without them, with the sequences' shared first rows attended once (`Shared`), and that with each row's own rows
by the native decode attention (`tz_decode_attention`) instead of SDPA, and that with the greedy tokens of all
rows from one pass of the head's int8 screen (`CpuDecoder.score_rows`) instead of the head's logits and their
argmax, on the default model, one thread, in one process.

    .venv/bin/python scripts/batch_ab.py [--context 1024] [--shared 0] [--batches 1,2,3,4,8,16,32] [--runs 7]

Each of B sequences is prefilled to `--context` tokens (lengths differ by a few tokens, as real traffic's do)
in its own lane, the first `--shared` of them the same for all (one caller's system prompt, computed alike);
then the six ways alternate, each running one decode step of all B sequences into its own set of caches, and
the script prints the median milliseconds per step, tokens per second, and the largest logit difference of
the packed batched step and of the shared one against the native step, relative to the largest logit, and
whether the screened tokens are the argmax of the native attention's logits.
`ModelRunner.decode` takes the native path at batch 1 only; this measures where that choice stands.

The process first takes the node's hygiene (`apply_hygiene`: memory locked where allowed, new allocations written
by glibc), so that the lanes' pages exist before a step writes its new rows into them, as in the node, whose lanes
are written at start. Without it, a step of 32 rows also took the page faults of its new rows (RESULTS.md,
2026-12-04, "huge pages for the lanes, tried").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cache.lanes import Lanes
from node.config import tenzro_home
from node.engine.batch_forward import BatchedDecode, Shared, equal_rows
from node.engine.cpu_kernels import load_kernels
from node.engine.cpu_layout import TransposedLinear
from node.engine.loader import DEFAULT_MODEL, load_model, resolve_model_dir
from node.hygiene import apply_hygiene


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", default="1,2,3,4,8,16,32")
    parser.add_argument("--shared", type=int, default=0, help="first tokens all sequences' prompts share")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    apply_hygiene()
    torch.set_num_threads(1)
    model_id, path = resolve_model_dir(DEFAULT_MODEL, tenzro_home())
    loaded = load_model(model_id, path)
    assert loaded.state is not None and loaded.forward.decoder is not None, loaded.forward.reason
    batched = BatchedDecode(loaded.model)
    lanes = Lanes(loaded.state.working_cache)
    native_attention = BatchedDecode(loaded.model, load_kernels().kernels)
    vocab = int(loaded.model.config.vocab_size)
    print(f"forward: {loaded.forward.backend} ({loaded.forward.reason}); context {args.context}, 1 thread")
    linears = [m for m in loaded.model.modules() if isinstance(m, TransposedLinear)]
    packed = [m.packed for m in linears]
    print(f"{'batch':>5} {'native ms':>10} {'batched ms':>11} {'unpacked ms':>12} {'shared ms':>10} "
          f"{'+native attn ms':>16} {'+screen ms':>11} {'native tok/s':>13} {'batched tok/s':>14} "
          f"{'shared tok/s':>13} {'+native tok/s':>14} {'+screen tok/s':>14} {'rel diff':>9} {'shared diff':>12} "
          f"{'screened = argmax':>18}")
    for batch in (int(b) for b in args.batches.split(",")):
        generator = torch.Generator().manual_seed(batch)
        system = torch.randint(100, vocab, (args.shared,), generator=generator).tolist()
        prompts = [system + torch.randint(100, vocab, (args.context - args.shared + 3 * row,),
                                          generator=generator).tolist() for row in range(batch)]
        sets = []
        for base in (0, batch, 2 * batch, 3 * batch, 4 * batch, 5 * batch):
            caches = []
            for row, prompt in enumerate(prompts):
                cache, _ = lanes.new_cache(base + row, len(prompt) + 2 * args.runs + 2)
                if args.shared:
                    loaded.forward.prefill(prompt[:args.shared], 0, cache)
                loaded.forward.prefill(prompt[args.shared:-1], args.shared, cache)
                caches.append(cache)
            sets.append(caches)
        length = min(equal_rows(sets[3][0], cache, args.shared) for cache in sets[3][1:]) if batch > 1 else 0
        length = min(length, *(equal_rows(sets[4][0], cache, args.shared) for cache in sets[4][1:])) if length else 0
        shared = [Shared(tuple(range(batch)), length)] if length else []
        tokens = [prompt[-1] for prompt in prompts]
        positions = [len(prompt) - 1 for prompt in prompts]
        times: list[list[float]] = [[], [], [], [], [], []]
        worst = worst_shared = 0.0
        agree = True
        for step in range(args.runs):
            at = [position + step for position in positions]
            started = time.perf_counter()
            one = [loaded.forward.prefill([token], p, cache).logits() for token, p, cache in zip(tokens, at, sets[0],
                                                                                         strict=True)]
            times[0].append(time.perf_counter() - started)
            started = time.perf_counter()
            many = batched.step(tokens, at, sets[1], loaded.device)
            times[1].append(time.perf_counter() - started)
            for module in linears:
                module.packed = None
            started = time.perf_counter()
            batched.step(tokens, at, sets[2], loaded.device)
            times[2].append(time.perf_counter() - started)
            for module, weight in zip(linears, packed, strict=True):
                module.packed = weight
            started = time.perf_counter()
            together = batched.step(tokens, at, sets[3], loaded.device, shared)
            times[3].append(time.perf_counter() - started)
            started = time.perf_counter()
            fastest = native_attention.step(tokens, at, sets[4], loaded.device, shared)
            times[4].append(time.perf_counter() - started)
            started = time.perf_counter()
            stepped = loaded.forward.step(native_attention, tokens, at, sets[5], shared, [True] * batch)
            picked = [p.greedy() for p in stepped]
            times[5].append(time.perf_counter() - started)
            agree &= picked == fastest.argmax(-1).tolist()
            for row, logits in enumerate(one):
                scale = max(1.0, float(logits.abs().max()))
                worst = max(worst, float((many[row] - logits).abs().max()) / scale)
                worst_shared = max(worst_shared, float((together[row] - logits).abs().max()) / scale,
                                   float((fastest[row] - logits).abs().max()) / scale)
        native, many_s, unpacked, shared_s, fastest_s, screened_s = (statistics.median(t) for t in times)
        print(f"{batch:>5} {native * 1e3:>10.1f} {many_s * 1e3:>11.1f} {unpacked * 1e3:>12.1f} {shared_s * 1e3:>10.1f} "
              f"{fastest_s * 1e3:>16.1f} {screened_s * 1e3:>11.1f} {batch / native:>13.1f} {batch / many_s:>14.1f} "
              f"{batch / shared_s:>13.1f} {batch / fastest_s:>14.1f} {batch / screened_s:>14.1f} {worst:>9.1e} "
              f"{worst_shared:>12.1e} {str(agree):>18}")
        for lane in range(6 * batch):
            lanes.wipe(lane, 0, args.context + 3 * batch + 2 * args.runs + 2)


if __name__ == "__main__":
    main()
