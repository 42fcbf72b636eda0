"""Generated models are deterministic and load through from_pretrained."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from node.cli import build_parser
from node.engine.loader import ModelLoadError, load_model
from node.engine.synthetic import (
    ARCHITECTURES,
    CLASSES,
    SIZES,
    VOCAB_SIZE,
    UnknownArchitectureError,
    build_tokenizer,
    init_model,
)


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_two_builds_are_byte_identical(tmp_path: Path, small_model_dir: Path) -> None:
    again = init_model("dense", tmp_path / "again", size="small")
    assert digest(again) == digest(small_model_dir)


def test_the_model_loads_with_its_chat_template_and_eos(small_model_dir: Path) -> None:
    loaded = load_model("small", small_model_dir)
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    text = loaded.tokenizer.decode(ids["input_ids"])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.eos_token_ids == frozenset({loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert loaded.state is not None and loaded.reuse_blocker is None


def test_unknown_architecture_and_non_model_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UnknownArchitectureError, match="choose one of: .*dense"):
        init_model("transformer-xl", tmp_path / "x")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model("x", tmp_path)


def parameters(config: PretrainedConfig) -> int:
    """The model's parameter count, built on the meta device: shapes without a byte of weights."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_the_1b_size_is_a_llama_shape_of_1_1_billion_parameters() -> None:
    config = ARCHITECTURES["dense"](SIZES["1b"])
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (
        "llama", 2048, 16, 32, 8, 8192, 32768)
    per_layer = 2048 * (2048 + 512 + 512 + 2048) + 3 * 2048 * 8192 + 2 * 2048  # q k v o, gate up down, two norms
    assert parameters(config) == 2 * VOCAB_SIZE * 2048 + 16 * per_layer + 2048 == 1_104_218_112


def test_the_1b_hybrid_is_bamba_within_a_fifth_of_the_dense_count() -> None:
    config = ARCHITECTURES["hybrid"](SIZES["1b"])
    assert CLASSES["hybrid"] == "bamba" and config.model_type == "bamba"
    assert config.attn_layer_indices == [3, 7, 11, 15]  # 12 Mamba2 layers, 4 attention layers
    assert (config.hidden_size, config.intermediate_size, config.mamba_n_heads, config.mamba_d_state) == (
        2048, 8192, 64, 128)
    hybrid, dense = parameters(config), parameters(ARCHITECTURES["dense"](SIZES["1b"]))
    assert hybrid == 1_288_555_776
    assert abs(hybrid - dense) <= 0.2 * dense


@pytest.mark.parametrize("size", sorted(SIZES))
def test_models_init_offers_every_size(size: str) -> None:
    assert build_parser().parse_args(["models", "init", "--size", size, "out"]).size == size


def test_the_tokenizer_limit_is_the_models_context(small_model_dir: Path) -> None:
    assert json.loads((small_model_dir / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    assert build_tokenizer(SIZES["1b"].context).model_max_length == 32768
