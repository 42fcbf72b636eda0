"""Segment files: splitting into lines, torn tails, headers, and reading records without verifying."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_fixtures import EVIDENCE_DIGEST, LedgerFactory, standard_counts

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
