"""A streamed request's first text: the worker hands the GIL to the event loop until it is written."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from cache.arena import Scope
from node.engine import scheduler
from node.engine.runner import GenerationRequest
from node.engine.sampling import SamplingParams
from node.engine.scheduler import Job, TextDelta

REQUEST = GenerationRequest(Scope("alice", "m"), [1, 2, 3], SamplingParams(max_tokens=2))


def emit_from_a_worker(job: Job, log: list[str]) -> threading.Thread:
    def work() -> None:
        for text in ("a", "b"):
            started = time.perf_counter()
            job.emit_text(text)
            log.append(f"returned {text} after {time.perf_counter() - started:.3f}")

    worker = threading.Thread(target=work)
    worker.start()
    return worker


async def test_a_streamed_job_waits_until_its_first_text_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler, "FIRST_WRITE_WAIT_S", 30.0)
    job = Job("alice", REQUEST, asyncio.get_running_loop(), streamed=True)
    log: list[str] = []
    worker = emit_from_a_worker(job, log)
    assert await job.events.get() == TextDelta("a")
    await asyncio.sleep(0.05)
    log.append("written a")  # what the handler does once the chunk is on the socket
    job.first_written.set()
    assert await job.events.get() == TextDelta("b")
    await asyncio.get_running_loop().run_in_executor(None, worker.join)
    assert [entry.split(" after")[0] for entry in log] == ["written a", "returned a", "returned b"]


async def test_the_wait_is_bounded_and_a_job_not_streamed_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler, "FIRST_WRITE_WAIT_S", 0.2)
    loop = asyncio.get_running_loop()
    streamed: list[str] = []
    await loop.run_in_executor(None, emit_from_a_worker(Job("alice", REQUEST, loop, streamed=True), streamed).join)
    seconds = [float(entry.split(" after ")[1]) for entry in streamed]
    assert seconds[0] >= 0.2 and seconds[1] < 0.2  # nobody wrote: it went on after the bound, and only once
    plain: list[str] = []
    await loop.run_in_executor(None, emit_from_a_worker(Job("alice", REQUEST, loop), plain).join)
    assert all(float(entry.split(" after ")[1]) < 0.2 for entry in plain)


class BlockingRunner:
    """Holds the worker on its first job until released; records what it ran."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ran: list[GenerationRequest] = []

    def pick_lane(self, scope: Scope, lanes: int) -> int:
        return 0

    def start(self, request: GenerationRequest, emit, cancelled, queue_wait_s: float = 0.0, lane: int = 0):  # type: ignore[no-untyped-def]
        self.ran.append(request)
        self.release.wait(10)
        raise RuntimeError("not a real generation")

    def expire(self, ttl_of) -> None:  # type: ignore[no-untyped-def]
        pass

    def settle(self, stop) -> None:  # type: ignore[no-untyped-def]
        pass


async def test_a_cancelled_waiting_job_leaves_the_queue_at_once_and_frees_its_place() -> None:
    runner = BlockingRunner()
    queue = scheduler.Scheduler(runner, max_queue=1)  # type: ignore[arg-type]
    queue.start()
    try:
        running = queue.submit("alice", REQUEST)
        while not runner.ran:
            await asyncio.sleep(0.01)
        waiting = queue.submit("bob", REQUEST)
        with pytest.raises(scheduler.QueueFullError):
            queue.check_room()
        waiting.cancel()
        event = await asyncio.wait_for(waiting.events.get(), 1)  # recorded now, not when the worker is free
        assert isinstance(event, scheduler.Failed) and isinstance(event.error, asyncio.CancelledError)
        queue.check_room()  # its place is free for another request
        assert queue.waiting == 0
        running.cancel()  # a running job stays with the worker, which sees the cancellation itself
        assert running.events.empty()
    finally:
        runner.release.set()
        queue.stop()


@dataclass(eq=False)
class Planned:
    """What the scheduler reads of a running sequence to plan a step."""

    position: int
    stops: list[int]
    decoding: bool = False
    donor: object | None = None
    finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        return not self.decoding and bool(self.stops)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def test_a_step_plan_follows_prefills_within_the_budget_decodes_and_retires() -> None:
    """Two decoding rows leave STEP_TOKENS - 2 of the budget to chunks, taken in turns: c's first (64), d's only
    one (50, which completes its prompt, so d decodes in the same step), then c's second would pass the budget.
    A follower runs no chunk; a request cancelled while prefilling retires."""
    queue = scheduler.Scheduler(SimpleNamespace(prefill_chunk=64), max_queue=4)  # type: ignore[arg-type]
    a, b = Planned(10, [], decoding=True), Planned(20, [], decoding=True)
    c, d = Planned(0, [64, 128, 192]), Planned(114, [164])
    e, f = Planned(0, [64], donor=a), Planned(0, [64])
    cancelled = threading.Event()
    cancelled.set()
    queue._running = [(SimpleNamespace(cancel_event=cancelled if seq is f else threading.Event()), seq)  # type: ignore[misc]
                      for seq in (a, b, c, d, e, f)]
    assert scheduler.STEP_TOKENS - 2 < 64 + 50 + 64
    plan = queue._plan()
    assert plan == scheduler.StepPlan(follow=(e,), prefill=(c, d), decode=(a, b, d), retire=(f,))  # type: ignore[arg-type]
    assert f.finish_reason == "cancelled"
    queue._running = [(SimpleNamespace(cancel_event=threading.Event()), seq) for seq in (c, d)]  # type: ignore[misc]
    # Nobody decodes: a wave's worth (PREFILL_PER_RUNNING per running request), so c's three chunks and d's one,
    # the turns going on from the last step's; both prompts complete, and both decode.
    assert scheduler.PREFILL_PER_RUNNING * 2 >= 64 * 3 + 50
    assert queue._plan() == scheduler.StepPlan(prefill=(c, d, c, c), decode=(c, d))  # type: ignore[arg-type]
