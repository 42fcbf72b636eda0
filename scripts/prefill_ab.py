"""A/B a prefill chunk: transformers' forward (oneDNN-packed GEMMs, SDPA, the last-row shortcut) against the native
kernels in pieces of `PIECE_TOKENS` and of half that (`cpu_decoder.py`), on the default model, one thread, in one
process.

    .venv/bin/python scripts/prefill_ab.py [--chunk 256] [--histories 0,256,768,1400,3000] [--runs 7]

For each history length, a working cache holds that many tokens; then the three ways alternate, each cutting the
cache back to the history and running the same `--chunk` new tokens into it. Prints the median milliseconds per
chunk and the largest logit difference from transformers', relative to the largest logit.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from cache.lanes import Lanes
from node.config import tenzro_home
from node.engine.cpu_decoder import PIECE_TOKENS
from node.engine.loader import DEFAULT_MODEL, LoadedModel, load_model, resolve_model_dir


def _ways(loaded: LoadedModel, cache: Any, chunk: list[int], history: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The three ways to run `chunk` after `history` tokens of `cache`, each returning the last row's logits."""
    decoder = loaded.forward.decoder
    assert decoder is not None

    def transformers() -> torch.Tensor:
        shortcut = loaded.forward.last_row.active() if loaded.forward.last_row is not None else nullcontext()
        with shortcut:
            out = loaded.model(input_ids=torch.tensor([chunk]),
                               position_ids=torch.arange(history, history + len(chunk)).unsqueeze(0),
                               cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def native(piece: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            for first in range(0, len(chunk) - piece, piece):
                decoder.extend(chunk[first:first + piece], history + first, cache)
            last = (len(chunk) - 1) // piece * piece
            return decoder.forward(chunk[last:], history + last, cache).logits()
        return run

    return {"transformers": transformers, "native": native(PIECE_TOKENS), "half": native(PIECE_TOKENS // 2)}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--histories", default="0,256,768,1400,3000")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_id, path = resolve_model_dir(DEFAULT_MODEL, tenzro_home())
    loaded = load_model(model_id, path)
    state = loaded.state
    assert loaded.forward.decoder is not None and state is not None, loaded.forward.reason
    vocab = int(loaded.model.config.vocab_size)
    histories = [int(h) for h in args.histories.split(",")]
    capacity = max(histories) + args.chunk
    ids = torch.randint(100, vocab, (capacity,), generator=torch.Generator().manual_seed(0)).tolist()
    lanes = Lanes(state.working_cache)
    print(f"forward: {loaded.forward.backend}; chunk {args.chunk} tokens, 1 thread")
    print(f"{'history':>7} {'transformers ms':>16} {f'native {PIECE_TOKENS} ms':>14} "
          f"{f'native {PIECE_TOKENS // 2} ms':>14} {'diff':>8}")
    for history in histories:
        cache, _ = lanes.new_cache(0, capacity)
        for start in range(0, history, 256):
            loaded.forward.prefill(ids[start:min(history, start + 256)], start, cache)
        chunk = ids[history:history + args.chunk]

        ways = _ways(loaded, cache, chunk, history)
        times: dict[str, list[float]] = {name: [] for name in ways}
        logits: dict[str, torch.Tensor] = {}
        for _ in range(args.runs):
            for name, way in ways.items():
                for layer in cache.layers:
                    assert layer.truncate(history, capacity) or not history  # empty before its first run
                started = time.perf_counter()
                logits[name] = way()
                times[name].append(time.perf_counter() - started)
        scale = max(1.0, float(logits["transformers"].abs().max()))
        diff = max(float((logits[name] - logits["transformers"]).abs().max()) / scale for name in ("native", "half"))
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{history:>7} {medians['transformers']:>16.1f} {medians['native']:>14.1f} {medians['half']:>14.1f} "
              f"{diff:>8.1e}")
        lanes.wipe(0, 0, capacity)


if __name__ == "__main__":
    main()
