"""A/B the node's native CPU ops against torch's own on the batched decode step of the default model, one thread,
in one process: the GEMM on its packed panels, RMSNorm, RoPE and SiLU-and-mul (issue 37 item 4).

    .venv/bin/python scripts/native_ab.py [--rows 1,8,32] [--runs 41] [--quick] [--size default] [--out FILE.json]

The model is the embedded default (`tenzro models init`'s dense recipe at `--size`, seeded as `init_model` seeds
it, so its weights are the served model's), built in memory. Each op is timed for one decode step of `--rows`
sequences: every linear layer of the 8 decoder layers (the output head has its own A/B, `head_ab.py`), the 17
RMSNorms (two per layer and the final one), 8 RoPEs and 8 SiLU-and-muls. The arms:

- GEMM: `tz_gemm` on the kernels' panels (`CpuKernels.pack`; each call prefetching the next weight, as
  `tz_decoder_forward` chains them), against torch's `F.linear` on the plain `[out, in]` weight (`nn.Linear`;
  aten's mm, on the BLAS torch was built with), `x @ weight_t` on the contiguous `[in, out]` copy (the node's
  `TransposedLinear` for one row) and oneDNN's `mkldnn._linear_pointwise` on the weight oneDNN packed for
  `PACK_ROWS_HINT` rows (`TransposedLinear` for two rows or more). That oneDNN path is the one torch's own
  compiler emits for a frozen CPU linear, on dense inputs; `torch._C._nn.mkldnn_linear` wants oneDNN's opaque
  tensors, so each call would convert x to them and back, and `torch.backends.mkldnn` only holds switches. All
  arms multiply the same fused weights (q, k and v as one, gate and up as one), so they do the same work; each
  arm's copy of the weights (about 100 MB at the default size) exceeds the last-level cache, so every step reads
  its weights from memory, as the node's does.
- RMSNorm: `tz_rmsnorm` against transformers' `LlamaRMSNorm` (the module the model runs) and `F.rms_norm`.
- RoPE: `tz_rope` in place on the q and k heads of each layer's fused projection against transformers'
  `apply_rotary_pos_emb` on the q and k views the attention module makes, with each row at its own position.
- SiLU-and-mul: `tz_silu_mul` on the fused gate/up rows against the MLP's `act_fn(gate) * up`.

The three small native ops run inside `tz_decoder_forward`, called from C; here they are called through ctypes
with their arguments prepared, and the cost of a ctypes call that does no work is printed beside them.
Before any timing, every torch arm's outputs are compared with the native arm's: an arm more than the case's
tolerance away (max |difference| over max(1, max |native|)) stops the script, nothing timed. Then the arms
alternate, their order rotating from one repetition to the next, and the table gives each arm's median
microseconds per decode step with its interquartile range. The native op wins where its upper quartile lies
below the lower quartile of the fastest torch arm, loses in the mirror case, and is within the spread
otherwise. `--out` writes the same as JSON, with the machine and its load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama

from node.engine.cpu_kernels import CpuKernels, load_kernels
from node.engine.cpu_layout import PACK_ROWS_HINT
from node.engine.kernel_operands import PackedWeight
from node.engine.synthetic import FAMILIES, SEED, SIZES

RUNS, QUICK_RUNS = 41, 5
TOLERANCE = 1e-5
"""Largest |difference| between an arm's outputs and the native arm's, relative to max(1, max |native|): float32
sums in another order, and the native exp's polynomial (relative error about 1e-7), stay far below it."""
POSITION = 1000
"""Where the step's rows stand (row r at POSITION + 3r): histories of about a thousand tokens, as in `bench load`."""
NO_WORK_CALLS = 1000


class Disagreement(RuntimeError):
    """An arm's outputs differ from the native arm's by more than the tolerance: timing them would compare
    different computations."""


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    run: Callable[[], Any]
    """One decode step's calls of the op."""
    outputs: Callable[[Any], list[torch.Tensor]] = list
    """`run`'s result as tensors laid out as the native arm's (for the check, outside the timing)."""


@dataclass(frozen=True, slots=True)
class Case:
    """One op at one batch size: the native arm first, then torch's."""

    op: str
    rows: int
    calls: int
    """Calls of the op in one decode step of the model."""
    arms: tuple[Arm, ...]
    tolerance: float = TOLERANCE


@dataclass(frozen=True, slots=True)
class Spread:
    """Microseconds per decode step over the repetitions."""

    median: float
    q1: float
    q3: float
    least: float
    most: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Spread:
        us = sorted(1e6 * s for s in seconds)
        q1, _, q3 = statistics.quantiles(us, n=4, method="inclusive") if len(us) > 1 else (us[0],) * 3
        return cls(statistics.median(us), q1, q3, us[0], us[-1])


