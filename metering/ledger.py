"""The node's append-only usage ledger: one new segment file per start, one signed record per line.

`append` is the only writer. Under one lock it numbers the record, links it to the previous line by
hash, signs it, writes the line and fsyncs before returning, so a record the node has acknowledged
survives a power cut. Appends block on the disk; call them from a worker thread, not the event loop.
The file layout is described in `metering.segment`.

A failed write is rolled back by truncating to the last complete line; if even that fails the
ledger refuses further appends, because a record after a torn line would break the segment for
every verifier. Restarting the node opens a fresh segment.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from metering.durable import fsync_directory
from metering.merkle import MerkleTree, leaf_hash
from metering.pricing import PriceSchedule
from metering.record import (
    NO_MEDIA,
    ZERO_HASH,
    Latency,
    MediaCounts,
    RecordStatus,
    TokenCounts,
    UsageRecord,
    check_evidence_digest,
)
from metering.segment import SegmentHeader, segment_path
from metering.signer import NodeSigner
from metering.tree_head import ConsistencyProof, InclusionProof, TreeHead


class LedgerError(RuntimeError):
    """The ledger cannot take this append or answer this query; the message says why."""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Ledger:
    """Writer of the current segment, with an in-memory index of its records and its Merkle tree.

    Memory grows with the segment (one `UsageRecord` and one 32-byte leaf hash per record).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        signer: NodeSigner,
        boot_id: str,
        *,
        evidence_digest: str,
        clock_ms: Callable[[], int] = wall_clock_ms,
        code_digest: str | None = None,
        model_digests: Mapping[str, str] | None = None,
    ) -> None:
        """`evidence_digest`: SHA-256 hex of the attestation evidence that binds `signer`'s key for this node
        start; the header, every record and every tree head name it. `code_digest` and `model_digests` (model
        id -> digest): what this node start runs, named by the header only (`metering.segment`)."""
        self.directory = Path(directory)
        self.signer = signer
        self.boot_id = boot_id
        self.evidence_digest = check_evidence_digest(evidence_digest)
        self.path = segment_path(self.directory, boot_id)
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self._records: list[UsageRecord] = []
        self._by_id: dict[str, UsageRecord] = {}
        self._tree = MerkleTree()
        self._prev_hash = ZERO_HASH
        self._broken: str | None = None
        # Before the file: a malformed digest must not leave an empty segment behind.
        self.header = SegmentHeader.create(signer, boot_id, clock_ms(), evidence_digest, code_digest=code_digest,
                                           model_digests=model_digests)

        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        except FileExistsError as exc:
            raise LedgerError(
                f"segment {self.path} already exists; every node start needs a new boot_id"
            ) from exc
        self._size = 0
        try:
            self._write_line(self.header.canonical_bytes())
        except LedgerError:
            os.close(self._fd)
            raise
        fsync_directory(self.directory)

    def append(
        self,
        *,
        record_id: str,
        caller_id: str,
        model: str,
        status: RecordStatus,
        counts: TokenCounts,
        prices: PriceSchedule,
        latency: Latency,
        media: MediaCounts = NO_MEDIA,
    ) -> UsageRecord:
        """Sign and durably write the record of one completion; returns it as written.

        `record_id` is the completion id and must be new to this segment.
        """
        with self._lock:
            if self._broken is not None:
                raise LedgerError(self._broken)
            if record_id in self._by_id:
                raise LedgerError(f"record {record_id!r} is already in the ledger; completion ids are unique")
            draft = UsageRecord.draft(
                record_id=record_id,
                seq=len(self._records),
                timestamp_ms=self._clock_ms(),
                node_key_id=self.signer.key_id,
                boot_id=self.boot_id,
                evidence_digest=self.evidence_digest,
                caller_id=caller_id,
                model=model,
                status=status,
                counts=counts,
                prices=prices,
                latency=latency,
                prev_hash=self._prev_hash,
                media=media,
            )
            record = draft.with_signature(self.signer.sign(draft.signing_payload()))
            line = record.canonical_bytes()
            self._write_line(line)
            self._records.append(record)
            self._by_id[record_id] = record
            self._tree.append(leaf_hash(line))
            self._prev_hash = hashlib.sha256(line).hexdigest()
            return record

    def _write_line(self, line: bytes) -> None:
        data = line + b"\n"
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
            os.fsync(self._fd)
        except OSError as exc:
            self._roll_back(exc)
            raise LedgerError(f"writing to {self.path} failed: {exc}") from exc
        self._size += len(data)

    def _roll_back(self, cause: OSError) -> None:
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError as exc:
            self._broken = (
                f"segment {self.path} may end in a partial line after a failed write ({cause}) "
                f"and could not be truncated ({exc}); restart the node to open a new segment"
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def get(self, record_id: str) -> UsageRecord | None:
        """The record of a completion id, or None. Callers check `caller_id` before showing it."""
        with self._lock:
            return self._by_id.get(record_id)

    def records_since(self, seq: int) -> list[UsageRecord]:
        """Records with seq >= `seq`, in order."""
        if seq < 0:
            raise LedgerError(f"seq must be non-negative, got {seq}")
        with self._lock:
            return self._records[seq:]

    def tree_head(self, size: int | None = None) -> TreeHead:
        """A signed head over the first `size` records (default: all so far)."""
        with self._lock:
            size = len(self._tree) if size is None else self._check_size(size)
            root = self._tree.root(size)
        return TreeHead.sign(self.signer, size, root, self._clock_ms(), self.evidence_digest)

    def inclusion_proof(self, record_id: str, tree_size: int | None = None) -> InclusionProof:
        """Audit path of a record in the tree of `tree_size` records (default: all so far)."""
        with self._lock:
            record = self._by_id.get(record_id)
            if record is None:
                raise LedgerError(f"record {record_id!r} is not in this segment")
            size = len(self._tree) if tree_size is None else self._check_size(tree_size)
            if record.seq >= size:
                raise LedgerError(f"record {record_id!r} has seq {record.seq}, beyond a tree of {size}")
            path = self._tree.inclusion_proof(record.seq, size)
        return InclusionProof(record_id, record.seq, size, tuple(node.hex() for node in path))

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> ConsistencyProof:
        """Proof that the tree of `new_size` records (default: all so far) extends that of `old_size`."""
        with self._lock:
            size = len(self._tree) if new_size is None else self._check_size(new_size)
            if not 0 <= old_size <= size:
                raise LedgerError(f"old size {old_size} must be between 0 and {size}")
            path = self._tree.consistency_proof(old_size, size)
        return ConsistencyProof(old_size, size, tuple(node.hex() for node in path))

    def _check_size(self, size: int) -> int:
        if not 0 <= size <= len(self._tree):
            raise LedgerError(f"tree size {size} is outside 0..{len(self._tree)} (records so far)")
        return size

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
                self._broken = f"ledger {self.path} is closed"

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
