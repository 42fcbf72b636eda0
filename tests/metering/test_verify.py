"""Offline verification: every tampering of a real ledger file is caught, named, and located.

The standard ledger holds 6 records; line 1 is the header and seq s is on line s + 2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from ledger_fixtures import EVIDENCE_DIGEST, OTHER_EVIDENCE_DIGEST, LedgerFactory

from metering.canonical import canonical_json, parse_canonical
from metering.ledger import Ledger
from metering.merkle import MerkleTree
from metering.pricing import PriceSchedule
from metering.record import ZERO_HASH, Latency, MediaCounts, TokenCounts, UsageRecord
from metering.segment import SegmentFormatError, read_segment
from metering.signer import NodeSigner, SignatureInvalid, signed_payload
from metering.tree_head import TreeHead
from metering.verify import PROBLEM_KINDS, Problem, VerifyReport, verify_ledger, verify_segment


def lines_of(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return data[:-1].split(b"\n")


def write_lines(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def resigned(line: bytes, signer: NodeSigner, **changes: Any) -> bytes:
    """The record line with `changes` applied and signed again by `signer` (an attacker with the key)."""
    obj = {**parse_canonical(line), **changes}
    obj["signature"] = signer.sign(signed_payload(obj)).hex()
    return canonical_json(obj)


def where(report: VerifyReport) -> tuple[str, int | None, int | None, str | None, int]:
    assert report.problem is not None, "verification passed"
    problem = report.problem
    return (problem.kind, problem.line, problem.seq, problem.record_id, report.good_records)


@pytest.fixture
def ledger(make_ledger: LedgerFactory, node_signer: NodeSigner) -> Ledger:
    return make_ledger(node_signer)


def verify(ledger: Ledger, node_signer: NodeSigner, tree_head: Any = None) -> VerifyReport:
    return verify_segment(ledger.path, node_signer.public_key_hex, tree_head)


def test_untouched_segment_verifies(ledger: Ledger, node_signer: NodeSigner) -> None:
    report = verify(ledger, node_signer)
    assert report.ok
    assert report.problem is None
    assert (report.good_records, report.node_key_id) == (6, node_signer.key_id)
    assert report.root_hash_hex == ledger.tree_head().root_hash_hex
    assert report.tree_head_size is None
    assert report.evidence_digest == EVIDENCE_DIGEST


def test_class_writes_verify_beside_records_without_them_and_their_price_is_signed(
    ledger: Ledger, node_signer: NodeSigner
) -> None:
    prices = PriceSchedule(3, 11, 1, 5, cached_write_1h_price_wei=8, cached_write_24h_price_wei=9)
    ledger.append(record_id="msg_1h", caller_id="caller-a", model="tiny", status="completed",
                  counts=TokenCounts(100, 0, 60, 2, cached_write_1h_tokens=40, cached_write_24h_tokens=20),
                  prices=prices, latency=Latency(1, 2, 3))
    report = verify(ledger, node_signer)
    assert (report.ok, report.good_records) == (True, 7)
    lines = lines_of(ledger.path)
    assert b'"cached_write_1h_price_wei":"8"' in lines[-1] and b"cached_write_1h" not in lines[2]
    lines[-1] = lines[-1].replace(b'"cached_write_1h_price_wei":"8"', b'"cached_write_1h_price_wei":"5"')
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer))[:2] == ("bad-signature", 8)


OLD_MEDIA_SEGMENT = Path(__file__).parent / "data" / "ledger-boot-before-media.jsonl"
"""Written by the ledger before records counted media: NODE_SEED's key, EVIDENCE_DIGEST; standard record 0, a record
with 1h and 24h writes, and an image node's record (counts only)."""


def test_a_segment_written_before_media_counts_verifies_and_keeps_its_bytes(node_signer: NodeSigner) -> None:
    report = verify_segment(OLD_MEDIA_SEGMENT, node_signer.public_key_hex)
    assert (report.ok, report.good_records) == (True, 3)
    lines = [line.raw for line in read_segment(OLD_MEDIA_SEGMENT).lines[1:]]
    assert [UsageRecord.from_json(parse_canonical(line)).canonical_bytes() for line in lines] == lines


