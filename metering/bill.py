"""A caller's bill over a time window: token and cost totals read from ledger segments.

Billing reads what the ledger says and re-checks nothing: a bill proves only what a verification of the
same segments proves, so the CLI's `metering bill` runs `metering verify`'s checks (`verify_ledger` under the
auditor's keys or evidence) first and bills nothing when they fail. Totals are exact integers: the cost is
the sum of the records' own signed `cost_wei`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from metering.record import UsageRecord
from metering.segment import read_records, segment_files


@dataclass(frozen=True, slots=True)
class UsageTotals:
    records: int = 0
    input_tokens: int = 0
    cached_read_tokens: int = 0
    cached_write_tokens: int = 0
    output_tokens: int = 0
    cost_wei: int = 0

    @property
    def uncached_input_tokens(self) -> int:
        return self.input_tokens - self.cached_read_tokens - self.cached_write_tokens

    def plus(self, record: UsageRecord) -> UsageTotals:
        return UsageTotals(
            records=self.records + 1,
            input_tokens=self.input_tokens + record.input_tokens,
            cached_read_tokens=self.cached_read_tokens + record.cached_read_tokens,
            cached_write_tokens=self.cached_write_tokens + record.cached_write_tokens,
            output_tokens=self.output_tokens + record.output_tokens,
            cost_wei=self.cost_wei + record.cost_wei,
        )


@dataclass(frozen=True, slots=True)
class BillLine:
    """Totals of one (model, status) pair."""

    model: str
    status: str
    totals: UsageTotals


@dataclass(frozen=True, slots=True)
class Bill:
    caller_id: str
    since_ms: int | None  # inclusive lower bound on record timestamps, None for open
    until_ms: int | None  # exclusive upper bound, None for open
    segments: int  # segment files read
    lines: tuple[BillLine, ...]  # ordered by model, then status
    total: UsageTotals


def bill(
    ledger_path: str | os.PathLike[str],
    caller_id: str,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> Bill:
    """Bill `caller_id` for records with since_ms <= timestamp_ms < until_ms.

    `ledger_path` is one segment file or a ledger directory (all its segments, one per node start).
    """
    segments, selected = caller_records(ledger_path, caller_id, since_ms, until_ms)
    lines, total = _totals(selected)
    return Bill(caller_id, since_ms, until_ms, segments, lines, total)


def caller_records(
    ledger_path: str | os.PathLike[str],
    caller_id: str,
    since_ms: int | None = None,
    until_ms: int | None = None,
    model: str | None = None,
) -> tuple[int, list[UsageRecord]]:
    """(segment files read, the caller's records with since_ms <= timestamp_ms < until_ms, of `model` when
    given), from one segment file or a ledger directory, in file order."""
    if since_ms is not None and until_ms is not None and until_ms < since_ms:
        raise ValueError(f"until ({until_ms} ms) is before since ({since_ms} ms); swap or widen them")
    files = segment_files(ledger_path)
    records = (record for path in files for record in read_records(path)[1])
    selected = [
        record
        for record in records
        if record.caller_id == caller_id
        and (model is None or record.model == model)
        and (since_ms is None or record.timestamp_ms >= since_ms)
        and (until_ms is None or record.timestamp_ms < until_ms)
    ]
    return len(files), selected


def _totals(records: Iterable[UsageRecord]) -> tuple[tuple[BillLine, ...], UsageTotals]:
    per_line: dict[tuple[str, str], UsageTotals] = {}
    total = UsageTotals()
    for record in records:
        key = (record.model, record.status)
        per_line[key] = per_line.get(key, UsageTotals()).plus(record)
        total = total.plus(record)
    lines = tuple(BillLine(model, status, totals) for (model, status), totals in sorted(per_line.items()))
    return lines, total
