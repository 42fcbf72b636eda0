"""The CPU kernels of `kernels/cpu_kernels.cpp`: built when the project is installed (setup.py), called
through ctypes (which releases the GIL, so the event loop keeps serving during a forward).

They exist for the few-token forwards of a resumed prompt on one thread, where library kernels leave
memory traffic and arithmetic serial (see the source's header), and for the attention of a batched decode
step over each row's own history (`decode_attention`, A/B in BATCHING.md). A machine without AVX-512, an install
that could not build them, or `TENZRO_NATIVE=off` gets no kernels from `load_kernels`, with the reason,
and the engine runs transformers' own forward instead.

This module finds the library and makes the typed calls: each checks the shapes it is given and passes
addresses. What the calls are handed (packed weights and heads, rows by address, the decoder's C structs) is
laid out in `kernel_operands.py`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from node.engine.kernel_operands import (
    ALIGNMENT,
    Int8Head,
    NativeDecoder,
    PackedHead,
    PackedWeight,
    RowsAt,
    aligned_empty,
    start_address,
)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "tz_packed_floats": ([_i64, _i64], _i64),
    "tz_pack": ([_ptr, _i64, _i64, _i64, _i64, _ptr], None),
    "tz_gemm": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, ctypes.c_int, _ptr], None),
    "tz_attention": ([_ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _f32, _ptr,
                      _i64, _ptr], ctypes.c_int),
    "tz_decode_attention": ([_i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _f32,
                             _ptr, _i64, _ptr, _ptr, _i64], ctypes.c_int),
    "tz_append_rows": ([_i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr], None),
    "tz_pack_screen": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr], None),
    "tz_head_argmax": ([_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr], None),
    "tz_head_pick": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr],
                     None),
    "tz_decoder_forward": ([_ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int, _ptr, _ptr],
                           ctypes.c_int),
    "tz_rmsnorm": ([_ptr, _i64, _i64, _i64, _ptr, _f32, _ptr, _i64], None),
    "tz_rope": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], None),
    "tz_silu_mul": ([_ptr, _i64, _i64, _ptr], None),
}


MAX_CANDIDATES = 64
"""Rows the greedy screen recomputes exactly at most; beyond that the full logits are cheaper to reason about."""
LIBRARY_SCREEN_ROWS = 12
"""Rows of x from which `head_argmax` screens through the library's int8 product (`torch._int_mm`, codes of x
and of the head's rows, VNNI dot products) instead of the hand-written screen (int8 codes of the head times
float32 x). Below it the hand-written screen, which reads the head's codes once at memory speed, is ahead; from
it the library's int8 arithmetic is (`scripts/head_ab.py`; BATCHING.md, "The head of a batched step"; RESULTS.md,
2026-12-04)."""
INT8_FLAGS = ("avx512_vnni", "amx_int8")
"""CPU features whose int8 dot products sum into 32 bits without saturating (one of them is needed)."""


CHECKED_COLUMNS = 2048
"""Columns of a head's codes `int8_products_exact` multiplies (the instructions a library picks do not depend on
the width; a large vocabulary's exact product in float64 would take gigabytes)."""


def int8_products_exact(codes: torch.Tensor, generator_seed: int = 0) -> bool:
    """Whether `torch._int_mm` against `codes` (int8 `[in, out]`) gives the exact integer products on this CPU:
    x of full-scale codes of random signs, the case where a product that adds pairs in 16 bits saturates."""
    generator = torch.Generator().manual_seed(generator_seed)
    signs = torch.randint(0, 2, (17, codes.shape[0]), generator=generator, dtype=torch.int8) * 2 - 1
    x = signs * 127
    x[0] = 127
    codes = codes[:, :CHECKED_COLUMNS]
    extreme = (torch.randint(0, 2, codes.shape, generator=generator, dtype=torch.int8) * 2 - 1) * 127
    return all(torch.equal(torch._int_mm(x, right).double(), x.double() @ right.double())
               for right in (codes, extreme))


