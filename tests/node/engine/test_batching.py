"""Many requests at once through the real scheduler: each one's output equals its output when run alone.

Four callers with prompts of different lengths and resume points run together; dense, sliding-window and
MoE models run their decode steps as one batched forward (counted), hybrids one sequence per forward. A long
prompt does not hold back a short request that arrives while it prefills, and more requests than lanes all
complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from cache.arena import Scope, new_prefix_cache
from cache.budget import CacheBudget
from node.engine.loader import LoadedModel, load_model
from node.engine.runner import GenerationRequest, GenerationResult, Runner
from node.engine.sampling import SamplingParams
from node.engine.scheduler import Failed, Finished, Job, Scheduler
from node.engine.synthetic import init_model

BATCHED = ["llama", "mistral", "gemma2", "qwen2-moe"]
ONE_BY_ONE = ["granite-moe-hybrid"]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reuse_runner(loaded: LoadedModel, prefill_chunk: int = 64) -> Runner:
    cache = new_prefix_cache(CacheBudget(1 << 30, 1 << 30), sealed=True)
    return Runner(loaded, cache, prefill_chunk=prefill_chunk)


async def outcome(job: Job) -> GenerationResult:
    while True:
        event = await asyncio.wait_for(job.events.get(), 120)
        if isinstance(event, Finished):
            return event.result
        if isinstance(event, Failed):
            raise event.error


def requests(model: str) -> list[GenerationRequest]:
    """Four callers: two continue a conversation they stored before, two are new; lengths 30 to 140."""
    return [GenerationRequest(Scope(f"caller-{i}", model), tokens(i, 30 + 37 * i) + tokens(10 + i, 11),
                              SamplingParams(max_tokens=6 + 2 * i, temperature=0.0)) for i in range(4)]


async def run_together(runner: Runner, batch: list[GenerationRequest], max_running: int = 32
                       ) -> list[GenerationResult]:
    scheduler = Scheduler(runner, max_queue=16, max_running=max_running)
    scheduler.start()
    try:
        jobs = [scheduler.submit(request.scope.caller, request) for request in batch]
        return [await outcome(job) for job in jobs]
    finally:
        scheduler.stop()


@pytest.mark.parametrize("family", BATCHED + ONE_BY_ONE)
async def test_concurrent_callers_get_what_they_get_alone(family: str, tmp_path: Path) -> None:
    loaded = load_model(family, init_model(family, tmp_path / family, size="small"))
    batch = requests(loaded.model_id)
    alone = Runner(loaded, None)
    expected = [alone.generate(request, lambda _: None, lambda: False).output_ids for request in batch]
    runner = reuse_runner(loaded)
    # Callers 0 and 1 stored the first part of their prompt before: they resume there.
    for request in batch[:2]:
        runner.generate(GenerationRequest(request.scope, request.prompt[:-11], SamplingParams(max_tokens=1)),
                        lambda _: None, lambda: False)
    results = await run_together(runner, batch)
    assert [result.output_ids for result in results] == expected
    assert results[0].cached_read_tokens > 0 and results[1].cached_read_tokens > 0
    assert results[2].cached_read_tokens == 0
    state = runner.engine_state()
    if family in BATCHED:
        assert state["batched_decode"] and state["batched_steps"] > 0 and state["largest_batch"] >= 2
    else:
        assert not state["batched_decode"] and state["batched_steps"] == 0
        assert "LinearAttentionLayer" in state["reason"]


async def test_more_requests_than_lanes_all_complete(small_model_dir: Path) -> None:
    loaded = load_model("small", small_model_dir)
    batch = requests(loaded.model_id) + [GenerationRequest(Scope("caller-0", loaded.model_id), tokens(40, 50),
                                                           SamplingParams(max_tokens=5, temperature=0.0))]
    alone = Runner(loaded, None)
    expected = [alone.generate(request, lambda _: None, lambda: False).output_ids for request in batch]
    results = await run_together(reuse_runner(loaded), batch, max_running=2)
    assert [result.output_ids for result in results] == expected


@asynccontextmanager
async def started(runner: Runner, prompt: list[int], max_tokens: int) -> AsyncIterator[tuple[Scheduler, Job]]:
    """A scheduler on `runner` and alice's request of `prompt`, once it is admitted (its prefill has begun)."""
    scheduler = Scheduler(runner, max_queue=4)
    scheduler.start()
    try:
        job = scheduler.submit("alice", GenerationRequest(Scope("alice", "small"), prompt,
                                                          SamplingParams(max_tokens=max_tokens, temperature=0.0)))
        while scheduler.running == 0:
            await asyncio.sleep(0.001)
        yield scheduler, job
    finally:
        scheduler.stop()


async def test_a_short_request_is_not_held_back_by_a_long_prefill(small_model_dir: Path) -> None:
    loaded = load_model("small", small_model_dir)
    async with started(reuse_runner(loaded, prefill_chunk=32), tokens(1, 1500), 1) as (scheduler, long):
        short = scheduler.submit("bob", GenerationRequest(Scope("bob", "small"), tokens(2, 20),
                                                          SamplingParams(max_tokens=3)))
        finished: list[int] = []

        async def note(job: Job) -> None:
            finished.append((await outcome(job)).prompt_tokens)

        await asyncio.gather(note(long), note(short))
        assert finished == [20, 1500]  # bob's reply came while alice's 47 chunks were still being computed


async def test_cancelling_a_request_while_its_prompt_prefills_stops_it(small_model_dir: Path) -> None:
    loaded = load_model("small", small_model_dir)
    runner = reuse_runner(loaded, prefill_chunk=16)
    async with started(runner, tokens(3, 1500), 4) as (scheduler, job):
        request = job.request
        job.cancel()
        result = await outcome(job)
        assert result.finish_reason == "cancelled" and result.output_ids == []
        assert runner.engine_state()["decode_steps"] == 0
        # What it computed before it stopped is kept, and resumes exactly.
        again = await outcome(scheduler.submit("alice", request))
        assert 0 < again.cached_read_tokens < 1500
        assert again.output_ids == Runner(loaded, None).generate(request, lambda _: None, lambda: False).output_ids


async def test_requests_that_end_in_the_same_step_keep_their_state(small_model_dir: Path) -> None:
    """Both end in one step: the first one's stored spans still borrow its lane's rows when the second becomes the
    hot working cache, and must be sealed before that lane is wiped."""
    loaded = load_model("small", small_model_dir)
    first = [GenerationRequest(Scope(name, "small"), tokens(seed, 60), SamplingParams(max_tokens=4, temperature=0.0))
             for seed, name in enumerate(("alice", "bob"))]
    runner = reuse_runner(loaded, prefill_chunk=256)  # both prompts prefill in the first step
    replies = await run_together(runner, first)
    follow = [GenerationRequest(request.scope, request.prompt + reply.output_ids + tokens(7, 9),
                                SamplingParams(max_tokens=6, temperature=0.0))
              for request, reply in zip(first, replies, strict=True)]
    alone = Runner(loaded, None)
    expected = [alone.generate(request, lambda _: None, lambda: False).output_ids for request in follow]
    results = await run_together(runner, follow)
    assert [result.output_ids for result in results] == expected
    assert [result.cached_read_tokens for result in results] == [64, 64]  # prompt and reply
