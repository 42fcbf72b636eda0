"""Pooled working layers: restored pieces appended by reference read the same as copies."""

from __future__ import annotations

import torch

from cache.lanes import BufferPool
from cache.working_cache import GrowableKVLayer


def kv(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, tokens, 8, generator=generator), torch.randn(1, 2, tokens, 8, generator=generator)


def reserve_and_write(layer: GrowableKVLayer, keys: torch.Tensor, values: torch.Tensor
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """As the CPU decoder appends: reserve the rows, write them in place, read the segments."""
    new_keys, new_values, segments = layer.reserve(keys)
    new_keys.copy_(keys)
    new_values.copy_(values)
    return segments


def test_pieces_by_reference_are_read_in_place_then_joined_on_demand() -> None:
    layer = GrowableKVLayer(capacity=8, pool=BufferPool())
    first, second, new = kv(1, 5), kv(2, 4), kv(3, 3)
    layer.defer(*first)
    layer.defer(*second)
    assert layer.get_seq_length() == 9
    segments = reserve_and_write(layer, *new)
    assert layer.get_seq_length() == 12 and layer.capacity == 16  # grew past 8 without copying the pieces
    assert len(segments) == 3
    assert segments[0][0] is first[0] and segments[1][1] is second[1]  # the stored tensors themselves
    assert torch.equal(segments[2][0], new[0]) and torch.equal(segments[2][1], new[1])
    expected_keys = torch.cat([first[0], second[0], new[0]], dim=2)
    expected_values = torch.cat([first[1], second[1], new[1]], dim=2)
    keys, values = layer.update(*kv(4, 1))  # a reader of one tensor joins the pieces first
    assert torch.equal(keys[:, :, :12], expected_keys) and torch.equal(values[:, :, :12], expected_values)
    assert len(layer.segments()) == 1


def test_pieces_after_buffered_tokens_keep_their_positions() -> None:
    layer = GrowableKVLayer(capacity=32)
    head, piece, tail = kv(5, 4), kv(6, 6), kv(7, 2)
    layer.update(*head)  # as an adopted prefix: already in the buffer
    layer.defer(*piece)
    segments = reserve_and_write(layer, *tail)
    assert [s[0].shape[2] for s in segments] == [4, 6, 2]
    layer.materialize()
    assert torch.equal(layer.keys, torch.cat([head[0], piece[0], tail[0]], dim=2))
    assert [s[0].shape[2] for s in layer.segments()] == [12]


def test_a_continuing_request_cuts_the_last_layer_back_in_place() -> None:
    layer = GrowableKVLayer(capacity=16, pool=BufferPool())
    keys, values = kv(8, 10)
    layer.update(keys, values)
    assert not layer.truncate(11, 16)  # fewer tokens than asked for
    assert not layer.truncate(6, 64)  # no room for the next request
    assert layer.truncate(6, 16)
    assert layer.get_seq_length() == 6 and torch.equal(layer.keys, keys[:, :, :6])
    layer.defer(*kv(9, 3))
    assert not layer.truncate(2, 16)  # pieces held by reference


def test_rows_written_in_place_count_at_once_and_the_views_catch_up_when_read() -> None:
    layer = GrowableKVLayer(capacity=8)
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer.update(keys, values)
    key_buffer, value_buffer, row = layer.append_at()  # type: ignore[misc]
    assert row == 5
    key_buffer[:, :, row] = 1.0
    value_buffer[:, :, row] = 2.0
    layer.advance()
    assert layer.get_seq_length() == 6 and layer.append_at()[2] == 6  # type: ignore[index]
    assert layer._keys is not None and layer._keys.shape[2] == 5  # no view made yet
    assert layer.keys is not None and layer.values is not None
    assert torch.equal(layer.keys[:, :, :5], keys) and bool((layer.keys[:, :, 5] == 1.0).all())
    assert bool((layer.values[:, :, 5] == 2.0).all()) and layer.get_seq_length() == 6
    k, _ = layer.update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))  # after the in-place row
    assert k.shape[2] == 8 and bool((k[:, :, 5] == 1.0).all())
    assert layer.append_at() is None  # full: the next row needs `update`, which grows the buffer
    layer.defer(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert layer.append_at() is None  # pieces held by reference are copied first, by `update`