@dataclass(frozen=True, slots=True)
class Result:
    op: str
    rows: int
    calls: int
    tolerance: float
    difference: dict[str, float]
    """Each torch arm's largest relative difference from the native arm."""
    times: dict[str, Spread]
    verdict: str
    """"native wins", "torch wins" or "within spread", against the torch arm of the lowest median."""


@dataclass(frozen=True, slots=True)
class Layer:
    """One decoder layer's linear weights, fused as the native decoder fuses them: q/k/v, o, gate/up, down."""

    plain: list[torch.Tensor]
    """`[out, in]`, contiguous."""
    transposed: list[torch.Tensor]
    """`[in, out]`, contiguous."""
    onednn: list[torch.Tensor]
    native: list[PackedWeight]


@dataclass(frozen=True, slots=True)
class NativeCalls:
    """A small native op's calls for one decode step, through the ctypes function with its arguments prepared (no
    wrapper's checks timed); `tensors` keeps alive the memory the arguments point into."""

    function: Any
    arguments: list[tuple[Any, ...]]
    tensors: tuple[torch.Tensor, ...]

    def run(self) -> None:
        for prepared in self.arguments:
            self.function(*prepared)


def relative_difference(got: torch.Tensor, native: torch.Tensor) -> float:
    return float((got.reshape(native.shape) - native).abs().max()) / max(1.0, float(native.abs().max()))


def check(case: Case) -> dict[str, float]:
    """Each torch arm's relative difference from the native arm, from one run of each; raises `Disagreement`
    where one exceeds the case's tolerance. Runs every arm first (an in-place arm starts from its inputs)."""
    native, *others = case.arms
    expected = native.outputs(native.run())
    differences = {}
    for arm in others:
        got = arm.outputs(arm.run())
        if len(got) != len(expected):
            raise Disagreement(f"{case.op} at {case.rows} rows: {arm.name} gives {len(got)} outputs, "
                               f"{native.name} {len(expected)}")
        differences[arm.name] = max(relative_difference(g, e) for g, e in zip(got, expected, strict=True))
        if not differences[arm.name] <= case.tolerance:  # NaN included
            raise Disagreement(f"{case.op} at {case.rows} rows: {arm.name} differs from {native.name} by "
                               f"{differences[arm.name]:.1e} of the largest value (tolerance {case.tolerance:.0e}); "
                               f"not timed")
    return differences


def measure(case: Case, runs: int) -> Result:
    """Check the arms agree, warm each once, then time `runs` repetitions of each, alternating."""
    differences = check(case)
    for arm in case.arms:
        arm.run()  # oneDNN builds its kernel for a shape at the first call
    seconds: dict[str, list[float]] = {arm.name: [] for arm in case.arms}
    for repetition in range(runs):
        turn = repetition % len(case.arms)
        for arm in case.arms[turn:] + case.arms[:turn]:
            started = time.perf_counter()
            arm.run()
            seconds[arm.name].append(time.perf_counter() - started)
    times = {name: Spread.of(values) for name, values in seconds.items()}
    native = times[case.arms[0].name]
    best = min((times[arm.name] for arm in case.arms[1:]), key=lambda spread: spread.median)
    return Result(case.op, case.rows, case.calls, case.tolerance, differences, times, verdict(native, best))


def verdict(native: Spread, torch_best: Spread) -> str:
    """Who wins by more than the spread: one arm's upper quartile below the other's lower quartile."""
    if native.q3 < torch_best.q1:
        return "native wins"
    if torch_best.q3 < native.q1:
        return "torch wins"
    return "within spread"


def layers_of(model: Any, kernels: CpuKernels) -> list[Layer]:
    """Every decoder layer's fused weights in the four layouts (`Layer`)."""
    layers = []
    for decoder_layer in model.model.layers:
        attention, mlp = decoder_layer.self_attn, decoder_layer.mlp
        plain = [torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]),
                 attention.o_proj.weight.detach().clone(),
                 torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight.detach().clone()]
        layers.append(Layer([weight.detach().contiguous() for weight in plain],
                            [weight.t().contiguous() for weight in plain],
                            [torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) for weight in plain],
                            [kernels.pack(weight) for weight in plain]))
    return layers


