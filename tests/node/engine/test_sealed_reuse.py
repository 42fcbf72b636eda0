"""Reuse from sealed state against the model itself: a sealed hit gives reuse-off output; a sealed entry that
fails authentication is dropped and recomputed; retention none and a removed caller leave no state behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cache.arena import Scope, SealCost, StateArena, new_prefix_cache
from cache.budget import CacheBudget
from node.engine.loader import LoadedModel
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from tests.node.engine.runners import dense_or_hybrid, sealed_runner, tokens

ALICE, BOB = Scope("alice", "m"), Scope("bob", "m")


@pytest.fixture(scope="module", params=["dense", "granite-moe-hybrid"])
def loaded(request: pytest.FixtureRequest, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> LoadedModel:
    return dense_or_hybrid(request.param, small_model_dir, tmp_path_factory)


def sealing_runner(loaded: LoadedModel, **kwargs: Any) -> ModelRunner:
    return sealed_runner(loaded, prefill_chunk=64, **kwargs)


def run(runner: ModelRunner, scope: Scope, prompt: list[int], retain: bool = True, boundaries: tuple[int, ...] = ()
        ) -> tuple[list[int], int, int]:
    """(output ids, cached reads, cached writes); settles after the reply as the scheduler does."""
    result = runner.generate(GenerationRequest(scope, prompt, SamplingParams(8, 0.0), boundaries, retain),
                             emit=lambda _: None, cancelled=lambda: False)
    runner.settle()
    return result.output_ids, result.cached_read_tokens, result.cached_write_tokens


def arena_of(runner: ModelRunner) -> StateArena:
    assert runner.reuse.arena is not None
    return runner.reuse.arena


def test_a_sealed_hit_equals_reuse_off(loaded: LoadedModel) -> None:
    sealed, plain = sealing_runner(loaded), ModelRunner(loaded, None)
    history = tokens(1, 150)
    first, _, written = run(sealed, ALICE, history, boundaries=(60,))
    assert written == 150
    arena = arena_of(sealed)
    assert arena.hot_bytes == 0 and arena.sealed_bytes == arena.bytes_total > 0
    run(sealed, BOB, tokens(2, 70))  # bob's request takes the working buffers: alice's state is only sealed now
    follow = history + first + tokens(3, 20)
    got, restored, _ = run(sealed, ALICE, follow)
    assert restored > 0
    assert got == run(plain, ALICE, follow)[0]


@pytest.mark.parametrize("tamper", ["flipped", "moved", "other scope"])
def test_an_entry_that_fails_to_open_is_dropped_counted_and_recomputed(loaded: LoadedModel, tamper: str) -> None:
    sealed, plain = sealing_runner(loaded), ModelRunner(loaded, None)
    history = tokens(4, 120)
    run(sealed, ALICE, history, boundaries=(60,))
    run(sealed, ALICE, history[:40] + tokens(9, 60))  # a second branch: two sealed spans of alice's to swap
    run(sealed, BOB, tokens(5, 50))
    arena = arena_of(sealed)
    alices = [e for e in arena._entries.values() if e.scope == ALICE and e.span.sealed is not None]
    if tamper == "flipped":
        for blob in {id(e.span.sealed.blob): e.span.sealed.blob for e in alices}.values():
            blob.data[-1] ^= 1  # the last message of each of alice's sealed spans is altered
    elif tamper == "moved":
        blobs = {id(e.span.sealed.blob): e.span for e in alices}  # two spans sealed apart (not a split's halves)
        first, second = list(blobs.values())[:2]
        first.sealed, second.sealed = second.sealed, first.sealed  # each in the other's place
    else:
        for entry in alices:
            entry.scope = BOB  # a bug hands alice's entries to bob's key
    follow = history + tokens(6, 10)
    got, restored, _ = run(sealed, ALICE, follow)
    assert arena.open_failures >= 1
    if tamper != "moved":  # every entry of alice's fails: what failed to open is not billed as read
        assert restored == 0
    assert got == run(plain, ALICE, follow)[0]


def test_a_sealed_hits_rows_open_layer_by_layer_while_its_first_chunk_runs(loaded: LoadedModel) -> None:
    sealed, plain = sealing_runner(loaded), ModelRunner(loaded, None)
    history = tokens(10, 150)
    first, _, _ = run(sealed, ALICE, history, boundaries=(60,))
    run(sealed, BOB, tokens(11, 70))
    follow = history + first + tokens(12, 20)
    seq = sealed.start(GenerationRequest(ALICE, follow, SamplingParams(8, 0.0)), lambda _: None, lambda: False)
    assert seq.restored > 0 and seq.opening is not None  # start returned with rows still opening
    order: list[int] = []
    for index, layer in enumerate(seq.cache.layers):
        hook = getattr(layer, "opening", None)
        if hook is not None:
            layer.opening = lambda hook=hook, index=index: (order.append(index), hook())
    hooked = len(order) + sum(getattr(layer, "opening", None) is not None for layer in seq.cache.layers)
    assert hooked > 0
    sealed.prefill(seq)
    assert order == sorted(order) and len(order) == hooked  # each layer waited for its own rows, in order
    assert seq.opening is None and seq.restored > 0
    while not seq.done:
        sealed.prefill(seq) if seq.prefilling else sealed.decode([seq])
    result = sealed.finish(seq)
    sealed.settle()
    assert result.output_ids == run(plain, ALICE, follow)[0]


def test_a_sealed_span_cut_short_by_the_prompt_opens_past_the_cut_before_its_first_chunk_writes_there(
        loaded: LoadedModel) -> None:
    sealed, plain = sealing_runner(loaded), ModelRunner(loaded, None)
    history = tokens(13, 150)
    run(sealed, ALICE, history, boundaries=(60,))
    run(sealed, BOB, tokens(14, 70))
    branch = history[:100] + tokens(15, 30)  # diverges inside alice's sealed span
    seq = sealed.start(GenerationRequest(ALICE, branch, SamplingParams(8, 0.0), (60,)), lambda _: None,
                       lambda: False)
    # A dense model resumes at the branch point, inside the span: its last block, cut there, opens in place past
    # it, over the rows the chunk writes next, which wait for it layer by layer. A hybrid resumes at its snapshot
    # (60), where a span ends: nothing is cut.
    assert seq.restored in (60, 100) and seq.opening is not None
    while not seq.done:
        sealed.prefill(seq) if seq.prefilling else sealed.decode([seq])
    result = sealed.finish(seq)
    sealed.settle()
    assert result.output_ids == run(plain, ALICE, branch)[0]


def test_retention_none_stores_nothing_and_leaves_no_working_state(loaded: LoadedModel) -> None:
    sealed = sealing_runner(loaded)
    prompt = tokens(7, 100)
    _, _, written = run(sealed, ALICE, prompt, retain=False)
    arena = arena_of(sealed)
    assert written == 0 and len(arena) == 0
    assert sealed.reuse.lanes is not None
    pool = sealed.reuse.lanes._pools[0]._buffers
    assert pool and all(not buffer[:, :, :108].any() for buffer in pool.values())  # the rows it wrote, wiped
    assert run(sealed, ALICE, prompt)[1] == 0


def test_a_wipe_of_an_idle_lane_gives_way_to_waiting_work_and_a_later_settle_finishes_it(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    sealed = sealing_runner(loaded)
    sealed.generate(GenerationRequest(ALICE, tokens(9, 300), SamplingParams(8, 0.0), (), False),
                    emit=lambda _: None, cancelled=lambda: False)
    lanes = sealed.reuse.lanes
    assert lanes is not None
    pool = lanes._pools[0]
    monkeypatch.setattr("cache.lanes.WIPE_BATCH_BYTES", 64 * pool.row_bytes)
    looks: list[int] = []

    def stop() -> bool:  # a request arrives after the first batch of rows
        looks.append(1)
        return len(looks) > 1

    dirty = lanes.written(0)
    assert dirty >= 300
    sealed.settle(stop)
    assert lanes.written(0) == dirty - 64  # what is left to zero
    for buffer in pool._buffers.values():
        assert buffer[:, :, :dirty - 64].any() and not buffer[:, :, dirty - 64:dirty].any()
    sealed.settle()
    assert lanes.written(0) == 0 and all(not buffer[:, :, :dirty].any() for buffer in pool._buffers.values())


def test_a_removed_caller_leaves_zeros_and_no_key(loaded: LoadedModel) -> None:
    sealed = sealing_runner(loaded)
    run(sealed, ALICE, tokens(8, 90))
    arena = arena_of(sealed)
    blobs = [entry.span.sealed.blob.data for entry in arena._entries.values() if entry.span.sealed is not None]
    assert blobs and all(any(blob) for blob in blobs)
    assert sealed.reuse.lanes is not None
    pool = sealed.reuse.lanes._pools[0]._buffers
    assert all(buffer[:, :, :98].any() for buffer in pool.values())  # alice's working cache is hot
    sealed.drop_caller("alice")
    assert all(not any(blob) for blob in blobs) and len(arena) == 0
    assert arena.sealer is not None and not arena.sealer.has_key(ALICE)
    assert all(not buffer[:, :, :98].any() for buffer in pool.values())


def test_the_cost_of_sealing_is_measured_at_load_and_these_models_keep_their_state(loaded: LoadedModel) -> None:
    cost = sealing_runner(loaded, seal_cost=None).reuse.seal_cost
    assert cost is not None and cost.sample_tokens == 256 and cost.sample_bytes > 0
    assert cost.open_s_per_byte > 0 and cost.recompute_s_per_token > 0
    assert cost.model_worth_sealing  # a CPU computes a token slower than it opens the token's state


def dropping_runner(loaded: LoadedModel, plaintext_bytes: int = 0) -> ModelRunner:
    """As on a fast device: a token computes faster than its state opens."""
    prefix_cache = new_prefix_cache(CacheBudget(1 << 30, 1 << 30), plaintext_bytes=plaintext_bytes)
    return ModelRunner(loaded, prefix_cache, prefill_chunk=64, seal_cost=SealCost(1.0, 1e-9, 1 << 20, 256))


def test_a_model_cheaper_to_compute_than_to_open_stores_nothing_and_bills_no_cached_writes(loaded: LoadedModel
                                                                                         ) -> None:
    dropping, plain = dropping_runner(loaded), ModelRunner(loaded, None)
    history = tokens(6, 100)
    first, restored, written = run(dropping, ALICE, history, boundaries=(60,))
    assert (restored, written, len(arena_of(dropping))) == (0, 0, 0)
    follow = history + first + tokens(7, 12)
    got, restored, _ = run(dropping, ALICE, follow)
    assert restored == 0 and got == run(plain, ALICE, follow)[0]


def test_with_a_hot_tier_such_state_is_stored_and_dropped_where_it_would_be_sealed(loaded: LoadedModel) -> None:
    dropping, plain = dropping_runner(loaded, plaintext_bytes=1), ModelRunner(loaded, None)
    arena = arena_of(dropping)
    history = tokens(8, 100)
    first, _, written = run(dropping, ALICE, history, boundaries=(60,))
    assert written == 100 and arena.unsealed_drops > 0  # over the 1-byte hot tier: dropped, none sealed
    assert len(arena) == 0 and arena.sealed_bytes == arena.bytes_total == 0
    follow = history + first + tokens(9, 12)
    got, restored, _ = run(dropping, ALICE, follow)
    assert restored == 0 and got == run(plain, ALICE, follow)[0]
