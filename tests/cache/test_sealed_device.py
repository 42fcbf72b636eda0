"""Sealing state held on a device: through host staging (`cache/device_copy.py`), run on a CPU by staging host
tensors too, against the zero-copy path host tensors take."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Gemma3TextConfig

from cache import sealed_payload
from cache.adapters import KVPiece, ModelStateAdapter
from cache.arena import Scope, StateArena
from cache.blob_memory import BlobMemory
from cache.device_copy import PAGEABLE, HostCopies
from cache.lanes import BufferPool
from cache.sealing import Place, Sealer
from cache.state_spec import model_state_specs

ALICE = Scope("alice", "m")
KV_HEADS, HEAD_DIM, TOKENS = 2, 4, 10
STAGED = HostCopies(stage_host=True)


def adapter() -> ModelStateAdapter:
    """A full-attention layer (spans) and a sliding one (a snapshot of its window's tail)."""
    config = Gemma3TextConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                              num_hidden_layers=2, intermediate_size=8, vocab_size=100, sliding_window=4,
                              layer_types=["full_attention", "sliding_attention"])
    return ModelStateAdapter(model_state_specs(config), config)


def kv(tokens: int, dtype: torch.dtype, seed: int) -> KVPiece:
    generator = torch.Generator().manual_seed(seed)
    return KVPiece(torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=generator).to(dtype),
                   torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=generator).to(dtype))


def restored(host_copies: HostCopies, span: KVPiece, tail: KVPiece, later: bool = False) -> list[torch.Tensor]:
    """`span` (the full layer's rows) and `tail` (the sliding layer's snapshot) stored, sealed, split at 4 (two
    windows on one ciphertext) and restored up to row 9 through `host_copies` (`later`: the last window opening
    in the sealing threads until the layer is read): the working cache's K/V of both layers."""
    state = adapter()
    arena = StateArena(Sealer(threads=2))
    arena.host_copies = host_copies
    arena.register_model(ALICE.model, state)
    handle = arena.put(ALICE, 0, TOKENS, (KVPiece(span.keys.clone(), span.values.clone()), None))
    arena.attach_snapshot(handle, ((None,), (KVPiece(tail.keys.clone(), tail.values.clone()),)))
    arena.seal_cold()
    assert arena.is_sealed(handle) and arena.hot_bytes == 0
    left, right = arena.split(handle, 4)
    work = state.working_cache(16, BufferPool())
    opening = arena.restore(state, work, [(left, 4), (right, 5)], skip=0, snapshot=right, position=9, later=later)
    assert (opening is not None) == later
    if opening is not None:
        opening.finish()
    state.materialize(work)
    layers: list[Any] = work.layers
    return [layers[0].keys[:, :, :9], layers[0].values[:, :, :9], layers[1].keys, layers[1].values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [4096, 3])
@pytest.mark.parametrize("later", [False, True], ids=["now", "later"])
def test_state_opened_through_host_staging_is_bit_for_bit_the_zero_copy_paths(
        monkeypatch: pytest.MonkeyPatch, stagings: list[torch.Tensor], block: int, dtype: torch.dtype,
        later: bool) -> None:
    """Blocks of 3 rows: the windows cut blocks at both ends, which the zero-copy path opens through scratch and
    the staged path through one staging per layer's keys or values."""
    monkeypatch.setattr(sealed_payload, "BLOCK_TOKENS", block)
    span, tail = kv(TOKENS, dtype, 1), kv(3, dtype, 2)
    zero_copy = restored(PAGEABLE, span, tail, later)
    assert stagings == []  # host tensors are sealed and opened where they lie
    staged = restored(STAGED, span, tail, later)
    # Sealed: the span's keys and values, the snapshot's; opened: each window's keys and values, the snapshot's.
    assert len(stagings) == 4 + 4 + 2
    for want, got_zero_copy, got_staged in zip([span.keys[:, :, :9], span.values[:, :, :9], tail.keys, tail.values],
                                               zero_copy, staged, strict=True):
        assert got_staged.dtype == dtype and torch.equal(got_zero_copy, want) and torch.equal(got_staged, want)
    assert all(not staging.any() for staging in stagings)  # the plaintext staged reads back as zeros


def test_an_interrupted_seal_zeroes_the_staging_it_filled(monkeypatch: pytest.MonkeyPatch,
                                                           stagings: list[torch.Tensor]) -> None:
    monkeypatch.setattr(sealed_payload, "SEAL_BATCH_BYTES", 1)  # one message a batch: a stop after the first
    plain = (kv(TOKENS, torch.float32, 3), None)
    sealed = sealed_payload.seal_payload(Sealer(threads=2), BlobMemory(), ALICE, Place(1, 0, TOKENS, "span"), plain,
                                         lambda: True, STAGED)
    assert sealed is None and len(stagings) == 1 and not stagings[0].any()
    assert plain[0].keys.any()  # the plaintext itself is the caller's, untouched


def test_a_restore_makes_its_rows_on_the_device_the_state_was_sealed_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """The working buffers a sealed restore grows first are made where the state opens to (a GPU's, on one),
    not in host memory beside a model on the device."""
    devices: list[torch.device] = []
    span_rows = ModelStateAdapter.span_rows

    def recorded(self: ModelStateAdapter, cache: Any, index: int, keys: torch.Tensor, values: torch.Tensor,
                 count: int, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        devices.append(keys.device)
        rows = span_rows(self, cache, index, keys, values, count, spare)
        devices.append(rows[0].device)
        return rows

    monkeypatch.setattr(ModelStateAdapter, "span_rows", recorded)
    restored(STAGED, kv(TOKENS, torch.float32, 4), kv(3, torch.float32, 5))
    assert devices == [torch.device("cpu")] * 4  # two windows: what the adapter was given, what it made
