"""One decode step of many sequences as one transformers forward.

Each running sequence has its own working cache (its lane's buffers, its restored prefix). A decode step
of B sequences runs the model once on a `[B, 1]` batch: embeddings, projections, MLPs, experts and the head
see B rows, so each weight is read once for all of them, which is what decoding on a CPU is bound by. Only
attention is per sequence: the step's cache (`RowsCache`) hands each row's new keys and values to that
sequence's own cache layer, and the attention function attends each row's query over the history its layer
returns, through transformers' own SDPA attention. Nothing is padded and no history is copied; the result
is each sequence's own decode step (logits within float32 noise of running it alone, see BATCHING.md).

It applies to models whose every cache layer is attention (full or sliding-window): recurrent layers keep
their state in the layer object, one per sequence, and step one sequence at a time (`batchable`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from cache.working_cache import GrowableKVLayer

ROWS = "tenzro_rows"
"""The attention implementation a batched decode step switches the model's configs to."""
_STEP = threading.local()
"""The `RowsCache` of the decode step running on this thread, if any."""


class RowsCache:
    """The cache a batched decode step passes to the model: row b of the batch is `caches[b]`. Each layer's
    update writes row b's new keys and values into `caches[b]`'s layer and keeps what that layer returns (its
    whole history) for the attention function."""

    def __init__(self, caches: Sequence[DynamicCache], inner: Callable[[Any], Callable[..., Any]]) -> None:
        self.caches = caches
        self.inner = inner
        """The model's own attention function for a module."""
        self.history: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layers: list[Any] = [cache.layers[layer_idx] for cache in self.caches]  # attention layers (`batchable`)
        self.history[layer_idx] = [layer.update(key_states[row:row + 1], value_states[row:row + 1])
                                   for row, layer in enumerate(layers)]
        return key_states, value_states


def _rows_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Each row's one query over its own history, by the model's own attention function, without a mask: one
    query attends to every key its layer returns, as when the sequence runs alone."""
    step: RowsCache = _STEP.rows
    inner = step.inner(module)
    rows = step.history.pop(module.layer_idx)
    outputs = [inner(module, query[row:row + 1], keys, values, None, *args, **kwargs)[0]
               for row, (keys, values) in enumerate(rows)]
    return torch.cat(outputs), None


AttentionInterface.register(ROWS, _rows_attention)


class BatchedDecode:
    """Batched decode steps of one model (`decode_step`)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)}
        self._configs = list(configs.values())
        self._implementations = [config._attn_implementation for config in self._configs]
        self._implementation_of = {id(config): name for config, name in zip(self._configs, self._implementations,
                                                                             strict=True)}
        """Each config's own attention implementation, which a batched step switches away from."""
        self._eager: dict[type, Callable[..., Any]] = {}

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
             device: torch.device) -> torch.Tensor:
        """Run one token per sequence (`tokens[b]` at `positions[b]` into `caches[b]`); returns the logits
        `[B, vocab]` in float32."""
        _STEP.rows = RowsCache(caches, self._inner)
        for config in self._configs:
            # transformers builds no mask for an implementation it has no mask function for.
            config._attn_implementation_internal = ROWS
        try:
            out = self._model(input_ids=torch.tensor(tokens, device=device).unsqueeze(1),
                              position_ids=torch.tensor(positions, device=device).unsqueeze(1),
                              cache=_STEP.rows, use_cache=True, logits_to_keep=1)
        finally:
            _STEP.rows = None
            for config, name in zip(self._configs, self._implementations, strict=True):
                config._attn_implementation_internal = name
        return out.logits[:, -1].float()


def batch_blocker(model: Any) -> str | None:
    """Why `model`'s decode steps cannot be batched (its layers hold more than keys and values), or None."""
    layers = DynamicCache(config=model.config).layers
    kinds = sorted({type(layer).__name__ for layer in layers
                    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if kinds:
        return f"layers of kind {', '.join(kinds)} keep per-sequence state objects: one sequence per forward"
    return None


def batchable(cache: DynamicCache) -> bool:
    """Whether a sequence with this working cache can take part in a batched decode step: every layer is
    attention whose state is its keys and values (recurrent layers hold per-sequence state objects)."""
    return all(type(layer) in (GrowableKVLayer, DynamicSlidingWindowLayer) for layer in cache.layers)
