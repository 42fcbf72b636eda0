"""What each layer kind must keep to resume computation at a prompt position.

A model is a stack of layers, each of one state kind. The kind, not the model type, decides how state is
cut, stored and restored, so new architectures are new table entries rather than new branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedLayerKindError(ValueError):
    """A layer kind the node cannot yet keep state for; the model is then served without reuse."""


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Keys and values for every token `[0, p)`; can resume at any position the stored spans cover."""

    kv_heads: int
    head_dim: int

    def tokens_needed(self, position: int) -> tuple[int, int]:
        """The token range whose K/V must be held to resume at `position`."""
        return 0, position


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Keys and values of the last `window` tokens before p (not yet kept: issue 4)."""

    window: int
    kv_heads: int
    head_dim: int

    def tokens_needed(self, position: int) -> tuple[int, int]:
        return max(0, position - self.window), position


@dataclass(frozen=True, slots=True)
class RecurrentSpec:
    """A snapshot of recurrent / state-space state taken at exactly p (not yet kept: issue 4)."""

    def tokens_needed(self, position: int) -> tuple[int, int]:
        return position, position


LayerStateSpec = FullAttentionSpec | SlidingWindowSpec | RecurrentSpec

# Layer kinds whose state the node stores today. The others are described so that the index can reason
# about them, but a model containing one is served with reuse off until its adapter exists.
STORABLE_SPECS: tuple[type, ...] = (FullAttentionSpec,)


def _attention_shape(config: Any) -> tuple[int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def _full(config: Any) -> LayerStateSpec:
    return FullAttentionSpec(*_attention_shape(config))


def _sliding(config: Any) -> LayerStateSpec:
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    if not window:
        raise UnsupportedLayerKindError("a sliding layer without a window size in the config")
    return SlidingWindowSpec(int(window), *_attention_shape(config))


def _recurrent(config: Any) -> LayerStateSpec:
    return RecurrentSpec()


# `config.layer_types` values (transformers 5.x) mapped to the state kind they keep.
LAYER_TYPE_SPECS = {
    "full_attention": _full,
    "sliding_attention": _sliding,
    "chunked_attention": _sliding,
    "linear_attention": _recurrent,
    "mamba": _recurrent,
    "conv": _recurrent,
}


def model_state_specs(config: Any) -> tuple[LayerStateSpec, ...]:
    """One spec per decoder layer, from `config.layer_types` (full attention when the config has none)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    specs = []
    for layer_type in layer_types:
        if layer_type not in LAYER_TYPE_SPECS:
            raise UnsupportedLayerKindError(f"layer type {layer_type!r} has no state spec")
        specs.append(LAYER_TYPE_SPECS[layer_type](config))
    return tuple(specs)


def reuse_blocker(specs: tuple[LayerStateSpec, ...]) -> str | None:
    """Why state of these layers cannot be stored yet, or None when it can."""
    kinds = sorted({type(spec).__name__ for spec in specs if not isinstance(spec, STORABLE_SPECS)})
    return f"no state adapter yet for {', '.join(kinds)}" if kinds else None
