"""The media worker: callers served round-robin, a full queue refused, a cancelled waiting job gone at once."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import pytest

from cache.scope import Scope
from node.engine.caller_queue import QueueFullError
from node.media.pipeline import EncoderUse, ImagePipeline, ImageRequest, Render, RenderCancelled, Rendered
from node.media.worker import MediaWorker


class GatedPipeline:
    """Renders nothing: records whose job ran, each after the test opens the gate."""

    def __init__(self) -> None:
        self.encodings = None
        self.ran: list[str] = []
        self.gate = threading.Semaphore(0)

    def render(self, job: Render, cancelled: Any) -> Rendered:
        self.gate.acquire()
        self.ran.append(f"{job.scope.caller}{job.request.seed}")
        return Rendered((b"png",), 1, EncoderUse(1, 0), EncoderUse(0, 0), 0.0, 0.0)


def job(caller: str, seed: int) -> Render:
    return Render(Scope(caller=caller, model="tiny"), ImageRequest("tiny", "p", 1, 64, 64, 1, seed))


async def test_callers_take_turns_a_full_queue_refuses_and_a_cancelled_job_leaves_it() -> None:
    pipeline = GatedPipeline()
    worker = MediaWorker(cast(ImagePipeline, pipeline), max_queue=5)
    worker.start()
    try:
        first = worker.submit("alice", job("alice", 0))
        while worker.waiting:  # the worker takes the first job and waits at the gate
            await asyncio.sleep(0.01)
        jobs = [worker.submit("alice", job("alice", seed)) for seed in (1, 2, 3)]
        jobs.append(worker.submit("bob", job("bob", 1)))
        withdrawn = worker.submit("carol", job("carol", 1))
        with pytest.raises(QueueFullError):
            worker.submit("dave", job("dave", 1))
        withdrawn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await withdrawn.done
        assert worker.waiting == 4
        for _ in range(5):
            pipeline.gate.release()
        await asyncio.gather(first.done, *(queued.done for queued in jobs))
        assert pipeline.ran == ["alice0", "alice1", "bob1", "alice2", "alice3"]
        while worker.describe()["running"]:  # the last job's outcome is handed out just before it is let go
            await asyncio.sleep(0.01)
        assert worker.describe() == {"waiting": 0, "max_queue": 5, "running": 0, "max_running": 1}
    finally:
        worker.stop()


class CancellablePipeline:
    """Renders until cancelled, as the real pipeline stops at its next denoising step."""

    encodings = None

    def __init__(self) -> None:
        self.started = threading.Event()

    def render(self, job: Render, cancelled: Any) -> Rendered:
        self.started.set()
        while not cancelled():
            threading.Event().wait(0.005)
        raise RenderCancelled


async def test_a_running_job_cancelled_ends_as_cancelled_and_the_worker_serves_on() -> None:
    pipeline = CancellablePipeline()
    worker = MediaWorker(cast(ImagePipeline, pipeline), max_queue=2)
    worker.start()
    try:
        running = worker.submit("alice", job("alice", 0))
        await asyncio.to_thread(pipeline.started.wait, 5)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running.done
        pipeline.started.clear()
        following = worker.submit("bob", job("bob", 0))
        await asyncio.to_thread(pipeline.started.wait, 5)
        following.cancel()
        with pytest.raises(asyncio.CancelledError):
            await following.done
    finally:
        worker.stop()
