"""Offline verification of a ledger segment against the node public key an auditor trusts.

Checks, record by record in file order: canonical form, signing key, signature, field validity (service
times included) and cost arithmetic, boot id, attestation evidence digest, sequence continuity, hash chain
and unique record ids. Verification stops at the first problem and names it with a kind, the line, and
the record's seq and id, so a report reads "line 19, seq 17, record chatcmpl-abc: broken-chain: ...".
Records before it count as good.

Deleting records from the end of a segment leaves a valid shorter segment; only a signed tree head
the auditor kept from earlier can reveal it, which is why `tree_head` is accepted here.

`verify_ledger` checks every segment of a ledger directory, one per node start, each under its own key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metering.canonical import CanonicalJsonError, parse_canonical
from metering.merkle import MerkleTree, leaf_hash
from metering.record import ZERO_HASH, CostMismatch, RecordError, UsageRecord
from metering.segment import (
    SegmentContents,
    SegmentFormatError,
    SegmentHeader,
    header_of,
    parse_header,
    read_segment,
    segment_files,
)
from metering.signer import SignatureInvalid, key_id_for, public_key_from_hex, verify_signed_object
from metering.tree_head import TreeHead, TreeHeadError, load_tree_head

PROBLEM_KINDS: tuple[str, ...] = (
    "missing-header",  # the file is empty
    "malformed-header",  # line 1 is not a valid segment header
    "malformed-line",  # a line is not canonical JSON of a record
    "foreign-key",  # the header or a record names a key other than the trusted one
    "bad-signature",  # the signature does not verify under the trusted key
    "invalid-record",  # signed, but a field is out of range (e.g. cached > input)
    "cost-mismatch",  # signed, but cost_wei differs from counts (tokens and images) x prices
    "boot-mismatch",  # a record of another node start (segment) was spliced in
    "evidence-mismatch",  # signed, but a record names other attestation evidence than its segment
    "duplicate",  # a seq that was already seen appears again
    "reordered",  # a later seq appears before an earlier one that is still in the file
    "sequence-gap",  # seqs are missing: records were deleted
    "broken-chain",  # prev_hash is not the hash of the previous line
    "duplicate-id",  # two records share one record id
    "torn-line",  # the final line is incomplete: an interrupted write, never a record
    "bad-tree-head",  # the tree head is not signed by the trusted key
    "missing-records",  # the tree head covers more records than the segment holds
    "root-mismatch",  # the Merkle root of the first `size` records differs from the tree head's
)


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str  # one of PROBLEM_KINDS
    line: int | None  # 1-based line in the segment file; None for tree-head problems
    seq: int | None  # the seq the offending line claims, or the expected one when it has none
    record_id: str | None
    detail: str

    def __str__(self) -> str:
        where = []
        if self.line is not None:
            where.append(f"line {self.line}")
        if self.seq is not None:
            where.append(f"seq {self.seq}")
        if self.record_id is not None:
            where.append(f"record {self.record_id}")
        return f"{', '.join(where) or 'tree head'}: {self.kind}: {self.detail}"


@dataclass(frozen=True, slots=True)
class VerifyReport:
    path: Path
    node_key_id: str  # key id of the trusted public key
    good_records: int  # records that passed every check, all before `problem`
    root_hash_hex: str  # Merkle root over the good records
    problem: Problem | None  # the first problem found
    tree_head_size: int | None  # size of the tree head checked, if one was given
    header: SegmentHeader | None  # the verified header (its key, boot and evidence); None when it did not verify

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def evidence_digest(self) -> str | None:
        """What the verified header names; None when it did not verify."""
        return None if self.header is None else self.header.evidence_digest


def verify_segment(
    path: str | os.PathLike[str],
    public_key_hex: str,
    tree_head: TreeHead | Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Verify a segment file; `tree_head` is a `TreeHead`, its JSON object, or a JSON file path."""
    return _verify_contents(read_segment(path), public_key_hex, _as_tree_head(tree_head))


