"""A/B the attention of a batched decode step: the native decode attention (`tz_decode_attention`) against SDPA's
flash kernel, on the default model's shapes (8 heads of 64, 8 layers), one thread, in one process.

    .venv/bin/python scripts/decode_attention_ab.py [--rows 32] [--own 300] [--shared 1000] [--runs 7]

Two workloads, each over histories the step reads from memory (caches flushed before every run):
- own rows: every one of `--rows` rows attends one query over its own `--own` rows (plus a few, so lengths
  differ), the work SDPA does as one flash call per row and layer;
- shared rows: 8, 16 and 32 queries attend the same `--shared` rows, as a group of one caller's sequences does.
It prints the median milliseconds of 8 layers for each, and reading the own rows with `torch.sum` (the floor).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from node.engine.cpu_kernels import load_kernels

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
LAYERS, HEADS, HEAD_DIM, SCALE = 8, 8, 64, 0.125


def median_ms(run: Callable[[int], object], runs: int, flush: torch.Tensor) -> float:
    times = []
    for _ in range(runs):
        flush.add_(1)  # evicts the histories from the caches
        started = time.perf_counter()
        for layer in range(LAYERS):
            run(layer)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--own", type=int, default=300)
    parser.add_argument("--shared", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found = load_kernels()
    assert found.kernels is not None, found.reason
    kernels = found.kernels
    flush = torch.zeros(40_000_000)
    lanes = [[(torch.randn(1, HEADS, 2048, HEAD_DIM), torch.randn(1, HEADS, 2048, HEAD_DIM)) for _ in range(LAYERS)]
             for _ in range(args.rows)]
    own = [[(keys[:, :, :args.own + row], values[:, :, :args.own + row]) for keys, values in layers]
           for row, layers in enumerate(lanes)]
    queries = torch.randn(args.rows, HEADS, HEAD_DIM)
    out, lse = torch.empty_like(queries), torch.empty(args.rows, HEADS)
    work = torch.zeros(64 * (HEAD_DIM + 2048))

    def own_flash(layer: int) -> None:
        for row in range(args.rows):
            keys, values = own[row][layer]
            FLASH(queries[row].view(1, HEADS, 1, HEAD_DIM), keys, values, 0.0, False, scale=SCALE)

    def own_native(layer: int) -> None:
        assert kernels.decode_attention(queries, [own[row][layer] for row in range(args.rows)], SCALE, out, lse, work)

    def own_read(layer: int) -> None:
        for row in range(args.rows):
            keys, values = own[row][layer]
            keys.sum()
            values.sum()

    print(f"own rows: {args.rows} rows of about {args.own}, 8 layers, ms")
    for _ in range(2):
        sdpa, native = median_ms(own_flash, args.runs, flush), median_ms(own_native, args.runs, flush)
        print(f"  SDPA {sdpa:6.2f}   native {native:6.2f}   read only {median_ms(own_read, args.runs, flush):6.2f}")
    print(f"shared rows: {args.shared} rows, 8 layers, ms")
    shared = [(keys[:, :, :args.shared], values[:, :, :args.shared]) for keys, values in lanes[0]]
    for group in (8, 16, 32):
        mine = torch.randn(group, HEADS, HEAD_DIM)
        stacked = mine.transpose(0, 1).reshape(1, HEADS * group, HEAD_DIM).contiguous()
        many_out, many_lse = torch.empty_like(stacked), torch.empty(1, HEADS * group)

        def shared_flash(layer: int, mine: torch.Tensor = mine, group: int = group) -> None:
            keys, values = shared[layer]
            FLASH(mine.transpose(0, 1).reshape(1, HEADS, group, HEAD_DIM), keys, values, 0.0, False, scale=SCALE)

        def shared_native(layer: int, stacked: torch.Tensor = stacked, many_out: torch.Tensor = many_out,
                          many_lse: torch.Tensor = many_lse) -> None:
            assert kernels.decode_attention(stacked, [shared[layer]], SCALE, many_out, many_lse, work)

        for _ in range(2):
            print(f"  {group:2d} queries: SDPA {median_ms(shared_flash, args.runs, flush):6.2f}"
                  f"   native {median_ms(shared_native, args.runs, flush):6.2f}")


if __name__ == "__main__":
    main()
