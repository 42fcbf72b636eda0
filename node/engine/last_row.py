"""The last decoder layer of transformers' forward, computed for the last position only.

A forward of new tokens that wants only the last position's logits (a resumed prompt's tail, a prefill
chunk) needs every layer's keys and values for all of its tokens, but from the last layer nothing else:
its attention output, output projection and MLP for the other rows feed only logits nobody reads. Here the
last layer, while `LastRow.active()`, runs its attention for the last query alone (the keys and values of
every row are still written to the cache first) and its output projection and MLP on the last row, which
the residual adds back by broadcasting; the rows left behind are never read (the head sees the last row).
On one CPU thread this saves an eighth of the attention and most of the last layer's GEMMs of a
32-token resumed forward on an 8-layer model (A/B in the closing note of the forward-path work).

Only library modules run: the layer's own projections and transformers' SDPA attention, on fewer rows. It
applies to models whose last layer has `self_attn` (with `o_proj`) and `mlp`, and only where the loader's
check finds logits equal to the plain forward's; anywhere else the forward runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

FLAG = "_tenzro_last_row"
"""Set on the last layer's attention module while only its last query is wanted."""

_SDPA: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS["sdpa"]


def _sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention; for a flagged module, of the last query only, broadcast to every row
    (`[batch, queries, heads, head_dim]`, as the module reshapes it)."""
    if not getattr(module, FLAG, False) or query.shape[2] == 1:
        return _SDPA(module, query, key, value, attention_mask, *args, **kwargs)
    mask = None if attention_mask is None else attention_mask[..., -1:, :]
    out, weights = _SDPA(module, query[:, :, -1:], key, value, mask, *args, **kwargs)
    return out.expand(out.shape[0], query.shape[2], *out.shape[2:]), weights


AttentionInterface.register("sdpa", _sdpa)  # per module opt-in: every other module runs the original


def _last_row_only(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if not getattr(module, FLAG, False):
        return None
    hidden = args[0]
    return (hidden[:, -1:], *args[1:])


class LastRow:
    """Hooks on a model's last decoder layer that, while active, compute it for the last position only."""

    def __init__(self, attention: Any, modules: list[Any]) -> None:
        self._flagged = [attention, *modules]
        for module in modules:
            module.register_forward_pre_hook(_last_row_only)

    @classmethod
    def install(cls, model: Any) -> LastRow | None:
        """The hooks for `model`, or None where its last layer is not an attention layer with an MLP."""
        body = getattr(model, "model", None)
        layers = getattr(body, "layers", None)
        if layers is None or not len(layers):
            return None
        last = layers[-1]
        attention, mlp = getattr(last, "self_attn", None), getattr(last, "mlp", None)
        output = getattr(attention, "o_proj", None)
        if attention is None or mlp is None or output is None:
            return None
        return cls(attention, [output, mlp])

    @contextmanager
    def active(self) -> Iterator[None]:
        for module in self._flagged:
            setattr(module, FLAG, True)
        try:
            yield
        finally:
            for module in self._flagged:
                setattr(module, FLAG, False)
