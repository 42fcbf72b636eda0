"""A request's write plan in the engine: breakpoints store only the prompt up to the last one, billed by class;
times to live run on the prefix cache's clock, refreshed by the requests that read the state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache.arena import Scope
from cache.ttl import Breakpoint, WritePlan
from node.engine.loader import LoadedModel, load_model
from node.engine.runner import GenerationRequest, GenerationResult, ModelRunner
from node.engine.sampling import SamplingParams
from tests.node.engine.runners import sealed_runner

SCOPE = Scope("alice", "small")
MINUTE = 60.0


@pytest.fixture(scope="module")
def loaded(small_model_dir: Path) -> LoadedModel:
    return load_model("small", small_model_dir)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tokens(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (n,), generator=generator).tolist()


def run(runner: ModelRunner, prompt: list[int], write: WritePlan) -> GenerationResult:
    return runner.generate(GenerationRequest(SCOPE, prompt, SamplingParams(4, 0.0), write=write), lambda _: None,
                           lambda: False)


def timed_runner(loaded: LoadedModel) -> tuple[ModelRunner, Clock]:
    runner, clock = sealed_runner(loaded, prefill_chunk=64), Clock()
    assert runner.reuse.prefix_cache is not None
    runner.reuse.prefix_cache.now = clock
    return runner, clock


def no_default(caller: str) -> float | None:
    return None


def test_breakpoints_store_the_prompt_up_to_the_last_one_and_bill_each_class(loaded: LoadedModel) -> None:
    runner, _ = timed_runner(loaded)
    prompt = tokens(1, 60)
    plan = WritePlan("default", (Breakpoint(20, "1h"), Breakpoint(45, "5m")))
    first = run(runner, prompt, plan)
    assert (first.cached_write_tokens, first.cached_write_1h_tokens, first.cached_write_24h_tokens) == (45, 20, 0)
    assert runner.reuse.prefix_cache is not None
    assert runner.reuse.prefix_cache.cached_tokens(SCOPE) == 45  # not the rest of the prompt, not the reply
    assert runner.reuse.replies.recall(SCOPE, first.text) is None  # nor is the reply remembered
    again = run(runner, prompt, plan)
    assert (again.cached_read_tokens, again.cached_write_tokens) == (45, 0)


def test_a_five_minute_write_read_at_four_minutes_lives_on_and_goes_after_five_idle(loaded: LoadedModel) -> None:
    runner, clock = timed_runner(loaded)
    prompt = tokens(2, 40)
    five = WritePlan("5m")
    assert run(runner, prompt, five).cached_write_tokens == 40
    clock.now += 4 * MINUTE
    runner.expire(no_default)
    assert run(runner, prompt, five).cached_read_tokens == 39  # read at four minutes: held five more
    clock.now += 4 * MINUTE
    runner.expire(no_default)
    assert runner.reuse.prefix_cache is not None and runner.reuse.prefix_cache.cached_tokens(SCOPE) > 0
    clock.now += 1 * MINUTE + 1
    runner.expire(no_default)
    assert runner.reuse.prefix_cache.cached_tokens(SCOPE) == 0
    assert run(runner, prompt, five).cached_read_tokens == 0


def test_a_24h_write_outlives_the_callers_default_and_is_billed_as_24h(loaded: LoadedModel) -> None:
    runner, clock = timed_runner(loaded)
    prompt = tokens(3, 40)
    first = run(runner, prompt, WritePlan("24h"))
    assert (first.cached_write_tokens, first.cached_write_24h_tokens) == (40, 40)
    clock.now += 23 * 3600
    runner.expire(lambda caller: 300.0)  # the caller's default is five minutes; this write asked for a day
    assert run(runner, prompt, WritePlan("24h")).cached_read_tokens == 39
    clock.now += 24 * 3600 + 1
    runner.expire(lambda caller: 300.0)
    assert run(runner, prompt, WritePlan("24h")).cached_read_tokens == 0
