"""A/B the greedy token of a batched step's rows from the output head: the hand-written int8 screen
(`tz_head_argmax`), the library's int8 product with the same exact pick (`torch._int_mm`, then `tz_head_pick`) and
oneDNN's float32 head with `argmax`, on the default model's head, one thread, in one process.

    .venv/bin/python scripts/head_ab.py [--rows 8,12,16,24,32] [--runs 9]

The rows are final hidden states of the default model over a random prompt; the head is read from memory (caches
flushed before every run). It prints the median milliseconds of each and whether each agrees with the argmax of
the float32 logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from node.config import tenzro_home
from node.engine import cpu_kernels
from node.engine.cpu_kernels import load_kernels
from node.engine.kernel_operands import PackedHead
from node.engine.loader import DEFAULT_MODEL, load_model, resolve_model_dir


def median_ms(run: Callable[[], object], runs: int, flush: torch.Tensor) -> float:
    times = []
    for _ in range(runs):
        flush.add_(1)
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,12,16,24,32")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = load_kernels().kernels
    if kernels is None:
        raise SystemExit(f"no native kernels here: {load_kernels().reason}")
    model = load_model(*resolve_model_dir(DEFAULT_MODEL, tenzro_home())).model
    head = kernels.pack_head(model.lm_head.weight)
    if head.rows is None:
        raise SystemExit("no exact library int8 product on this CPU (no VNNI or AMX)")
    ids = torch.randint(100, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(3))
    hidden = model.model(input_ids=ids).last_hidden_state[0]
    flush = torch.empty(128 << 20, dtype=torch.uint8)
    print(f"{'rows':>4}  {'hand-written':>12}  {'library':>8}  {'oneDNN':>7}  agree")
    for count in (int(part) for part in args.rows.split(",")):
        times, agree = measure(kernels, head, model.lm_head.weight.detach(), hidden[:count].contiguous(), args.runs,
                               flush)
        print(f"{count:>4}  {times[0]:>12.2f}  {times[1]:>8.2f}  {times[2]:>7.2f}  {agree}")


def measure(kernels: cpu_kernels.CpuKernels, head: PackedHead, weight: torch.Tensor, x: torch.Tensor,
            runs: int, flush: torch.Tensor) -> tuple[list[float], bool]:
    """Median ms of the three for the rows `x`, and whether both screens agree with oneDNN's argmax."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=x.shape[0])

    def onednn() -> list[int]:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").argmax(-1).tolist()

    def hand() -> list[int | None]:
        return kernels.head_argmax(x, replace(head, rows=None))

    def library() -> list[int | None]:
        saved, cpu_kernels.LIBRARY_SCREEN_ROWS = cpu_kernels.LIBRARY_SCREEN_ROWS, 1
        try:
            return kernels.head_argmax(x, head)
        finally:
            cpu_kernels.LIBRARY_SCREEN_ROWS = saved

    times = [median_ms(run, runs, flush) for run in (hand, library, onednn)]
    return times, hand() == onednn() and library() == onednn()


if __name__ == "__main__":
    main()
