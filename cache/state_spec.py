"""What each layer kind must keep to resume computation at a prompt position.

A model is a stack of layers; each layer holds state of one or two kinds (FalconH1 layers hold both a
recurrent and an attention part). The kind, not the model type, decides how state is cut, stored and
restored, so a new architecture is a new table entry rather than a new branch. The table is keyed by the
cache-layer class transformers builds for the layer, which is exactly what the engine must fill.

| kind | needed to resume at p |
|---|---|
| full attention | K,V for tokens `[0, p)`: kept per span, so any position the spans cover works |
| sliding window W | K,V for `[p-W+1, p)`: kept in snapshots taken at p |
| recurrent / state space | conv and recurrent state at exactly p: kept in snapshots taken at p |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)


class UnsupportedLayerKindError(ValueError):
    """A layer kind the node cannot keep state for; the model is then served without reuse."""


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """K/V `[batch, kv_heads, seq, head_dim]` for every token before p."""


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """K/V of the `window - 1` tokens before p (transformers keeps exactly those)."""

    window: int


@dataclass(frozen=True, slots=True)
class RecurrentSpec:
    """Conv and recurrent states at exactly p; cannot be rewound, so only snapshots resume."""


ComponentSpec = FullAttentionSpec | SlidingWindowSpec | RecurrentSpec


@dataclass(frozen=True, slots=True)
class LayerStateSpec:
    """The state parts of one decoder layer, in a fixed order (recurrent first, then attention)."""

    components: tuple[ComponentSpec, ...]

    @property
    def keeps_spans(self) -> bool:
        return any(isinstance(c, FullAttentionSpec) for c in self.components)

    @property
    def needs_snapshot(self) -> bool:
        return any(not isinstance(c, FullAttentionSpec) for c in self.components)


def _window(layer: Any) -> int:
    return int(layer.sliding_window)


# Cache-layer class -> the state parts it holds. Looked up by exact type: the hybrid classes subclass the
# plain ones, so an isinstance test would give them the wrong parts.
LAYER_CLASS_SPECS: dict[type, Any] = {
    DynamicLayer: lambda layer: (FullAttentionSpec(),),
    DynamicSlidingWindowLayer: lambda layer: (SlidingWindowSpec(_window(layer)),),
    LinearAttentionLayer: lambda layer: (RecurrentSpec(),),
    LinearAttentionAndFullAttentionLayer: lambda layer: (RecurrentSpec(), FullAttentionSpec()),
    LinearAttentionAndSlidingWindowAttentionLayer: lambda layer: (RecurrentSpec(), SlidingWindowSpec(_window(layer))),
    DummyLayer: lambda layer: (),
}


def model_state_specs(config: Any) -> tuple[LayerStateSpec, ...]:
    """One spec per decoder layer, read off the cache transformers builds for this config."""
    try:
        layers = DynamicCache(config=config).layers
    except (KeyError, ValueError, TypeError) as exc:
        raise UnsupportedLayerKindError(f"cannot build a cache for this model: {exc}") from exc
    specs = []
    for layer in layers:
        factory = LAYER_CLASS_SPECS.get(type(layer))
        if factory is None:
            raise UnsupportedLayerKindError(f"no state spec for cache layer {type(layer).__name__}")
        specs.append(LayerStateSpec(factory(layer)))
    return tuple(specs)
