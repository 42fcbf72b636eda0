"""Many requests at once through the real scheduler: each one's output equals its output when run alone.

Four callers with prompts of different lengths and resume points run together; dense, sliding-window, MoE,
recurrent and hybrid models run their decode steps as one batched forward (counted). One
caller's sequences over one system prompt attend its rows once per step, and other callers' never. A long
prompt does not hold back a short request that arrives while it prefills, and more requests than lanes all
complete.

The models load on TENZRO_TEST_DEVICE (default cpu; `cuda` runs these tests on the GPU), in float32 on every device:
outputs are compared token for token. Tests of the native CPU kernels skip on another device.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from cache.adapters import RecurrentPiece
from cache.arena import Scope
from cache.lanes import BufferPool
from cache.working_cache import GrowableKVLayer
from node.engine import scheduler as scheduler_module
from node.engine.batch_forward import BatchedDecode, Shared, batch_blocker, batchable, equal_rows
from node.engine.cpu_decoder import SCREENED_ROWS, RowPrediction
from node.engine.cpu_kernels import load_kernels, native_switched_off
from node.engine.loader import LoadedModel, load_model
from node.engine.runner import GenerationRequest, GenerationResult, ModelRunner, Sequence
from node.engine.sampling import SamplingParams
from node.engine.scheduler import Failed, Finished, Job, Scheduler
from node.engine.synthetic import init_model
from tests.node.conftest import TEST_DEVICE, TEST_DTYPE
from tests.node.engine.runners import sealed_runner

BATCHED = ["llama", "mistral", "gemma2", "qwen2-moe", "granite-moe-hybrid", "falcon-h1"]
RECURRENT = ["mamba", "mamba2", "jamba", "bamba", "falcon-h1", "granite-moe-hybrid", "lfm2", "qwen3-next"]
"""Every family with recurrent layers: conv and recurrent states (short conv, Mamba-1/2 scans, gated delta-net),
alone or beside attention, and FalconH1's layers that hold both."""


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(model_id: str, path: Path) -> LoadedModel:
    """The model on TENZRO_TEST_DEVICE, in float32."""
    return load_model(model_id, path, device=TEST_DEVICE, dtype=TEST_DTYPE)


def reuse_runner(loaded: LoadedModel, prefill_chunk: int = 64) -> ModelRunner:
    return sealed_runner(loaded, prefill_chunk=prefill_chunk)


def alone(loaded: LoadedModel, batch: list[GenerationRequest]) -> list[list[int]]:
    """Each request's output run alone, with reuse off: what it must get in any batch."""
    runner = ModelRunner(loaded, None)
    return [runner.generate(request, lambda _: None, lambda: False).output_ids for request in batch]


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


async def run_together(runner: ModelRunner, batch: list[GenerationRequest], max_running: int = 32
                       ) -> list[GenerationResult]:
    scheduler = Scheduler(runner, max_queue=16, max_running=max_running)
    scheduler.start()
    try:
        jobs = [scheduler.submit(request.scope.caller, request) for request in batch]
        return [await outcome(job) for job in jobs]
    finally:
        scheduler.stop()


@pytest.mark.parametrize("family", BATCHED)
async def test_concurrent_callers_get_what_they_get_alone(family: str, tmp_path: Path) -> None:
    loaded = load(family, init_model(family, tmp_path / family, size="small"))
    batch = requests(loaded.model_id)
    expected = alone(loaded, batch)
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
    assert state["batched_decode"] and state["batched_steps"] > 0 and state["largest_batch"] >= 2


async def test_more_requests_than_lanes_all_complete(small_model_dir: Path) -> None:
    loaded = load("small", small_model_dir)
    batch = requests(loaded.model_id) + [GenerationRequest(Scope("caller-0", loaded.model_id), tokens(40, 50),
                                                           SamplingParams(max_tokens=5, temperature=0.0))]
    expected = alone(loaded, batch)
    results = await run_together(reuse_runner(loaded), batch, max_running=2)
    assert [result.output_ids for result in results] == expected