def _verify_contents(contents: SegmentContents, public_key_hex: str, head: TreeHead | None) -> VerifyReport:
    key_id = key_id_for(public_key_from_hex(public_key_hex))
    check = _SegmentCheck(contents, public_key_hex, key_id)
    problem = check.run()
    if problem is None and head is not None:
        problem = check.check_tree_head(head)
    return VerifyReport(
        path=contents.path,
        node_key_id=key_id,
        good_records=len(check.tree),
        root_hash_hex=check.tree.root().hex(),
        problem=problem,
        tree_head_size=None if head is None else head.size,
        header=check.header,
    )


def verify_ledger(
    path: str | os.PathLike[str], trusted_keys: Collection[str] = ()
) -> tuple[VerifyReport, ...]:
    """Verify each segment of a ledger (a segment file, or a directory holding one per node start).

    Each node start signs with its own key, so each segment is verified under the key its header names.
    With `trusted_keys` (public keys, 64 hex) that key must be one of them. Without, a report proves the
    segment whole and signed by its own key; that the key is the node's comes from the attestation evidence
    the report names. Raises SegmentFormatError for a segment whose header cannot be read, SignatureInvalid
    for a malformed trusted key.
    """
    trusted = {public_key_from_hex(key) for key in trusted_keys}
    reports = []
    for segment in segment_files(path):
        contents = read_segment(segment)  # once: the header names the key the whole segment is checked under
        header = header_of(contents)
        if trusted and bytes.fromhex(header.public_key) not in trusted:
            known = ", ".join(sorted(key_id_for(key) for key in trusted))
            detail = f"segment is signed by key {header.node_key_id}, which is not a trusted key ({known})"
            reports.append(
                VerifyReport(
                    path=segment,
                    node_key_id=header.node_key_id,
                    good_records=0,
                    root_hash_hex=MerkleTree().root().hex(),
                    problem=Problem("foreign-key", 1, None, None, detail),
                    tree_head_size=None,
                    header=None,
                )
            )
        else:
            reports.append(_verify_contents(contents, header.public_key, None))
    return tuple(reports)


def _as_tree_head(value: TreeHead | Mapping[str, Any] | str | os.PathLike[str] | None) -> TreeHead | None:
    if value is None or isinstance(value, TreeHead):
        return value
    if isinstance(value, Mapping):
        return TreeHead.from_json(value)
    return load_tree_head(value)


_Finding = tuple[str, str]
"""(kind, detail) of a problem in one record line; `run` adds where it is."""


