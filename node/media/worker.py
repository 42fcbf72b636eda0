"""Media jobs queued fairly per caller and run one at a time on the pipeline's own worker thread.

The queue is the text scheduler's (`node/engine/caller_queue.py`): each caller has a FIFO, callers are served
round-robin, and at most `max_queue` jobs wait in all (a full queue refuses with QueueFullError: 503 with a
Retry-After, as the text queue's). A render holds the whole device for its denoising steps, so jobs run one after
another, not batched; a cancelled job leaves the queue at once, or stops at its next denoising step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from node.engine.caller_queue import CallerQueues
from node.log_privacy import Safe
from node.media.pipeline import ImagePipeline, Render, RenderCancelled, Rendered

log = logging.getLogger(__name__)

TICK_S = 1.0
"""How often an idle worker expires encodings past their scope's time to live."""


@dataclass(eq=False)
class MediaJob:
    caller: str
    render: Render
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Rendered]
    """Set on the event loop with the images, or the failure (asyncio.CancelledError when cancelled)."""
    cancel_event: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    queue_wait_s: float = 0.0
    """Set when the worker takes the job."""
    withdraw: Callable[[MediaJob], None] | None = None

    def cancel(self) -> None:
        """Stop the job: a waiting one leaves the queue now, a running one at its next denoising step."""
        self.cancel_event.set()
        if self.withdraw is not None:
            self.withdraw(self)

    def settle(self, result: Rendered | None, error: BaseException | None) -> None:
        """Hand the outcome to the event loop (from the worker thread); once only."""
        def settle() -> None:
            if self.done.done():
                return
            if error is not None:
                self.done.set_exception(error)
            else:
                self.done.set_result(result)  # type: ignore[arg-type]
        self.loop.call_soon_threadsafe(settle)


class MediaWorker:
    def __init__(self, pipeline: ImagePipeline, max_queue: int) -> None:
        self.pipeline = pipeline
        self.ttl_of: Callable[[str], float | None] = lambda caller: None
        """A caller's time to live for stored encodings (seconds, None: no limit), from the node's config."""
        self._queues: CallerQueues[MediaJob] = CallerQueues(max_queue)
        self._cond = threading.Condition()
        self._stopping = False
        self._running: MediaJob | None = None
        self._thread = threading.Thread(target=self._work, name="media-worker", daemon=True)

    @property
    def max_queue(self) -> int:
        return self._queues.max_queue

    @property
    def waiting(self) -> int:
        return self._queues.waiting

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, caller: str, render: Render) -> MediaJob:
        """Queue a render; raises QueueFullError when `max_queue` jobs already wait."""
        loop = asyncio.get_running_loop()
        job = MediaJob(caller, render, loop, loop.create_future(), withdraw=self._withdraw)
        with self._cond:
            self._queues.push(caller, job)
            self._cond.notify()
        return job

    def _withdraw(self, job: MediaJob) -> None:
        with self._cond:
            if not self._queues.remove(job.caller, job):
                return  # taken by the worker, which sees the cancellation at its next step
        job.settle(None, asyncio.CancelledError())

    def _take(self) -> MediaJob | None:
        with self._cond:
            while not self._queues and not self._stopping:
                if not self._cond.wait(TICK_S):
                    return None
            if self._stopping:
                return None
            job = self._queues.pop()
            job.withdraw = None
            self._running = job
            return job

    def _work(self) -> None:
        while not self._stopping:
            job = self._take()
            if job is None:
                self._expire()
                continue
            job.queue_wait_s = time.perf_counter() - job.enqueued_at
            try:
                if job.cancel_event.is_set():
                    raise RenderCancelled
                job.settle(self.pipeline.render(job.render, job.cancel_event.is_set), None)
            except RenderCancelled:
                job.settle(None, asyncio.CancelledError())
            except Exception as exc:  # noqa: BLE001 - reported to the waiting request, worker keeps serving
                # Frames only: an exception's message may quote the prompt.
                log.error("render failed: %s\n%s", Safe(type(exc).__name__),
                          Safe("".join(traceback.format_tb(exc.__traceback__))))
                job.settle(None, exc)
            finally:
                self._running = None
                del job
        with self._cond:  # stopping: the jobs still waiting will not run
            while self._queues:
                self._queues.pop().settle(None, asyncio.CancelledError())

    def _expire(self) -> None:
        encodings = self.pipeline.encodings
        if encodings is not None:
            encodings.expire(self.ttl_of)

    def describe(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "max_queue": self.max_queue, "running": int(self._running is not None),
                "max_running": 1}