def test_images_are_verified_at_the_image_price(ledger: Ledger, node_signer: NodeSigner) -> None:
    prices = PriceSchedule(3, 11, 1, 5, image_price_wei=700)
    ledger.append(record_id="img-1", caller_id="caller-a", model="tiny-diffusion", status="completed",
                  counts=TokenCounts(7, 0, 7, 0), prices=prices, latency=Latency(1, 0, 900),
                  media=MediaCounts(conditionings_encoded=1, images=2))
    ledger.append(record_id="chatcmpl-6", caller_id="caller-a", model="tiny", status="completed",
                  counts=TokenCounts(50, 40, 0, 2), prices=prices, latency=Latency(1, 2, 3),
                  media=MediaCounts(attachments_encoded=1, attachments_reused=1))
    assert (verify(ledger, node_signer).ok, verify(ledger, node_signer).good_records) == (True, 8)
    lines = lines_of(ledger.path)
    image = parse_canonical(lines[-2])
    # 7 cached writes * 5 + 2 images * 700
    assert (image["cost_wei"], image["images"], image["image_price_wei"]) == ("1435", 2, "700")
    assert b"image" not in lines[-1] and b'"attachments_encoded":1,"attachments_reused":1' in lines[-1]
    for wrong in ({"cost_wei": "35"}, {"image_price_wei": "0"}, {"images": 3}):
        changed = [*lines[:-2], resigned(lines[-2], node_signer, **wrong), lines[-1]]
        write_lines(ledger.path, changed)
        kind, line, seq, record_id, good = where(verify(ledger, node_signer))
        assert (kind, line, seq, record_id, good) == ("cost-mismatch", 8, 6, "img-1", 6), wrong


