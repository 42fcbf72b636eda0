"""Every architecture `tenzro models init` offers builds, loads and continues a prompt from its cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from node.engine.loader import load_model
from node.engine.synthetic import ARCHITECTURES, CLASSES, FAMILIES, SIZES, SPECIAL_TOKENS, init_model

EOS_ID = SPECIAL_TOKENS.index("<|im_end|>")
PAD_ID = SPECIAL_TOKENS.index("<|endoftext|>")
PROMPT, MORE = 40, 8
"""Longer than the small sliding window (16) and the small Mamba2 scan chunk (16)."""

FULL, SLIDING, RECURRENT = "DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer"

# Per family at size small: the cache-layer classes of `DynamicCache(config=...)` and `config.layer_types`.
SMALL_LAYERS: dict[str, tuple[list[str], list[str] | None]] = {
    "llama": ([FULL] * 2, None),
    "mistral": ([SLIDING] * 2, None),
    "gemma2": ([SLIDING, FULL, SLIDING, FULL],
               ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "gemma3": ([SLIDING, SLIDING, FULL, SLIDING],
               ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    "mixtral": ([FULL] * 2, None),
    "olmoe": ([FULL] * 2, None),
    "qwen2-moe": ([FULL] * 2, ["full_attention"] * 2),
    "mamba": ([RECURRENT] * 2, ["linear_attention"] * 2),
    "mamba2": ([RECURRENT] * 2, ["linear_attention"] * 2),
    "jamba": ([RECURRENT, RECURRENT, FULL, RECURRENT],
              ["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
    "bamba": ([RECURRENT, RECURRENT, FULL, RECURRENT],
              ["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
    "falcon-h1": (["LinearAttentionAndFullAttentionLayer"] * 2, ["hybrid"] * 2),
    "granite-moe-hybrid": ([RECURRENT, RECURRENT, FULL, RECURRENT],
                           ["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
    "lfm2": ([RECURRENT, RECURRENT, FULL, RECURRENT], ["conv", "conv", "full_attention", "conv"]),
    "qwen3-next": ([RECURRENT, RECURRENT, FULL, RECURRENT],
                   ["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
}

# Parameter counts (small, default). A change here is a recipe change: bump RECIPE_VERSION with it.
PARAMETERS: dict[str, tuple[int, int]] = {
    "llama": (4_194_624, 58_073_600),
    "mistral": (4_170_048, 58_073_600),
    "gemma2": (2_196_544, 41_697_792),
    "gemma3": (2_196_672, 41_698_816),
    "mixtral": (4_170_560, 53_764_608),
    "olmoe": (4_170_752, 53_772_800),
    "qwen2-moe": (4_195_520, 60_072_448),
    "mamba": (2_113_472, 31_126_016),
    "mamba2": (4_152_368, 46_000_000),
    "jamba": (4_268_844, 53_800_384),
    "bamba": (4_291_432, 61_702_688),
    "falcon-h1": (4_225_968, 71_292_800),
    "granite-moe-hybrid": (4_341_608, 63_685_152),
    "lfm2": (2_208_928, 41_699_072),
    "qwen3-next": (4_366_272, 67_024_192),
}


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_every_class_names_a_family_and_every_family_is_listed() -> None:
    assert set(CLASSES.values()) <= set(FAMILIES)
    assert set(ARCHITECTURES) == set(FAMILIES) | set(CLASSES)
    assert set(SMALL_LAYERS) == set(PARAMETERS) == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parameter_counts(name: str) -> None:
    counts = []
    for size in ("small", "default"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(FAMILIES[name](SIZES[size]))
        counts.append(sum(p.numel() for p in model.parameters()))
    assert tuple(counts) == PARAMETERS[name]


def test_granite_default_is_the_hybrid_benchmark_shape() -> None:
    config = FAMILIES["granite-moe-hybrid"](SIZES["default"])
    assert config.hidden_size == 512
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_builds_loads_and_continues_from_its_cache(name: str, tmp_path: Path) -> None:
    loaded = load_model(name, init_model(name, tmp_path / name, size="small"))
    model, config = loaded.model, loaded.model.config
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (EOS_ID, PAD_ID, None)
    assert loaded.eos_token_ids == frozenset({EOS_ID})
    assert loaded.context_length == 4096
    assert config.vocab_size == loaded.tokenizer.vocab_size == 32000
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    ids = torch.randint(len(SPECIAL_TOKENS), 32000, (1, PROMPT + MORE), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=config)
    with torch.no_grad():
        first = model(input_ids=ids[:, :PROMPT], position_ids=torch.arange(PROMPT)[None], cache=cache).logits
        more = model(input_ids=ids[:, PROMPT:], position_ids=torch.arange(PROMPT, PROMPT + MORE)[None],
                     cache=cache).logits
    assert first.shape == (1, PROMPT, 32000) and more.shape == (1, MORE, 32000)
    assert torch.isfinite(first).all() and torch.isfinite(more).all()
    layer_classes, layer_types = SMALL_LAYERS[CLASSES.get(name, name)]
    assert [type(layer).__name__ for layer in cache.layers] == layer_classes
    assert getattr(config, "layer_types", None) == layer_types


def test_a_hybrid_builds_byte_identically(tmp_path: Path) -> None:
    first = init_model("hybrid-moe", tmp_path / "first", size="small")
    again = init_model("hybrid-moe", tmp_path / "again", size="small")
    assert digest(first) == digest(again)
