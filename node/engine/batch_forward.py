"""One decode step of many sequences as one transformers forward.

Each running sequence has its own working cache (its lane's buffers, its restored prefix). A decode step
of B sequences runs the model once on a `[B, 1]` batch: embeddings, projections, MLPs, experts and the head
see B rows, so each weight is read once for all of them, which is what decoding on a CPU is bound by. Only
attention is per sequence: the step's cache (`RowsCache`) hands each row's new keys and values to that
sequence's own cache layer, and the attention function attends each row's query over the history its layer
returns, through transformers' own SDPA attention. Nothing is padded and no history is copied; the result
is each sequence's own decode step (logits within float32 noise of running it alone, see BATCHING.md).

Sequences of one caller often hold the same first rows (one system prompt, restored from one stored span or
computed alike): `equal_rows` finds how many, value for value, and a step given such a group (`Shared`) attends
the group's queries over those rows once, from one member's buffers, and each member's query over its own rest,
merging the two parts by their log-sum-exp. The shared rows are then read once per step instead of once per
sequence, which is what bounds a step of many sequences over long histories. Groups never span scopes: the
runner forms them from one caller's sequences only. Where the CPU kernels run, each row's own rows are attended
by the native decode attention, all rows of a layer in one call (`_attend_each`); and the step's new rows are
written straight into the rows' buffers by one native call per layer, the rows' histories then handed to the
attention by address (`RowsCache._write`, `Written`, `_attend_written`): a tensor view per row and layer cost
more than the attention's own arithmetic saves at 32 rows (BATCHING.md).

On any device but the CPU (or with `BatchedDecode(portable=True)`, which runs that path on a CPU for tests), the
step uses no CPU-only operator: no native kernels, and no shared rows (their merge needs the log-sum-exp that only
SDPA's CPU flash kernel returns). Every row attends its whole history through the model's own attention function
(transformers' SDPA one calls torch's public `scaled_dot_product_attention`, key/value heads shared by query heads
as when the sequence runs alone), which gives each row the result the shared rows would.

Recurrent layers (Mamba-1/2 scans, gated delta-net, short convs, alone or beside attention) keep one
position's conv and recurrent states per sequence. For the step they are stacked along the batch (`[B, ...]`),
the model's own mixers update them for all rows at once, and each row's states are copied back into its own
layer afterwards (`RowsCache.scatter`): a copy of one position's state per sequence and layer, against a forward
per sequence that reads every weight again.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from cache.working_cache import GrowableKVLayer
from node.engine.cpu_kernels import CpuKernels
from node.engine.kernel_operands import RowsAt, decode_work_floats
from node.engine.static_decode import StaticDecode

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""SDPA's CPU flash kernel, which also returns each query's log-sum-exp (what merging two parts needs)."""
_NEUTRAL = {"dropout": 0.0, "sliding_window": None, "softcap": None, "s_aux": None, "position_bias": None}
"""Attention arguments a shared-rows attention takes only at these values (the rest are positions, or flags of
no effect on one query); with any other value, or one it does not know, rows attend one by one."""
NATIVE_SHARED_QUERIES = 32
"""Most queries per key/value head (a group's members times query heads per key/value head) whose attention over
shared rows the native decode attention takes (`scripts/decode_attention_ab.py`, 1k rows, 8 layers). Groups of 16
and 32 queries take all their scores in one pass over the keys (`decode_head_wide`), which keeps them ahead of
SDPA's flash kernel up to 32 (BATCHING.md; RESULTS.md, 2026-12-04)."""
_HARMLESS = frozenset({"scaling", "position_ids", "cache_position", "output_attentions", "output_router_logits",
                       "use_cache", "is_causal"})

ROWS = "tenzro_rows"
"""The attention implementation a batched decode step switches the model's configs to."""
_STEP = threading.local()
"""The `RowsCache` of the decode step running on this thread, if any."""


