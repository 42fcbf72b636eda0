"""Fixtures for metering tests: fixed keys and ledgers holding the standard records."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ledger_fixtures import EVIDENCE_DIGEST, NODE_SEED, OTHER_SEED, LedgerFactory, StepClock, append_standard

from metering.ledger import Ledger
from metering.signer import NodeSigner


@pytest.fixture
def node_signer() -> NodeSigner:
    return NodeSigner.from_seed(NODE_SEED)


@pytest.fixture
def other_signer() -> NodeSigner:
    return NodeSigner.from_seed(OTHER_SEED)


@pytest.fixture
def make_ledger(tmp_path: Path) -> Iterator[LedgerFactory]:
    """Factory: a ledger in tmp_path/<directory> holding `records` standard records (seq 0 .. n-1),
    timestamped START_MS + 1000 * (seq + 1) (the header takes START_MS), naming EVIDENCE_DIGEST."""
    opened: list[Ledger] = []

    def factory(
        signer: NodeSigner, boot_id: str = "boot-a", records: int = 6, directory: str = "ledger"
    ) -> Ledger:
        ledger = Ledger(tmp_path / directory, signer, boot_id, evidence_digest=EVIDENCE_DIGEST, clock_ms=StepClock())
        opened.append(ledger)
        for seq in range(records):
            append_standard(ledger, seq)
        return ledger

    yield factory
    for ledger in opened:
        ledger.close()
