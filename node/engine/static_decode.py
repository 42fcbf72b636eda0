"""Decode steps at fixed addresses and shapes, replayed as CUDA graphs: a GPU's decode step without its launches.

On a GPU an eager decode step of a 1B model costs the same at one row and at 32: the host's Python and kernel
launches are the whole cost, and replaying the step's kernels as one captured CUDA graph removes 20-30x of it
(../shared/GPU-NOTES.md, "What plain transformers does on the same chip"). A graph replays kernels over the tensors
they were captured with, at fixed addresses and fixed shapes; the batched step of `batch_forward.py` attends each
row's own cache, ragged and moving, so it cannot be captured. This one can:

- Where it runs, the lanes' key and value buffers are one slab per layer (`Lanes.reserve(contiguous=True)`): lane
  i's buffers are index i of `[lanes + 1, kv_heads, rows, head_dim]` tensors, the last lane scratch. A sequence in a
  lane writes there as always (its working cache's layers are views of its lane); nothing is copied in or out.
- A step of sequences in lanes l_1..l_B runs the model on the first M lanes (M the smallest of `BATCHES` that covers
  the highest lane): lane l's row takes the token of its sequence, writes the new key and value at the sequence's length
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

Hybrid and state-space models (Mamba-1/2, short-conv and gated delta-net layers, beside attention or alone) keep
one position's conv and recurrent states per sequence. Each recurrent layer's states have a buffer `[lanes,
...]` per state beside the slabs: the step copies its sequences' states into their lanes' rows (one `_foreach_copy_`
for all, outside the graph), the model's mixers update rows `[0, M)` as a batch, and the rows are copied back into
the sequences' own states after it. Idle lanes' rows are computed and dropped as their attention is. A model
without attention has no slabs: its step's sequences take rows `[0, B)` of the state buffers, whatever their lanes.

It takes a step when every row's working cache is full attention in the slab, with room for the new row, and
recurrent layers that have run; sliding-window layers, a lane that outgrew its rows, rows still opening or held by
reference first take the per-row step (`batch_forward.py`). Nothing looks across scopes: each row reads only its
own lane's rows and its own states.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, LinearAttentionLayer
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
    """Each sequence's attention layers, which `advance` once the step has written their row."""
    rows: list[torch.Tensor]
    """The step's rows of the recurrent state buffers (`[1, ...]` views), one per sequence and state ..."""
    states: list[torch.Tensor]
    """... and the sequences' own states they are copied from before the step and back into after it."""


class _SlabCache(Cache):
    """The cache a static step passes the model: layer i's update writes each lane's new key and value at its
    length in its write lane and returns the first L rows of lanes `[0, M)`."""

    def __init__(self, owner: StaticDecode, rows: int, length: int) -> None:
        self.recurrent = {layer: owner.stacked(layer, rows) for layer in owner.states}
        """Each recurrent layer's states: rows `[0, M)` of its state buffers."""
        super().__init__(layers=[self.recurrent.get(layer, _LAYER) for layer in range(len(owner.kinds))])
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

    def keep_states(self) -> None:
        """After the forward: a state the model replaced rather than updated in place goes into its buffer."""
        for layer, stacked in self.recurrent.items():
            for (kind, index), buffer in self.owner.states[layer].items():
                state = (stacked.conv_states if kind == "conv" else stacked.recurrent_states)[index]
                if state is not None and state.data_ptr() != buffer.data_ptr():
                    buffer[:self.rows].copy_(state)


_LAYER: Any = object()
"""A `_SlabCache` layer: the slab holds the state, nothing per layer object."""


def _static_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The model's own attention function over the lanes' rows, under the step's mask."""
    step: _SlabCache = _STEP.cache
    return step.owner.inner(module)(module, query, key, value, step.mask, *args, **kwargs)


AttentionInterface.register(STATIC, _static_attention)


def _kind(layer: Any) -> str:
    """"attention" (a working layer, in the slabs), "recurrent" (conv and recurrent states), or its class's name."""
    if type(layer) is GrowableKVLayer:
        return "attention"
    if type(layer) is LinearAttentionLayer:
        return "recurrent"
    return type(layer).__name__


def _state_buffers(layer: LinearAttentionLayer, lanes: int) -> dict[tuple[str, int], torch.Tensor]:
    """A zeroed buffer `[lanes, ...]` per state the layer holds (`[1, ...]` each)."""
    buffers = {}
    for index in range(layer.number_of_states):
        for kind, state in (("conv", layer.conv_states[index]), ("recurrent", layer.recurrent_states[index])):
            if state is not None:
                buffers[(kind, index)] = state.new_zeros((lanes, *state.shape[1:]))
    return buffers


