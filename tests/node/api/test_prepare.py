"""The preparation threads are shared among callers in turn: one caller's jobs, however many and however long,
hold one thread, and other callers' jobs run beside them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from node.api.prepare import ANONYMOUS, FairPreparation

WAIT_S = 10.0
"""Only a hang waits this long: every wait below ends as soon as the job it waits for ran."""


def blocked(gate: threading.Event, ran: list[str], name: str) -> str:
    ran.append(name)
    if not gate.wait(WAIT_S):
        raise TimeoutError(name)
    return name


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(int(WAIT_S / 0.001)):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def test_a_caller_flooding_preparation_holds_one_thread_and_others_run_beside_it() -> None:
    async def run() -> None:
        prepare = FairPreparation(2)
        gate, ran = threading.Event(), list[str]()
        flood = [asyncio.create_task(prepare.run("mallory", blocked, gate, ran, f"m{i}")) for i in range(5)]
        await until(lambda: ran == ["m0"])
        assert prepare.running == {"mallory"} and prepare.waiting("mallory") == 4
        # Mallory's first job is blocked and four more wait: alice's job still gets the second thread, and so
        # does a keyless request's after it.
        assert await asyncio.wait_for(prepare.run("alice", str.upper, "alice"), WAIT_S) == "ALICE"
        assert await asyncio.wait_for(prepare.run(ANONYMOUS, str.upper, "public"), WAIT_S) == "PUBLIC"
        assert ran == ["m0"]  # mallory's second job never took the free thread
        gate.set()
        assert await asyncio.gather(*flood) == [f"m{i}" for i in range(5)]
        assert ran == [f"m{i}" for i in range(5)]
        prepare.shutdown()

    asyncio.run(run())


def test_when_every_thread_is_busy_waiting_callers_are_served_in_turn() -> None:
    async def run() -> None:
        prepare = FairPreparation(1)
        gates = {name: threading.Event() for name in ("a0", "a1", "a2", "b0", "c0")}
        ran: list[str] = []
        jobs = [asyncio.create_task(prepare.run(name[0], blocked, gates[name], ran, name))
                for name in ("a0", "a1", "a2")]
        await until(lambda: ran == ["a0"])
        jobs += [asyncio.create_task(prepare.run(name[0], blocked, gates[name], ran, name)) for name in ("b0", "c0")]
        await asyncio.sleep(0)
        for gate in gates.values():
            gate.set()
        await asyncio.gather(*jobs)
        assert ran == ["a0", "b0", "c0", "a1", "a2"]  # b and c waited while a0 ran: their turns come before a1
        prepare.shutdown()

    asyncio.run(run())


def test_a_cancelled_waiting_job_never_runs_and_a_failing_job_raises_to_its_caller() -> None:
    async def run() -> None:
        prepare = FairPreparation(1)
        gate, ran = threading.Event(), list[str]()
        first = asyncio.create_task(prepare.run("a", blocked, gate, ran, "first"))
        await until(lambda: ran == ["first"])
        second = asyncio.create_task(prepare.run("a", blocked, gate, ran, "second"))
        await asyncio.sleep(0)
        second.cancel()
        gate.set()
        assert await first == "first"
        with pytest.raises(asyncio.CancelledError):
            await second
        with pytest.raises(ValueError, match="invalid literal"):
            await prepare.run("a", int, "x")
        assert ran == ["first"] and prepare.running == frozenset()
        prepare.shutdown()

    asyncio.run(run())


async def test_a_share_whose_large_body_was_refused_waits_four_times_its_cost_and_no_other_share_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from node.api import prepare

    clock = [100.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(prepare.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(prepare.asyncio, "sleep", sleep)
    fair = FairPreparation(1)
    try:
        fair.refused("flood", 0.05)
        fair.refused("flood", 0.05)  # a second refusal waits behind the first
        await fair.backoff("alice")
        assert slept == []
        await fair.backoff("flood")
        assert slept == [pytest.approx(2 * prepare.REFUSAL_BACKOFF * 0.05)]
        await fair.backoff("flood")  # waited out: the next large body is read at once
        assert len(slept) == 1
        fair.refused(ANONYMOUS, 0.01)
        assert "flood" not in fair._backoff  # a share whose wait is over is forgotten
    finally:
        fair.shutdown()
