"""Decode steps at fixed addresses and shapes, replayed as CUDA graphs: a GPU's decode step without its launches.

On a GPU an eager decode step of a 1B model costs the same at one row and at 32: the host's Python and kernel
launches are the whole cost, and replaying the step's kernels as one captured CUDA graph removes 20-30x of it
(../shared/GPU-NOTES.md, "What plain transformers does on the same chip"). A graph replays kernels over the tensors
they were captured with, at fixed addresses and fixed shapes; the batched step of `batch_forward.py` attends each
row's own cache, ragged and moving, so it cannot be captured. This one can:

- Where it runs, the lanes' key and value buffers are one slab per layer (`Lanes.reserve(contiguous=True)`): lane
  i's buffers are index i of `[lanes + 1, kv_heads, rows, head_dim]` tensors, the last lane scratch. A sequence in a
  lane writes there as always (its working cache's layers are views of its lane); nothing is copied in or out.
- A step of sequences in lanes l_1..l_B runs the model on the first M lanes (M the smallest of `BATCHES` above the
  highest lane): lane l's row takes the token of its sequence, writes the new key and value at the sequence's length
  in lane l, and attends the first L rows of lane l (L the smallest of the `_lengths` past the longest sequence)
  under a mask that keeps rows `[0, length]`, through the model's own SDPA attention function. A lane with no
  sequence in the step writes into the scratch lane, attends one row, and its result is dropped: no row's result
  depends on another row's values (attention reads only the row's own lane; every other operation is per row).
- Every (M, L) is captured at start (`prepare`), over idle inputs (every lane writes into the scratch lane), each
  after one eager run of the same step (the warm-up a capture needs); the graphs share one memory pool. So no
  request waits for a capture, and no step's time tells whether an earlier step, another caller's, used its size
  first. A step's inputs are one static `[4, M]` tensor (token, position, length, write lane), copied in before
  each replay. Off CUDA (the CPU tests) the same step runs eagerly, which is how its results are checked against
  the per-row step.

It takes a step when every row's working cache is plain full attention in the slab, with room for the new row:
sliding-window and recurrent layers, a lane that outgrew its rows, rows still opening or held by reference first
take the per-row step (`batch_forward.py`). Nothing looks across scopes: each row reads only its own lane's rows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.modeling_utils import AttentionInterface

from cache.working_cache import GrowableKVLayer

log = logging.getLogger(__name__)

STATIC = "tenzro_static"
"""The attention implementation a static step switches the model's configs to."""
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Rows a captured step runs (lanes `[0, M)`): a step takes the smallest that covers its highest lane, or all the
lanes. Doubling keeps the graphs few (one per size and length) and a step's wasted rows under half."""
FIRST_LENGTH = 256
"""The shortest history a captured step attends; longer ones double up to the lanes' rows."""
_STEP = threading.local()
"""The static step running on this thread, if any."""


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a step's sequences are: each one's lane and length (the row its new key and value go to)."""

    lanes: tuple[int, ...]
    lengths: tuple[int, ...]
    layers: tuple[tuple[GrowableKVLayer, ...], ...]
    """Each sequence's layers, which `advance` once the step has written their row."""


class _SlabCache(Cache):
    """The cache a static step passes the model: layer i's update writes each lane's new key and value at its
    length in its write lane and returns the first L rows of lanes `[0, M)`."""

    def __init__(self, owner: StaticDecode, rows: int, length: int) -> None:
        super().__init__(layers=[_LAYER] * len(owner.slabs))
        self.owner, self.rows, self.length = owner, rows, length
        at, write = owner.inputs[2, :rows], owner.inputs[3, :rows]
        self.at, self.write = at, write
        self.mask = (owner.columns[:length].unsqueeze(0) <= at.unsqueeze(1))[:, None, None, :]
        """`[M, 1, 1, L]`: lane m's query keeps rows `[0, length]` (its history and its new row)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.owner.slabs[layer_idx]
        keys[self.write, :, self.at] = key_states[:, :, 0]
        values[self.write, :, self.at] = value_states[:, :, 0]
        return keys[:self.rows, :, :self.length], values[:self.rows, :, :self.length]


_LAYER: Any = object()
"""A `_SlabCache` layer: the slab holds the state, nothing per layer object."""


def _static_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The model's own attention function over the lanes' rows, under the step's mask."""
    step: _SlabCache = _STEP.cache
    return step.owner.inner(module)(module, query, key, value, step.mask, *args, **kwargs)