class RowsCache(Cache):
    """The cache a batched decode step passes to the model: row b of the batch is `caches[b]`. Each attention
    layer's update writes row b's new keys and values into `caches[b]`'s layer and keeps what that layer returns
    (its whole history) for the attention function. Each recurrent layer's conv and recurrent states are the
    rows' states stacked along the batch (`[B, ...]`), which the model's mixers update in place for all rows at
    once; `scatter` copies them back into each row's own layer after the forward."""

    def __init__(self, caches: Sequence[DynamicCache], inner: Callable[[Any], Callable[..., Any]],
                 sdpa: Callable[[Any], bool], shared: Sequence[Shared] = (), kernels: CpuKernels | None = None,
                 work: Callable[[int], torch.Tensor] | None = None) -> None:
        per_layer: list[tuple[Any, ...]] = list(zip(*(cache.layers for cache in caches), strict=True))
        stacked: list[Any] = [_stacked(layers) if isinstance(layers[0], LinearAttentionCacheLayerMixin) else _PER_ROW
                              for layers in per_layer]
        super().__init__(layers=stacked)
        self._recurrent: list[tuple[tuple[Any, ...], Any]] = [
            (layers, layer) for layers, layer in zip(per_layer, stacked, strict=True) if layer is not _PER_ROW]
        self.caches = caches
        self.inner = inner
        """The model's own attention function for a module."""
        self.sdpa = sdpa
        """Whether a module's own attention function is SDPA (which the shared rows' attention reproduces)."""
        self.shared = shared
        self.kernels = kernels
        """The native decode attention's, where it runs (one torch thread, the kernels loaded)."""
        self.work = work or (lambda floats: torch.empty(floats))
        """Scratch of at least so many floats for it."""
        self.history: dict[int, Written | list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.shared_rows = 0
        """Row-layers whose shared rows were read once for their group in this step."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layers: list[Any] = [cache.layers[layer_idx] for cache in self.caches]  # attention layers (`batchable`)
        written = self._write(key_states, value_states, layers) if self.kernels is not None else None
        self.history[layer_idx] = written if written is not None else [
            layer.update(key_states[row:row + 1], value_states[row:row + 1]) for row, layer in enumerate(layers)]
        return key_states, value_states

    def _write(self, keys: torch.Tensor, values: torch.Tensor, layers: list[Any]) -> Written | None:
        """Every row's new keys and values written into its layer's buffers by one native call, where every
        row's layer takes a row in place (`GrowableKVLayer.append_at`): no tensor view per row. None (nothing
        written) otherwise."""
        assert self.kernels is not None
        kv_heads, head_dim = keys.shape[1], keys.shape[3]
        places = []
        for layer in layers:
            place = layer.append_at() if type(layer) is GrowableKVLayer else None
            if place is None:
                return None
            shape = place[0].shape  # rows of head_dim floats contiguous, heads `stride(1)` apart (`append_at`)
            if shape[1] != kv_heads or shape[3] != head_dim:
                return None
            places.append(place)
        positions = [row for _, _, row in places]
        rows = RowsAt([k.data_ptr() for k, _, _ in places], [v.data_ptr() for _, v, _ in places],
                      [k.stride(1) for k, _, _ in places], [row + 1 for row in positions], kv_heads)
        if not self.kernels.append_rows(keys, values, rows, positions):
            return None
        for layer in layers:
            layer.advance()
        return Written(layers, rows)

    def scatter(self) -> None:
        """After the forward: each row's recurrent states are its row of the stacked ones (copied in place, as the
        model updates them)."""
        for layers, stacked in self._recurrent:
            for index in range(stacked.number_of_states):
                if stacked.is_conv_states_initialized[index]:
                    for row, layer in enumerate(layers):
                        layer.conv_states[index].copy_(stacked.conv_states[index][row:row + 1])
                if stacked.is_recurrent_states_initialized[index]:
                    for row, layer in enumerate(layers):
                        layer.recurrent_states[index].copy_(stacked.recurrent_states[index][row:row + 1])


_PER_ROW = object()
"""A `RowsCache` layer that is attention: each row's own layer (`RowsCache.update`), nothing batch-wide."""


