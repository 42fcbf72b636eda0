"""A/B the decode step of B sequences: the native kernels one sequence after another against transformers' batched
forward (`node/engine/batch_forward.py`), on the default model, one thread, in one process.

    .venv/bin/python scripts/batch_ab.py [--context 1024] [--batches 1,2,3,4,8,16,32] [--runs 7]

Each of B sequences is prefilled to `--context` tokens (lengths differ by a few tokens, as real traffic's do)
in its own lane; then the two ways alternate, each running one decode step of all B sequences into its own set
of caches, and the script prints the median milliseconds per step and per token, and the largest logit
difference between the two, relative to the largest logit. `Runner.decode` takes the native path at batch 1
only; this measures where that choice stands.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from node.config import tenzro_home
from node.engine.batch_forward import BatchedDecode
from node.engine.loader import DEFAULT_MODEL, load_model, resolve_model_dir


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", default="1,2,3,4,8,16,32")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_id, path = resolve_model_dir(DEFAULT_MODEL, tenzro_home())
    loaded = load_model(model_id, path)
    assert loaded.state is not None and loaded.decoder is not None, loaded.forward_path.reason
    batched = BatchedDecode(loaded.model)
    vocab = int(loaded.model.config.vocab_size)
    print(f"forward: {loaded.forward_path.name} ({loaded.forward_path.reason}); context {args.context}, 1 thread")
    print(f"{'batch':>5} {'native ms':>10} {'batched ms':>11} {'native tok/s':>13} {'batched tok/s':>14} "
          f"{'rel diff':>9}")
    for batch in (int(b) for b in args.batches.split(",")):
        generator = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(100, vocab, (args.context + 3 * row,), generator=generator).tolist()
                   for row in range(batch)]
        sets = []
        for base in (0, batch):
            caches = []
            for row, prompt in enumerate(prompts):
                cache, _ = loaded.state.new_cache(len(prompt) + 2 * args.runs + 2, lane=base + row)
                loaded.forward(prompt[:-1], 0, cache)
                caches.append(cache)
            sets.append(caches)
        tokens = [prompt[-1] for prompt in prompts]
        positions = [len(prompt) - 1 for prompt in prompts]
        native_s, batched_s, worst = [], [], 0.0
        for step in range(args.runs):
            at = [position + step for position in positions]
            started = time.perf_counter()
            one = [loaded.forward([token], p, cache).logits() for token, p, cache in zip(tokens, at, sets[0],
                                                                                         strict=True)]
            middle = time.perf_counter()
            many = batched.step(tokens, at, sets[1], loaded.device)
            ended = time.perf_counter()
            native_s.append(middle - started)
            batched_s.append(ended - middle)
            for row, logits in enumerate(one):
                worst = max(worst, float((many[row] - logits).abs().max()) / max(1.0, float(logits.abs().max())))
        native, many_s = statistics.median(native_s), statistics.median(batched_s)
        print(f"{batch:>5} {native * 1e3:>10.1f} {many_s * 1e3:>11.1f} {batch / native:>13.1f} "
              f"{batch / many_s:>14.1f} {worst:>9.1e}")
        for lane in range(2 * batch):
            loaded.state.wipe_pool(0, args.context + 3 * batch + 2 * args.runs + 2, lane)


if __name__ == "__main__":
    main()