class StaticDecode:
    """Static decode steps over the lanes' slabs (`Lanes.slabs`), captured as CUDA graphs where `capture`.

    `configs` and `implementations`: the model's configs and their own attention implementations, which a step
    switches away from and back; `inner(module)`: a module's own attention function (`BatchedDecode`'s)."""

    def __init__(self, model: Any, slabs: dict[int, torch.Tensor], template: DynamicCache, lanes: int,
                 configs: Sequence[Any], implementations: Sequence[str | None], inner: Any, capture: bool) -> None:
        """`template`: a working cache that has run (one token), whose layers say which are attention (in the slabs)
        and which recurrent, and the shapes of the recurrent states. `lanes`: how many; a model without attention
        layers has no slabs to count them by."""
        self.model = model
        self.kinds = [_kind(layer) for layer in template.layers]
        self.slabs = {layer: (slabs[2 * layer], slabs[2 * layer + 1])
                      for layer in sorted({slot // 2 for slot in slabs})}
        """Per attention layer, its keys' and values' slabs."""
        recurrent: dict[int, Any] = {index: layer for index, layer in enumerate(template.layers)
                                     if self.kinds[index] == "recurrent"}
        first = next(iter(self.slabs.values()))[0] if self.slabs else None
        self.lanes = lanes
        """Lanes (in the slabs, whose last index is scratch)."""
        self.rows = first.shape[2] if first is not None else 1
        """Rows of history a lane holds (1 without attention: nothing to attend)."""
        self.device = first.device if first is not None else next(
            state for layer in recurrent.values() for state in (*layer.conv_states.values(),
                                                                 *layer.recurrent_states.values())
            if state is not None).device
        self.states = {index: _state_buffers(layer, self.lanes) for index, layer in recurrent.items()}
        """Per recurrent layer, a buffer `[lanes, ...]` per state: row l holds lane l's state during a step."""
        self._kernels = {index: dict(layer.conv_kernel_size) for index, layer in recurrent.items()}
        self._lane_rows = [[buffer[lane:lane + 1] for buffers in self.states.values() for buffer in buffers.values()]
                           for lane in range(self.lanes)]
        """Per lane, its row (a `[1, ...]` view) of every state buffer, in `_states`' order: made once, not per
        step."""
        self._configs, self._implementations, self.inner = list(configs), list(implementations), inner
        self.inputs = torch.zeros(4, self.lanes, dtype=torch.long, device=self.device)
        """Per lane: token, position, length, write lane (the static inputs every captured step reads)."""
        self.columns = torch.arange(self.rows, device=self.device)
        self._starts = {layer: (keys.data_ptr(), keys.stride(0) * keys.element_size(),
                                values.data_ptr(), values.stride(0) * values.element_size())
                        for layer, (keys, values) in self.slabs.items()}
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

    def stacked(self, layer: int, rows: int) -> Any:
        """Recurrent layer `layer` of a step over lanes `[0, rows)`: its states are rows `[0, rows)` of the buffers,
        continued (every sequence's layer has run before)."""
        stacked: Any = LinearAttentionLayer(number_of_states=len(self._kernels[layer]))
        for (kind, index), buffer in self.states[layer].items():
            stacked.device, stacked.dtype = buffer.device, buffer.dtype
            if kind == "conv":
                stacked.conv_states[index] = buffer[:rows]
                stacked.conv_kernel_size[index] = self._kernels[layer][index]
                stacked.is_conv_states_initialized[index] = True
            else:
                stacked.recurrent_states[index] = buffer[:rows]
                stacked.is_recurrent_states_initialized[index] = True
            stacked.has_previous_state[index] = True
        return stacked

    def place(self, caches: Sequence[DynamicCache]) -> Placed | None:
        """Where the sequences holding `caches` are in the slab, or None where any is not (a step then runs per
        row): every attention layer a working layer in one lane's rows of the slab, with room for one more row;
        every recurrent layer continuing a state of the buffers' shape."""
        lanes: list[int] = []
        lengths: list[int] = []
        layers: list[tuple[GrowableKVLayer, ...]] = []
        rows: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        if len(caches) > self.lanes:
            return None
        for row, cache in enumerate(caches):
            if len(cache.layers) != len(self.kinds) or any(_kind(one) != kind for one, kind in zip(
                    cache.layers, self.kinds, strict=True)):
                return None
            mine = cast(tuple[GrowableKVLayer, ...], tuple(cache.layers[layer] for layer in self.slabs))
            lane = self._lane(mine) if mine else row  # without attention, any row holds a sequence's states
            if lane is None or lane in lanes or not self._states(cache, lane, rows, states):
                return None
            lanes.append(lane)
            lengths.append(mine[0].get_seq_length() if mine else 0)
            layers.append(mine)
        return Placed(tuple(lanes), tuple(lengths), tuple(layers), rows, states)

    def _states(self, cache: DynamicCache, lane: int, rows: list[torch.Tensor], states: list[torch.Tensor]) -> bool:
        """Add the cache's recurrent states, and lane's rows of their buffers, to `states` and `rows`; False where
        a layer has not run, records its past, or holds a state of another shape."""
        for layer, buffers in self.states.items():
            own: Any = cache.layers[layer]
            if own.record_past or not all(own.has_previous_state.values()):
                return False
            for (kind, index), buffer in buffers.items():
                state = (own.conv_states if kind == "conv" else own.recurrent_states)[index]
                if state is None or state.shape[1:] != buffer.shape[1:] or state.dtype != buffer.dtype:
                    return False
                states.append(state)
        rows.extend(self._lane_rows[lane])
        return True

    def _lane(self, layers: Sequence[GrowableKVLayer]) -> int | None:
        """The lane whose slab rows every attention layer's buffers are, with room past the length; rows still
        opening or held by reference are put in place first (the step reads the slab, not the layers). The layers of
        a working cache are made, grown and written together, so they hold the same length: the first one's is the
        cache's."""
        first = layers[0]
        keys = first._key_buffer
        if keys is None or keys.shape[2] <= first.get_seq_length():
            return None
        starts = list(self._starts.values())
        key_start, key_step = starts[0][:2]
        lane, off = divmod(keys.data_ptr() - key_start, key_step)
        if off or not 0 <= lane < self.lanes:
            return None
        for layer, (key_start, key_step, value_start, value_step) in zip(layers, starts, strict=True):
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
        if placed.rows:
            torch._foreach_copy_(placed.rows, placed.states)
        logits = self._replay(rows, length) if self.capture else self._run(rows, length)
        if placed.rows:
            torch._foreach_copy_(placed.states, placed.rows)
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
            cache.keep_states()
        finally:
            _STEP.cache = None
            for config, name in zip(self._configs, self._implementations, strict=True):
                config._attn_implementation_internal = name
        return out.logits[:, -1]