def gemm_case(kernels: CpuKernels, layers: list[Layer], rows: int, generator: torch.Generator) -> Case:
    inputs = {width: torch.randn(rows, width, generator=generator)
              for width in {weight.shape[1] for layer in layers for weight in layer.plain}}
    chain = [(inputs[weight.in_features], weight) for layer in layers for weight in layer.native]
    following: list[PackedWeight | None] = [weight for _, weight in chain[1:]] + [None]  # what each call prefetches
    calls = [(x, weight, torch.empty(rows, weight.out_features), then)
             for (x, weight), then in zip(chain, following, strict=True)]
    plain = [(inputs[weight.shape[1]], weight) for layer in layers for weight in layer.plain]
    transposed = [(inputs[weight.shape[0]], weight) for layer in layers for weight in layer.transposed]
    onednn = [(inputs[weight.shape[1]], packed) for layer in layers
              for weight, packed in zip(layer.plain, layer.onednn, strict=True)]

    def native() -> list[torch.Tensor]:
        for x, weight, out, then in calls:
            kernels.gemm(x, weight, out, then=then)
        return [out for _, _, out, _ in calls]

    return Case("gemm", rows, len(calls), (
        Arm("native tz_gemm (panels)", native),
        Arm("F.linear [out,in]", lambda: [F.linear(x, weight) for x, weight in plain]),
        Arm("x @ weight_t [in,out]", lambda: [x @ weight for x, weight in transposed]),
        Arm("oneDNN packed", lambda: [torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                                      for x, packed in onednn]),
    ))


