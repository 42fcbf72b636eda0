"""Known keys, evidence digest, prices, clock and records shared by the metering tests (imported by conftest
and tests)."""

from __future__ import annotations

from collections.abc import Callable

from metering.ledger import Ledger
from metering.pricing import PriceSchedule
from metering.record import Latency, TokenCounts

NODE_SEED = bytes(range(32))
OTHER_SEED = bytes(range(32, 64))
START_MS = 1_700_000_000_000
EVIDENCE_DIGEST = "e1" * 32
"""Stands for the SHA-256 of a node start's attestation evidence."""
OTHER_EVIDENCE_DIGEST = "e2" * 32
LedgerFactory = Callable[..., Ledger]
"""Type of the `make_ledger` fixture."""

PRICES = PriceSchedule(
    input_price_wei=3, output_price_wei=11, cached_read_price_wei=1, cached_write_price_wei=5
)


class StepClock:
    """Returns START_MS, START_MS + 1000, ... on successive calls."""

    def __init__(self, start_ms: int = START_MS, step_ms: int = 1000) -> None:
        self.now = start_ms - step_ms
        self.step_ms = step_ms

    def __call__(self) -> int:
        self.now += self.step_ms
        return self.now


def standard_counts(seq: int) -> TokenCounts:
    """Counts of the seq-th standard record (valid for seq <= 10)."""
    return TokenCounts(
        input_tokens=100 + seq, cached_read_tokens=10 * seq, cached_write_tokens=5, output_tokens=20 + seq
    )


def standard_latency(seq: int) -> Latency:
    """Times of the seq-th standard record."""
    return Latency(queue_wait_ms=10 * seq, ttft_ms=100 + 20 * seq, total_ms=300 + 50 * seq)


def append_standard(ledger: Ledger, seq: int) -> None:
    """Append the seq-th standard record: id chatcmpl-<seq>, caller-a for even seq and caller-b for
    odd, model tiny, status completed, counts `standard_counts(seq)`, prices PRICES, times
    `standard_latency(seq)`."""
    ledger.append(
        record_id=f"chatcmpl-{seq}",
        caller_id="caller-a" if seq % 2 == 0 else "caller-b",
        model="tiny",
        status="completed",
        counts=standard_counts(seq),
        prices=PRICES,
        latency=standard_latency(seq),
    )
