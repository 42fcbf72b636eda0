"""The lanes' working memory: reserved in whole grains, counted as written, wiped giving way to waiting work."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from cache.adapters import ModelStateAdapter
from cache.lanes import BufferPool, Lanes, rows_per_lane
from cache.state_spec import model_state_specs
from cache.working_cache import GrowableKVLayer

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4
ROW_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
"""Per token row: keys and values of every full-attention layer, float32."""


def lanes_of_a_small_model() -> Lanes:
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         num_hidden_layers=LAYERS, intermediate_size=8, vocab_size=100)
    return Lanes(ModelStateAdapter(model_state_specs(config), config).working_cache)


def write(cache: DynamicCache, rows: int, value: float = 1.0) -> None:
    """As a forward does: `rows` new K/V rows of `value` in every layer, after what the cache holds."""
    for layer in cache.layers:
        assert isinstance(layer, GrowableKVLayer)
        layer.update(torch.full((1, KV_HEADS, rows, HEAD_DIM), value), torch.full((1, KV_HEADS, rows, HEAD_DIM), value))


def buffers(lanes: Lanes, lane: int) -> list[torch.Tensor]:
    return list(lanes._pools[lane]._buffers.values())


def written_lane(lanes: Lanes, lane: int, rows: int) -> None:
    """`rows` rows of ones written in `lane` and counted, as a request that leaves its lane."""
    cache, _ = lanes.new_cache(lane, rows)
    write(cache, rows)
    lanes.mark_written(lane, rows)


def test_rows_per_lane_are_whole_grains_of_the_budget_capped_by_the_context() -> None:
    assert rows_per_lane(4 * 1100 * ROW_BYTES, 4, ROW_BYTES, 4096) == 1024  # 1,100 rows fit: two grains
    assert rows_per_lane(4 * 511 * ROW_BYTES, 4, ROW_BYTES, 4096) == 0  # under a grain
    assert rows_per_lane(4 * 512 * ROW_BYTES, 4, ROW_BYTES, 4096) == 512
    assert rows_per_lane(10**12, 4, ROW_BYTES, 4096) == 4096
    assert rows_per_lane(10**12, 4, ROW_BYTES, 1000) == 512  # capped by the context first, then whole grains


def test_reserve_learns_the_row_bytes_once_and_gives_every_lane_zeroed_buffers_of_the_rows() -> None:
    lanes = lanes_of_a_small_model()
    probes: list[int] = []

    def probe(cache: DynamicCache) -> None:  # one token run, as the engine's forward would
        probes.append(1)
        write(cache, 1)

    assert lanes.reserve(3, 0, 4096, probe) == 0 and probes == [] and lanes.row_bytes(0) == 0
    assert lanes.reserve(3, 3 * 511 * ROW_BYTES, 4096, probe) == 0 and lanes.rows == 0  # under a grain
    assert probes == [1] and lanes.row_bytes(0) == ROW_BYTES and lanes.written(0) == 0
    assert lanes.reserve(3, 3 * 1100 * ROW_BYTES, 4096, probe) == 1024 and lanes.rows == 1024
    assert probes == [1]  # lane 0's buffers told the shapes
    for lane in range(3):
        assert [tuple(buffer.shape) for buffer in buffers(lanes, lane)] == [(1, KV_HEADS, 1024, HEAD_DIM)] * 4
        assert not any(buffer.any() for buffer in buffers(lanes, lane))
    assert 3 not in lanes._pools
    # A request of up to the reserved rows takes those buffers: nothing is allocated on its time.
    held = [buffer.data_ptr() for buffer in buffers(lanes, 2)]
    written_lane(lanes, 2, 1000)
    assert [buffer.data_ptr() for buffer in buffers(lanes, 2)] == held


def test_a_model_without_rows_in_lanes_reserves_nothing() -> None:
    lanes = Lanes(lambda capacity, pool: DynamicCache())  # as a recurrent model's: no full-attention layer
    assert lanes.reserve(4, 1 << 30, 4096, lambda cache: None) == 0 and lanes.rows == 0


def test_the_rows_written_in_a_lane_are_counted_to_the_furthest_row() -> None:
    lanes = lanes_of_a_small_model()
    lanes.mark_written(0, 30)
    lanes.mark_written(0, 20)
    lanes.mark_written(2, 5)
    assert [lanes.written(lane) for lane in range(3)] == [30, 0, 5]


def test_a_wiped_lane_reads_all_zeros_and_has_nothing_left_to_wipe() -> None:
    lanes = lanes_of_a_small_model()
    written_lane(lanes, 0, 100)
    assert all(buffer[:, :, :100].all() for buffer in buffers(lanes, 0))
    lanes.wipe_idle((), {})
    assert lanes.written(0) == 0 and not any(buffer[:, :, :100].any() for buffer in buffers(lanes, 0))


def test_a_wipe_keeps_the_hot_rows_and_leaves_busy_lanes_alone() -> None:
    lanes = lanes_of_a_small_model()
    written_lane(lanes, 0, 100)
    written_lane(lanes, 1, 60)
    lanes.wipe_idle({1}, {0: 40})
    assert lanes.written(0) == 40 and lanes.written(1) == 60
    assert all(buffer[:, :, :40].all() and not buffer[:, :, 40:100].any() for buffer in buffers(lanes, 0))
    assert all(buffer[:, :, :60].all() for buffer in buffers(lanes, 1))


def test_a_wipe_that_gives_way_leaves_the_rows_below_where_it_stopped_for_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = lanes_of_a_small_model()
    written_lane(lanes, 1, 100)  # written first: wiped first
    written_lane(lanes, 0, 100)
    monkeypatch.setattr("cache.lanes.WIPE_BATCH_BYTES", 16 * ROW_BYTES)
    looks = iter([False, True, True])
    lanes.wipe_idle((), {1: 10}, lambda: next(looks))  # a request arrives after the first batch of rows
    assert lanes.written(1) == 84 and lanes.written(0) == 100
    assert all(buffer[:, :, :84].all() and not buffer[:, :, 84:100].any() for buffer in buffers(lanes, 1))
    assert all(buffer[:, :, :100].all() for buffer in buffers(lanes, 0))
    lanes.wipe_idle((), {1: 10})
    assert lanes.written(1) == 10 and lanes.written(0) == 0
    assert all(buffer[:, :, :10].all() and not buffer[:, :, 10:100].any() for buffer in buffers(lanes, 1))
    assert not any(buffer[:, :, :100].any() for buffer in buffers(lanes, 0))


def test_a_lanes_next_cache_is_its_last_cut_back_or_continuing_from_its_rows() -> None:
    lanes = lanes_of_a_small_model()
    cache, adopted = lanes.new_cache(0, 64)
    assert adopted == 0 and all(isinstance(layer, GrowableKVLayer) for layer in cache.layers)
    write(cache, 40, 2.0)
    again, adopted = lanes.new_cache(0, 64, adopt=30)
    assert again is cache and adopted == 30 and again.get_seq_length() == 30
    layer = again.layers[1]
    assert isinstance(layer, GrowableKVLayer) and layer.keys is not None and bool((layer.keys == 2.0).all())
    other, adopted = lanes.new_cache(1, 64, adopt=30)  # another lane holds none of these rows
    assert other is not cache and adopted == 0 and other.get_seq_length() == 0


def test_a_reserved_pool_holds_zeroed_buffers_shaped_as_its_model_and_keeps_them() -> None:
    model = BufferPool()
    layer = GrowableKVLayer(capacity=4, pool=model)
    layer.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8))
    pool = BufferPool()
    pool.reserve(model, 1000)
    assert pool.row_bytes == model.row_bytes == 2 * (2 * 8 * 4)  # keys and values: 2 heads of 8 floats
    held = [pool.held(slot) for slot in (0, 1)]
    assert all(buffer is not None and buffer.shape == (1, 2, 1024, 8) and not buffer.any() for buffer in held)
    layer = GrowableKVLayer(capacity=1000, pool=pool)
    layer.update(torch.ones(1, 2, 1000, 8), torch.ones(1, 2, 1000, 8))
    assert [pool.held(slot) for slot in (0, 1)] == held


def test_zeroing_rows_goes_from_the_last_row_down_in_batches_and_stops_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BufferPool()
    layer = GrowableKVLayer(capacity=100, pool=pool)
    layer.update(torch.ones(1, 2, 100, 8), torch.ones(1, 2, 100, 8))
    monkeypatch.setattr("cache.lanes.WIPE_BATCH_BYTES", 30 * pool.row_bytes)
    looks = iter([False, False, True])
    assert pool.zero_rows(10, 100, lambda: next(looks)) == 40  # two batches of 30 rows, then asked to stop
    held = [pool.held(slot) for slot in (0, 1)]
    assert all(b is not None and b[:, :, 10:40].all() and not b[:, :, 40:100].any() for b in held)
    assert pool.zero_rows(10, 40) == 10
    assert all(b is not None and b[:, :, :10].all() and not b[:, :, 10:100].any() for b in held)
