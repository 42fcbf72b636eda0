"""Ledger segment files: the on-disk layout shared by the writer (`ledger`) and readers (`verify`, `bill`).

One segment per node start, named `ledger-<boot_id>.jsonl` inside the ledger directory. Every line
is RFC 8785 canonical JSON followed by "\\n":

    line 1      segment header: format, boot_id, created_ms, node_key_id, public_key, evidence_digest,
                [code_digest, model_digests,] signature
    line 2 + s  usage record with seq s (s = 0, 1, 2, ...), as `UsageRecord.to_json()`

The header names the key that signs the segment and the digest of the attestation evidence that binds
that key, so the file says which attested key to check it against; every record names the same digest.
A header may also name what the node start ran: `code_digest` and `model_digests` (model id -> digest), as
`node.code_identity` defines them. Both are optional and absent from segments written before they existed, so
those still verify: the signature covers exactly the members present.
The header is signed by that key and is not a Merkle leaf. Records are the Merkle leaves, leaf
index = seq, leaf data = the line without its newline. A node never reopens an old segment, so a
crash can leave at most one torn line, at the end of its own segment.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from metering.canonical import CanonicalJsonError, canonical_json, parse_canonical
from metering.record import RecordError, UsageRecord, check_boot_id, check_evidence_digest
from metering.signer import NodeSigner, SignatureInvalid, key_id_for, public_key_from_hex, signed_payload

SEGMENT_FORMAT = "tenzro-ledger-segment/2"
"""/2: records carry service times and, like the header and tree heads, the attestation evidence digest."""
SEGMENT_PREFIX = "ledger-"
SEGMENT_SUFFIX = ".jsonl"
OPTIONAL_MEMBERS = ("code_digest", "model_digests")
"""Header members a segment written before they existed lacks."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


class SegmentFormatError(ValueError):
    """A segment file does not have the layout above; the message names the file and line."""


def segment_path(directory: str | os.PathLike[str], boot_id: str) -> Path:
    """Where the segment of node start `boot_id` lives."""
    return Path(directory) / f"{SEGMENT_PREFIX}{check_boot_id(boot_id)}{SEGMENT_SUFFIX}"


def segment_files(path: str | os.PathLike[str]) -> list[Path]:
    """A segment file itself, or every segment in a ledger directory, ordered by name."""
    path = Path(path)
    if path.is_dir():
        return sorted(path.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"))
    if not path.exists():
        raise SegmentFormatError(f"ledger path {path} does not exist; give a segment file or its directory")
    return [path]


def _check_format(segment_format: object) -> None:
    if segment_format != SEGMENT_FORMAT:
        raise SegmentFormatError(f"segment format is {segment_format!r}; this reader knows {SEGMENT_FORMAT!r}")


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """First line of a segment: which node start wrote it and with which public key."""

    format: str
    boot_id: str
    created_ms: int
    node_key_id: str
    public_key: str  # 64 hex characters, raw Ed25519 public key
    evidence_digest: str  # SHA-256 hex of the attestation evidence that binds `public_key`
    signature: str  # 128 hex characters over the canonical JSON of the other members
    code_digest: str | None = None
    """SHA-256 hex of the code the node start ran (`node.code_identity`); None in older segments."""
    model_digests: tuple[tuple[str, str], ...] | None = None
    """(model id, SHA-256 hex of its directory) for each model served, sorted by id; None in older segments.
    On disk a JSON object of model id to digest."""

    def __post_init__(self) -> None:
        _check_format(self.format)
        check_boot_id(self.boot_id)
        check_evidence_digest(self.evidence_digest)
        _check_served(self.code_digest, self.model_digests)
        if type(self.created_ms) is not int or self.created_ms < 0:
            raise SegmentFormatError(f"created_ms must be a non-negative integer, got {self.created_ms!r}")
        for name in ("node_key_id", "public_key", "signature"):
            if not isinstance(getattr(self, name), str):
                raise SegmentFormatError(f"segment header {name} must be a string")
        try:
            key_id = key_id_for(public_key_from_hex(self.public_key))
        except SignatureInvalid as exc:
            raise SegmentFormatError(f"segment header public_key: {exc}") from exc
        if key_id != self.node_key_id:
            raise SegmentFormatError("segment header node_key_id is not the key id of its public_key")

    @classmethod
    def create(cls, signer: NodeSigner, boot_id: str, created_ms: int, evidence_digest: str, *,
               code_digest: str | None = None, model_digests: Mapping[str, str] | None = None) -> SegmentHeader:
        """A signed header; `code_digest` and `model_digests` (model id -> digest), when given, are signed with it."""
        body: dict[str, Any] = {
            "format": SEGMENT_FORMAT,
            "boot_id": boot_id,
            "created_ms": created_ms,
            "node_key_id": signer.key_id,
            "public_key": signer.public_key_hex,
            "evidence_digest": evidence_digest,
        }
        if code_digest is not None:
            body["code_digest"] = code_digest
        if model_digests is not None:
            body["model_digests"] = dict(model_digests)
        members = {**body, "signature": signer.sign(signed_payload(body)).hex()}
        if model_digests is not None:
            members["model_digests"] = tuple(sorted(model_digests.items()))
        return cls(**members)

    @classmethod
    def from_json(cls, obj: Any) -> SegmentHeader:
        names = [field.name for field in fields(cls)]
        required = [name for name in names if name not in OPTIONAL_MEMBERS]
        if isinstance(obj, Mapping) and "format" in obj:
            _check_format(obj["format"])  # first: another format's header has other members
        if not isinstance(obj, Mapping) or not set(required) <= set(obj) or not set(obj) <= set(names):
            raise SegmentFormatError(f"a segment header is a JSON object with exactly {', '.join(required)}, "
                                     f"and optionally {', '.join(OPTIONAL_MEMBERS)}")
        members = dict(obj)
        for name in OPTIONAL_MEMBERS:  # absent, never null: a null would verify as if absent, so no line has one
            if name in members and members[name] is None:
                raise SegmentFormatError(f"segment header {name} is null; leave it out instead")
        models = members.get("model_digests")
        if isinstance(models, Mapping):
            members["model_digests"] = tuple(sorted(models.items()))
        elif models is not None:
            raise SegmentFormatError(f"segment header model_digests must be an object of model id to digest, "
                                     f"got {models!r}")
        try:
            return cls(**members)
        except ValueError as exc:  # RecordError and SegmentFormatError are ValueErrors
            raise SegmentFormatError(f"invalid segment header: {exc}") from exc

    def to_json(self) -> dict[str, Any]:
        """The header's members; an optional one that is None is absent (as in a segment written before it)."""
        obj = {field.name: getattr(self, field.name) for field in fields(self)}
        if self.model_digests is not None:
            obj["model_digests"] = dict(self.model_digests)
        return {name: value for name, value in obj.items() if value is not None or name not in OPTIONAL_MEMBERS}

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.to_json())


