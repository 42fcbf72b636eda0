"""The preparation threads, shared among callers in turn: one caller's large requests cannot hold another's.

Preparation (parsing a large body, rendering, tokenizing, signing evidence) grows with a request's size and runs
off the event loop. A shared first-come pool let two callers looping expensive bodies take every thread, and every
other caller's chat waited behind their work. Here each caller (each share) runs at most one job at a time, and
its further jobs wait in its own queue; when every thread is busy, a freed one goes to the next share in turn (a
share whose job ends goes behind the shares waiting). A caller's share of the threads is therefore one, whatever
it sends at once, and a caller arriving while others flood finds a thread unless `threads` other callers are all
preparing. Requests without a caller (public routes called without a key) are one share together, `ANONYMOUS`.

Jobs are not preempted: a running job keeps its thread, and its share, until it returns, even when its request
has been cancelled (the work is bounded by the request limits). A job still waiting when its request is cancelled
never runs. All bookkeeping is on the event loop's thread.

Reading a large body costs the event loop too, before any thread is involved, and a body refused once it is read
(too many messages, over the context) has cost the node that and its parse for nothing. So a share whose large
body was refused waits `REFUSAL_BACKOFF` times what that body cost before its next large body is read
(`refused`, `backoff`): a caller looping such bodies gets at most a fraction of the node, and others' requests
go on beside it. A caller whose bodies are accepted never waits.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

ANONYMOUS: str | None = None
"""The share of requests with no authenticated caller (no caller's name is None)."""
REFUSAL_BACKOFF = 4.0
"""How many times a refused large body's cost its share waits before its next large body is read: a share looping
refused bodies occupies the node at most 1 / (1 + REFUSAL_BACKOFF) of the time."""


@dataclass(frozen=True, slots=True)
class _Job:
    done: asyncio.Future[Any]
    work: Callable[..., Any]
    args: tuple[Any, ...]


class FairPreparation:
    """`run(share, work, *args)`: `work(*args)` on a pool thread, at most one at a time per share, shares served
    in turn."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError("preparation needs at least one thread")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="prepare")
        self._shares: OrderedDict[str | None, deque[_Job]] = OrderedDict()
        """The shares with a job waiting or running, in turn: a share whose job ends goes behind the others."""
        self._running: set[str | None] = set()
        self._closed = False
        self._backoff: dict[str | None, float] = {}
        """Per share: the monotonic time before which its next large body is not read."""

    @property
    def running(self) -> frozenset[str | None]:
        """The shares with a job on a thread now."""
        return frozenset(self._running)

    def waiting(self, share: str | None) -> int:
        """Jobs of `share` not started yet."""
        return len(self._shares.get(share, ()))

    async def run(self, share: str | None, work: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("the preparation threads are shut down")
        job = _Job(asyncio.get_running_loop().create_future(), work, args)
        self._shares.setdefault(share, deque()).append(job)
        self._dispatch()
        # Cancelling the request cancels `job.done`: a waiting job is then dropped, a running one keeps its share
        # until its thread returns.
        return await job.done

    def _next(self) -> tuple[str | None, _Job] | None:
        for share, jobs in self._shares.items():
            if share not in self._running and jobs:
                return share, jobs.popleft()
        return None

    def _dispatch(self) -> None:
        while len(self._running) < self.threads and (picked := self._next()) is not None:
            share, job = picked
            if job.done.cancelled():
                if not self._shares[share]:
                    del self._shares[share]
                continue
            self._running.add(share)
            running = asyncio.get_running_loop().run_in_executor(self._pool, job.work, *job.args)
            running.add_done_callback(functools.partial(self._finished, share, job))

    def _finished(self, share: str | None, job: _Job, finished: asyncio.Future[Any]) -> None:
        self._running.discard(share)
        if self._shares.get(share):
            self._shares.move_to_end(share)
        else:
            self._shares.pop(share, None)
        if not job.done.done():
            if finished.cancelled():
                job.done.cancel()
            elif (error := finished.exception()) is not None:
                job.done.set_exception(error)
            else:
                job.done.set_result(finished.result())
        if not self._closed:
            self._dispatch()

    def refused(self, share: str | None, spent_s: float) -> None:
        """A large body of `share` was read and refused after `spent_s` seconds of the node's work."""
        now = time.monotonic()
        self._backoff[share] = max(self._backoff.get(share, now), now) + REFUSAL_BACKOFF * spent_s
        for other, until in list(self._backoff.items()):  # forget the shares whose wait is over
            if until <= now:
                del self._backoff[other]

    async def backoff(self, share: str | None) -> None:
        """Wait out the share's back-off, if it has one, before its next large body is read."""
        wait = self._backoff.get(share, 0.0) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    def shutdown(self) -> None:
        """Waiting jobs are cancelled; running ones end on their threads, unawaited."""
        self._closed = True
        for jobs in self._shares.values():
            for job in jobs:
                job.done.cancel()
        self._shares.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
