"""Fair queueing of generation requests onto the model's worker thread, and the plan of each step it runs.

Model calls run off the event loop, in one worker thread per model, so the HTTP server keeps answering
while prompts are prefilled. Callers take turns: each has its own FIFO, and requests are admitted from the
callers round-robin (`caller_queue.py`, which the media worker queues by too), so one caller's burst cannot starve
another's single request. Up to `max_running`
admitted requests run at once, each in its own lane of working memory, and the worker advances them in
steps. Each step is planned here (`StepPlan`) and run by the model runner (`ModelRunner.run`): requests whose
prompt a running request of their caller is computing copy its rows instead, and wait for them (`follow`);
prefill chunks run within the step's token budget (what the decoding rows leave of `STEP_TOKENS` while any
request decodes, else `PREFILL_PER_RUNNING` per running request; the prefilling requests take turns, a chunk
each, so a long prompt delays a short one by at most one step's chunks); every decoding request runs one decode
step, batched into one forward where the model allows it; and the requests that ended leave (`retire`), so
that waiting ones take their lanes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from node.engine.caller_queue import CallerQueues
from node.engine.caller_queue import QueueFullError as QueueFullError  # the scheduler's refusal, caught by its callers
from node.engine.runner import GenerationRequest, GenerationResult, ModelRunner, Sequence, StepPlan
from node.log_privacy import Safe

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    result: GenerationResult


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


Event = TextDelta | Finished | Failed


FIRST_WRITE_WAIT_S = 0.005
"""Longest the worker waits for a streamed request's first text to be written (see `Job.emit_text`)."""