def _stacked(layers: Sequence[Any]) -> LinearAttentionLayer:
    """One recurrent layer whose states are the rows' (`layers`, each `[1, ...]` per state) stacked along the
    batch; every row has run before (`batchable`), so the step continues each row's state."""
    first = layers[0]
    stacked = LinearAttentionLayer(number_of_states=first.number_of_states)
    stacked.device, stacked.dtype = first.device, first.dtype
    for index in range(first.number_of_states):
        if first.is_conv_states_initialized[index]:
            stacked.conv_states[index] = torch.cat([layer.conv_states[index] for layer in layers])
            stacked.conv_kernel_size[index] = first.conv_kernel_size[index]
            stacked.is_conv_states_initialized[index] = True
        if first.is_recurrent_states_initialized[index]:
            stacked.recurrent_states[index] = torch.cat([layer.recurrent_states[index] for layer in layers])
            stacked.is_recurrent_states_initialized[index] = True
        stacked.has_previous_state[index] = True
    return stacked


@dataclass(frozen=True, slots=True)
class Shared:
    """Rows of a step's batch (`members`, two or more, of one scope) whose full-attention layers hold the same
    first `length` rows, value for value."""

    members: tuple[int, ...]
    length: int


@dataclass(frozen=True, slots=True)
class Written:
    """A layer's rows of a step whose new keys and values were written in place (`RowsCache._write`): the rows'
    layers and their whole histories by address."""

    layers: list[GrowableKVLayer]
    at: RowsAt

    def __len__(self) -> int:
        return len(self.layers)

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The histories as the layers' views (which catch up with the rows written in place)."""
        return [(layer.keys, layer.values) for layer in self.layers]  # type: ignore[misc]


def _rows_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Each row's one query over its own history, without a mask: one query attends to every key its layer
    returns, as when the sequence runs alone. Where the layer is full attention by plain SDPA, groups of rows
    with shared first rows attend those once (`_attend_shared`), and every row's own rows go to the native
    decode attention where it runs (`_attend_each`; by address, `_attend_written`, where the step wrote the new
    rows in place); otherwise each row runs the model's own attention function."""
    step: RowsCache = _STEP.rows
    rows = step.history.pop(module.layer_idx)
    plain = (step.shared or step.kernels is not None) and _plain(step, module, args, kwargs)
    if isinstance(rows, Written):
        done = _attend_written(step, query, rows, _scale(query, kwargs)) if plain else None
        if done is not None:
            return done, None
        rows = rows.tensors()
    outputs: list[torch.Tensor | None] = [None] * len(rows)
    if plain:
        scale = _scale(query, kwargs)
        queries = query.reshape(len(rows), query.shape[1], query.shape[-1])  # one query per row
        for group in step.shared:
            merged = _attend_shared(queries, group, rows[0][0].shape[1], *_tensor_parts(step, rows, group, scale))
            assert merged is not None  # the tensor parts never decline
            for member, output in zip(group.members, merged, strict=True):
                outputs[member] = output.unsqueeze(0)
            step.shared_rows += len(group.members)
        alone = [row for row, output in enumerate(outputs) if output is None]
        if alone and step.kernels is not None:
            out, _ = _attend_each(step, queries[alone], [rows[row] for row in alone], scale)
            for row, output in zip(alone, out, strict=True):
                outputs[row] = output.reshape(1, 1, *output.shape)  # [batch, query, heads, head_dim]
    inner = step.inner(module)
    for row, (keys, values) in enumerate(rows):
        if outputs[row] is None:
            outputs[row] = inner(module, query[row:row + 1], keys, values, None, *args, **kwargs)[0]
    return torch.cat(outputs), None  # type: ignore[arg-type]


def _scale(query: torch.Tensor, kwargs: dict[str, Any]) -> float:
    scale = kwargs.get("scaling")
    return float(scale) if scale is not None else query.shape[-1] ** -0.5


def _attend_written(step: RowsCache, query: torch.Tensor, written: Written, scale: float) -> torch.Tensor | None:
    """`_rows_attention`'s native path over histories by address (`Written`): one call for the layer, each group's
    shared rows once for all its members' queries, every row's own rows alone, without a tensor view per row
    (`CpuKernels.decode_attention_groups`). Returns `[rows, 1, heads, head_dim]`, or None where the call declines
    (the caller goes on with the layers' views)."""
    assert step.kernels is not None
    count, at = len(written), written.at
    queries = query.reshape(count, query.shape[1], query.shape[-1]).contiguous()
    heads, head_dim = queries.shape[1:]
    out, lse = queries.new_empty(queries.shape), queries.new_empty((count, heads))
    work = step.work(decode_work_floats(heads, at.kv_heads, head_dim, max(at.lengths)))
    groups = [(group.members, group.length) for group in step.shared]
    if not step.kernels.decode_attention_groups(queries, at, groups, scale, out, lse, work):
        return None
    step.shared_rows += sum(len(group.members) for group in step.shared)
    return out.reshape(count, 1, heads, head_dim)


