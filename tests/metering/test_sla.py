"""Service levels: exact nearest-rank percentiles, shares and windows over records with known times."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_fixtures import EVIDENCE_DIGEST, PRICES, START_MS, StepClock

from metering.ledger import Ledger
from metering.record import Latency, RecordStatus, TokenCounts
from metering.signer import NodeSigner
from metering.sla import Percentiles, SlaReport, nearest_rank, sla

# (boot, record id, caller, model, status, output tokens, (queue_wait_ms, ttft_ms, total_ms)).
# Each boot's records are stamped START_MS + 1000, + 2000, ... in this order.
ENTRIES: list[tuple[str, str, str, str, RecordStatus, int, tuple[int, int, int]]] = [
    ("boot-1", "r0", "caller-a", "tiny", "completed", 5, (10, 120, 400)),
    ("boot-1", "r1", "caller-a", "tiny", "completed", 3, (0, 250, 300)),
    ("boot-1", "r2", "caller-a", "tiny", "failed", 0, (0, 0, 90)),  # a failure reports no tokens
    ("boot-1", "r3", "caller-a", "big", "completed", 2, (200, 251, 900)),
    ("boot-1", "r4", "caller-b", "tiny", "completed", 1, (0, 40, 50)),
    ("boot-2", "r5", "caller-a", "tiny", "cancelled", 0, (60, 0, 60)),  # cancelled while it waited
    ("boot-2", "r6", "caller-a", "tiny", "completed", 4, (5, 80, 150)),
]


@pytest.fixture
def ledger_dir(tmp_path: Path, node_signer: NodeSigner, other_signer: NodeSigner) -> Path:
    signers = {"boot-1": node_signer, "boot-2": other_signer}
    ledgers = {
        boot: Ledger(tmp_path, signer, boot, evidence_digest=EVIDENCE_DIGEST, clock_ms=StepClock())
        for boot, signer in signers.items()
    }
    for boot, record_id, caller, model, status, output, times in ENTRIES:
        ledgers[boot].append(
            record_id=record_id,
            caller_id=caller,
            model=model,
            status=status,
            counts=TokenCounts(10, 0, 0, output),
            prices=PRICES,
            latency=Latency(*times),
        )
    for ledger in ledgers.values():
        ledger.close()
    return tmp_path


def test_nearest_rank_is_an_observed_value() -> None:
    values = list(range(1, 11))
    assert [nearest_rank(values, percent) for percent in (1, 10, 11, 50, 51, 90, 99, 100)] == [
        1, 1, 2, 5, 6, 9, 10, 10
    ]
    assert nearest_rank([7], 50) == 7
    assert nearest_rank([0.25, 1.5], 50) == 0.25


@pytest.mark.parametrize(
    ("values", "percent", "message"),
    [
        ([], 50, "a percentile needs at least one value"),
        ([1], 0, "percent must be 1 to 100, got 0"),
        ([1], 101, "percent must be 1 to 100, got 101"),
    ],
)
def test_nearest_rank_refuses(values: list[int], percent: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        nearest_rank(values, percent)


def test_percentiles_of_unsorted_values() -> None:
    assert Percentiles.of([900, 60, 300, 150, 90, 400]) == Percentiles(p50=150, p90=900, p99=900)
    assert Percentiles.of(iter([])) is None


def test_every_model_of_a_caller_across_segments(ledger_dir: Path) -> None:
    # First tokens of caller-a: 120, 250, 251, 80 (r2 failed and r5 never started: no first token).
    assert sla(ledger_dir, "caller-a", 250) == SlaReport(
        caller_id="caller-a",
        model=None,
        since_ms=None,
        until_ms=None,
        ttft_limit_ms=250,
        segments=2,
        requests=6,
        first_tokens=4,
        met=3,
        ttft_ms=Percentiles(p50=120, p90=251, p99=251),  # of 80, 120, 250, 251
        total_ms=Percentiles(p50=150, p90=900, p99=900),  # of 60, 90, 150, 300, 400, 900
    )


def test_one_model_and_a_stricter_promise(ledger_dir: Path) -> None:
    tiny = sla(ledger_dir, "caller-a", 100, model="tiny")
    assert (tiny.requests, tiny.first_tokens, tiny.met) == (5, 3, 1)  # only r6's 80 ms
    assert tiny.ttft_ms == Percentiles(p50=120, p90=250, p99=250)  # of 80, 120, 250
    assert tiny.total_ms == Percentiles(p50=150, p90=400, p99=400)  # of 60, 90, 150, 300, 400
    assert tiny.met_basis_points == 2000


def test_window_is_inclusive_then_exclusive(ledger_dir: Path) -> None:
    report = sla(ledger_dir, "caller-a", 250, since_ms=START_MS + 2000, until_ms=START_MS + 4000)
    # boot-1's r1 and r2 (stamped +2000 and +3000) and boot-2's r6 (+2000).
    assert (report.requests, report.first_tokens, report.met) == (3, 2, 2)
    assert report.ttft_ms == Percentiles(p50=80, p90=250, p99=250)
    assert report.total_ms == Percentiles(p50=150, p90=300, p99=300)
    assert report.met_basis_points == 6667


def test_a_caller_without_records(ledger_dir: Path) -> None:
    report = sla(ledger_dir, "caller-z", 250)
    assert (report.requests, report.first_tokens, report.met, report.ttft_ms, report.total_ms) == (
        0, 0, 0, None, None
    )
    assert report.met_basis_points is None


def test_requests_without_a_first_token_have_total_times_only(ledger_dir: Path) -> None:
    report = sla(ledger_dir, "caller-a", 10_000, until_ms=START_MS + 1000 + 1)  # r0 and r5
    assert (report.requests, report.first_tokens, report.met) == (2, 1, 1)
    assert report.ttft_ms == Percentiles(120, 120, 120)
    assert report.total_ms == Percentiles(60, 400, 400)


@pytest.mark.parametrize(
    ("met", "requests", "basis_points"),
    [(0, 5, 0), (5, 5, 10_000), (1, 6, 1667), (2, 3, 6667), (1, 32, 313), (1, 8, 1250), (1, 3, 3333)],
)
def test_share_is_rounded_half_up_to_hundredths_of_a_percent(met: int, requests: int, basis_points: int) -> None:
    report = SlaReport("c", None, None, None, 1, 1, requests, requests, met, None, None)
    assert report.met_basis_points == basis_points


def test_bad_promise_or_window_is_an_error(ledger_dir: Path) -> None:
    with pytest.raises(ValueError, match="promised time to first token must be a non-negative integer"):
        sla(ledger_dir, "caller-a", -1)
    with pytest.raises(ValueError, match=r"until \(1 ms\) is before since \(2 ms\)"):
        sla(ledger_dir, "caller-a", 1, since_ms=2, until_ms=1)