def rmsnorm_case(kernels: CpuKernels, model: Any, rows: int, generator: torch.Generator) -> Case:
    norms = [norm for layer in model.model.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms.append(model.model.norm)
    hidden = model.config.hidden_size
    x = torch.randn(rows, 1, hidden, generator=generator)
    outs = [torch.empty(rows, hidden) for _ in norms]
    calls = NativeCalls(kernels._lib.tz_rmsnorm, [
        (x.data_ptr(), rows, hidden, hidden, norm.weight.data_ptr(), float(norm.variance_epsilon), out.data_ptr(),
         hidden) for norm, out in zip(norms, outs, strict=True)], (x, *outs, *(norm.weight for norm in norms)))

    def native() -> list[torch.Tensor]:
        calls.run()
        return outs

    return Case("rmsnorm", rows, len(norms), (
        Arm("native tz_rmsnorm", native),
        Arm("transformers LlamaRMSNorm", lambda: [norm(x) for norm in norms]),
        Arm("F.rms_norm", lambda: [F.rms_norm(x, (hidden,), norm.weight, norm.variance_epsilon) for norm in norms]),
    ))


def rope_case(kernels: CpuKernels, model: Any, rows: int, generator: torch.Generator) -> Case:
    config, first = model.config, model.model.layers[0].self_attn
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, first.head_dim
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    positions = torch.tensor([POSITION + 3 * row for row in range(rows)]).unsqueeze(1)
    projections = [torch.randn(rows, q_width + 2 * kv_width, generator=generator) for _ in model.model.layers]
    cos, sin = model.model.rotary_emb(projections[0], positions)  # [rows, 1, head_dim]
    flat_cos, flat_sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    # transformers' attention views its q and k projections [rows, 1, heads * head_dim] as [rows, heads, 1, head_dim].
    views = [(q.contiguous().view(rows, 1, heads, head_dim).transpose(1, 2),
              k.contiguous().view(rows, 1, kv_heads, head_dim).transpose(1, 2))
             for q, k in ((p[:, :q_width], p[:, q_width:q_width + kv_width]) for p in projections)]
    buffers = [p.clone() for p in projections]  # the native arm rotates these in place
    calls = NativeCalls(kernels._lib.tz_rope, [
        (buffer.data_ptr(), rows, heads + kv_heads, head_dim, buffer.stride(0), flat_cos.data_ptr(),
         flat_sin.data_ptr()) for buffer in buffers], (flat_cos, flat_sin, *buffers))

    def native() -> list[torch.Tensor]:
        calls.run()
        return [buffer[:, :q_width + kv_width] for buffer in buffers]

    def as_rows(result: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.cat([q.transpose(1, 2).reshape(rows, q_width), k.transpose(1, 2).reshape(rows, kv_width)], 1)
                for q, k in result]

    return Case("rope", rows, len(buffers), (
        Arm("native tz_rope (in place)", native),
        Arm("transformers apply_rotary_pos_emb",
            lambda: [modeling_llama.apply_rotary_pos_emb(q, k, cos, sin) for q, k in views], as_rows),
    ))


def silu_case(kernels: CpuKernels, model: Any, rows: int, generator: torch.Generator) -> Case:
    mlp = model.model.layers[0].mlp
    size = mlp.intermediate_size
    gate_up = 3 * torch.randn(rows, 2 * size, generator=generator)
    gate, up = gate_up[:, :size].contiguous().view(rows, 1, size), gate_up[:, size:].contiguous().view(rows, 1, size)
    outs = [torch.empty(rows, size) for _ in model.model.layers]
    calls = NativeCalls(kernels._lib.tz_silu_mul, [(gate_up.data_ptr(), rows, size, out.data_ptr()) for out in outs],
                        (gate_up, *outs))

    def native() -> list[torch.Tensor]:
        calls.run()
        return outs

    return Case("silu_mul", rows, len(outs), (
        Arm("native tz_silu_mul", native),
        Arm("transformers act_fn(gate) * up", lambda: [layer.mlp.act_fn(gate) * up for layer in model.model.layers]),
    ))


def no_work_call_us(kernels: CpuKernels, runs: int) -> float:
    """Median microseconds of a ctypes call into the library that does no work (`tz_silu_mul` of no rows)."""
    function, seconds = kernels._lib.tz_silu_mul, []
    for _ in range(runs):
        started = time.perf_counter()
        for _ in range(NO_WORK_CALLS):
            function(None, 0, 0, None)
        seconds.append((time.perf_counter() - started) / NO_WORK_CALLS)
    return 1e6 * statistics.median(seconds)


def machine() -> dict[str, Any]:
    """What the run's figures depend on."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.partition(":")[2].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.partition(":")[2].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {"cpu": model or platform.processor(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "mkl": torch.backends.mkl.is_available(),
            "onednn": torch.backends.mkldnn.is_available(),
            "flags": sorted(flag for flag in flags if flag.startswith(("avx512", "amx")))}


def table(results: Sequence[Result]) -> str:
    lines = [f"{'op':<9}{'rows':>5}  {'arm':<34}{'median us':>11}{'q1-q3 us':>20}{'min-max us':>20}"
             f"{'x native':>9}  verdict"]
    for result in results:
        native = next(iter(result.times.values())).median
        for index, (name, spread) in enumerate(result.times.items()):
            note = result.verdict if index == 0 else f"diff {result.difference[name]:.1e}"
            lines.append(f"{result.op:<9}{result.rows:>5}  {name:<34}{spread.median:>11.1f}"
                         f"{f'{spread.q1:.1f}-{spread.q3:.1f}':>20}{f'{spread.least:.1f}-{spread.most:.1f}':>20}"
                         f"{spread.median / native:>9.2f}  {note}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32", help="batch sizes of the decode step")
    parser.add_argument("--runs", type=int, default=None, help=f"repetitions of each arm ({RUNS}; {QUICK_RUNS} quick)")
    parser.add_argument("--quick", action="store_true", help=f"a short run: {QUICK_RUNS} repetitions")
    parser.add_argument("--size", default="default", choices=sorted(SIZES), help="the model's size (small: tests)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    runs = args.runs or (QUICK_RUNS if args.quick else RUNS)
    found = load_kernels()
    if found.kernels is None:
        raise SystemExit(f"no native kernels to compare here: {found.reason}")
    kernels = found.kernels
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(FAMILIES["llama"](SIZES[args.size]), dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        layers = layers_of(model, kernels)
        for rows in (int(part) for part in args.rows.split(",")):
            generator = torch.Generator().manual_seed(rows)
            for case in (gemm_case(kernels, layers, rows, generator), rmsnorm_case(kernels, model, rows, generator),
                         rope_case(kernels, model, rows, generator), silu_case(kernels, model, rows, generator)):
                try:
                    results.append(measure(case, runs))
                except Disagreement as exc:
                    raise SystemExit(str(exc)) from exc
    results.sort(key=lambda result: (result.op, result.rows))
    floor = no_work_call_us(kernels, runs)
    load_after = os.getloadavg()
    print(f"{args.size} model, 1 torch thread, {runs} repetitions per arm, microseconds per decode step; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(table(results))
    print(f"a ctypes call into the kernels that does no work: {floor:.2f} us (the small native ops pay it per call "
          f"here, not inside tz_decoder_forward)")
    if args.out is not None:
        args.out.write_text(json.dumps({
            "command": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), "size": args.size,
            "runs": runs, "threads": torch.get_num_threads(), "tolerance": TOLERANCE,
            "load_average_before": load_before, "load_average_after": load_after, "no_work_call_us": floor,
            "results": [asdict(result) for result in results]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