def test_empty_segment_verifies(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    report = verify(make_ledger(node_signer, records=0), node_signer)
    assert (report.ok, report.good_records) == (True, 0)


def test_changed_count(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    assert b'"output_tokens":22,' in lines[3]
    lines[3] = lines[3].replace(b'"output_tokens":22,', b'"output_tokens":23,')
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("bad-signature", 4, 2, "chatcmpl-2", 2)
    assert str(report.problem).startswith(
        "line 4, seq 2, record chatcmpl-2: bad-signature: signature does not verify"
    )


def test_deleted_record(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    del lines[3]
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("sequence-gap", 4, 3, "chatcmpl-3", 2)
    assert report.problem is not None
    assert report.problem.detail == "expected seq 2; seq 2 missing (deleted)"


def test_deleted_records_range(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    del lines[2:5]
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("sequence-gap", 3, 4, "chatcmpl-4", 1)
    assert report.problem is not None
    assert report.problem.detail == "expected seq 1; seq 1 to 3 missing (deleted)"


def test_reordered_records(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[3], lines[4] = lines[4], lines[3]
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("reordered", 4, 3, "chatcmpl-3", 2)


def test_duplicated_record(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines.insert(4, lines[3])
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("duplicate", 5, 2, "chatcmpl-2", 3)


def test_truncated_mid_record_is_torn_and_not_accepted(ledger: Ledger, node_signer: NodeSigner) -> None:
    data = ledger.path.read_bytes()
    last_line_start = data.rstrip(b"\n").rfind(b"\n") + 1
    ledger.path.write_bytes(data[: last_line_start + 100])
    report = verify(ledger, node_signer)
    assert where(report) == ("torn-line", 7, 5, None, 5)
    assert report.problem is not None
    assert report.problem.detail == (
        "the final line (100 bytes) is incomplete and is not a record; the 5 records before it verify"
    )
    assert not report.ok


def test_torn_line_followed_by_newline_is_still_torn(ledger: Ledger, node_signer: NodeSigner) -> None:
    data = ledger.path.read_bytes()
    last_line_start = data.rstrip(b"\n").rfind(b"\n") + 1
    ledger.path.write_bytes(data[: last_line_start + 100] + b"\n")
    assert where(verify(ledger, node_signer)) == ("torn-line", 7, 5, None, 5)


def test_complete_last_line_without_newline_is_torn(ledger: Ledger, node_signer: NodeSigner) -> None:
    ledger.path.write_bytes(ledger.path.read_bytes()[:-1])
    assert where(verify(ledger, node_signer)) == ("torn-line", 7, 5, None, 5)


def test_torn_header(ledger: Ledger, node_signer: NodeSigner) -> None:
    ledger.path.write_bytes(ledger.path.read_bytes()[:40])
    assert where(verify(ledger, node_signer)) == ("torn-line", 1, None, None, 0)


def test_swapped_signatures(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    one, two = parse_canonical(lines[2]), parse_canonical(lines[3])
    one["signature"], two["signature"] = two["signature"], one["signature"]
    lines[2], lines[3] = canonical_json(one), canonical_json(two)
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("bad-signature", 3, 1, "chatcmpl-1", 1)


def test_spliced_record_of_another_key(
    ledger: Ledger, make_ledger: LedgerFactory, node_signer: NodeSigner, other_signer: NodeSigner
) -> None:
    foreign = lines_of(make_ledger(other_signer, directory="other").path)
    lines = lines_of(ledger.path)
    lines[4] = foreign[4]  # the other node's seq 3 in place of ours
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("foreign-key", 5, 3, "chatcmpl-3", 3)
    assert report.problem is not None
    assert report.problem.detail == (
        f"record names key '{other_signer.key_id}', not the trusted key {node_signer.key_id}"
    )


def test_inserted_record_of_another_key(
    ledger: Ledger, make_ledger: LedgerFactory, node_signer: NodeSigner, other_signer: NodeSigner
) -> None:
    foreign = lines_of(make_ledger(other_signer, directory="other").path)
    lines = lines_of(ledger.path)
    lines.insert(4, foreign[1])
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("foreign-key", 5, 0, "chatcmpl-0", 3)


def test_record_of_another_key_claiming_ours(
    ledger: Ledger, node_signer: NodeSigner, other_signer: NodeSigner
) -> None:
    lines = lines_of(ledger.path)
    lines[4] = resigned(lines[4], other_signer, model="bigger")
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("bad-signature", 5, 3, "chatcmpl-3", 3)


def test_cost_mismatch_even_when_signed(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    record = parse_canonical(lines[5])
    # seq 4: (104 - 40 - 5) * 3 + 40 * 1 + 5 * 5 + 24 * 11 = 177 + 40 + 25 + 264
    assert record["cost_wei"] == "506"
    lines[5] = resigned(lines[5], node_signer, cost_wei="505")
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("cost-mismatch", 6, 4, "chatcmpl-4", 4)
    assert report.problem is not None
    assert report.problem.detail.startswith("cost_wei is 505 but counts and prices give 506")


def test_changed_time(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    assert b'"ttft_ms":140}' in lines[3]  # seq 2: queue wait 20, first token at 140, end at 400
    lines[3] = lines[3].replace(b'"ttft_ms":140}', b'"ttft_ms":99}')
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("bad-signature", 4, 2, "chatcmpl-2", 2)


def test_times_out_of_order_even_when_signed(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[4] = resigned(lines[4], node_signer, ttft_ms=451)  # seq 3 ends at 450
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("invalid-record", 5, 3, "chatcmpl-3", 3)
    assert report.problem is not None
    assert report.problem.detail.startswith("ttft_ms (451) exceeds total_ms (450)")


def test_first_token_before_the_start_even_when_signed(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[4] = resigned(lines[4], node_signer, ttft_ms=29)  # seq 3 started at 30
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("invalid-record", 5, 3, "chatcmpl-3", 3)
    assert report.problem is not None
    assert report.problem.detail.startswith("ttft_ms (29) is below queue_wait_ms (30)")


def test_record_naming_other_evidence_even_when_signed(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[4] = resigned(lines[4], node_signer, evidence_digest=OTHER_EVIDENCE_DIGEST)
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("evidence-mismatch", 5, 3, "chatcmpl-3", 3)
    assert report.problem is not None
    assert report.problem.detail == f"record names evidence {OTHER_EVIDENCE_DIGEST}, the segment {EVIDENCE_DIGEST}"


def test_invalid_record_even_when_signed(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[4] = resigned(lines[4], node_signer, cached_read_tokens=1000)
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("invalid-record", 5, 3, "chatcmpl-3", 3)


def test_broken_chain(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[5] = resigned(lines[5], node_signer, prev_hash=ZERO_HASH)
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("broken-chain", 6, 4, "chatcmpl-4", 4)


def test_rewritten_record_breaks_the_chain_at_the_next_one(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    # A consistent, validly signed rewrite of seq 3 (no output tokens, so no first token, lower cost).
    # Without output tokens seq 3 costs (103 - 30 - 5) * 3 + 30 * 1 + 5 * 5 = 259.
    lines[4] = resigned(lines[4], node_signer, output_tokens=0, cost_wei="259", ttft_ms=0)
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("broken-chain", 6, 4, "chatcmpl-4", 4)


def test_record_of_another_boot_of_the_same_key(
    ledger: Ledger, make_ledger: LedgerFactory, node_signer: NodeSigner
) -> None:
    other_boot = lines_of(make_ledger(node_signer, boot_id="boot-b", directory="other").path)
    lines = lines_of(ledger.path)
    lines[3] = other_boot[3]
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("boot-mismatch", 4, 2, "chatcmpl-2", 2)


def test_duplicate_record_id(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[4] = resigned(lines[4], node_signer, record_id="chatcmpl-1")
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("duplicate-id", 5, 3, "chatcmpl-1", 3)


def test_garbage_line_in_the_middle(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[3] = b"not json"
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("malformed-line", 4, 2, None, 2)


def test_non_canonical_line(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[3] = json.dumps(parse_canonical(lines[3])).encode()  # same members, spaces after separators
    write_lines(ledger.path, lines)
    report = verify(ledger, node_signer)
    assert where(report) == ("malformed-line", 4, 2, "chatcmpl-2", 2)
    assert report.problem is not None and "not RFC 8785 canonical" in report.problem.detail


def test_wrong_trusted_key(ledger: Ledger, other_signer: NodeSigner, node_signer: NodeSigner) -> None:
    report = verify_segment(ledger.path, other_signer.public_key_hex)
    assert where(report) == ("foreign-key", 1, None, None, 0)
    assert report.evidence_digest is None
    assert report.problem is not None
    assert report.problem.detail == (
        f"segment is signed by key {node_signer.key_id}, not the trusted key {other_signer.key_id}"
    )


def test_tampered_header(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    lines[0] = lines[0].replace(b'"created_ms":1700000000000', b'"created_ms":1700000000001')
    write_lines(ledger.path, lines)
    assert where(verify(ledger, node_signer)) == ("bad-signature", 1, None, None, 0)


def test_malformed_header(ledger: Ledger, node_signer: NodeSigner) -> None:
    lines = lines_of(ledger.path)
    write_lines(ledger.path, lines[1:])  # header deleted: the first record is not a header
    report = verify(ledger, node_signer)
    assert where(report) == ("malformed-header", 1, None, None, 0)


def test_empty_file(ledger: Ledger, node_signer: NodeSigner) -> None:
    ledger.path.write_bytes(b"")
    assert where(verify(ledger, node_signer)) == ("missing-header", 1, None, None, 0)


def test_tree_head_of_a_prefix_matches(ledger: Ledger, node_signer: NodeSigner, tmp_path: Path) -> None:
    head = ledger.tree_head(4)
    assert verify(ledger, node_signer, head).ok
    assert verify(ledger, node_signer, head.to_json()).ok
    path = tmp_path / "head.json"
    path.write_text(json.dumps(head.to_json(), indent=2))
    report = verify(ledger, node_signer, path)
    assert (report.ok, report.tree_head_size) == (True, 4)


def test_deleting_the_last_record_needs_a_tree_head_to_be_seen(
    ledger: Ledger, node_signer: NodeSigner
) -> None:
    head = ledger.tree_head()
    write_lines(ledger.path, lines_of(ledger.path)[:-1])
    assert verify(ledger, node_signer).ok  # a shorter segment is self-consistent
    report = verify(ledger, node_signer, head)
    assert where(report) == ("missing-records", None, 5, None, 5)
    assert report.problem is not None
    assert str(report.problem) == (
        "seq 5: missing-records: the tree head covers 6 records, the segment has 5: "
        "records were deleted from the end"
    )


def test_consistent_rewrite_is_caught_by_an_earlier_tree_head(
    ledger: Ledger, node_signer: NodeSigner
) -> None:
    head = ledger.tree_head()
    lines = lines_of(ledger.path)
    # The key holder rewrites seq 3 and re-chains everything after it: the segment verifies on its own.
    # Without output tokens seq 3 costs (103 - 30 - 5) * 3 + 30 * 1 + 5 * 5 = 259.
    lines[4] = resigned(lines[4], node_signer, output_tokens=0, cost_wei="259", ttft_ms=0)
    for index in range(5, len(lines)):
        lines[index] = resigned(
            lines[index], node_signer, prev_hash=hashlib.sha256(lines[index - 1]).hexdigest()
        )
    write_lines(ledger.path, lines)
    assert verify(ledger, node_signer).ok
    report = verify(ledger, node_signer, head)
    assert where(report) == ("root-mismatch", None, None, None, 6)


def test_tree_head_of_another_key(ledger: Ledger, node_signer: NodeSigner, other_signer: NodeSigner) -> None:
    head = TreeHead.sign(other_signer, 6, ledger.tree_head().root_hash, 1, EVIDENCE_DIGEST)
    report = verify(ledger, node_signer, head)
    assert where(report) == ("bad-tree-head", None, None, None, 6)
    assert report.problem is not None
    assert report.problem.detail == (
        f"tree head names key {other_signer.key_id}, not the node key {node_signer.key_id}"
    )


def test_tree_head_naming_other_evidence(ledger: Ledger, node_signer: NodeSigner) -> None:
    head = TreeHead.sign(node_signer, 6, ledger.tree_head().root_hash, 1, OTHER_EVIDENCE_DIGEST)
    report = verify(ledger, node_signer, head)
    assert where(report) == ("bad-tree-head", None, None, None, 6)
    assert report.problem is not None
    assert report.problem.detail == (
        f"tree head names evidence {OTHER_EVIDENCE_DIGEST}, the segment {EVIDENCE_DIGEST}"
    )


def test_tree_head_with_forged_size(ledger: Ledger, node_signer: NodeSigner) -> None:
    head = ledger.tree_head(6).to_json()
    head["size"] = 5
    assert where(verify(ledger, node_signer, head)) == ("bad-tree-head", None, None, None, 6)


def test_bad_trusted_key_is_an_error_not_a_report(ledger: Ledger) -> None:
    with pytest.raises(SignatureInvalid, match="64 hex characters"):
        verify_segment(ledger.path, "abc")


def test_problem_kinds_are_documented() -> None:
    assert len(PROBLEM_KINDS) == len(set(PROBLEM_KINDS)) == 18
    assert str(Problem("root-mismatch", None, None, None, "x")) == "tree head: root-mismatch: x"


@pytest.fixture
def two_starts(make_ledger: LedgerFactory, node_signer: NodeSigner, other_signer: NodeSigner) -> Path:
    """A ledger directory with the segments of two node starts, each with its own key: boot-a (6 records,
    NODE_SEED) and boot-b (2 records, OTHER_SEED)."""
    first = make_ledger(node_signer, boot_id="boot-a")
    make_ledger(other_signer, boot_id="boot-b", records=2)
    return first.path.parent


def test_ledger_segments_verify_each_under_its_own_key(
    two_starts: Path, node_signer: NodeSigner, other_signer: NodeSigner
) -> None:
    reports = verify_ledger(two_starts)
    assert [(r.path.name, r.ok, r.good_records, r.node_key_id, r.evidence_digest) for r in reports] == [
        ("ledger-boot-a.jsonl", True, 6, node_signer.key_id, EVIDENCE_DIGEST),
        ("ledger-boot-b.jsonl", True, 2, other_signer.key_id, EVIDENCE_DIGEST),
    ]
    assert verify_ledger(two_starts, [node_signer.public_key_hex, other_signer.public_key_hex.upper()]) == reports
    assert verify_ledger(two_starts / "ledger-boot-b.jsonl") == reports[1:]


def test_ledger_segment_of_an_untrusted_key(
    two_starts: Path, node_signer: NodeSigner, other_signer: NodeSigner
) -> None:
    first, second = verify_ledger(two_starts, [node_signer.public_key_hex])
    assert first.ok
    assert where(second) == ("foreign-key", 1, None, None, 0)
    assert second.problem is not None
    assert second.problem.detail == (
        f"segment is signed by key {other_signer.key_id}, which is not a trusted key ({node_signer.key_id})"
    )
    assert (second.node_key_id, second.root_hash_hex, second.evidence_digest) == (
        other_signer.key_id,
        MerkleTree().root().hex(),
        None,
    )


def test_ledger_segment_problems_are_reported_per_segment(two_starts: Path, node_signer: NodeSigner) -> None:
    segment = two_starts / "ledger-boot-b.jsonl"
    lines = lines_of(segment)
    del lines[1]
    write_lines(segment, lines)
    first, second = verify_ledger(two_starts)
    assert first.ok
    assert where(second) == ("sequence-gap", 2, 1, "chatcmpl-1", 0)


def test_ledger_with_an_unreadable_header_or_trusted_key_is_an_error(
    two_starts: Path, node_signer: NodeSigner
) -> None:
    with pytest.raises(SignatureInvalid, match="public key must be 64 hex characters, got 'xyz'"):
        verify_ledger(two_starts, ["xyz"])
    (two_starts / "ledger-boot-c.jsonl").write_bytes(b"")
    with pytest.raises(SegmentFormatError, match="ledger-boot-c.jsonl has no complete header line"):
        verify_ledger(two_starts)
