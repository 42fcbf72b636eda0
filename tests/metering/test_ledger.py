"""The ledger writer: segment layout on disk, seq and hash chain, lookups, proofs, threads, failures."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
from ledger_fixtures import (
    EVIDENCE_DIGEST,
    PRICES,
    START_MS,
    LedgerFactory,
    StepClock,
    append_standard,
    standard_counts,
    standard_latency,
)

from metering.canonical import parse_canonical
from metering.ledger import Ledger, LedgerError
from metering.merkle import MerkleTree, verify_consistency
from metering.record import ZERO_HASH, Latency, RecordError, TokenCounts, UsageRecord
from metering.segment import SEGMENT_FORMAT, SegmentHeader, read_records, segment_files, segment_path
from metering.signer import NodeSigner, verify_signed_object
from metering.tree_head import TreeHeadError
from metering.verify import verify_segment


def file_lines(ledger: Ledger) -> list[bytes]:
    data = ledger.path.read_bytes()
    assert data.endswith(b"\n")
    return data[:-1].split(b"\n")


def test_segment_file_is_named_after_the_boot(
    make_ledger: LedgerFactory, node_signer: NodeSigner, tmp_path: Path
) -> None:
    ledger = make_ledger(node_signer, boot_id="3f2a", records=0)
    assert ledger.path == tmp_path / "ledger" / "ledger-3f2a.jsonl"
    assert segment_path(tmp_path / "ledger", "3f2a") == ledger.path
    assert oct(ledger.path.stat().st_mode & 0o777) == "0o600"


def test_header_line_names_boot_and_key(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=0)
    header_line = file_lines(ledger)[0]
    assert header_line == (
        b'{"boot_id":"boot-a","created_ms":1700000000000,"evidence_digest":"' + EVIDENCE_DIGEST.encode() + b'",'
        b'"format":"tenzro-ledger-segment/2","node_key_id":"56475aa75463474c",'
        b'"public_key":"' + node_signer.public_key_hex.encode() + b'",'
        b'"signature":"' + ledger.header.signature.encode() + b'"}'
    )
    header = SegmentHeader.from_json(parse_canonical(header_line))
    assert header.format == SEGMENT_FORMAT
    verify_signed_object(node_signer.public_key_hex, header.to_json())


def test_records_are_numbered_chained_and_written_one_per_line(
    make_ledger: LedgerFactory, node_signer: NodeSigner
) -> None:
    ledger = make_ledger(node_signer, records=4)
    lines = file_lines(ledger)
    assert len(lines) == 5
    records = [UsageRecord.from_json(parse_canonical(line)) for line in lines[1:]]
    assert [record.seq for record in records] == [0, 1, 2, 3]
    assert [record.timestamp_ms for record in records] == [START_MS + 1000 * (seq + 1) for seq in range(4)]
    assert records[0].prev_hash == ZERO_HASH
    for seq in range(1, 4):
        assert records[seq].prev_hash == hashlib.sha256(lines[seq]).hexdigest()
        assert records[seq].prev_hash == records[seq - 1].entry_hash()
    for record in records:
        verify_signed_object(node_signer.public_key_hex, record.to_json())
    assert [record.latency for record in records] == [standard_latency(seq) for seq in range(4)]
    assert {record.evidence_digest for record in records} == {EVIDENCE_DIGEST}
    assert records == ledger.records_since(0)


def test_append_returns_the_record_as_written(tmp_path: Path, node_signer: NodeSigner) -> None:
    with Ledger(tmp_path, node_signer, "b1", evidence_digest=EVIDENCE_DIGEST, clock_ms=StepClock()) as ledger:
        record = ledger.append(
            record_id="chatcmpl-x",
            caller_id="caller-a",
            model="tiny",
            status="cancelled",
            counts=TokenCounts(
                input_tokens=105, cached_read_tokens=50, cached_write_tokens=5, output_tokens=25
            ),
            prices=PRICES,
            latency=Latency(queue_wait_ms=3, ttft_ms=41, total_ms=260),
        )
    assert (record.seq, record.status, record.cost_wei) == (0, "cancelled", 500)
    assert (record.queue_wait_ms, record.ttft_ms, record.total_ms) == (3, 41, 260)
    assert record.evidence_digest == EVIDENCE_DIGEST
    assert record.timestamp_ms == START_MS + 1000
    assert record.node_key_id == node_signer.key_id and record.boot_id == "b1"
    assert ledger.path.read_bytes().split(b"\n")[1] == record.canonical_bytes()


def test_lookup_by_record_id_and_since(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=5)
    record = ledger.get("chatcmpl-3")
    assert record is not None
    assert (record.seq, record.caller_id, record.counts) == (3, "caller-b", standard_counts(3))
    assert ledger.get("chatcmpl-99") is None
    assert [r.seq for r in ledger.records_since(3)] == [3, 4]
    assert ledger.records_since(5) == []
    assert len(ledger) == 5
    with pytest.raises(LedgerError, match="seq must be non-negative"):
        ledger.records_since(-1)


def test_duplicate_record_id_is_refused_and_nothing_is_written(
    make_ledger: LedgerFactory, node_signer: NodeSigner
) -> None:
    ledger = make_ledger(node_signer, records=2)
    size = ledger.path.stat().st_size
    with pytest.raises(LedgerError, match="record 'chatcmpl-1' is already in the ledger"):
        append_standard(ledger, 1)
    assert ledger.path.stat().st_size == size
    assert len(ledger) == 2


def test_invalid_fields_are_refused_before_writing(
    make_ledger: LedgerFactory, node_signer: NodeSigner
) -> None:
    ledger = make_ledger(node_signer, records=1)
    with pytest.raises(RecordError, match="status must be one of completed, failed, cancelled, got 'ok'"):
        ledger.append(
            record_id="r",
            caller_id="c",
            model="m",
            status="ok",  # type: ignore[arg-type]
            counts=standard_counts(0),
            prices=PRICES,
            latency=standard_latency(0),
        )
    assert len(ledger) == 1 and len(file_lines(ledger)) == 2


def test_each_start_needs_a_new_segment(tmp_path: Path, node_signer: NodeSigner) -> None:
    Ledger(tmp_path, node_signer, "b1", evidence_digest=EVIDENCE_DIGEST).close()
    with pytest.raises(
        LedgerError, match="ledger-b1.jsonl already exists; every node start needs a new boot_id"
    ):
        Ledger(tmp_path, node_signer, "b1", evidence_digest=EVIDENCE_DIGEST)
    Ledger(tmp_path, node_signer, "b2", evidence_digest=EVIDENCE_DIGEST).close()
    assert [path.name for path in segment_files(tmp_path)] == ["ledger-b1.jsonl", "ledger-b2.jsonl"]


def test_boot_id_must_be_safe_in_a_file_name(tmp_path: Path, node_signer: NodeSigner) -> None:
    with pytest.raises(ValueError, match="boot_id must be 1-64 characters"):
        Ledger(tmp_path, node_signer, "../escape", evidence_digest=EVIDENCE_DIGEST)


def test_malformed_evidence_digest_is_refused_before_a_segment_exists(
    tmp_path: Path, node_signer: NodeSigner
) -> None:
    with pytest.raises(RecordError, match="evidence_digest must be 64 lowercase hex characters"):
        Ledger(tmp_path / "ledger", node_signer, "b1", evidence_digest="E1" * 32)
    assert not (tmp_path / "ledger").exists()


def test_tree_head_and_proofs_match_the_lines(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=6)
    tree = MerkleTree.from_leaves(file_lines(ledger)[1:])
    head = ledger.tree_head()
    assert (head.size, head.root_hash_hex, head.key_id, head.evidence_digest) == (
        6, tree.root().hex(), node_signer.key_id, EVIDENCE_DIGEST
    )
    head.verify(node_signer.public_key_hex)

    proof = ledger.inclusion_proof("chatcmpl-4")
    assert (proof.record_id, proof.leaf_index, proof.tree_size) == ("chatcmpl-4", 4, 6)
    assert list(proof.audit_path) == [node.hex() for node in tree.inclusion_proof(4)]
    record = ledger.get("chatcmpl-4")
    assert record is not None
    proof.verify(record, head, node_signer.public_key_hex)
    with pytest.raises(TreeHeadError, match="not chatcmpl-3 at 3"):
        other = ledger.get("chatcmpl-3")
        assert other is not None
        proof.verify(other, head, node_signer.public_key_hex)

    old_head = ledger.tree_head(3)
    assert old_head.root_hash_hex == tree.root(3).hex()
    consistency = ledger.consistency_proof(3)
    assert (consistency.old_size, consistency.new_size) == (3, 6)
    consistency.verify(old_head, head, node_signer.public_key_hex)
    verify_consistency(3, 6, old_head.root_hash, head.root_hash, [bytes.fromhex(h) for h in consistency.path])


def test_proof_requests_out_of_range(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=3)
    with pytest.raises(LedgerError, match="record 'nope' is not in this segment"):
        ledger.inclusion_proof("nope")
    with pytest.raises(LedgerError, match="has seq 2, beyond a tree of 2"):
        ledger.inclusion_proof("chatcmpl-2", tree_size=2)
    with pytest.raises(LedgerError, match=r"tree size 4 is outside 0..3"):
        ledger.tree_head(4)
    with pytest.raises(LedgerError, match="old size 4 must be between 0 and 3"):
        ledger.consistency_proof(4)


def test_tree_head_of_an_empty_segment(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    head = make_ledger(node_signer, records=0).tree_head()
    assert (head.size, head.root_hash_hex) == (0, hashlib.sha256(b"").hexdigest())


def test_concurrent_appends_keep_seq_and_chain_continuous(tmp_path: Path, node_signer: NodeSigner) -> None:
    ledger = Ledger(tmp_path, node_signer, "threads", evidence_digest=EVIDENCE_DIGEST)
    threads_count, per_thread = 8, 40
    barrier = threading.Barrier(threads_count)

    def worker(thread: int) -> None:
        barrier.wait()
        for index in range(per_thread):
            ledger.append(
                record_id=f"t{thread}-{index}",
                caller_id=f"caller-{thread}",
                model="tiny",
                status="completed",
                counts=TokenCounts(10, 2, 3, 4),
                prices=PRICES,
                latency=Latency(queue_wait_ms=1, ttft_ms=2, total_ms=3),
            )

    threads = [threading.Thread(target=worker, args=(thread,)) for thread in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.close()
    header, records = read_records(ledger.path)
    assert [record.seq for record in records] == list(range(threads_count * per_thread))
    assert len({record.record_id for record in records}) == threads_count * per_thread
    report = verify_segment(ledger.path, node_signer.public_key_hex)
    assert (report.ok, report.good_records) == (True, 320)


def test_failed_fsync_rolls_back_the_line(
    make_ledger: LedgerFactory, node_signer: NodeSigner, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = make_ledger(node_signer, records=2)
    before = ledger.path.read_bytes()

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("metering.ledger.os.fsync", failing_fsync)
    with pytest.raises(LedgerError, match="writing to .* failed: \\[Errno 5\\] Input/output error"):
        append_standard(ledger, 2)
    assert ledger.path.read_bytes() == before  # truncated back; the fsync of the truncation failed too
    assert len(ledger) == 2
    with pytest.raises(LedgerError, match="could not be truncated .*restart the node to open a new segment"):
        append_standard(ledger, 2)


def test_failed_write_is_truncated_and_the_ledger_continues(
    make_ledger: LedgerFactory, node_signer: NodeSigner, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = make_ledger(node_signer, records=2)
    real_write = os.write
    calls = {"count": 0}

    def half_write_then_fail(fd: int, data: bytes) -> int:
        calls["count"] += 1
        if calls["count"] == 1:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("metering.ledger.os.write", half_write_then_fail)
    with pytest.raises(LedgerError, match="No space left on device"):
        append_standard(ledger, 2)
    monkeypatch.setattr("metering.ledger.os.write", real_write)
    assert len(file_lines(ledger)) == 3  # the half line is gone
    append_standard(ledger, 2)
    assert [record.seq for record in read_records(ledger.path)[1]] == [0, 1, 2]
    assert verify_segment(ledger.path, node_signer.public_key_hex).ok


def test_closed_ledger_refuses_appends(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=1)
    ledger.close()
    with pytest.raises(LedgerError, match="is closed"):
        append_standard(ledger, 1)
    ledger.close()  # idempotent