async def test_requests_in_reserved_lanes_allocate_nothing_and_get_what_they_get_alone(small_model_dir: Path) -> None:
    loaded = load("small", small_model_dir)
    batch = requests(loaded.model_id)
    expected = alone(loaded, batch)
    runner = reuse_runner(loaded)
    lanes = runner.reuse.lanes
    assert lanes is not None and lanes.row_bytes(0) == 0  # no request ran in lane 0 yet
    row_bytes = 2 * 2 * 2 * 32 * 4  # layers · (keys, values) · kv_heads · head_dim · float32 bytes
    assert runner.reuse.reserve_lanes(4, 0) == 0 and lanes.row_bytes(0) == 0  # nothing to reserve: no probe
    assert runner.reuse.reserve_lanes(4, 4 * 511 * row_bytes) == 0  # under a grain
    assert lanes.row_bytes(0) == row_bytes  # the shapes were learnt from one token run in lane 0
    assert runner.reuse.reserve_lanes(4, 4 * 1100 * row_bytes) == 1024
    assert runner.engine_state()["reserved_lane_rows"] == 1024
    pools = [lanes._pools[lane]._buffers for lane in range(4)]
    assert all(buffer.shape[2] == 1024 and not buffer.any() for pool in pools for buffer in pool.values())
    held = [{slot: buffer.data_ptr() for slot, buffer in pool.items()} for pool in pools]
    results = await run_together(runner, batch, max_running=4)
    assert [result.output_ids for result in results] == expected
    assert [{slot: buffer.data_ptr() for slot, buffer in pool.items()} for pool in pools] == held


async def test_a_step_prefills_128_tokens_per_running_request(small_model_dir: Path) -> None:
    """Four 96-token prompts in chunks of 16: the first step's budget (4 x 128 tokens) computes all four, so every
    decode step runs all four; with one chunk per step they would start decoding one after another."""
    loaded = load("small", small_model_dir)
    batch = [GenerationRequest(Scope(f"caller-{i}", loaded.model_id), tokens(50 + i, 96),
                               SamplingParams(max_tokens=5, temperature=0.0)) for i in range(4)]
    expected = alone(loaded, batch)
    runner = reuse_runner(loaded, prefill_chunk=16)
    scheduler = Scheduler(runner, max_queue=16)
    jobs = [scheduler.submit(request.scope.caller, request) for request in batch]  # all admitted in one step
    scheduler.start()
    try:
        results = [await outcome(job) for job in jobs]
    finally:
        scheduler.stop()
    assert [result.output_ids for result in results] == expected
    state = runner.engine_state()
    assert state["decode_steps"] == state["batched_steps"] == 4 and state["largest_batch"] == 4


@asynccontextmanager
async def started(runner: ModelRunner, prompt: list[int], max_tokens: int, max_queue: int = 4
                  ) -> AsyncIterator[tuple[Scheduler, Job]]:
    """A scheduler on `runner` and alice's request of `prompt`, once it is admitted (its prefill has begun)."""
    scheduler = Scheduler(runner, max_queue=max_queue)
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
    loaded = load("small", small_model_dir)
    async with started(reuse_runner(loaded, prefill_chunk=32), tokens(1, 1500), 1) as (scheduler, long):
        short = scheduler.submit("bob", GenerationRequest(Scope("bob", "small"), tokens(2, 20),
                                                          SamplingParams(max_tokens=3)))
        finished: list[int] = []

        async def note(job: Job) -> None:
            finished.append((await outcome(job)).prompt_tokens)

        await asyncio.gather(note(long), note(short))
        assert finished == [20, 1500]  # bob's reply came while alice's 47 chunks were still being computed


