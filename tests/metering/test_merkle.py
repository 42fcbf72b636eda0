"""RFC 9162 / RFC 6962 Merkle tree: published test vectors, proofs for every small tree, tampering."""

from __future__ import annotations

import hashlib

import pytest

from metering.merkle import (
    EMPTY_ROOT,
    MerkleTree,
    ProofError,
    leaf_hash,
    node_hash,
    root_from_inclusion_proof,
    verify_consistency,
    verify_inclusion,
)

# Test vectors of transparency-dev/merkle (proof/verify_test.go, rfc6962/rfc6962_test.go), the
# RFC 6962 reference tree of 8 leaves used by certificate-transparency implementations.
LEAVES = [
    bytes.fromhex(h)
    for h in [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
]
# ROOTS[n - 1] is the root of the tree of the first n leaves.
ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
# (leaf index, tree size, audit path); the source numbers leaves from 1, these from 0.
INCLUSION_PROOFS = [
    (0, 1, []),
    (
        0,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        5,
        8,
        [
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (
        1,
        5,
        [
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
]
# (old size, new size, consistency proof)
CONSISTENCY_PROOFS = [
    (1, 1, []),
    (
        1,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        6,
        8,
        [
            "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
    (
        2,
        5,
        [
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
    (
        6,
        7,
        [
            "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
]
SOME_HASH = bytes.fromhex("abacaba000000000000000000000000000000000000000000060061e00123456")


def hexes(hashes: list[bytes]) -> list[str]:
    return [value.hex() for value in hashes]


def unhex(values: list[str]) -> list[bytes]:
    return [bytes.fromhex(value) for value in values]


@pytest.fixture
def tree() -> MerkleTree:
    return MerkleTree.from_leaves(LEAVES)


def test_rfc6962_hash_vectors() -> None:
    assert EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert leaf_hash(b"").hex() == "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    assert leaf_hash(b"L123456").hex() == "395aa064aa4c29f7010acfe3f25db9485bbd4b91897b6ad7ad547639252b4d56"
    assert (
        node_hash(b"N123", b"N456").hex()
        == "aa217fe888e47007fa15edab33c2b492a722cb106c64667fc2b044444de66bbb"
    )


def test_roots_of_every_prefix(tree: MerkleTree) -> None:
    assert [tree.root(size).hex() for size in range(1, 9)] == ROOTS
    assert tree.root(0) == EMPTY_ROOT
    assert MerkleTree().root() == EMPTY_ROOT
    assert tree.root().hex() == ROOTS[7]


@pytest.mark.parametrize(("index", "size", "proof"), INCLUSION_PROOFS)
def test_inclusion_proof_vectors(tree: MerkleTree, index: int, size: int, proof: list[str]) -> None:
    assert hexes(tree.inclusion_proof(index, size)) == proof
    root = bytes.fromhex(ROOTS[size - 1])
    assert root_from_inclusion_proof(index, size, leaf_hash(LEAVES[index]), unhex(proof)) == root
    verify_inclusion(index, size, leaf_hash(LEAVES[index]), unhex(proof), root)


@pytest.mark.parametrize(("old", "new", "proof"), CONSISTENCY_PROOFS)
def test_consistency_proof_vectors(tree: MerkleTree, old: int, new: int, proof: list[str]) -> None:
    assert hexes(tree.consistency_proof(old, new)) == proof
    verify_consistency(old, new, bytes.fromhex(ROOTS[old - 1]), bytes.fromhex(ROOTS[new - 1]), unhex(proof))


def test_generated_proofs_verify_for_every_small_tree(tree: MerkleTree) -> None:
    for size in range(1, 9):
        for index in range(size):
            verify_inclusion(
                index, size, tree.leaf_hash_at(index), tree.inclusion_proof(index, size), tree.root(size)
            )
        for old in range(0, size + 1):
            verify_consistency(old, size, tree.root(old), tree.root(size), tree.consistency_proof(old, size))


def inclusion_tamperings(
    index: int, size: int, proof: list[bytes], root: bytes, leaf: bytes
) -> dict[str, tuple]:
    tamperings: dict[str, tuple] = {
        "index - 1": (index - 1, size, leaf, proof, root),
        "index + 1": (index + 1, size, leaf, proof, root),
        "index ^ 2": (index ^ 2, size, leaf, proof, root),
        "size * 2": (index, size * 2, leaf, proof, root),
        "size // 2": (index, size // 2, leaf, proof, root),
        "wrong leaf": (index, size, SOME_HASH, proof, root),
        "empty tree root": (index, size, leaf, proof, EMPTY_ROOT),
        "random root": (index, size, leaf, proof, SOME_HASH),
        "trailing root": (index, size, leaf, [*proof, root], root),
        "preceding root": (index, size, leaf, [root, *proof], root),
        "trailing short garbage": (index, size, leaf, [*proof, b""], root),
    }
    for position in range(len(proof)):
        flipped = list(proof)
        flipped[position] = bytes([flipped[position][0] ^ 8]) + flipped[position][1:]
        tamperings[f"bit flip in proof[{position}]"] = (index, size, leaf, flipped, root)
    if proof:
        tamperings["removed last element"] = (index, size, leaf, proof[:-1], root)
    if len(proof) > 1:
        tamperings["inserted element"] = (index, size, leaf, [proof[0], SOME_HASH, *proof[1:]], root)
    return tamperings


@pytest.mark.parametrize(("index", "size", "proof"), INCLUSION_PROOFS[1:])
def test_tampered_inclusion_proofs_fail(index: int, size: int, proof: list[str]) -> None:
    root = bytes.fromhex(ROOTS[size - 1])
    tamperings = inclusion_tamperings(index, size, unhex(proof), root, leaf_hash(LEAVES[index]))
    accepted = []
    for name, arguments in tamperings.items():
        try:
            verify_inclusion(*arguments)
        except ProofError:
            continue
        accepted.append(name)
    assert accepted == []


def consistency_tamperings(
    old: int, new: int, proof: list[bytes], old_root: bytes, root: bytes
) -> dict[str, tuple]:
    tamperings: dict[str, tuple] = {
        "old - 1": (old - 1, new, old_root, root, proof),
        "old + 1": (old + 1, new, old_root, root, proof),
        "old ^ 2": (old ^ 2, new, old_root, root, proof),
        "new * 2": (old, new * 2, old_root, root, proof),
        "new // 2": (old, new // 2, old_root, root, proof),
        "wrong old root": (old, new, SOME_HASH, root, proof),
        "wrong root": (old, new, old_root, SOME_HASH, proof),
        "swapped roots": (old, new, root, old_root, proof),
        "empty proof": (old, new, old_root, root, []),
        "trailing old root": (old, new, old_root, root, [*proof, old_root]),
        "trailing root": (old, new, old_root, root, [*proof, root]),
        "preceding old root": (old, new, old_root, root, [old_root, *proof]),
        "preceding root": (old, new, old_root, root, [root, *proof]),
        "preceding proof[0]": (old, new, old_root, root, [proof[0], *proof]),
        "truncated": (old, new, old_root, root, proof[:-1]),
    }
    for position in range(len(proof)):
        flipped = list(proof)
        flipped[position] = bytes([flipped[position][0] ^ 16]) + flipped[position][1:]
        tamperings[f"bit flip in proof[{position}]"] = (old, new, old_root, root, flipped)
    return tamperings


@pytest.mark.parametrize(("old", "new", "proof"), CONSISTENCY_PROOFS[1:])
def test_tampered_consistency_proofs_fail(old: int, new: int, proof: list[str]) -> None:
    tamperings = consistency_tamperings(
        old, new, unhex(proof), bytes.fromhex(ROOTS[old - 1]), bytes.fromhex(ROOTS[new - 1])
    )
    accepted = []
    for name, arguments in tamperings.items():
        try:
            verify_consistency(*arguments)
        except ProofError:
            continue
        accepted.append(name)
    assert accepted == []


A, B = hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest()


@pytest.mark.parametrize(
    ("old", "new", "old_root", "root", "proof", "ok"),
    [
        (0, 0, A, A, [], True),
        (0, 1, A, B, [], True),  # every tree extends the empty tree
        (1, 1, B, B, [], True),
        (1, 1, A, B, [], False),  # same size, different roots
        (1, 0, A, B, [], False),  # shrinking
        (2, 1, A, B, [], False),
        (1, 2, A, B, [], False),  # a real extension needs a proof
        (0, 0, EMPTY_ROOT, EMPTY_ROOT, [EMPTY_ROOT], False),  # trivial cases take an empty proof
        (0, 1, EMPTY_ROOT, EMPTY_ROOT, [EMPTY_ROOT], False),
        (1, 1, EMPTY_ROOT, EMPTY_ROOT, [EMPTY_ROOT], False),
    ],
)
def test_consistency_edge_cases(
    old: int, new: int, old_root: bytes, root: bytes, proof: list[bytes], ok: bool
) -> None:
    if ok:
        verify_consistency(old, new, old_root, root, proof)
    else:
        with pytest.raises(ProofError):
            verify_consistency(old, new, old_root, root, proof)


def test_single_leaf_tree_and_hash_sizes() -> None:
    single = leaf_hash(b"data")
    verify_inclusion(0, 1, single, [], single)
    with pytest.raises(ProofError):
        verify_inclusion(0, 1, single, [], EMPTY_ROOT)
    with pytest.raises(ProofError, match="32-byte"):
        verify_inclusion(0, 1, b"", [], b"")  # equal but not hashes
    for index, size in [(0, 0), (1, 0), (2, 1)]:
        with pytest.raises(ProofError, match="outside a tree"):
            verify_inclusion(index, size, SOME_HASH, [], EMPTY_ROOT)


def test_out_of_range_requests(tree: MerkleTree) -> None:
    with pytest.raises(ProofError, match="leaf index 8 is outside a tree of 8 leaves"):
        tree.inclusion_proof(8)
    with pytest.raises(ProofError, match=r"tree size 9 is outside 0..8"):
        tree.root(9)
    with pytest.raises(ProofError, match="old size 5 must be between 0 and the new size 4"):
        tree.consistency_proof(5, 4)
    with pytest.raises(ProofError, match="a leaf hash is 32 bytes, got 3"):
        tree.append(b"abc")


def reference_root(hashes: list[bytes]) -> bytes:
    """MTH written straight from RFC 9162 2.1.1, without caching."""
    if len(hashes) == 1:
        return hashes[0]
    k = 1 << ((len(hashes) - 1).bit_length() - 1)
    return node_hash(reference_root(hashes[:k]), reference_root(hashes[k:]))


def test_cached_subtrees_agree_with_the_definition_as_the_tree_grows() -> None:
    hashes = [leaf_hash(index.to_bytes(4, "big")) for index in range(300)]
    tree = MerkleTree()
    for count, value in enumerate(hashes, start=1):
        tree.append(value)
        if count in (1, 63, 64, 65, 128, 129, 200, 256, 300):
            assert tree.root() == reference_root(hashes[:count])
    # Old sizes after growth still use only the leaves they cover.
    assert tree.root(130) == reference_root(hashes[:130])
    verify_inclusion(129, 130, hashes[129], tree.inclusion_proof(129, 130), reference_root(hashes[:130]))
    verify_consistency(70, 300, reference_root(hashes[:70]), tree.root(), tree.consistency_proof(70))