def _check_served(code_digest: object, model_digests: object) -> None:
    if code_digest is not None and (not isinstance(code_digest, str) or not _HEX64.fullmatch(code_digest)):
        raise SegmentFormatError(f"segment header code_digest must be 64 lowercase hex characters, got {code_digest!r}")
    if model_digests is None:
        return
    if not isinstance(model_digests, tuple) or not model_digests:
        raise SegmentFormatError("segment header model_digests must name at least one model")
    for model_id, digest in model_digests:
        if not isinstance(model_id, str) or not model_id:
            raise SegmentFormatError(f"segment header model_digests: a model id must be a non-empty string, "
                                     f"got {model_id!r}")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise SegmentFormatError(f"segment header model_digests[{model_id!r}] must be 64 lowercase hex "
                                     f"characters, got {digest!r}")


@dataclass(frozen=True, slots=True)
class SegmentLine:
    number: int  # 1-based line number in the file
    raw: bytes  # the line without its trailing newline


@dataclass(frozen=True, slots=True)
class SegmentContents:
    """A segment file split into lines, without judging them."""

    path: Path
    lines: tuple[SegmentLine, ...]  # newline-terminated lines, header first
    torn_tail: SegmentLine | None  # an interrupted final write, if any


def read_segment(path: str | os.PathLike[str]) -> SegmentContents:
    """Split a segment into lines. The final line is torn when it lacks its newline or is not JSON
    at all: both are what an interrupted append leaves, and neither ever became a record."""
    path = Path(path)
    pieces = path.read_bytes().split(b"\n")
    tail = pieces.pop()  # b"" when the file ends with a newline
    lines = [SegmentLine(number, raw) for number, raw in enumerate(pieces, start=1)]
    torn: SegmentLine | None = None
    if tail:
        torn = SegmentLine(len(pieces) + 1, tail)
    elif lines and not _is_json(lines[-1].raw):
        torn = lines.pop()
    return SegmentContents(path, tuple(lines), torn)


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both derive from it
        return False
    return True


def parse_header(line: SegmentLine, path: Path) -> SegmentHeader:
    try:
        return SegmentHeader.from_json(parse_canonical(line.raw))
    except (CanonicalJsonError, SegmentFormatError) as exc:
        raise SegmentFormatError(f"{path} line {line.number}: {exc}") from exc


def read_records(path: str | os.PathLike[str]) -> tuple[SegmentHeader, list[UsageRecord]]:
    """Parse a segment without checking signatures or the chain (that is `verify_segment`'s job).

    A torn final line is left out, as it never became a record; any other bad line is an error.
    """
    contents = read_segment(path)
    header = header_of(contents)
    records = []
    for line in contents.lines[1:]:
        try:
            records.append(UsageRecord.from_json(parse_canonical(line.raw)))
        except (CanonicalJsonError, RecordError) as exc:
            raise SegmentFormatError(f"{contents.path} line {line.number}: {exc}") from exc
    return header, records


def read_header(path: str | os.PathLike[str]) -> SegmentHeader:
    """A segment's header, without checking its signature (that is `verify_segment`'s job)."""
    return header_of(read_segment(path))


def header_of(contents: SegmentContents) -> SegmentHeader:
    if not contents.lines:
        raise SegmentFormatError(f"{contents.path} has no complete header line")
    return parse_header(contents.lines[0], contents.path)