async def test_a_decoding_request_waits_for_at_most_the_steps_token_budget(
        small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While any request decodes, a step prefills what its decoding rows leave of STEP_TOKENS (at least one
    chunk) and admits at most ADMIT_WHILE_DECODING requests; with nobody decoding, a wave's worth."""
    monkeypatch.setattr(scheduler_module, "STEP_TOKENS", 40)
    loaded = load("small", small_model_dir)
    runner = reuse_runner(loaded, prefill_chunk=32)
    steps: list[tuple[int, int, int]] = []  # (admitted, prompt tokens prefilled, rows decoded) of each decode step
    pending = {"admitted": 0, "prefilled": 0}
    start, prefill, decode = runner.start, runner.prefill, runner.decode

    def counted_start(*args, **kwargs):  # type: ignore[no-untyped-def]
        pending["admitted"] += 1
        return start(*args, **kwargs)

    def counted_prefill(seq: Sequence) -> None:
        pending["prefilled"] += seq.stops[0] - seq.position  # the chunk it runs
        prefill(seq)

    submitted = threading.Event()

    def counted_decode(seqs: list[Sequence]) -> None:
        steps.append((pending["admitted"], pending["prefilled"], len(seqs)))
        pending.update(admitted=0, prefilled=0)
        submitted.wait(10)  # the worker's first step waits until all six have arrived
        decode(seqs)

    monkeypatch.setattr(runner, "start", counted_start)
    monkeypatch.setattr(runner, "prefill", counted_prefill)
    monkeypatch.setattr(runner, "decode", counted_decode)
    async with started(runner, tokens(1, 40), 120, max_queue=8) as (scheduler, alice):
        while not steps:
            await asyncio.sleep(0.001)
        others = [scheduler.submit(name, GenerationRequest(Scope(name, "small"), tokens(seed, 100),
                                                           SamplingParams(max_tokens=1)))
                  for seed, name in enumerate(("bob", "carol", "dave", "erin", "frank", "grace"), start=2)]
        submitted.set()
        results = [await outcome(job) for job in (*others, alice)]
    assert [result.prompt_tokens for result in results] == [100] * 6 + [40]
    assert steps[0] == (1, 40, 1)  # nobody decoding yet: alice's whole prompt, two chunks, in one step
    while_decoding = [step for step in steps[1:] if step[0] or step[1]]
    # Alice alone decodes: 39 tokens of prefill a step, whole chunks (32, or the short ones before a prompt's end).
    assert while_decoding and all(admitted <= 2 and prefilled <= 39 for admitted, prefilled, _ in while_decoding)
    assert sum(prefilled for _, prefilled, _ in while_decoding) == 600 and len(while_decoding) >= 600 // 39
    assert [admitted for admitted, _, _ in while_decoding if admitted] == [2, 2, 2]  # six arrived at once
    assert sum(admitted for admitted, _, _ in while_decoding) == 6


async def test_cancelling_a_request_while_its_prompt_prefills_stops_it(small_model_dir: Path) -> None:
    loaded = load("small", small_model_dir)
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
    # Once the scheduler has stopped: its worker shares the model's native scratch, which it zeroes when idle.
    assert again.output_ids == ModelRunner(loaded, None).generate(request, lambda _: None, lambda: False).output_ids


async def test_requests_that_end_in_the_same_step_keep_their_state(small_model_dir: Path) -> None:
    """Both end in one step: the first one's stored spans still borrow its lane's rows when the second becomes the
    hot working cache, and must be sealed before that lane is wiped."""
    loaded = load("small", small_model_dir)
    first = [GenerationRequest(Scope(name, "small"), tokens(seed, 60), SamplingParams(max_tokens=4, temperature=0.0))
             for seed, name in enumerate(("alice", "bob"))]
    runner = reuse_runner(loaded, prefill_chunk=256)  # both prompts prefill in the first step
    replies = await run_together(runner, first)
    assert runner.engine_state()["fed_together"] == 2  # their last tokens ran in one forward
    follow = [GenerationRequest(request.scope, request.prompt + reply.output_ids + tokens(7, 9),
                                SamplingParams(max_tokens=6, temperature=0.0))
              for request, reply in zip(first, replies, strict=True)]
    expected = alone(loaded, follow)
    results = await run_together(runner, follow)
    assert [result.output_ids for result in results] == expected
    assert [result.cached_read_tokens for result in results] == [64, 64]  # prompt and reply


async def test_a_failed_feed_of_last_tokens_stores_nothing_and_replies(small_model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward that runs ended requests' last tokens together fails: their caches may be part written, so
    nothing of them is stored; their replies still come, and the node goes on."""
    loaded = load("small", small_model_dir)
    first = [GenerationRequest(Scope(name, "small"), tokens(seed, 60), SamplingParams(max_tokens=4, temperature=0.0))
             for seed, name in enumerate(("alice", "bob"))]
    expected = alone(loaded, first)
    runner = reuse_runner(loaded, prefill_chunk=256)
    step = runner._batched.step

    def failing(*args: object, logits: bool = True, **kwargs: object) -> torch.Tensor:
        if not logits:
            raise RuntimeError("feed failed")
        return step(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner._batched, "step", failing)
    results = await run_together(runner, first)
    assert [result.output_ids for result in results] == expected
    assert [result.retained for result in results] == [False, False]
    assert runner.engine_state()["fed_together"] == 0
    again = await run_together(runner, first)
    assert [result.cached_read_tokens for result in again] == [0, 0]
    assert [result.output_ids for result in again] == expected


async def test_settle_zeroes_the_native_attention_scratch(small_model_dir: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The native decode attention's scratch holds the last step's attention weights, derived from a caller's keys:
    once the replies are out it reads back as zeros."""
    loaded = load("small", small_model_dir)
    runner = reuse_runner(loaded)
    if loaded.forward.decode_attention != "native":
        pytest.skip("the native decode attention runs only where the kernels load and torch runs one thread")
    await run_together(runner, requests(loaded.model_id))
    scratch = runner._batched._work
    assert scratch.numel() > 0 and not scratch.any()
    assert "housekeeping failed" not in caplog.text


def one_callers_requests(model: str, scope: str | None = None, max_tokens: int = 8) -> list[GenerationRequest]:
    """Four requests over one 300-token system prompt, each with its own question; one scope unless `scope` is
    None (then one scope each)."""
    system = tokens(99, 300)
    return [GenerationRequest(Scope(scope or f"caller-{i}", model), system + tokens(i, 5 + 7 * i),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0)) for i in range(4)]


@pytest.mark.parametrize("family", ["llama", "qwen2-moe", "gemma3"])
async def test_one_callers_sequences_attend_their_shared_rows_once(family: str, tmp_path: Path) -> None:
    loaded = load(family, init_model(family, tmp_path / family, size="small"))
    # 24-token replies overlap even where prompts are computed in turns (gemma3's sliding layers copy no rows).
    batch = one_callers_requests(loaded.model_id, scope="agent", max_tokens=24)
    expected = alone(loaded, batch)
    runner = reuse_runner(loaded)
    results = await run_together(runner, batch)
    assert [result.output_ids for result in results] == expected
    assert runner.engine_state()["shared_rows"] > 0


async def test_different_callers_never_share_rows(small_model_dir: Path) -> None:
    """The same system prompt from four callers at once: each computes and attends its own copy."""
    loaded = load("small", small_model_dir)
    runner = reuse_runner(loaded)
    # Each computes its prompt in five or six 64-token chunks, taking turns: replies of 24 tokens overlap.
    results = await run_together(runner, one_callers_requests(loaded.model_id, max_tokens=24))
    state = runner.engine_state()
    assert state["largest_batch"] == 4 and state["shared_rows"] == 0
    assert [result.cached_read_tokens for result in results] == [0, 0, 0, 0]


async def test_one_callers_requests_copy_the_prompt_rows_another_computes(small_model_dir: Path) -> None:
    """Four requests of one caller arrive together over a system prompt nothing stored yet: the first computes
    it, the others wait for its rows and copy them (billed as cached reads), and each reply is its own."""
    loaded = load("small", small_model_dir)
    batch = one_callers_requests(loaded.model_id, scope="agent")
    expected = alone(loaded, batch)
    runner = reuse_runner(loaded)  # 64-token chunks: the followers wait through five of the first one's
    results = await run_together(runner, batch)
    assert [result.output_ids for result in results] == expected
    assert [result.cached_read_tokens for result in results] == [0, 300, 300, 300]


@pytest.mark.parametrize("family", ["granite-moe-hybrid", "falcon-h1", "mamba", "mistral"])
async def test_one_callers_requests_copy_the_state_of_a_model_that_resumes_at_snapshots(family: str,
                                                                                      tmp_path: Path) -> None:
    """The same with hybrid, state-space and sliding-window models, which resume only where a snapshot holds
    their recurrent states and window tails: the followers take the first request's live state each step it
    computes of the system prompt (rows of its attention layers, a copy of the rest), up to the system message's
    end, where it snapshots; each reply is its own, and the followers' stored state resumes there too."""
    loaded = load(family, init_model(family, tmp_path / family, size="small"))
    system = tokens(99, 300)  # then a user message long enough for every request to snapshot where it starts
    batch = [GenerationRequest(Scope("agent", loaded.model_id), system + tokens(i, 40 + 7 * i),
                               SamplingParams(max_tokens=8, temperature=0.0), boundaries=(300,)) for i in range(4)]
    expected = alone(loaded, batch)
    runner = reuse_runner(loaded)
    assert runner.loaded.state is not None and runner.loaded.state.needs_snapshots
    results = await run_together(runner, batch)
    assert [result.output_ids for result in results] == expected
    assert [result.cached_read_tokens for result in results] == [0, 300, 300, 300]
    again = GenerationRequest(batch[2].scope, batch[2].prompt[:300] + tokens(7, 9), batch[2].params,
                              boundaries=(300,))
    result = runner.generate(again, lambda _: None, lambda: False)
    assert result.cached_read_tokens == 300
    assert [result.output_ids] == alone(loaded, [again])


async def test_a_request_without_retention_neither_copies_nor_gives_rows(small_model_dir: Path) -> None:
    """Retention none: nothing of the request is kept, nor lent to another request, nor taken from one."""
    loaded = load("small", small_model_dir)
    batch = one_callers_requests(loaded.model_id, scope="agent")
    batch[1] = GenerationRequest(batch[1].scope, batch[1].prompt, batch[1].params, retain=False)
    batch[0] = GenerationRequest(batch[0].scope, batch[0].prompt, batch[0].params, retain=False)
    results = await run_together(reuse_runner(loaded), batch)
    assert [result.cached_read_tokens for result in results] == [0, 0, 0, 300]


@torch.inference_mode()
def prefilled(loaded: LoadedModel, prompt: list[int]) -> DynamicCache:
    """A working cache of `prompt` in buffers of its own, shaped as a lane's."""
    assert loaded.state is not None
    cache = loaded.state.working_cache(len(prompt) + 8, BufferPool())
    for start in range(0, len(prompt), 64):  # the same chunks for every prompt: the same rows for the same tokens
        loaded.forward.prefill(prompt[start:start + 64], start, cache)
    return cache


def test_equal_rows_counts_the_rows_held_value_for_value(small_model_dir: Path) -> None:
    loaded = load("small", small_model_dir)
    system = tokens(99, 300)
    first, second = prefilled(loaded, system + tokens(1, 20)), prefilled(loaded, system + tokens(2, 30))
    assert equal_rows(first, second, 320) == 300
    assert equal_rows(first, second, 200) == 200
    layer = second.layers[1]
    assert isinstance(layer, GrowableKVLayer) and layer.values is not None
    with torch.inference_mode():
        layer.values[0, 1, 123, 5] += 1.0
    assert equal_rows(first, second, 320) == 123


@pytest.mark.parametrize("native", [False, True], ids=["sdpa", "native-attention"])
def test_a_step_over_shared_rows_gives_each_sequence_its_own_logits(small_model_dir: Path, native: bool) -> None:
    """One batched step with its group's rows shared (each row's own rows by SDPA or by the native decode
    attention), against the plain batched step with none: logits within float32 noise (parts merged by
    log-sum-exp, sums in another order), the same greedy tokens."""
    kernels = load_kernels().kernels
    if native and kernels is None:
        pytest.skip(f"no native kernels: {load_kernels().reason}")
    if native and TEST_DEVICE != "cpu":
        pytest.skip("the native decode attention runs on CPU tensors only")
    loaded = load("small", small_model_dir)
    system = tokens(99, 300)
    prompts = [system + tokens(i, 9 + 13 * i) for i in range(3)]
    steps = BatchedDecode(loaded.model, kernels if native else None)
    logits = []
    for batched, shared in ((BatchedDecode(loaded.model), ()), (steps, (Shared((0, 2), 300), ))):
        caches = [prefilled(loaded, prompt) for prompt in prompts]
        logits.append(batched.step([5, 6, 7], [len(prompt) for prompt in prompts], caches, loaded.device, shared))
    assert steps.shared_rows == 2 * 2  # two members, both layers
    scale = logits[0].abs().max()
    assert float((logits[0] - logits[1]).abs().max() / scale) < 1e-5
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize(("rows", "all_greedy"), [(3, False), (17, True), (40, False)])
def test_a_steps_greedy_rows_take_their_tokens_from_one_screen_of_the_head(small_model_dir: Path, rows: int,
                                                                           all_greedy: bool) -> None:
    """With the CPU decoder, the greedy rows of a batched step (at most SCREENED_ROWS of them, or any number where
    the library's int8 product screens) get the argmax of their own logits from one screen of the head, without
    logits; the other rows' logits are those of the plain step. With more greedy rows than a screen takes every
    row's logits come from the model's head."""
    loaded = load("small", small_model_dir)
    if loaded.forward.decoder is None:
        pytest.skip(f"no CPU decoder: {loaded.forward.reason}")
    prompts = [tokens(i, 5 + 7 * i) for i in range(rows)]
    greedy = [all_greedy or row % 3 != 1 for row in range(rows)]
    steps = [5 + row for row in range(rows)], [len(prompt) for prompt in prompts]
    logits = BatchedDecode(loaded.model).step(*steps, [prefilled(loaded, p) for p in prompts], loaded.device)
    caches = [prefilled(loaded, prompt) for prompt in prompts]
    predictions = loaded.forward.step(BatchedDecode(loaded.model), *steps, caches, (), greedy)
    screened = loaded.forward.decoder.screens(greedy)
    assert screened == (sum(greedy) <= SCREENED_ROWS or loaded.forward.decoder.screens_every_row)
    for row, prediction in enumerate(predictions):
        assert (isinstance(prediction, RowPrediction) and prediction.index is not None) == (screened and greedy[row])
        assert prediction.greedy() == int(logits[row].argmax())
        assert float((prediction.logits() - logits[row]).abs().max()) < 1e-5 * float(logits[row].abs().max())


@pytest.mark.parametrize("family", RECURRENT)
@torch.inference_mode()  # as the runner steps: recurrent states are updated in place
def test_a_batched_step_of_recurrent_layers_continues_each_sequences_state(family: str, tmp_path: Path) -> None:
    """Three sequences of different lengths decode three steps as one forward each, their recurrent states stacked
    along the batch: each row's logits within float32 noise of the same sequence stepped alone, the same greedy
    tokens, and each sequence's own states left where its alone twin's are."""
    if native_switched_off():
        pytest.skip("the step here runs no native code: the pass with the native kernels ran this same code")
    loaded = load(family, init_model(family, tmp_path / family, size="small"))
    assert batch_blocker(loaded.model) is None
    prompts = [tokens(i, 20 + 31 * i) for i in range(3)]
    single = [prefilled(loaded, prompt) for prompt in prompts]
    together = [prefilled(loaded, prompt) for prompt in prompts]
    assert all(batchable(cache) for cache in together)
    steps = BatchedDecode(loaded.model)
    for step in range(3):
        ids, positions = [500 + step + i for i in range(3)], [len(prompt) + step for prompt in prompts]
        got = steps.step(ids, positions, together, loaded.device)
        for row in range(3):
            want = loaded.forward.prefill([ids[row]], positions[row], single[row]).logits()
            assert float((got[row] - want).abs().max() / want.abs().max()) < 1e-5, (family, step, row)
            assert int(got[row].argmax()) == int(want.argmax())
    assert loaded.state is not None
    for mine, twin in zip(together, single, strict=True):
        for got_piece, want_piece in zip(loaded.state.snapshot(mine), loaded.state.snapshot(twin), strict=True):
            for a, b in zip(got_piece, want_piece, strict=True):
                if isinstance(a, RecurrentPiece) and isinstance(b, RecurrentPiece):
                    for x, y in zip(a.conv + a.recurrent, b.conv + b.recurrent, strict=True):
                        assert (x is None) == (y is None)
                        if x is not None and y is not None:
                            assert torch.allclose(x, y, rtol=1e-4, atol=1e-5)