@dataclass(eq=False)
class Job:
    caller: str
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    streamed: bool = False
    """The handler writes each text delta as it comes (SSE), and says so through `first_written`."""
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    first_written: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    withdraw: Callable[[Job], None] | None = None
    """Set by the scheduler while the job waits in its queue: takes it out at once when cancelled."""

    def post(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def emit_text(self, text: str) -> None:
        """Hand a text delta to the handler. The first one of a streamed request is the caller's time to first
        token, and the event loop needs the GIL to send it, which the worker's Python between native calls
        would hold: the worker waits until it is written (at most FIRST_WRITE_WAIT_S, the GIL released)."""
        self.post(TextDelta(text))
        if self.streamed and not self.first_written.is_set():
            self.first_written.wait(FIRST_WRITE_WAIT_S)
            self.first_written.set()  # once per request, written or not

    def cancel(self) -> None:
        """Stop the job: a running one at its next decode step, a waiting one now (it leaves the queue, and
        its place is free for another request)."""
        self.cancel_event.set()
        if self.withdraw is not None:
            self.withdraw(self)


TICK_S = 1.0
"""How often an idle worker expires state past its time to live."""
MAX_RUNNING = 32
"""Requests that run at once by default: the lanes of working memory (see BATCHING.md for their size)."""
PREFILL_PER_RUNNING = 128
"""Prompt tokens a step may prefill per running request, when that exceeds `prefill_chunk` and no request is
decoding: a wave of prompts with nobody waiting for a next token is computed in a step or two, and decode steps
then run full batches, which is what a step's fixed costs (its shared rows, its per-layer overhead) are spread over
(BATCHING.md, "The step's token budget")."""
STEP_TOKENS = 128
"""Tokens a step computes while requests are decoding: each decoding row counts one and prefill chunks fill the
rest, at least one chunk so that prompts always advance (vLLM's chunked prefill budgets a step the same way). A
decoding request's next token then waits for at most this much prefill, not for a whole wave of next-turn prompts
(BATCHING.md, "The step's token budget")."""
ADMIT_WHILE_DECODING = 2
"""Requests admitted in one turn while others decode: admitting one restores its prefix into its lane (a copy of
its rows), and a wave admitted at once holds every decoding request's next token; the budget above would hold
their prompts back in any case."""


class Scheduler:
    def __init__(self, runner: ModelRunner, max_queue: int, max_running: int = MAX_RUNNING) -> None:
        self.runner = runner
        self.max_running = max(1, max_running)
        self.ttl_of: Callable[[str], float | None] = lambda caller: None
        """A caller's time to live for stored state (seconds, None: no limit), from the node's config."""
        self._queues: CallerQueues[Job] = CallerQueues(max_queue)
        self._chores: deque[Callable[[], None]] = deque()
        self._running: list[tuple[Job, Sequence]] = []
        """Admitted requests, in the order they came in; touched by the worker thread only."""
        self._turn = 0
        """Which prefilling request runs the next chunk (they take turns)."""
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="engine-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    @property
    def max_queue(self) -> int:
        return self._queues.max_queue

    @property
    def waiting(self) -> int:
        return self._queues.waiting

    @property
    def running(self) -> int:
        return len(self._running)

    def check_room(self) -> None:
        """Raise QueueFullError when a request submitted now would be refused."""
        self._queues.check_room()

    def reserve(self) -> None:
        """Hold a place in the queue for a job submitted later with `reserved=True` (or `release` it);
        raises QueueFullError when there is none."""
        with self._cond:
            self._queues.reserve()

    def release(self) -> None:
        """Give back a place held by `reserve` that no job will take."""
        with self._cond:
            self._queues.release()

    def submit(self, caller: str, request: GenerationRequest, streamed: bool = False, reserved: bool = False) -> Job:
        """Queue a job; `reserved`: it takes the place a `reserve` held (and cannot be refused)."""
        job = Job(caller=caller, request=request, loop=asyncio.get_running_loop(), streamed=streamed,
                  withdraw=self._withdraw)
        with self._cond:
            self._queues.push(caller, job, reserved)
            self._cond.notify()
        return job

    def chore(self, work: Callable[[], None]) -> None:
        """Run `work` on the worker thread, which owns the model's state, before the next step."""
        with self._cond:
            self._chores.append(work)
            self._cond.notify()

    def ask(self, work: Callable[[], T]) -> Future[T]:
        """Run `work` as a chore and hand back its result (or its exception): for reading what the worker owns
        (the prefix index) without racing it."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the asker went away
            try:
                future.set_result(work())
            except BaseException as exc:  # noqa: BLE001 - handed to the asker, who raises it
                future.set_exception(exc)

        self.chore(run)
        return future

    def _withdraw(self, job: Job) -> None:
        with self._cond:
            if not self._queues.remove(job.caller, job):
                return  # already taken by the worker, which sees the cancellation itself
        job.post(Failed(asyncio.CancelledError()))

    def _take(self) -> tuple[list[Callable[[], None]], list[Job]] | None:
        """Chores to run and jobs to admit (as many as there are free lanes), waiting while there is nothing to
        do; None when stopping."""
        with self._cond:
            if not self._running and not self._queues and not self._chores and not self._stopping:
                self._cond.wait(TICK_S)
            if self._stopping:
                return None
            chores = list(self._chores)
            self._chores.clear()
            jobs: list[Job] = []
            admit = self.max_running - len(self._running)
            if any(not seq.prefilling and not seq.done for _, seq in self._running):
                admit = min(admit, ADMIT_WHILE_DECODING)
            while self._queues and len(jobs) < admit:
                job = self._queues.pop()  # round-robin over the callers
                job.withdraw = None  # admitted: cancellation stops it at its next step
                jobs.append(job)
        return chores, jobs

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - housekeeping must not stop the worker
            self._failed_housekeeping(exc)

    @staticmethod
    def _failed_housekeeping(exc: Exception) -> None:
        log.error("housekeeping failed: %s\n%s", Safe(type(exc).__name__),
                  Safe("".join(traceback.format_tb(exc.__traceback__))))

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            self._turn_of(*taken)
            # While the worker waits for the next work, nothing of the last (its job, its prompt) stays reachable
            # from this frame: a finished request's token ids go as soon as the reply does.
            del taken
        for job, seq in self._running:  # stopping
            self.runner.release(seq)
            job.post(Failed(asyncio.CancelledError()))
        self._running.clear()

    def _turn_of(self, chores: list[Callable[[], None]], jobs: list[Job]) -> None:
        for chore in chores:
            self._guarded(chore)
        for job in jobs:
            self._admit(job)
        if self._running:
            self._step()
        elif not jobs:
            self._guarded(lambda: self.runner.expire(self.ttl_of))
            self._guarded(lambda: self.runner.settle(stop=lambda: self.waiting > 0))  # what a busy spell left

    def _admit(self, job: Job) -> None:
        if job.cancel_event.is_set():
            job.post(Failed(asyncio.CancelledError()))
            return
        wait = time.perf_counter() - job.enqueued_at
        try:
            seq = self.runner.start(job.request, emit=job.emit_text, cancelled=job.cancel_event.is_set,
                                    queue_wait_s=wait, lane=self.runner.pick_lane(job.request.scope,
                                                                                  self.max_running))
        except Exception as exc:  # noqa: BLE001 - reported to the waiting request, worker keeps serving
            self._failed(job, exc)
            return
        self._running.append((job, seq))

    def _step(self) -> None:
        """Plan a step, have the runner run it, and answer the requests that ended or failed in it."""
        outcome = self.runner.run(self._plan())
        if outcome.trouble is not None:
            self._failed_housekeeping(outcome.trouble)
        jobs = {id(seq): job for job, seq in self._running}
        for seq, exc in outcome.failed:
            self._running.remove((job := jobs[id(seq)], seq))
            self._failed(job, exc)
        for seq, result in outcome.finished:
            self._running.remove((job := jobs[id(seq)], seq))
            job.post(Finished(result))
        if outcome.finished or outcome.failed:
            # After replies: cold state is sealed, running and waiting work going first (up to a bound), and
            # plaintext no longer hot is zeroed, requests waiting to start going first.
            self._guarded(lambda: self.runner.settle(stop=lambda: bool(self._running) or self.waiting > 0,
                                                     waiting=lambda: self.waiting > 0))

    def _plan(self) -> StepPlan:
        """The next step: requests cancelled while waiting for their prompt retire; those following a request of
        their caller copy its rows; prefill chunks, the prefilling requests taking turns, up to the step's token
        budget (what the decoding rows leave of STEP_TOKENS while any decode, else a wave's worth); and one decode
        step of every decoding request, and of each whose prompt the step's chunks complete."""
        retire, follow, prefilling, decode = [], [], [], []
        for job, seq in self._running:
            if seq.prefilling and not seq.done and job.cancel_event.is_set():
                seq.finish_reason = "cancelled"
            if seq.done:
                retire.append(seq)
            elif not seq.prefilling:
                decode.append(seq)
            elif seq.donor is not None:
                follow.append(seq)
            else:
                prefilling.append(seq)
        budget = (STEP_TOKENS - len(decode) if decode
                  else max(self.runner.prefill_chunk, PREFILL_PER_RUNNING * len(self._running)))
        chunks = {seq: [stop - start for start, stop in zip([seq.position, *seq.stops[:-1]], seq.stops, strict=True)]
                  for seq in prefilling}
        prefill: list[Sequence] = []
        spent = 0
        while turns := [seq for seq in prefilling if chunks[seq]]:
            seq = turns[self._turn % len(turns)]
            if spent and spent + chunks[seq][0] > budget:
                break
            self._turn += 1
            spent += chunks[seq].pop(0)
            prefill.append(seq)
        decode += [seq for seq in prefilling if not chunks[seq]]
        return StepPlan(tuple(follow), tuple(prefill), tuple(decode), tuple(retire))

    @staticmethod
    def _failed(job: Job, exc: Exception) -> None:
        # Frames only: an exception's message may quote token ids.
        log.error("generation failed: %s\n%s", Safe(type(exc).__name__),
                  Safe("".join(traceback.format_tb(exc.__traceback__))))
        job.post(Failed(exc))

    def describe(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "max_queue": self.max_queue, "running": len(self._running),
                "max_running": self.max_running}
