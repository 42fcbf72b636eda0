"""The last layer computed for the last position only: the same logits and greedy tokens as the full forward."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from node.engine import forward
from node.engine.last_row import FLAG, LastRow
from node.engine.loader import load_model
from node.engine.synthetic import init_model
from tests.numeric import relative_error

TOLERANCE = 1e-5  # of the largest |logit|; measured about 2e-7 (the same sums on fewer rows)


def ids(seed: int, count: int) -> list[int]:
    return torch.randint(100, 30000, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["dense", "swa", "moe", "gemma2"])
def test_a_resumed_chunk_gives_the_full_forwards_logits(arch: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENZRO_NATIVE", "off")  # transformers' forward, where the hooks act
    loaded = load_model(arch, init_model(arch, tmp_path / arch, "small"))
    got_forward = loaded.forward
    assert got_forward.last_row is not None and got_forward.decoder is None
    full = dataclasses.replace(got_forward, last_row=None)
    prompt = ids(1, 90)
    got_cache, want_cache = DynamicCache(config=loaded.model.config), DynamicCache(config=loaded.model.config)
    with torch.inference_mode():
        got_forward.prefill(prompt[:60], 0, got_cache)
        full.prefill(prompt[:60], 0, want_cache)
        got = got_forward.prefill(prompt[60:], 60, got_cache).logits()
        want = full.prefill(prompt[60:], 60, want_cache).logits()
        assert relative_error(got, want) <= TOLERANCE
        # The keys and values of every row were still written: the next step agrees too.
        step_got = got_forward.prefill([7], 90, got_cache).logits()
        step_want = full.prefill([7], 90, want_cache).logits()
    assert relative_error(step_got, step_want) <= TOLERANCE
    assert not any(getattr(module, FLAG, False) for module in loaded.model.modules())  # off again after


def test_a_model_whose_last_layer_is_not_attention_and_mlp_gets_no_hooks(tmp_path: Path) -> None:
    loaded = load_model("mamba2", init_model("mamba2", tmp_path / "m", "small"))
    assert loaded.forward.last_row is None and LastRow.install(loaded.model) is None


def test_hooks_that_change_the_logits_are_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forward, "last_row_agrees", lambda model, last_row: False)
    assert load_model("d", init_model("dense", tmp_path / "d", "small")).forward.last_row is None


def test_the_check_catches_a_last_layer_that_the_last_row_does_not_reproduce(tmp_path: Path) -> None:
    """A layer whose rows mix (here: its MLP input averaged over the rows) cannot be cut to one row."""
    loaded = load_model("d", init_model("dense", tmp_path / "d", "small"))
    model = loaded.model
    mlp = model.model.layers[-1].mlp
    original = mlp.forward
    mlp.forward = lambda hidden: original(hidden.mean(dim=1, keepdim=True).expand_as(hidden) + hidden)
    last_row = LastRow.install(model)
    assert last_row is not None and not forward.last_row_agrees(model, last_row)
