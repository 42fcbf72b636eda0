"""Signed tree heads of a ledger segment and the proofs checked against them, in JSON-ready form.

A tree head commits the node to the first `size` records of its segment: an auditor who holds one
detects any later deletion, reordering or rewrite of those records (`verify_segment`), can check
that a single record is among them from a short proof (`InclusionProof`), and can check that a
later head extends an earlier one (`ConsistencyProof`). Hashes travel as lowercase hex.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from metering.merkle import ProofError, leaf_hash, verify_consistency, verify_inclusion
from metering.record import RecordError, UsageRecord, check_evidence_digest
from metering.signer import (
    NodeSigner,
    SignatureInvalid,
    key_id_for,
    public_key_from_hex,
    signed_payload,
    verify_signed_object,
)

_HEX64 = re.compile(r"[0-9a-f]{64}")


class TreeHeadError(ValueError):
    """A tree head or proof is malformed, signed by another key, or does not verify."""


@dataclass(frozen=True, slots=True)
class TreeHead:
    """The node's signed statement: the first `size` records of its segment have this Merkle root."""

    size: int
    root_hash_hex: str
    timestamp_ms: int
    key_id: str
    evidence_digest: str  # SHA-256 hex of the attestation evidence of the node start that signs
    signature: str  # Ed25519 over the canonical JSON of the other members, hex

    def __post_init__(self) -> None:
        for name in ("size", "timestamp_ms"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise TreeHeadError(f"tree head {name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.root_hash_hex, str) or not _HEX64.fullmatch(self.root_hash_hex):
            raise TreeHeadError("tree head root_hash_hex must be 64 lowercase hex characters")
        for name in ("key_id", "signature"):
            if not isinstance(getattr(self, name), str):
                raise TreeHeadError(f"tree head {name} must be a string")
        try:
            check_evidence_digest(self.evidence_digest)
        except RecordError as exc:
            raise TreeHeadError(f"tree head {exc}") from exc

    @classmethod
    def sign(
        cls, signer: NodeSigner, size: int, root: bytes, timestamp_ms: int, evidence_digest: str
    ) -> TreeHead:
        body: dict[str, Any] = {
            "size": size,
            "root_hash_hex": root.hex(),
            "timestamp_ms": timestamp_ms,
            "key_id": signer.key_id,
            "evidence_digest": evidence_digest,
        }
        return cls(**body, signature=signer.sign(signed_payload(body)).hex())

    @property
    def root_hash(self) -> bytes:
        return bytes.fromhex(self.root_hash_hex)

    def to_json(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_json(cls, obj: Any) -> TreeHead:
        names = [field.name for field in fields(cls)]
        if not isinstance(obj, Mapping) or sorted(obj) != sorted(names):
            raise TreeHeadError(f"a tree head is a JSON object with exactly {', '.join(names)}")
        return cls(**obj)

    def verify(self, public_key_hex: str) -> None:
        """Raise `TreeHeadError` unless this head is signed by the node key `public_key_hex`."""
        try:
            expected = key_id_for(public_key_from_hex(public_key_hex))
            if self.key_id != expected:
                raise TreeHeadError(f"tree head names key {self.key_id}, not the node key {expected}")
            verify_signed_object(public_key_hex, self.to_json())
        except SignatureInvalid as exc:
            raise TreeHeadError(f"tree head signature: {exc}") from exc


def load_tree_head(path: str | os.PathLike[str]) -> TreeHead:
    """Read a tree head saved as JSON (any formatting; the signature covers its canonical form)."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TreeHeadError(f"tree head file {path} cannot be read as JSON: {exc}") from exc
    return TreeHead.from_json(obj)


def _hashes(values: Any, what: str) -> tuple[bytes, ...]:
    if not isinstance(values, list | tuple) or not all(
        isinstance(value, str) and _HEX64.fullmatch(value) for value in values
    ):
        raise TreeHeadError(f"{what} must be a list of 64-character lowercase hex hashes")
    return tuple(bytes.fromhex(value) for value in values)


@dataclass(frozen=True, slots=True)
class InclusionProof:
    """RFC 9162 audit path of one record (leaf index = seq) in a tree of `tree_size` records."""

    record_id: str
    leaf_index: int
    tree_size: int
    audit_path: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "record_id": self.record_id,
            "leaf_index": self.leaf_index,
            "tree_size": self.tree_size,
            "audit_path": list(self.audit_path),
        }

    def verify(self, record: UsageRecord, head: TreeHead, public_key_hex: str) -> None:
        """Raise `TreeHeadError` unless `record` is leaf `leaf_index` under the signed `head`."""
        head.verify(public_key_hex)
        try:
            verify_signed_object(public_key_hex, record.to_json())
        except SignatureInvalid as exc:
            raise TreeHeadError(f"record {record.record_id}: {exc}") from exc
        if (record.record_id, record.seq) != (self.record_id, self.leaf_index):
            raise TreeHeadError(
                f"proof is for record {self.record_id} at {self.leaf_index}, "
                f"not {record.record_id} at {record.seq}"
            )
        if head.size != self.tree_size:
            raise TreeHeadError(f"proof is for a tree of {self.tree_size} records, the head has {head.size}")
        try:
            verify_inclusion(
                self.leaf_index,
                self.tree_size,
                leaf_hash(record.canonical_bytes()),
                _hashes(self.audit_path, "audit_path"),
                head.root_hash,
            )
        except ProofError as exc:
            raise TreeHeadError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class ConsistencyProof:
    """RFC 9162 proof that the tree of `new_size` records extends the tree of `old_size`."""

    old_size: int
    new_size: int
    path: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"old_size": self.old_size, "new_size": self.new_size, "path": list(self.path)}

    def verify(self, old_head: TreeHead, new_head: TreeHead, public_key_hex: str) -> None:
        """Raise `TreeHeadError` unless both heads are the node's and `new_head` extends `old_head`."""
        old_head.verify(public_key_hex)
        new_head.verify(public_key_hex)
        if (old_head.size, new_head.size) != (self.old_size, self.new_size):
            raise TreeHeadError(
                f"proof is from {self.old_size} to {self.new_size} records, "
                f"the heads are {old_head.size} and {new_head.size}"
            )
        try:
            verify_consistency(
                self.old_size,
                self.new_size,
                old_head.root_hash,
                new_head.root_hash,
                _hashes(self.path, "path"),
            )
        except ProofError as exc:
            raise TreeHeadError(str(exc)) from exc
