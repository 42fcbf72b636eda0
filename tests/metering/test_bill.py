"""Bills: exact per-(model, status) and total sums over a caller's records in a time window."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_fixtures import EVIDENCE_DIGEST, PRICES, START_MS, LedgerFactory, StepClock

from metering.bill import Bill, BillLine, UsageTotals, bill, caller_records
from metering.ledger import Ledger
from metering.pricing import PriceSchedule
from metering.record import Latency, RecordStatus, TokenCounts
from metering.signer import NodeSigner

# Standard record seq s costs (95 - 9s) * 3 + 10s * 1 + 5 * 5 + (20 + s) * 11 = 530 - 6s wei.
CALLER_A_ALL = UsageTotals(
    records=3,
    input_tokens=306,
    cached_read_tokens=60,
    cached_write_tokens=15,
    output_tokens=66,
    cost_wei=1554,
)


def test_whole_segment_for_one_caller(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer)
    result = bill(ledger.path, "caller-a")
    assert result == Bill(
        caller_id="caller-a",
        since_ms=None,
        until_ms=None,
        segments=1,
        lines=(BillLine("tiny", "completed", CALLER_A_ALL),),
        total=CALLER_A_ALL,
    )
    assert result.total.uncached_input_tokens == 306 - 60 - 15


def test_window_is_inclusive_then_exclusive(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer)  # seq s is stamped START_MS + 1000 * (s + 1)
    result = bill(ledger.path, "caller-a", since_ms=START_MS + 3000, until_ms=START_MS + 5000)
    assert result.total == UsageTotals(
        records=1,
        input_tokens=102,
        cached_read_tokens=20,
        cached_write_tokens=5,
        output_tokens=22,
        cost_wei=518,
    )
    assert bill(ledger.path, "caller-b", since_ms=START_MS + 2000).total.cost_wei == 524 + 512 + 500
    assert bill(ledger.path, "caller-b", until_ms=START_MS + 2000).total == UsageTotals()


def test_unknown_caller_gets_an_empty_bill(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    result = bill(make_ledger(node_signer).path, "caller-z")
    assert (result.lines, result.total) == ((), UsageTotals())


def test_lines_per_model_and_status_across_segments(tmp_path: Path, node_signer: NodeSigner) -> None:
    big_prices = PriceSchedule(10**18, 4 * 10**18, 10**17, 125 * 10**16)
    entries: list[tuple[str, str, RecordStatus, TokenCounts, PriceSchedule]] = [
        ("boot-1", "tiny", "completed", TokenCounts(10, 4, 2, 5), PRICES),  # 4*3 + 4 + 10 + 55 = 81
        ("boot-1", "big", "failed", TokenCounts(1000, 0, 1000, 0), big_prices),  # 1000 * 1.25e18
        ("boot-2", "tiny", "completed", TokenCounts(20, 0, 0, 1), PRICES),  # 60 + 11 = 71
        ("boot-2", "tiny", "cancelled", TokenCounts(7, 7, 0, 0), PRICES),  # 7
    ]
    ledgers = {
        boot: Ledger(tmp_path, node_signer, boot, evidence_digest=EVIDENCE_DIGEST, clock_ms=StepClock())
        for boot in ("boot-1", "boot-2")
    }
    latency = Latency(queue_wait_ms=0, ttft_ms=0, total_ms=4)
    for index, (boot, model, status, counts, prices) in enumerate(entries):
        ledgers[boot].append(
            record_id=f"r{index}",
            caller_id="caller-a",
            model=model,
            status=status,
            counts=counts,
            prices=prices,
            latency=latency,
        )
        ledgers[boot].append(
            record_id=f"other{index}",
            caller_id="caller-b",
            model=model,
            status=status,
            counts=counts,
            prices=prices,
            latency=latency,
        )
    for ledger in ledgers.values():
        ledger.close()

    result = bill(tmp_path, "caller-a")
    assert result.segments == 2
    assert result.lines == (
        BillLine("big", "failed", UsageTotals(1, 1000, 0, 1000, 0, 1_250_000_000_000_000_000_000)),
        BillLine("tiny", "cancelled", UsageTotals(1, 7, 7, 0, 0, 7)),
        BillLine("tiny", "completed", UsageTotals(2, 30, 4, 2, 6, 81 + 71)),
    )
    assert result.total == UsageTotals(4, 1037, 11, 1002, 6, 1_250_000_000_000_000_000_159)

    segments, tiny = caller_records(tmp_path, "caller-a", model="tiny")
    assert (segments, [record.record_id for record in tiny]) == (2, ["r0", "r2", "r3"])


def test_torn_tail_is_not_billed(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer)
    ledger.path.write_bytes(ledger.path.read_bytes()[:-30])  # seq 5 (caller-b) is torn
    assert bill(ledger.path, "caller-b").total.records == 2
    assert bill(ledger.path, "caller-a").total == CALLER_A_ALL


def test_reversed_window_is_an_error(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    with pytest.raises(ValueError, match=r"until \(1 ms\) is before since \(2 ms\)"):
        bill(make_ledger(node_signer).path, "caller-a", since_ms=2, until_ms=1)
