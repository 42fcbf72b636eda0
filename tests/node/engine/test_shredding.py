"""A caller shreds its scope (`DELETE /v1/cache`, `ModelRunner.shred`) while requests it sent before still wait or
run: each replies in full and stores nothing in the scope after the shred (no state, no snapshot, no reply, no
cached write billed); another caller's request, and the caller's requests accepted after, store as usual; a request
accepted after never copies rows from one accepted before; a removed caller's queued request stores nothing either.
Over a dense model and a hybrid one (whose stored state resumes at snapshots)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cache.arena import Scope
from cache.prefix_cache import NOTHING_HELD, Holdings
from node.engine.loader import LoadedModel
from node.engine.runner import GenerationRequest, GenerationResult, ModelRunner
from node.engine.sampling import SamplingParams
from tests.node.engine.runners import dense_or_hybrid, sealed_runner, tokens

A, B = Scope("a", "m"), Scope("b", "m")
PROMPT = tokens(1, 120)
BOUNDARIES = (40, 90)
"""Where messages start: the hybrid model's snapshots."""


@pytest.fixture(scope="module", params=["dense", "granite-moe-hybrid"])
def loaded(request: pytest.FixtureRequest, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> LoadedModel:
    return dense_or_hybrid(request.param, small_model_dir, tmp_path_factory)


def accepted(runner: ModelRunner, scope: Scope, prompt: list[int] = PROMPT) -> GenerationRequest:
    """A request accepted now (stamped as `ModelService.request` stamps it), to run later."""
    return GenerationRequest(scope, prompt, SamplingParams(6, 0.0), BOUNDARIES, stamp=runner.reuse.shreds.now)


def generate(runner: ModelRunner, request: GenerationRequest,
             emit: Callable[[str], None] = lambda _: None) -> GenerationResult:
    result = runner.generate(request, emit=emit, cancelled=lambda: False)
    runner.settle()  # after the reply, as the scheduler does
    return result


def held(runner: ModelRunner, scope: Scope) -> tuple[Holdings, int]:
    """(What the prefix index holds for `scope`, replies remembered for it)."""
    assert runner.reuse.prefix_cache is not None
    return runner.reuse.prefix_cache.holdings(scope), runner.reuse.replies.replies(scope)


def billed(result: GenerationResult) -> tuple[int, int, bool]:
    return result.cached_read_tokens, result.cached_write_tokens, result.retained


def test_a_request_accepted_before_the_shred_stores_nothing_after_it(loaded: LoadedModel) -> None:
    runner = sealed_runner(loaded, prefill_chunk=64)
    first = generate(runner, accepted(runner, A))
    stored = len(PROMPT) + len(first.output_ids)  # what a request stores: its prompt and its reply
    assert billed(first) == (0, len(PROMPT), True) and held(runner, A)[0].tokens == stored
    waiting, others = accepted(runner, A), accepted(runner, B)  # queued when the caller shreds
    runner.shred(A)
    assert held(runner, A) == (NOTHING_HELD, 0)
    late = generate(runner, waiting)
    assert billed(late) == (0, 0, False) and late.output_ids == first.output_ids
    assert held(runner, A) == (NOTHING_HELD, 0)
    assert billed(generate(runner, others)) == (0, len(PROMPT), True)  # another caller's stores as usual
    assert held(runner, B)[0].tokens == stored
    again = generate(runner, accepted(runner, A))  # accepted after the shred: stores as usual
    assert billed(again) == (0, len(PROMPT), True) and again.output_ids == first.output_ids
    assert held(runner, A)[0].tokens == stored


def test_a_request_running_when_its_caller_shreds_stores_nothing(loaded: LoadedModel) -> None:
    runner = sealed_runner(loaded, prefill_chunk=64)
    shredded: list[bool] = []

    def shred_once(_: str) -> None:  # while it decodes, as the worker's chore between steps would
        if not shredded:
            runner.shred(A)
            shredded.append(True)

    request = GenerationRequest(A, PROMPT, SamplingParams(6, 0.0), BOUNDARIES)  # stamped when it starts
    result = generate(runner, request, shred_once)
    assert shredded and billed(result) == (0, 0, False)
    assert held(runner, A) == (NOTHING_HELD, 0)
    after = generate(runner, request)  # started after the shred: stores
    assert billed(after) == (0, len(PROMPT), True) and after.output_ids == result.output_ids


def test_a_request_accepted_after_the_shred_copies_nothing_from_one_accepted_before(loaded: LoadedModel) -> None:
    runner = sealed_runner(loaded, prefill_chunk=64)
    prompt = tokens(2, 300)
    before = runner.start(accepted(runner, A, prompt), lambda _: None, lambda: False, lane=0)
    control = runner.start(accepted(runner, A, prompt), lambda _: None, lambda: False, lane=1)
    assert control.donor is not None and control.donor[0] is before  # before the shred it would follow
    runner.release(control)
    runner.shred(A)
    after = runner.start(accepted(runner, A, prompt), lambda _: None, lambda: False, lane=1)
    assert (after.donor, after.restored) == (None, 0)
    for seq in (before, after):
        runner.release(seq)


def test_a_request_queued_when_its_caller_is_removed_stores_nothing(loaded: LoadedModel) -> None:
    runner = sealed_runner(loaded, prefill_chunk=64)
    waiting, others = accepted(runner, A), accepted(runner, B)
    runner.drop_caller(A.caller)  # its key removed from the config
    assert billed(generate(runner, waiting)) == (0, 0, False) and held(runner, A) == (NOTHING_HELD, 0)
    assert billed(generate(runner, others)) == (0, len(PROMPT), True)