class _SegmentCheck:
    """State of one pass over a segment: the good prefix so far."""

    def __init__(self, contents: SegmentContents, public_key_hex: str, key_id: str) -> None:
        self.contents = contents
        self.public_key_hex = public_key_hex
        self.key_id = key_id
        self.tree = MerkleTree()
        self.prev_hash = ZERO_HASH
        self.record_ids: set[str] = set()
        self.header: SegmentHeader | None = None  # set once the header verified

    def run(self) -> Problem | None:
        lines = self.contents.lines
        torn = self.contents.torn_tail
        if not lines:
            if torn is not None:
                return Problem(
                    "torn-line", torn.number, None, None, "the segment header itself is incomplete"
                )
            return Problem(
                "missing-header", 1, None, None, "the file is empty; a segment starts with a header"
            )
        header_problem, header = self.check_header()
        if header_problem is not None:
            return header_problem
        assert header is not None
        claimed = [_claimed(line.raw) for line in lines[1:]]
        # Last position claiming each seq: tells a reordering (the expected seq comes later) from a gap.
        last_position = {seq: index for index, (seq, _) in enumerate(claimed) if seq is not None}
        for index, line in enumerate(lines[1:]):
            expected = len(self.tree)
            seq, record_id = claimed[index]
            problem = self.check_record(line.raw, header, last_position.get(expected, -1) > index)
            if problem is not None:
                kind, detail = problem
                return Problem(kind, line.number, expected if seq is None else seq, record_id, detail)
        if torn is not None:
            return Problem(
                "torn-line",
                torn.number,
                len(self.tree),
                None,
                f"the final line ({len(torn.raw)} bytes) is incomplete and is not a record; "
                f"the {len(self.tree)} records before it verify",
            )
        return None

    def check_header(self) -> tuple[Problem | None, SegmentHeader | None]:
        try:
            header = parse_header(self.contents.lines[0], self.contents.path)
        except SegmentFormatError as exc:
            return Problem("malformed-header", 1, None, None, str(exc)), None
        if header.public_key != self.public_key_hex.lower():
            detail = f"segment is signed by key {header.node_key_id}, not the trusted key {self.key_id}"
            return Problem("foreign-key", 1, None, None, detail), None
        try:
            verify_signed_object(self.public_key_hex, header.to_json())
        except SignatureInvalid as exc:
            return Problem("bad-signature", 1, None, None, f"segment header: {exc}"), None
        self.header = header
        return None, header

    def check_record(self, raw: bytes, header: SegmentHeader, expected_comes_later: bool) -> _Finding | None:
        """Check one record line; on success extend the good prefix, else return (kind, detail)."""
        expected = len(self.tree)
        try:
            obj = parse_canonical(raw)
        except CanonicalJsonError as exc:
            return "malformed-line", str(exc)
        if not isinstance(obj, dict):
            return "malformed-line", "a record line is a JSON object"
        if obj.get("node_key_id") != self.key_id:
            return (
                "foreign-key",
                f"record names key {obj.get('node_key_id')!r}, not the trusted key {self.key_id}",
            )
        try:
            verify_signed_object(self.public_key_hex, obj)
        except SignatureInvalid as exc:
            return "bad-signature", str(exc)
        try:
            record = UsageRecord.from_json(obj)
        except CostMismatch as exc:
            return "cost-mismatch", str(exc)
        except RecordError as exc:
            return "invalid-record", str(exc)
        if record.boot_id != header.boot_id:
            return (
                "boot-mismatch",
                f"record is from node start {record.boot_id}, the segment is {header.boot_id}",
            )
        if record.evidence_digest != header.evidence_digest:
            return (
                "evidence-mismatch",
                f"record names evidence {record.evidence_digest}, the segment {header.evidence_digest}",
            )
        if record.seq < expected:
            return "duplicate", f"seq {record.seq} was already seen; expected seq {expected}"
        if record.seq > expected:
            if expected_comes_later:
                return "reordered", f"expected seq {expected}, which appears later in the file"
            missing = f"{expected}" if record.seq == expected + 1 else f"{expected} to {record.seq - 1}"
            return "sequence-gap", f"expected seq {expected}; seq {missing} missing (deleted)"
        if record.prev_hash != self.prev_hash:
            return (
                "broken-chain",
                f"prev_hash is {record.prev_hash}, the previous line hashes to {self.prev_hash}",
            )
        if record.record_id in self.record_ids:
            return "duplicate-id", f"record id {record.record_id} already appeared at a lower seq"
        self.record_ids.add(record.record_id)
        self.tree.append(leaf_hash(raw))
        self.prev_hash = hashlib.sha256(raw).hexdigest()
        return None

    def check_tree_head(self, head: TreeHead) -> Problem | None:
        try:
            head.verify(self.public_key_hex)
        except TreeHeadError as exc:
            return Problem("bad-tree-head", None, None, None, str(exc))
        assert self.header is not None  # the records were checked first
        if head.evidence_digest != self.header.evidence_digest:
            detail = f"tree head names evidence {head.evidence_digest}, the segment {self.header.evidence_digest}"
            return Problem("bad-tree-head", None, None, None, detail)
        if head.size > len(self.tree):
            detail = (
                f"the tree head covers {head.size} records, the segment has {len(self.tree)}: "
                "records were deleted from the end"
            )
            return Problem("missing-records", None, len(self.tree), None, detail)
        root = self.tree.root(head.size)
        if root != head.root_hash:
            detail = (
                f"root of the first {head.size} records is {root.hex()}, the tree head says "
                f"{head.root_hash_hex}"
            )
            return Problem("root-mismatch", None, None, None, detail)
        return None


def _claimed(raw: bytes) -> tuple[int | None, str | None]:
    """The seq and record id a line claims, unverified, for naming it in a problem."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    seq = obj.get("seq")
    record_id = obj.get("record_id")
    return (
        seq if type(seq) is int else None,
        record_id if isinstance(record_id, str) else None,
    )
