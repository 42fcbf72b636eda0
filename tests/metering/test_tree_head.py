"""Signed tree heads and the JSON proofs handed to auditors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ledger_fixtures import EVIDENCE_DIGEST, OTHER_EVIDENCE_DIGEST, LedgerFactory

from metering.signer import NodeSigner
from metering.tree_head import ConsistencyProof, InclusionProof, TreeHead, TreeHeadError, load_tree_head

ROOT = bytes.fromhex("5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328")
SIGNATURE = (  # of the head of 8 records over ROOT at 1_700_000_000_000 under NODE_SEED and EVIDENCE_DIGEST
    "c3ebe9f453ebc1acfcbfbd6dfd5484319e6bd6092a31a62df4db568e54e9d9af"
    "b3e249e24e2f1a41853e97ebe84172318614e2f0a7bf612d75d496beec9df90a"
)
WELL_FORMED = {
    "size": 1,
    "root_hash_hex": "00" * 32,
    "timestamp_ms": 0,
    "key_id": "k",
    "evidence_digest": EVIDENCE_DIGEST,
    "signature": "s",
}


def test_exact_signed_tree_head(node_signer: NodeSigner) -> None:
    head = TreeHead.sign(node_signer, 8, ROOT, 1_700_000_000_000, EVIDENCE_DIGEST)
    assert head.to_json() == {
        "size": 8,
        "root_hash_hex": ROOT.hex(),
        "timestamp_ms": 1_700_000_000_000,
        "key_id": "56475aa75463474c",
        "evidence_digest": EVIDENCE_DIGEST,
        "signature": head.signature,
    }
    assert head.signature == SIGNATURE  # Ed25519 is deterministic
    head.verify(node_signer.public_key_hex)
    assert head.root_hash == ROOT


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"size": 7}, "does not verify"),
        ({"timestamp_ms": 1}, "does not verify"),
        ({"evidence_digest": OTHER_EVIDENCE_DIGEST}, "does not verify"),
        ({"signature": "00"}, "128 hex"),
    ],
)
def test_changed_tree_head_fails(node_signer: NodeSigner, changes: dict[str, Any], message: str) -> None:
    head = replace(TreeHead.sign(node_signer, 8, ROOT, 5, EVIDENCE_DIGEST), **changes)
    with pytest.raises(TreeHeadError, match=message):
        head.verify(node_signer.public_key_hex)


def test_tree_head_of_another_key_fails(node_signer: NodeSigner, other_signer: NodeSigner) -> None:
    with pytest.raises(
        TreeHeadError, match=f"names key {other_signer.key_id}, not the node key {node_signer.key_id}"
    ):
        TreeHead.sign(other_signer, 8, ROOT, 5, EVIDENCE_DIGEST).verify(node_signer.public_key_hex)


def test_from_json_and_file(node_signer: NodeSigner, tmp_path: Path) -> None:
    head = TreeHead.sign(node_signer, 8, ROOT, 5, EVIDENCE_DIGEST)
    assert TreeHead.from_json(head.to_json()) == head
    path = tmp_path / "head.json"
    path.write_text(json.dumps(head.to_json(), indent=4))
    assert load_tree_head(path) == head


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"size": 1}, "exactly size, root_hash_hex, timestamp_ms, key_id, evidence_digest, signature"),
        ({**WELL_FORMED, "size": -1}, "size must be"),
        ({**WELL_FORMED, "root_hash_hex": "AB" * 32}, "root_hash_hex must be 64 lowercase hex"),
        ({**WELL_FORMED, "evidence_digest": "e1" * 31}, "tree head evidence_digest must be 64 lowercase hex"),
    ],
)
def test_malformed_tree_heads(obj: dict[str, object], message: str) -> None:
    with pytest.raises(TreeHeadError, match=message):
        TreeHead.from_json(obj)


def test_unreadable_tree_head_file(tmp_path: Path) -> None:
    with pytest.raises(TreeHeadError, match="cannot be read as JSON"):
        load_tree_head(tmp_path / "missing.json")


def test_inclusion_proof_json_and_tampering(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=5)
    head = ledger.tree_head()
    assert head.evidence_digest == EVIDENCE_DIGEST
    proof = ledger.inclusion_proof("chatcmpl-2")
    assert proof.to_json() == {
        "record_id": "chatcmpl-2",
        "leaf_index": 2,
        "tree_size": 5,
        "audit_path": list(proof.audit_path),
    }
    assert len(proof.audit_path) == 3
    record = ledger.get("chatcmpl-2")
    assert record is not None
    proof.verify(record, head, node_signer.public_key_hex)

    flipped = ("f" if proof.audit_path[0][0] != "f" else "e") + proof.audit_path[0][1:]
    with pytest.raises(TreeHeadError, match="does not lead to the given root"):
        replace(proof, audit_path=(flipped, *proof.audit_path[1:])).verify(
            record, head, node_signer.public_key_hex
        )
    with pytest.raises(TreeHeadError, match="proof is for a tree of 5 records, the head has 4"):
        proof.verify(record, ledger.tree_head(4), node_signer.public_key_hex)
    with pytest.raises(TreeHeadError, match="record chatcmpl-2: signature does not verify"):
        proof.verify(replace(record, total_ms=record.total_ms - 1), head, node_signer.public_key_hex)
    with pytest.raises(TreeHeadError, match="audit_path must be a list of 64-character lowercase hex hashes"):
        InclusionProof("chatcmpl-2", 2, 5, ("xyz",)).verify(record, head, node_signer.public_key_hex)


def test_consistency_proof_json_and_tampering(make_ledger: LedgerFactory, node_signer: NodeSigner) -> None:
    ledger = make_ledger(node_signer, records=6)
    old, new = ledger.tree_head(2), ledger.tree_head()
    proof = ledger.consistency_proof(2)
    assert proof.to_json() == {"old_size": 2, "new_size": 6, "path": list(proof.path)}
    proof.verify(old, new, node_signer.public_key_hex)
    with pytest.raises(TreeHeadError, match="proof is from 2 to 6 records, the heads are 3 and 6"):
        proof.verify(ledger.tree_head(3), new, node_signer.public_key_hex)
    with pytest.raises(TreeHeadError, match="consistency proof"):
        ConsistencyProof(2, 6, proof.path[:-1]).verify(old, new, node_signer.public_key_hex)
