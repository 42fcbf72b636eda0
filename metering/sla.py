"""A caller's service levels over a time window: how many requests got their first token within a promised
time, and percentiles of time to first token and of total time, read from ledger segments.

Like a bill, this reads what the ledger says without re-checking it: the CLI's `metering sla` first runs
`metering verify`'s checks, with the same trust options, and reports nothing for a ledger they refuse. Every
number is an exact integer taken from the records' signed `ttft_ms` and `total_ms`, as
`metering.record.Latency` defines them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from metering.bill import caller_records

Value = TypeVar("Value", int, float)


def nearest_rank(ascending: Sequence[Value], percent: int) -> Value:
    """The nearest-rank percentile: the smallest value with at least `percent`% of the values at or below it.

    Always an observed value, never an interpolation, so a percentile of signed times is itself a signed time.
    """
    if not ascending:
        raise ValueError("a percentile needs at least one value")
    if not 0 < percent <= 100:
        raise ValueError(f"percent must be 1 to 100, got {percent}")
    rank = -(-percent * len(ascending) // 100)  # ceil(percent / 100 * n) in integers
    return ascending[rank - 1]


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Nearest-rank percentiles of one time, in milliseconds."""

    p50: int
    p90: int
    p99: int

    @classmethod
    def of(cls, values: Iterable[int]) -> Percentiles | None:
        """The percentiles of `values`, or None when there are none."""
        ascending = sorted(values)
        if not ascending:
            return None
        return cls(nearest_rank(ascending, 50), nearest_rank(ascending, 90), nearest_rank(ascending, 99))


@dataclass(frozen=True, slots=True)
class SlaReport:
    caller_id: str
    model: str | None  # the one model counted; None for every model
    since_ms: int | None  # inclusive lower bound on record timestamps, None for open
    until_ms: int | None  # exclusive upper bound, None for open
    ttft_limit_ms: int  # the promise checked: a first token within this many ms of the enqueue
    segments: int  # segment files read
    requests: int  # the caller's records in the window, of every status
    first_tokens: int  # of them, those that got a first token (output_tokens > 0)
    met: int  # of them, those with ttft_ms <= ttft_limit_ms; a request without a first token never meets it
    ttft_ms: Percentiles | None  # over the requests with a first token; None when none got one
    total_ms: Percentiles | None  # over every request; None when there are none

    @property
    def met_basis_points(self) -> int | None:
        """met / requests in hundredths of a percent, rounded half up; None when there are no requests."""
        if self.requests == 0:
            return None
        return (20_000 * self.met + self.requests) // (2 * self.requests)


def sla(
    ledger_path: str | os.PathLike[str],
    caller_id: str,
    ttft_limit_ms: int,
    since_ms: int | None = None,
    until_ms: int | None = None,
    model: str | None = None,
) -> SlaReport:
    """The service levels of `caller_id`'s records with since_ms <= timestamp_ms < until_ms (of `model` when
    given), in one segment file or a ledger directory (all its segments, one per node start)."""
    if type(ttft_limit_ms) is not int or ttft_limit_ms < 0:
        raise ValueError(f"the promised time to first token must be a non-negative integer (ms), got {ttft_limit_ms!r}")
    segments, records = caller_records(ledger_path, caller_id, since_ms, until_ms, model)
    first_token_ms = [record.ttft_ms for record in records if record.output_tokens > 0]
    return SlaReport(
        caller_id=caller_id,
        model=model,
        since_ms=since_ms,
        until_ms=until_ms,
        ttft_limit_ms=ttft_limit_ms,
        segments=segments,
        requests=len(records),
        first_tokens=len(first_token_ms),
        met=sum(1 for ttft_ms in first_token_ms if ttft_ms <= ttft_limit_ms),
        ttft_ms=Percentiles.of(first_token_ms),
        total_ms=Percentiles.of(record.total_ms for record in records),
    )
