"""Trust groups in the engine: a member resumes the group's prefix from the group's scope, its own turns stay its
own, a non-member reads nothing of the group, the group's prefix is billed once, and a dropped group is gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache.arena import Scope
from cache.scope import SharedPrefix, group_scope
from node.engine.loader import LoadedModel
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from tests.node.engine.runners import dense_or_hybrid, sealed_runner, tokens

A, B, C = Scope("a", "m"), Scope("b", "m"), Scope("c", "m")
GROUP = group_scope("team", "m")
SHARED = 100
"""Tokens of the group's prefix (a system prompt)."""


@pytest.fixture(scope="module", params=["dense", "granite-moe-hybrid"])
def loaded(request: pytest.FixtureRequest, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> LoadedModel:
    return dense_or_hybrid(request.param, small_model_dir, tmp_path_factory)


PREFIX = tokens(1, SHARED)


def run(runner: ModelRunner, scope: Scope, prompt: list[int], shared: bool) -> tuple[list[int], int, int]:
    """(output ids, cached reads, cached writes) of `prompt`, its first SHARED tokens the group's when `shared`;
    settles after the reply as the scheduler does."""
    request = GenerationRequest(scope, prompt, SamplingParams(8, 0.0), (SHARED,),
                                shared=SharedPrefix(GROUP, SHARED) if shared else None)
    result = runner.generate(request, emit=lambda _: None, cancelled=lambda: False)
    runner.settle()
    return result.output_ids, result.cached_read_tokens, result.cached_write_tokens


def test_members_share_the_groups_prefix_and_nothing_else(loaded: LoadedModel) -> None:
    runner, plain = sealed_runner(loaded, prefill_chunk=64), ModelRunner(loaded, None)
    a_turn, b_turn = PREFIX + tokens(2, 40), PREFIX + tokens(3, 30)
    out, read, written = run(runner, A, a_turn, shared=True)
    assert (read, written) == (0, 140)  # the group's 100 and A's own 40, both written by A
    assert out == run(plain, A, a_turn, shared=True)[0]
    out, read, written = run(runner, B, b_turn, shared=True)
    assert (read, written) == (SHARED, 30)  # B reads A's write of the prefix; its copy of it is not billed
    assert out == run(plain, B, b_turn, shared=True)[0]
    assert run(runner, C, b_turn, shared=False)[1:] == (0, 130)  # a non-member reads nothing of the group
    assert run(runner, B, a_turn, shared=True)[1] == SHARED  # A's own turn stays A's: B reads the prefix only
    b_next = b_turn + out + tokens(4, 20)
    assert run(runner, B, b_next, shared=True)[1] >= len(b_turn)  # B's own turns resume from B's own scope
    reuse = runner.reuse
    assert reuse.prefix_cache is not None
    assert reuse.prefix_cache.holdings(GROUP).tokens == SHARED  # the group holds its prefix, and only that


def test_a_dropped_group_is_read_by_no_member(loaded: LoadedModel) -> None:
    runner = sealed_runner(loaded, prefill_chunk=64)
    run(runner, A, PREFIX + tokens(2, 40), shared=True)
    runner.drop_caller(GROUP.caller)
    assert run(runner, B, PREFIX + tokens(3, 30), shared=True)[1:] == (0, 130)


def test_a_request_running_when_its_group_is_dropped_stores_nothing_there(loaded: LoadedModel) -> None:
    runner = sealed_runner(loaded, prefill_chunk=64)
    dropped: list[bool] = []

    def drop_once(_: str) -> None:  # while the request decodes, as the worker's chore between steps would
        if not dropped:
            dropped.append(runner.reuse.drop_caller(GROUP.caller))  # the group removed from the config

    request = GenerationRequest(A, PREFIX + tokens(2, 40), SamplingParams(8, 0.0), (SHARED,),
                                shared=SharedPrefix(GROUP, SHARED))
    result = runner.generate(request, emit=drop_once, cancelled=lambda: False)
    assert dropped and result.cached_write_tokens == 140  # all of it A's own now
    assert runner.reuse.prefix_cache is not None and runner.reuse.prefix_cache.holdings(GROUP).tokens == 0


def test_a_request_queued_when_its_group_is_removed_stores_nothing_there(loaded: LoadedModel) -> None:
    runner = sealed_runner(loaded, prefill_chunk=64)
    request = GenerationRequest(A, PREFIX + tokens(2, 40), SamplingParams(8, 0.0), (SHARED,),
                                shared=SharedPrefix(GROUP, SHARED), stamp=runner.reuse.shreds.now)
    runner.drop_caller(GROUP.caller)
    result = runner.generate(request, emit=lambda _: None, cancelled=lambda: False)
    assert result.cached_write_tokens == 140  # all of it A's own
    assert runner.reuse.prefix_cache is not None and runner.reuse.prefix_cache.holdings(GROUP).tokens == 0