Part = Callable[..., "tuple[torch.Tensor, torch.Tensor] | None"]
"""Attention of some queries over some rows: outputs `[R, heads, head_dim]` and log-sum-exp `[R, heads]`, or None
where a native call declines."""


def _tensor_parts(step: RowsCache, history: list[tuple[torch.Tensor, torch.Tensor]], group: Shared,
                  scale: float) -> tuple[Part, Part]:
    """A group's two parts (`_attend_shared`) over its members' views: the shared rows from the first member's."""
    keys, values = history[group.members[0]]
    length = group.length

    def shared(stacked: torch.Tensor, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return _attend_each(step, stacked, [(keys[:, :, :length], values[:, :, :length])], scale, native=native)

    def own(mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _attend_each(step, mine, [(history[member][0][:, :, length:], history[member][1][:, :, length:])
                                         for member in group.members], scale)

    return shared, own


def _attend_at(step: RowsCache, queries: torch.Tensor, rows: RowsAt, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_attend_each`'s native call over rows by address; None where it declines."""
    assert step.kernels is not None
    queries = queries.contiguous()
    count, heads, head_dim = queries.shape
    out, lse = queries.new_empty(queries.shape), queries.new_empty((count, heads))
    work = step.work(decode_work_floats(heads, rows.kv_heads, head_dim, max(rows.lengths)))
    return (out, lse) if step.kernels.decode_attention_at(queries, rows, scale, out, lse, work) else None


def _plain(step: RowsCache, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this layer's attention is what `_attend_shared` and `_attend_each` compute: plain SDPA of full
    attention."""
    if args or not step.sdpa(module):
        return False
    if not all(type(cache.layers[module.layer_idx]) is GrowableKVLayer for cache in step.caches):
        return False
    return all(name in _HARMLESS or (name in _NEUTRAL and value == _NEUTRAL[name]) for name, value in kwargs.items())


def _attend_each(step: RowsCache, queries: torch.Tensor, history: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 scale: float, native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's queries (`queries` `[R, heads, head_dim]`) over its own keys and values; returns the outputs
    `[R, heads, head_dim]` and each head's log-sum-exp `[R, heads]`. One native call for all rows where the
    kernels run and `native` (`CpuKernels.decode_attention`, which reads each key and value row once for up to
    four queries, BATCHING.md), else SDPA's flash kernel row by row."""
    heads, head_dim = queries.shape[1:]
    if step.kernels is not None and native:
        rows = step.kernels.rows_at(history, head_dim)
        done = None if rows is None else _attend_at(step, queries, rows, scale)
        if done is not None:
            return done
    outs, lses = [], []
    for query, (keys, values) in zip(queries, history, strict=True):
        kv_heads = keys.shape[1]  # query heads sharing one key/value head attend as more queries of it
        out, lse = _FLASH(query.reshape(1, kv_heads, heads // kv_heads, head_dim), keys, values, 0.0, False,
                          scale=scale)
        outs.append(out.reshape(heads, head_dim))
        lses.append(lse.reshape(heads))
    return torch.stack(outs), torch.stack(lses)


def _attend_shared(queries: torch.Tensor, group: Shared, kv_heads: int, shared: Part, own: Part
                   ) -> torch.Tensor | None:
    """Attention of the group's queries (`queries` `[B, heads, head_dim]`) over their histories, whose first
    `group.length` rows are the same: those rows once for all the group's queries (`shared(stacked, native)`,
    the queries as one row of many heads per key/value head, `native` when few enough for the native call),
    each member's own rest alone (`own(mine)`), the two parts merged by their log-sum-exp. Returns `[members, 1,
    heads, head_dim]`, the layout the model's attention functions return; None where a part declines."""
    size, heads, head_dim = len(group.members), queries.shape[1], queries.shape[-1]
    per_kv = heads // kv_heads  # query heads sharing one key/value head: they attend as more queries of it
    mine = queries[list(group.members)]
    stacked = mine.reshape(size, kv_heads, per_kv, head_dim).transpose(0, 1).reshape(1, -1, head_dim)
    first_part, second_part = shared(stacked, size * per_kv <= NATIVE_SHARED_QUERIES), own(mine)
    if first_part is None or second_part is None:
        return None
    (first, first_lse), (second, second_lse) = first_part, second_part
    first = first.reshape(kv_heads, size, per_kv, head_dim).transpose(0, 1).reshape(size, heads, head_dim)
    first_lse = first_lse.reshape(kv_heads, size, per_kv).transpose(0, 1).reshape(size, heads)
    top = torch.maximum(first_lse, second_lse)
    first_weight, second_weight = (first_lse - top).exp_().unsqueeze(-1), (second_lse - top).exp_().unsqueeze(-1)
    merged = (first * first_weight + second * second_weight) / (first_weight + second_weight)
    return merged.reshape(size, 1, heads, head_dim)


AttentionInterface.register(ROWS, _rows_attention)


class BatchedDecode:
    """Batched decode steps of one model (`step`). `kernels`: the native decode attention's, used where they
    load and torch runs one thread (the kernels are single-threaded). `portable`: every step takes the path of a
    device other than the CPU (no kernels, no shared rows), also on a CPU."""

    def __init__(self, model: Any, kernels: CpuKernels | None = None, portable: bool = False) -> None:
        self._model = model
        self._kernels = kernels
        self.portable = portable
        self._work = torch.zeros(0)
        """The native decode attention's scores: zeroed by `wipe_scratch`."""
        configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)}
        self._configs = list(configs.values())
        self._implementations = [config._attn_implementation for config in self._configs]
        self._implementation_of = {id(config): name for config, name in zip(self._configs, self._implementations,
                                                                             strict=True)}
        """Each config's own attention implementation, which a batched step switches away from."""
        self._eager: dict[type, Callable[..., Any]] = {}
        self.shared_rows = 0
        """Row-layers whose shared rows were attended once for their group, over all steps."""
        self.static: StaticDecode | None = None
        """The steps over the lanes' slabs (`static_decode.py`), once the runner laid its lanes out so (`go_static`):
        a step whose rows are all there runs there."""

    def go_static(self, slabs: dict[int, torch.Tensor], template: DynamicCache, lanes: int, capture: bool
                  ) -> StaticDecode:
        """Run steps over the lanes' slabs (`Lanes.slabs`; none for a model without attention) from now on, captured
        as CUDA graphs where `capture`; `template`: a working cache that has run, whose recurrent layers' states give
        their buffers' shapes."""
        self.static = StaticDecode(self._model, slabs, template, lanes, self._configs, self._implementations,
                                   self._inner, capture)
        return self.static

    def static_step(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[DynamicCache]
                    ) -> torch.Tensor | None:
        """One step over the lanes' slabs (`StaticDecode.step`, logits `[B, vocab]`) where every row is placed there;
        None, nothing run, where the lanes are not laid out so or a row is not (the per-row `step` then runs)."""
        placed = self.static.place(caches) if self.static is not None else None
        if placed is None:
            return None
        assert self.static is not None
        return self.static.step(tokens, positions, placed)

    def _scratch(self, floats: int) -> torch.Tensor:
        if self._work.numel() < floats:
            self._work.zero_()
            self._work = torch.zeros(floats + floats // 2)
        return self._work

    @torch.inference_mode()  # the scratch is made in a step, under inference mode
    def wipe_scratch(self) -> None:
        """Zero the scratch: it holds the last step's attention weights, which are derived from a caller's
        keys."""
        self._work.zero_()

    def _sdpa(self, module: Any) -> bool:
        return self._implementation_of[id(module.config)] == "sdpa"

    def _inner(self, module: Any) -> Callable[..., Any]:
        """The attention function `module` runs outside a batched step."""
        name = self._implementation_of[id(module.config)]
        if name in (None, "eager"):
            kind = type(module)
            if kind not in self._eager:
                self._eager[kind] = sys.modules[kind.__module__].eager_attention_forward
            return self._eager[kind]
        return ALL_ATTENTION_FUNCTIONS[name]

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[DynamicCache],
             device: torch.device, shared: Sequence[Shared] = (), logits: bool = True, hidden: bool = False
             ) -> torch.Tensor:
        """Run one token per sequence (`tokens[b]` at `positions[b]` into `caches[b]`), attending each group
        of `shared` rows once for its members; returns the logits `[B, vocab]` in float32 (`[B, 0]` without
        `logits`: the head is not run, only the caches are written). With `hidden`, the final normed hidden
        states `[B, hidden]` instead, for the caller to score: the model's body runs, its head does not. Off
        the CPU (or `portable`), `shared` is not used: every row attends its whole history."""
        if self.portable or device.type != "cpu":
            rows = _STEP.rows = RowsCache(caches, self._inner, self._sdpa)
        else:
            rows = _STEP.rows = RowsCache(caches, self._inner, self._sdpa, shared, self._kernels, self._scratch)
        for config in self._configs:
            # transformers builds no mask for an implementation it has no mask function for.
            config._attn_implementation_internal = ROWS
        try:
            inputs = {"input_ids": torch.tensor(tokens, device=device).unsqueeze(1),
                      "position_ids": torch.tensor(positions, device=device).unsqueeze(1),
                      "cache": _STEP.rows, "use_cache": True}
            if hidden:
                result = self._model.model(**inputs).last_hidden_state[:, -1]
            else:
                out = self._model(**inputs,
                                  logits_to_keep=1 if logits else torch.zeros(0, dtype=torch.long, device=device))
                result = out.logits[:, -1].float() if logits else out.logits.new_zeros(len(tokens), 0)
            rows.scatter()
        finally:
            _STEP.rows = None
            self.shared_rows += rows.shared_rows
            for config, name in zip(self._configs, self._implementations, strict=True):
                config._attn_implementation_internal = name
        return result


_ROW_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)
"""Cache layer kinds a batched step takes, by exact type (a subclass may keep more state): attention, whose rows
each attend their own history, and recurrent layers, whose states stack along the batch."""


def batch_blocker(model: Any) -> str | None:
    """Why `model`'s decode steps cannot be batched (a layer kind the step does not know), or None."""
    layers = DynamicCache(config=model.config).layers
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) not in _ROW_LAYERS})
    if kinds:
        return f"layers of kind {', '.join(kinds)}: one sequence per forward"
    return None


@torch.inference_mode()
def equal_rows(first: DynamicCache, second: DynamicCache, limit: int) -> int:
    """How many of the first `limit` rows every full-attention layer of the two working caches holds bit for
    bit (0 where either has other layers); both are materialized."""
    # Sliding layers attend their own window tail, never shared rows.
    pairs: list[tuple[Any, Any]] = [
        (mine, theirs) for mine, theirs in zip(first.layers, second.layers, strict=True)
        if not (isinstance(mine, DynamicSlidingWindowLayer) and isinstance(theirs, DynamicSlidingWindowLayer))]
    if not all(type(mine) is GrowableKVLayer and type(theirs) is GrowableKVLayer for mine, theirs in pairs):
        return 0  # another layer's state (recurrent) is not rows to share: nothing to compare
    equal = limit
    for mine, theirs in pairs:
        mine.materialize()
        theirs.materialize()
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            if a is None or b is None:
                return 0
            equal = min(equal, a.shape[2], b.shape[2])
            if equal == 0:
                return 0
            if torch.equal(a[:, :, :equal], b[:, :, :equal]):  # the usual case, at the speed of reading both
                continue
            differs = (a[:, :, :equal] != b[:, :, :equal]).any(dim=3).any(dim=1).any(dim=0)
            equal = int(differs.nonzero()[0, 0])
    return equal


def batchable(cache: DynamicCache) -> bool:
    """Whether a sequence with this working cache can take part in a batched decode step: its attention layers are
    working layers, and its recurrent layers have run (a state to continue) without recording their past."""
    layer: Any
    for layer in cache.layers:
        kind = type(layer)
        if kind is GrowableKVLayer or kind is DynamicSlidingWindowLayer:
            continue
        if kind not in (LinearAttentionLayer, LinearAttentionAndFullAttentionLayer) or layer.record_past:
            return False
        if not all(layer.has_previous_state.values()):
            return False
    return True