AttentionInterface.register(STATIC, _static_attention)


class StaticDecode:
    """Static decode steps over the lanes' slabs (`Lanes.slabs`), captured as CUDA graphs where `capture`.

    `configs` and `implementations`: the model's configs and their own attention implementations, which a step
    switches away from and back; `inner(module)`: a module's own attention function (`BatchedDecode`'s)."""

    def __init__(self, model: Any, slabs: dict[int, torch.Tensor], configs: Sequence[Any],
                 implementations: Sequence[str | None], inner: Any, capture: bool) -> None:
        layers = len(slabs) // 2
        self.model = model
        self.slabs = [(slabs[2 * layer], slabs[2 * layer + 1]) for layer in range(layers)]
        first = self.slabs[0][0]
        self.lanes = first.shape[0] - 1
        """Lanes in the slab (the last index is scratch)."""
        self.rows = first.shape[2]
        self.device = first.device
        self._configs, self._implementations, self.inner = list(configs), list(implementations), inner
        self.inputs = torch.zeros(4, self.lanes, dtype=torch.long, device=self.device)
        """Per lane: token, position, length, write lane (the static inputs every captured step reads)."""
        self.columns = torch.arange(self.rows, device=self.device)
        self._starts = [(keys.data_ptr(), keys.stride(0) * keys.element_size(),
                         values.data_ptr(), values.stride(0) * values.element_size()) for keys, values in self.slabs]
        self.capture = capture and self.device.type == "cuda"
        self.reason = ("decode steps replay as CUDA graphs, one per batch size and history length"
                       if self.capture else f"decode steps run eagerly over the lanes' slabs on {self.device.type}")
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if self.capture else None
        self.steps = 0

    def describe(self) -> dict[str, Any]:
        """`GET /v1/node`: whether steps are captured, why, and the sizes and history lengths they take (fixed at
        start)."""
        return {"graphs": self.capture, "reason": self.reason, "batches": self._sizes(), "lengths": self._lengths()}

    def _sizes(self) -> list[int]:
        return [size for size in BATCHES if size < self.lanes] + [self.lanes]

    def _lengths(self) -> list[int]:
        lengths, length = [], FIRST_LENGTH
        while length < self.rows:
            lengths.append(length)
            length *= 2
        return [*lengths, self.rows]

    @torch.inference_mode()
    def prepare(self) -> int:
        """At start: capture the step of every size and history length (`describe`), over idle inputs: every lane
        writes into the scratch lane, so nothing a lane holds changes. Returns the graphs captured (0 off CUDA, or
        once a capture failed: steps then run eagerly)."""
        if not self.capture:
            return 0
        self.inputs.zero_()
        self.inputs[3].fill_(self.lanes)
        for rows in self._sizes():
            for length in self._lengths():
                if self._captured(rows, length) is None:
                    return 0
        return len(self._graphs)

    def place(self, caches: Sequence[DynamicCache]) -> Placed | None:
        """Where the sequences holding `caches` are in the slab, or None where any is not (a step then runs per
        row): every layer a working layer in one lane's rows of the slab, with room for one more row."""
        lanes: list[int] = []
        lengths: list[int] = []
        layers: list[tuple[GrowableKVLayer, ...]] = []
        for cache in caches:
            if len(cache.layers) != len(self.slabs) or any(type(one) is not GrowableKVLayer for one in cache.layers):
                return None
            mine = cast(tuple[GrowableKVLayer, ...], tuple(cache.layers))
            lane = self._lane(mine)
            if lane is None or lane in lanes:
                return None
            length = mine[0].get_seq_length()
            lanes.append(lane)
            lengths.append(length)
            layers.append(mine)
        return Placed(tuple(lanes), tuple(lengths), tuple(layers))

    def _lane(self, layers: Sequence[GrowableKVLayer]) -> int | None:
        """The lane whose slab rows every layer's buffers are, with room past the length; rows still opening or held
        by reference are put in place first (the step reads the slab, not the layers). The layers of a working cache
        are made, grown and written together, so they hold the same length: the first one's is the cache's."""
        first = layers[0]
        keys = first._key_buffer
        if keys is None or keys.shape[2] <= first.get_seq_length():
            return None
        key_start, key_step = self._starts[0][:2]
        lane, off = divmod(keys.data_ptr() - key_start, key_step)
        if off or not 0 <= lane < self.lanes:
            return None
        for layer, (key_start, key_step, value_start, value_step) in zip(layers, self._starts, strict=True):
            if layer.opening is not None:
                layer.wait_rows()
            if layer._pending:
                layer.materialize()
            keys, values = layer._key_buffer, layer._value_buffer
            if (keys is None or values is None or keys.data_ptr() != key_start + lane * key_step
                    or values.data_ptr() != value_start + lane * value_step):
                return None
        return lane

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], positions: Sequence[int], placed: Placed) -> torch.Tensor:
        """One decode step of each sequence (`tokens[b]` at rotary position `positions[b]`, its new row at
        `placed.lengths[b]` in lane `placed.lanes[b]`); returns the logits `[B, vocab]` in float32."""
        top = max(placed.lanes) + 1
        rows = next((size for size in BATCHES if size >= top and size <= self.lanes), self.lanes)
        longest = max(placed.lengths) + 1
        length = FIRST_LENGTH
        while length < longest:
            length *= 2
        length = min(length, self.rows)
        table = [[0] * rows, [0] * rows, [0] * rows, [self.lanes] * rows]  # no sequence: write into the scratch lane
        for token, position, lane, at in zip(tokens, positions, placed.lanes, placed.lengths, strict=True):
            table[0][lane], table[1][lane], table[2][lane], table[3][lane] = token, position, at, lane
        self.inputs[:, :rows].copy_(torch.tensor(table))
        logits = self._replay(rows, length) if self.capture else self._run(rows, length)
        for layers in placed.layers:
            for layer in layers:
                layer.advance()
        self.steps += 1
        return logits[torch.tensor(placed.lanes, device=logits.device)].float()

    def _replay(self, rows: int, length: int) -> torch.Tensor:
        captured = self._captured(rows, length)
        if captured is None:  # the step still runs, eagerly, and so do the next ones
            return self._run(rows, length)
        graph, logits = captured
        graph.replay()
        return logits

    def _captured(self, rows: int, length: int) -> tuple[Any, torch.Tensor] | None:
        """The step's graph, captured now if it was not at start; None once a capture failed."""
        captured = self._graphs.get((rows, length))
        if captured is None:
            try:
                captured = self._graphs[(rows, length)] = self._capture(rows, length)
            except Exception as exc:
                self.capture = False
                self.reason = f"capturing a decode step failed ({type(exc).__name__}): decode steps run eagerly"
                log.warning("%s", self.reason)
                self._graphs.clear()
                return None
        return captured

    def _capture(self, rows: int, length: int) -> tuple[Any, torch.Tensor]:
        """A graph of the step over lanes `[0, rows)` and `length` rows of history, and its logits tensor. The
        warm-up run computes this step (the replay writes the same rows again)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._run(rows, length)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._run(rows, length)
        return graph, logits

    def _run(self, rows: int, length: int) -> torch.Tensor:
        """The step over lanes `[0, rows)`, `length` rows of history: logits `[rows, vocab]` in the model's dtype."""
        cache = _STEP.cache = _SlabCache(self, rows, length)
        for config in self._configs:
            config._attn_implementation_internal = STATIC
        try:
            out = self.model(input_ids=self.inputs[0, :rows].unsqueeze(1),
                             position_ids=self.inputs[1, :rows].unsqueeze(1), cache=cache, use_cache=True,
                             logits_to_keep=1)
        finally:
            _STEP.cache = None
            for config, name in zip(self._configs, self._implementations, strict=True):
                config._attn_implementation_internal = name
        return out.logits[:, -1]
