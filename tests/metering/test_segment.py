"""Segment files: splitting into lines, torn tails, headers, and reading records without verifying."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_fixtures import EVIDENCE_DIGEST, START_MS, LedgerFactory, StepClock, append_standard, standard_counts

from metering.canonical import canonical_json, parse_canonical
from metering.ledger import Ledger
from metering.segment import (
    SegmentFormatError,
    SegmentHeader,
    SegmentLine,
    read_header,
    read_records,
    read_segment,
    segment_files,
)
from metering.signer import NodeSigner
from metering.verify import verify_segment


def test_read_segment_splits_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"a":1}\n{"b":2}\n')
    contents = read_segment(path)
    assert contents.lines == (SegmentLine(1, b'{"a":1}'), SegmentLine(2, b'{"b":2}'))
    assert contents.torn_tail is None


@pytest.mark.parametrize(
    ("data", "torn"),
    [
        (b'{"a":1}\n{"b":', SegmentLine(2, b'{"b":')),  # no newline
        (b'{"a":1}\n{"b":2}', SegmentLine(2, b'{"b":2}')),  # complete JSON, but the newline never landed
        (b'{"a":1}\n{"b":\n', SegmentLine(2, b'{"b":')),  # newline after a cut record
    ],
)
def test_final_interrupted_line_is_torn(tmp_path: Path, data: bytes, torn: SegmentLine) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(data)
    contents = read_segment(path)
    assert contents.lines == (SegmentLine(1, b'{"a":1}'),)
    assert contents.torn_tail == torn


def test_invalid_line_in_the_middle_is_not_torn(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"a":\n{"b":2}\n')
    assert read_segment(path).torn_tail is None


def test_read_records_skips_the_torn_tail(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=3)
    ledger.path.write_bytes(ledger.path.read_bytes()[:-20])
    header, records = read_records(ledger.path)
    assert header == ledger.header
    assert [(record.seq, record.counts) for record in records] == [
        (0, standard_counts(0)),
        (1, standard_counts(1)),
    ]


def test_read_records_rejects_a_bad_middle_line(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=3)
    lines = ledger.path.read_bytes().split(b"\n")
    lines[2] = b'{"seq":1}'
    ledger.path.write_bytes(b"\n".join(lines))
    with pytest.raises(SegmentFormatError, match=r"ledger-boot-a.jsonl line 3: usage record members differ"):
        read_records(ledger.path)


def test_read_records_needs_a_header(tmp_path: Path) -> None:
    path = tmp_path / "ledger-x.jsonl"
    path.write_bytes(b"")
    with pytest.raises(SegmentFormatError, match="has no complete header line"):
        read_records(path)
    path.write_bytes(b'{"format":"tenzro-ledger-segment/2"}\n')
    with pytest.raises(SegmentFormatError, match="line 1: a segment header is a JSON object with exactly"):
        read_records(path)


def test_another_format_is_named_before_its_members(tmp_path: Path) -> None:
    path = tmp_path / "ledger-x.jsonl"
    # A format 1 header: no evidence_digest.
    path.write_bytes(
        b'{"boot_id":"x","created_ms":1,"format":"tenzro-ledger-segment/1","node_key_id":"k","public_key":"p",'
        b'"signature":"s"}\n'
    )
    message = "line 1: segment format is 'tenzro-ledger-segment/1'; this reader knows 'tenzro-ledger-segment/2'"
    with pytest.raises(SegmentFormatError, match=message):
        read_header(path)


def test_read_header_names_the_evidence(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=2)
    header = read_header(ledger.path)
    assert header == ledger.header
    assert (header.evidence_digest, header.public_key) == (EVIDENCE_DIGEST, node_signer.public_key_hex)


def test_header_checks_its_key_id(node_signer: NodeSigner, other_signer: NodeSigner) -> None:
    header = SegmentHeader.create(node_signer, "b1", 5, EVIDENCE_DIGEST)
    obj = {**header.to_json(), "node_key_id": other_signer.key_id}
    with pytest.raises(SegmentFormatError, match="node_key_id is not the key id of its public_key"):
        SegmentHeader.from_json(obj)
    with pytest.raises(SegmentFormatError, match="segment format is 'v0'"):
        SegmentHeader.from_json({**header.to_json(), "format": "v0"})
    with pytest.raises(SegmentFormatError, match="invalid segment header: evidence_digest must be 64 lowercase hex"):
        SegmentHeader.from_json({**header.to_json(), "evidence_digest": "xyz"})


def test_segment_files_of_a_directory_or_a_file(tmp_path: Path) -> None:
    for name in ("ledger-b.jsonl", "ledger-a.jsonl", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [path.name for path in segment_files(tmp_path)] == ["ledger-a.jsonl", "ledger-b.jsonl"]
    assert segment_files(tmp_path / "notes.txt") == [tmp_path / "notes.txt"]
    with pytest.raises(SegmentFormatError, match="does not exist"):
        segment_files(tmp_path / "missing.jsonl")


CODE_DIGEST = "c0" * 32
MODEL_DIGESTS = {"tiny": "a1" * 32, "other": "a2" * 32}
OLD_SEGMENT = Path(__file__).parent / "data" / "ledger-boot-before-identity.jsonl"
"""Written by the ledger before headers could name code and models: NODE_SEED's key, EVIDENCE_DIGEST, three
standard records."""


def test_a_header_names_the_code_and_models_it_signs(tmp_path: Path, node_signer: NodeSigner) -> None:
    ledger = Ledger(tmp_path, node_signer, "boot-s", evidence_digest=EVIDENCE_DIGEST, clock_ms=StepClock(),
                    code_digest=CODE_DIGEST, model_digests=MODEL_DIGESTS)
    append_standard(ledger, 0)
    ledger.close()
    header = read_header(ledger.path)
    assert (header.code_digest, header.model_digests) == (CODE_DIGEST, (("other", "a2" * 32), ("tiny", "a1" * 32)))
    assert parse_canonical(read_segment(ledger.path).lines[0].raw) == {
        "format": "tenzro-ledger-segment/2", "boot_id": "boot-s", "created_ms": START_MS,
        "node_key_id": node_signer.key_id, "public_key": node_signer.public_key_hex,
        "evidence_digest": EVIDENCE_DIGEST, "code_digest": CODE_DIGEST, "model_digests": MODEL_DIGESTS,
        "signature": header.signature}
    report = verify_segment(ledger.path, node_signer.public_key_hex)
    assert (report.ok, report.good_records, report.header) == (True, 1, header)


@pytest.mark.parametrize(("member", "value"), [("code_digest", "c1" * 32), ("model_digests", {"tiny": "a3" * 32})])
def test_a_changed_code_or_model_digest_breaks_the_header_signature(tmp_path: Path, node_signer: NodeSigner,
                                                                    member: str, value: object) -> None:
    ledger = Ledger(tmp_path, node_signer, "boot-s", evidence_digest=EVIDENCE_DIGEST, code_digest=CODE_DIGEST,
                    model_digests={"tiny": "a1" * 32})
    ledger.close()
    header = parse_canonical(read_segment(ledger.path).lines[0].raw)
    ledger.path.write_bytes(canonical_json({**header, member: value}) + b"\n")
    problem = verify_segment(ledger.path, node_signer.public_key_hex).problem
    assert problem is not None and (problem.kind, problem.line) == ("bad-signature", 1)


def test_a_segment_written_before_code_and_model_digests_still_verifies(node_signer: NodeSigner) -> None:
    report = verify_segment(OLD_SEGMENT, node_signer.public_key_hex)
    assert (report.ok, report.good_records) == (True, 3)
    assert report.header is not None
    assert (report.header.code_digest, report.header.model_digests) == (None, None)
    assert "code_digest" not in report.header.to_json() and "model_digests" not in report.header.to_json()
    assert report.header.canonical_bytes() == read_segment(OLD_SEGMENT).lines[0].raw


@pytest.mark.parametrize(("member", "value", "message"), [
    ("code_digest", "C0" * 32, "code_digest must be 64 lowercase hex characters"),
    ("code_digest", None, "code_digest is null; leave it out instead"),
    ("model_digests", {}, "model_digests must name at least one model"),
    ("model_digests", [["tiny", "a1" * 32]], "model_digests must be an object of model id to digest"),
    ("model_digests", {"": "a1" * 32}, "a model id must be a non-empty string"),
    ("model_digests", {"tiny": "a1"}, r"model_digests\['tiny'\] must be 64 lowercase hex characters"),
    ("tls", "x", "with exactly format, boot_id, created_ms, node_key_id, public_key, evidence_digest, signature, "
                 "and optionally code_digest, model_digests"),
])
def test_malformed_code_and_model_members_are_refused(node_signer: NodeSigner, member: str, value: object,
                                                      message: str) -> None:
    header = SegmentHeader.create(node_signer, "b1", 5, EVIDENCE_DIGEST, code_digest=CODE_DIGEST,
                                  model_digests=MODEL_DIGESTS).to_json()
    with pytest.raises(SegmentFormatError, match=message):
        SegmentHeader.from_json({**header, member: value})


def test_a_malformed_digest_leaves_no_segment_behind(tmp_path: Path, node_signer: NodeSigner) -> None:
    with pytest.raises(SegmentFormatError, match="code_digest must be 64 lowercase hex characters"):
        Ledger(tmp_path, node_signer, "boot-s", evidence_digest=EVIDENCE_DIGEST, code_digest="abc")
    assert list(tmp_path.iterdir()) == []
