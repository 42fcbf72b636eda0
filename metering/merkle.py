"""RFC 9162 (Certificate Transparency 2.0) Merkle tree over ledger lines, with its proofs.

Hashing is that of RFC 6962 and RFC 9162 section 2.1.1: a leaf is SHA-256(0x00 || leaf bytes), an
interior node SHA-256(0x01 || left || right), the empty tree SHA-256(""). A tree of n leaves splits
at k, the largest power of two below n. Proof generation follows the PATH and PROOF definitions of
sections 2.1.3.1 and 2.1.4.1; verification follows the algorithms of 2.1.3.2 and 2.1.4.2 step by
step, so any RFC 9162 client can check what the node hands out.

Every left subtree in that recursion is a perfect, aligned subtree that never changes once full,
so `MerkleTree` caches the hashes of large ones: a root or proof then costs O(log n) hashes plus
the leaves of the one partial subtree, not O(n).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

HASH_BYTES = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()

_CACHE_MIN_LEAVES = 64
"""Perfect subtrees at least this large keep their hash: about n / 64 cached hashes for n leaves."""


class ProofError(ValueError):
    """A Merkle proof does not verify, or its arguments are out of range."""


def leaf_hash(leaf: bytes) -> bytes:
    """HASH(0x00 || leaf)."""
    return hashlib.sha256(b"\x00" + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """HASH(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(size: int) -> int:
    """k: the largest power of two smaller than size (size >= 2)."""
    return 1 << ((size - 1).bit_length() - 1)


class MerkleTree:
    """Append-only list of leaf hashes and the RFC 9162 hashes and proofs over any prefix of it.

    Not thread-safe: the ledger calls it under its own lock.
    """

    def __init__(self, leaf_hashes: Iterable[bytes] = ()) -> None:
        self._leaves: list[bytes] = []
        self._perfect: dict[tuple[int, int], bytes] = {}
        for item in leaf_hashes:
            self.append(item)

    @classmethod
    def from_leaves(cls, leaves: Iterable[bytes]) -> MerkleTree:
        """A tree over raw leaf data (hashes each leaf with `leaf_hash`)."""
        return cls(leaf_hash(leaf) for leaf in leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    def append(self, hashed_leaf: bytes) -> int:
        """Add a leaf hash; returns its index."""
        if len(hashed_leaf) != HASH_BYTES:
            raise ProofError(f"a leaf hash is {HASH_BYTES} bytes, got {len(hashed_leaf)}")
        self._leaves.append(hashed_leaf)
        return len(self._leaves) - 1

    def leaf_hash_at(self, index: int) -> bytes:
        return self._leaves[index]

    def root(self, size: int | None = None) -> bytes:
        """MTH(D[0:size]), the root of the first `size` leaves (default all)."""
        size = self._check_size(size)
        return EMPTY_ROOT if size == 0 else self._hash(0, size)

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """PATH(index, D[0:size]): the audit path of leaf `index` in the tree of `size` leaves."""
        size = self._check_size(size)
        if not 0 <= index < size:
            raise ProofError(f"leaf index {index} is outside a tree of {size} leaves")
        return self._path(index, 0, size)

    def consistency_proof(self, old_size: int, size: int | None = None) -> list[bytes]:
        """PROOF(old_size, D[0:size]): shows the tree of `size` leaves extends the one of `old_size`.

        Empty when old_size is 0 or equals size: those cases need no proof.
        """
        size = self._check_size(size)
        if not 0 <= old_size <= size:
            raise ProofError(f"old size {old_size} must be between 0 and the new size {size}")
        if old_size == 0:
            return []
        return self._subproof(old_size, 0, size, True)

    def _check_size(self, size: int | None) -> int:
        if size is None:
            return len(self._leaves)
        if not 0 <= size <= len(self._leaves):
            raise ProofError(f"tree size {size} is outside 0..{len(self._leaves)} (leaves appended so far)")
        return size

    def _hash(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]) for end > start."""
        count = end - start
        if count == 1:
            return self._leaves[start]
        perfect = count & (count - 1) == 0
        if perfect and count >= _CACHE_MIN_LEAVES:
            cached = self._perfect.get((start, count))
            if cached is not None:
                return cached
        k = _split(count)
        result = node_hash(self._hash(start, start + k), self._hash(start + k, end))
        if perfect and count >= _CACHE_MIN_LEAVES:
            self._perfect[(start, count)] = result
        return result

    def _path(self, index: int, start: int, end: int) -> list[bytes]:
        """PATH(index - start, D[start:end])."""
        if end - start == 1:
            return []
        k = _split(end - start)
        if index < start + k:
            return self._path(index, start, start + k) + [self._hash(start + k, end)]
        return self._path(index, start + k, end) + [self._hash(start, start + k)]

    def _subproof(self, m: int, start: int, end: int, complete: bool) -> list[bytes]:
        """SUBPROOF(m, D[start:end], complete), m counted from start."""
        n = end - start
        if m == n:
            return [] if complete else [self._hash(start, end)]
        k = _split(n)
        if m <= k:
            return self._subproof(m, start, start + k, complete) + [self._hash(start + k, end)]
        return self._subproof(m - k, start + k, end, False) + [self._hash(start, start + k)]


def _check_hash(value: bytes, what: str) -> None:
    if len(value) != HASH_BYTES:
        raise ProofError(f"{what} must be a {HASH_BYTES}-byte SHA-256 hash, got {len(value)} bytes")


def _shift_until_odd_or_zero(fn: int, sn: int) -> tuple[int, int]:
    while fn & 1 == 0 and fn != 0:
        fn >>= 1
        sn >>= 1
    return fn, sn


def root_from_inclusion_proof(index: int, size: int, hashed_leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """The root that `proof` and the leaf hash imply (RFC 9162 2.1.3.2, steps 1 to 4)."""
    _check_hash(hashed_leaf, "leaf hash")
    for element in proof:
        _check_hash(element, "proof element")
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is outside a tree of {size} leaves")
    fn, sn = index, size - 1
    r = hashed_leaf
    for p in proof:
        if sn == 0:
            raise ProofError("inclusion proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                fn, sn = _shift_until_odd_or_zero(fn, sn)
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("inclusion proof is shorter than the tree is deep")
    return r


def verify_inclusion(index: int, size: int, hashed_leaf: bytes, proof: Sequence[bytes], root: bytes) -> None:
    """Raise `ProofError` unless `proof` shows leaf `index` of a `size`-leaf tree with `root` hashes to
    `hashed_leaf` (RFC 9162 2.1.3.2)."""
    _check_hash(root, "root")
    if root_from_inclusion_proof(index, size, hashed_leaf, proof) != root:
        raise ProofError(f"inclusion proof for leaf {index} of {size} does not lead to the given root")


def verify_consistency(
    old_size: int, size: int, old_root: bytes, root: bytes, proof: Sequence[bytes]
) -> None:
    """Raise `ProofError` unless `proof` shows the tree (`size`, `root`) extends (`old_size`,
    `old_root`) (RFC 9162 2.1.4.2; sizes 0 and equal sizes need an empty proof)."""
    _check_hash(old_root, "old root")
    _check_hash(root, "root")
    for element in proof:
        _check_hash(element, "proof element")
    if not 0 <= old_size <= size:
        raise ProofError(f"old size {old_size} must be between 0 and the new size {size}")
    if old_size == 0 or old_size == size:
        if proof:
            raise ProofError(f"consistency from {old_size} to {size} needs an empty proof")
        if old_size == size and old_root != root:
            raise ProofError(f"two trees of size {size} have different roots")
        return
    # Steps 1 to 7 of RFC 9162 2.1.4.2.
    if not proof:
        raise ProofError("consistency proof is empty")
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    fn, sn = old_size - 1, size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise ProofError("consistency proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                fn, sn = _shift_until_odd_or_zero(fn, sn)
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("consistency proof is shorter than the tree is deep")
    if fr != old_root:
        raise ProofError(f"consistency proof does not lead to the old root of size {old_size}")
    if sr != root:
        raise ProofError(f"consistency proof does not lead to the root of size {size}")