def _int8_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `matrix` as int8 codes over its own scale (its largest |value| / 127, or 1 for a row of
    zeros): (codes, scale), the row about `scale * codes`."""
    largest = matrix.abs().amax(1)
    scale = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
    return torch.round(matrix / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


_Ready = ctypes.CFUNCTYPE(None, ctypes.c_int64)
"""`tz_decoder_forward`'s callback before a layer's attention; ctypes takes the interpreter lock around it."""



def _contiguous_rows(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.stride(-1) == 1


class CpuKernels:
    """Typed calls into the built library. Tensors are float32 on the CPU; shapes are in each docstring."""

    def __init__(self, library: ctypes.CDLL) -> None:
        for name, (arguments, result) in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, result
        self._lib = library

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """Pack `weight` `[out, in]` (any strides, e.g. a transposed view)."""
        weight = weight.detach().float()
        out_features, in_features = weight.shape
        data = aligned_empty(self._lib.tz_packed_floats(in_features, out_features))
        self._lib.tz_pack(weight.data_ptr(), in_features, out_features, weight.stride(0), weight.stride(1),
                          data.data_ptr())
        packed_bias = None if bias is None else bias.detach().float().contiguous()
        return PackedWeight(data, in_features, out_features, packed_bias)

    def pack_head(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedHead:
        """Pack an output head `weight` `[out, in]` (any strides) for `gemm` and `head_argmax`."""
        packed = self.pack(weight, bias)
        weight = weight.detach().float()
        out_features, in_features = weight.shape
        codes = aligned_empty(self._lib.tz_packed_floats(in_features, out_features), torch.int8)
        scale = torch.empty(out_features)
        slack = torch.empty(out_features, dtype=torch.float64)
        self._lib.tz_pack_screen(weight.data_ptr(), in_features, out_features, weight.stride(0), weight.stride(1),
                                 codes.data_ptr(), scale.data_ptr(), slack.data_ptr())
        bias_slack = None
        if packed.bias is not None:
            unit = 2.0 ** -24
            gamma = (in_features + 1) * unit / (1 - (in_features + 1) * unit)
            bias_slack = 2 * gamma * packed.bias.double().abs()
        return PackedHead(packed, codes, scale, slack, bias_slack, self._int8_head(weight))

    @staticmethod
    def _int8_head(weight: torch.Tensor) -> Int8Head | None:
        """`weight` `[out, in]` as `Int8Head`, where this CPU has int8 dot products and the library's product
        is exact on them; else None."""
        flags = _cpu_flags() or frozenset()
        if not any(flag in flags for flag in INT8_FLAGS):
            return None
        codes, scale = _int8_rows(weight)
        wide = weight.double()
        residual = (scale.double()[:, None] * codes.double() - wide).norm(dim=1)
        head = Int8Head(codes.t(), scale, wide.norm(dim=1), residual)
        return head if int8_products_exact(head.codes) else None

    def head_argmax(self, x: torch.Tensor, head: PackedHead) -> list[int | None]:
        """For each row of x `[M, in]` (rows contiguous), the index `torch.argmax` gives on the logits
        `gemm(x, head.weight)` computes for it, found from the int8 screen of every head row (read once for all
        M) and the float32 weights of the few rows it cannot rule out; None for a row where the screen cannot
        decide (a non-finite value, or more than MAX_CANDIDATES rows left), whose caller computes its logits."""
        assert x.dim() == 2 and _contiguous_rows(x) and x.shape[1] == head.in_features
        if head.rows is not None and x.shape[0] >= LIBRARY_SCREEN_ROWS:
            return self._library_argmax(x, head, head.rows)
        screen = torch.empty(x.shape[0], head.out_features)
        found = torch.empty(x.shape[0], dtype=torch.int64)
        bias = head.weight.bias
        self._lib.tz_head_argmax(x.data_ptr(), x.shape[0], x.stride(0), head.in_features, head.weight.data.data_ptr(),
                                 head.codes.data_ptr(), head.out_features, head.scale.data_ptr(),
                                 None if bias is None else bias.data_ptr(), head.slack.data_ptr(),
                                 None if head.bias_slack is None else head.bias_slack.data_ptr(),
                                 screen.data_ptr(), MAX_CANDIDATES, found.data_ptr())
        return [None if index < 0 else index for index in found.tolist()]

    def _library_argmax(self, x: torch.Tensor, head: PackedHead, rows: Int8Head) -> list[int | None]:
        """`head_argmax` from the library's int8 product of x's rows, each coded over its own scale, and the
        head's codes; the same pick makes each row's answer exact (`tz_head_pick`)."""
        coded, unit = _int8_rows(x)
        products = torch._int_mm(coded, rows.codes)
        found = torch.empty(x.shape[0], dtype=torch.int64)
        bias, bias_slack = head.weight.bias, head.bias_slack
        self._lib.tz_head_pick(x.data_ptr(), x.shape[0], x.stride(0), head.in_features, head.weight.data.data_ptr(),
                               head.out_features, None if bias is None else bias.data_ptr(), products.data_ptr(),
                               coded.data_ptr(), unit.data_ptr(), rows.scale.data_ptr(), rows.norm.data_ptr(),
                               rows.residual.data_ptr(), None if bias_slack is None else bias_slack.data_ptr(),
                               MAX_CANDIDATES, found.data_ptr())
        return [None if index < 0 else index for index in found.tolist()]

    def gemm(self, x: torch.Tensor, weight: PackedWeight, out: torch.Tensor, accumulate: bool = False,
             then: PackedWeight | PackedHead | None = None) -> None:
        """`out[M, out] (+)= x[M, in] @ weight.T + bias`; rows of x and out may be strided. `then`, the weight
        the caller multiplies by next, has its first panel prefetched meanwhile."""
        assert _contiguous_rows(x) and _contiguous_rows(out) and x.shape[1] == weight.in_features
        assert out.shape == (x.shape[0], weight.out_features)
        bias = weight.bias.data_ptr() if weight.bias is not None else None
        self._lib.tz_gemm(x.data_ptr(), x.shape[0], weight.in_features, x.stride(0), weight.data.data_ptr(),
                          weight.out_features, out.data_ptr(), out.stride(0), bias, int(accumulate),
                          start_address(then))

    def attention(self, q: torch.Tensor, segments: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int,
                  scale: float, out: torch.Tensor, then: PackedWeight | PackedHead | None = None) -> bool:
        """Causal attention of q `[T, heads, head_dim]` at positions `start..start+T-1` into out
        `[T, heads * head_dim]`, over keys and values given as pieces in position order, each
        `[1, kv_heads, n, head_dim]` with contiguous rows (a restored prefix and the working buffer need not
        be joined first). False when the shapes are not ones the kernel takes (then nothing was written).
        `then`, the weight read next, starts streaming in during the last head."""
        tokens, heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim or not segments:
            return False
        kv_heads = segments[0][0].shape[1]
        for keys, values in segments:
            if (keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != head_dim
                    or keys.shape != values.shape or keys.shape[1] != kv_heads or keys.shape[3] != head_dim):
                return False
        count = len(segments)
        key_pointers = (ctypes.c_void_p * count)(*(k.data_ptr() for k, _ in segments))
        value_pointers = (ctypes.c_void_p * count)(*(v.data_ptr() for _, v in segments))
        head_strides = (ctypes.c_int64 * count)(*(k.stride(1) for k, _ in segments))
        lengths = (ctypes.c_int64 * count)(*(k.shape[2] for k, _ in segments))
        status = self._lib.tz_attention(q.data_ptr(), tokens, heads, kv_heads, head_dim, q.stride(0), count,
                                        key_pointers, value_pointers, head_strides, lengths, start, scale,
                                        out.data_ptr(), out.stride(0), start_address(then))
        return bool(status == 0)

    def decode_attention(self, queries: torch.Tensor, history: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         scale: float, out: torch.Tensor, lse: torch.Tensor, work: torch.Tensor) -> bool:
        """One query per row over that row's own keys and values (a decode step of many sequences): queries
        `[R, heads, head_dim]` contiguous, `history[r]` row r's keys and values `[1, kv_heads, n_r, head_dim]`
        with contiguous rows; out `[R, heads, head_dim]` and each head's log-sum-exp of its scaled scores, lse
        `[R, heads]`, both contiguous. `work` (zeroed by its owner, 64-byte aligned) holds at least
        `decode_work_floats` floats. False when the shapes are not ones the kernel takes
        (then nothing was written). One row of many heads per key/value head is many queries over the same
        rows: each row of keys and values is read once for a few of them at a time."""
        rows = self.rows_at(history, queries.shape[-1])
        return rows is not None and self.decode_attention_at(queries, rows, scale, out, lse, work)

    @staticmethod
    def rows_at(history: Sequence[tuple[torch.Tensor, torch.Tensor]], head_dim: int) -> RowsAt | None:
        """The addresses of `history`'s views (`decode_attention`), or None unless each is `[1, kv_heads, n,
        head_dim]` with rows of head_dim contiguous and keys and values strided alike."""
        if not history:
            return None
        kv_heads = history[0][0].shape[1]
        for keys, values in history:
            if (keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != head_dim
                    or keys.shape != values.shape or keys.shape[1] != kv_heads or keys.shape[3] != head_dim):
                return None
        return RowsAt([k.data_ptr() for k, _ in history], [v.data_ptr() for _, v in history],
                      [k.stride(1) for k, _ in history], [k.shape[2] for k, _ in history], kv_heads)

    def decode_attention_at(self, queries: torch.Tensor, rows: RowsAt, scale: float, out: torch.Tensor,
                            lse: torch.Tensor, work: torch.Tensor) -> bool:
        """`decode_attention` over rows given by address (`RowsAt`, whose maker vouches for their layout); the
        other arguments and the result as there."""
        return self.decode_attention_groups(queries, rows, (), scale, out, lse, work)

    def decode_attention_groups(self, queries: torch.Tensor, rows: RowsAt, groups: Sequence[tuple[Sequence[int], int]],
                                scale: float, out: torch.Tensor, lse: torch.Tensor, work: torch.Tensor) -> bool:
        """`decode_attention_at` where each of `groups`, (members, length), is rows whose histories begin with the
        same `length` rows (value for value; each member has at least one more): those are read once, from the
        first member's buffers, for all the members' queries, and merged with each member's own rest. One call for
        a layer of a decode step; False (nothing written) for shapes or groups the kernel does not take."""
        count, heads, head_dim = queries.shape
        kv_heads = rows.kv_heads
        group = [-1] * count
        for index, (members, _) in enumerate(groups):
            for member in members:
                if not 0 <= member < count or group[member] != -1:
                    return False
                group[member] = index
        if (heads % kv_heads or len(rows.lengths) != count or min(rows.lengths) < 1
                or not (queries.is_contiguous() and out.is_contiguous() and lse.is_contiguous())
                or out.shape != queries.shape or lse.shape != (count, heads) or not work.is_contiguous()
                or work.data_ptr() % ALIGNMENT or any(len(members) < 2 for members, _ in groups)):
            return False
        size = len(groups)
        status = self._lib.tz_decode_attention(
            count, heads, kv_heads, head_dim, queries.data_ptr(), heads * head_dim,
            (ctypes.c_void_p * count)(*rows.keys), (ctypes.c_void_p * count)(*rows.values),
            (ctypes.c_int64 * count)(*rows.strides), (ctypes.c_int64 * count)(*rows.lengths),
            (ctypes.c_int64 * count)(*group), size, (ctypes.c_int64 * size)(*(members[0] for members, _ in groups)),
            (ctypes.c_int64 * size)(*(length for _, length in groups)), scale, out.data_ptr(), heads * head_dim,
            lse.data_ptr(), work.data_ptr(), work.numel())
        return bool(status == 0)

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor, rows: RowsAt, positions: Sequence[int]) -> bool:
        """Write a decode step's new rows, keys and values `[R, kv_heads, 1, head_dim]` (float32, the same strides
        over rows and heads, head_dim contiguous), into the buffers `rows` names, row r at row `positions[r]`. False
        (nothing written) for other shapes."""
        count, kv_heads, one, head_dim = keys.shape
        if (one != 1 or keys.stride()[:2] != values.stride()[:2] or not _contiguous_rows(keys)
                or not _contiguous_rows(values) or values.shape != keys.shape or kv_heads != rows.kv_heads
                or len(rows.keys) != count or len(positions) != count):
            return False
        self._lib.tz_append_rows(count, kv_heads, head_dim, keys.data_ptr(), values.data_ptr(), keys.stride(0),
                                 keys.stride(1), (ctypes.c_void_p * count)(*rows.keys),
                                 (ctypes.c_void_p * count)(*rows.values), (ctypes.c_int64 * count)(*rows.strides),
                                 (ctypes.c_int64 * count)(*positions))
        return True

    def decoder_forward(self, decoder: NativeDecoder, ids: Sequence[int], start: int, cos: torch.Tensor,
                        sin: torch.Tensor, work: torch.Tensor, logits: bool, last: torch.Tensor,
                        ready: Callable[[int], None] | None = None) -> None:
        """Run the tokens `ids` at positions `start..` through every layer of `decoder`, whose layers' caches
        are set; cos/sin `[T, head_dim]`; work holds at least `decoder.work_floats(T)` floats. With `logits`,
        the last token's final normed hidden state goes to `last` `[hidden]`; without, the last layer stops
        once its K/V are written. `ready(layer)`, if given, runs before a layer's attention reads its stored
        rows (it must not raise)."""
        tokens = len(ids)
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[0] == tokens
        assert work.numel() >= decoder.work_floats(tokens) and last.numel() == decoder.hidden
        if min(ids) < 0 or max(ids) >= decoder.vocab:
            raise ValueError(f"token ids must lie in [0, {decoder.vocab})")
        status = self._lib.tz_decoder_forward(ctypes.addressof(decoder.model), ctypes.addressof(decoder.structs),
                                              len(decoder.layers), (ctypes.c_int64 * tokens)(*ids), tokens, start,
                                              cos.data_ptr(), sin.data_ptr(), work.data_ptr(), int(logits),
                                              last.data_ptr(), None if ready is None else _Ready(ready))
        if status != 0:
            raise RuntimeError("tz_decoder_forward refused its shapes")

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        """out `[T, N]` = weight * x / sqrt(mean(x^2) + eps), per row of x `[T, N]`."""
        assert _contiguous_rows(x) and _contiguous_rows(out) and weight.is_contiguous()
        self._lib.tz_rmsnorm(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), eps,
                             out.data_ptr(), out.stride(0))

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding in place on the first `heads` heads of each row of x `[T, >= heads * head_dim]`;
        cos and sin `[T, head_dim]`, contiguous."""
        assert _contiguous_rows(x) and cos.is_contiguous() and sin.is_contiguous()
        self._lib.tz_rope(x.data_ptr(), x.shape[0], heads, head_dim, x.stride(0), cos.data_ptr(), sin.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out `[T, I]` = silu(gate_up[:, :I]) * gate_up[:, I:], both contiguous."""
        assert gate_up.is_contiguous() and out.is_contiguous() and gate_up.shape[1] == 2 * out.shape[1]
        self._lib.tz_silu_mul(gate_up.data_ptr(), gate_up.shape[0], out.shape[1], out.data_ptr())


REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma")
"""What the library is built for (x86-64-v4, setup.py) and what the CPU must report before it is called."""

NATIVE_SWITCH = "TENZRO_NATIVE"
"""`TENZRO_NATIVE=off` (or 0, false, no) keeps every model on transformers' forward: the fallback path,
tested on machines that could run the kernels."""


def native_switched_off() -> bool:
    return os.environ.get(NATIVE_SWITCH, "").strip().lower() in ("off", "0", "false", "no")


def _cpu_flags() -> frozenset[str] | None:
    """The first CPU's feature flags, or None where /proc/cpuinfo cannot be read."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in info.splitlines() if line.startswith("flags")), None)
    return None if line is None else frozenset(line.partition(":")[2].split())


def library_path() -> Path | None:
    """Where the install put the built library (`node/engine/_cpu_kernels*.so`), or None: not built."""
    spec = importlib.util.find_spec(f"{__package__}._cpu_kernels")
    return None if spec is None or spec.origin is None else Path(spec.origin)


@dataclass(frozen=True, slots=True)
class KernelsFound:
    """The kernels when this machine can run them, else None and why not."""

    kernels: CpuKernels | None
    reason: str


def load_kernels(library: Path | None = None) -> KernelsFound:
    """The kernels built at install (or `library`), where this process may and this CPU can run them."""
    if native_switched_off():
        return KernelsFound(None, f"switched off by {NATIVE_SWITCH}={os.environ[NATIVE_SWITCH]}")
    if platform.machine() not in ("x86_64", "AMD64"):
        return KernelsFound(None, f"the native kernels are x86-64 code; this CPU is {platform.machine()}")
    flags = _cpu_flags()
    if flags is None:
        return KernelsFound(None, "the CPU's features cannot be read (/proc/cpuinfo)")
    missing = [flag for flag in REQUIRED_FLAGS if flag not in flags]
    if missing:
        best = "AVX2" if "avx2" in flags else "no AVX2"
        return KernelsFound(None, f"this CPU has no AVX-512 ({best}; missing {', '.join(missing)})")
    library = library or library_path()
    if library is None or not library.is_file():
        return KernelsFound(None, "the native kernels were not built when the node was installed "
                                  "(no C++ compiler then?); reinstall with g++ present to get them")
    try:
        return KernelsFound(CpuKernels(ctypes.CDLL(str(library))), f"AVX-512 kernels from {library.name}")
    except (OSError, AttributeError) as exc:  # a library that does not load, or lacks a function
        return KernelsFound(None, f"the native kernels do not load: {exc}")
