"""Generated models are deterministic and load through from_pretrained."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from node.engine.loader import ModelLoadError, load_model
from node.engine.synthetic import UnknownArchitectureError, init_model


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
