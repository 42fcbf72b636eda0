"""The evidence document: exact JSON form, round trips, the digest, and every malformed field named."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from typing import Any

import pytest

from attestation.binding import BoundIdentity
from attestation.errors import MalformedEvidence, VerificationError
from attestation.evidence import Evidence, GpuDeviceReport, GpuEvidence, evidence_digest

NONE_EVIDENCE = Evidence(evidence_type="none", source="none", report=b"", aux=b"", gpu=None, public_key=bytes(32),
                         boot_id="boot-a", nonce=bytes(range(32)))
GPU = GpuEvidence(cc_enabled=True, environment="prod", dev_tools=False, ready=True,
                  devices=(GpuDeviceReport(index=0, uuid="GPU-1", report=b"\x11\xe0spdm", cert_chain=b"PEM"),))
SNP_EVIDENCE = Evidence(evidence_type="sev-snp", source="sev-guest", report=b"report", aux=b"table", gpu=GPU,
                        public_key=bytes(range(32)), boot_id="boot-b", nonce=bytes(32))
BOUND = BoundIdentity.of(tls_spki_sha256=b"\x11" * 32, code_digest=b"\x22" * 32,
                         model_digests=[("default", b"\x33" * 32), ("alt", b"\x44" * 32)])
NONE_V2 = replace(NONE_EVIDENCE, bound=BOUND)
SNP_V2 = replace(SNP_EVIDENCE, bound=replace(BOUND, tls_spki_sha256=None))


def test_none_document_is_exact_and_its_digest_is_sha256_of_the_canonical_json() -> None:
    document = NONE_EVIDENCE.document()
    assert document == {
        "format": "tenzro-evidence-v1", "type": "none", "source": "none", "report": None, "aux": None, "gpu": None,
        "public_key": "00" * 32, "boot_id": "boot-a", "nonce": bytes(range(32)).hex(),
    }
    # printf '%s' '<the canonical JSON>' | sha256sum
    assert evidence_digest(document) == "b1fcd641999d35a83afbc4fdff334aa86cb29a2f99b11dcd6900282cd468c842"
    assert NONE_EVIDENCE.digest() == evidence_digest(document)
    assert not NONE_EVIDENCE.trusted


def test_hardware_document_carries_base64_and_the_gpu_part() -> None:
    document = SNP_EVIDENCE.document()
    assert (document["report"], document["aux"]) == (base64.b64encode(b"report").decode(), "dGFibGU=")
    assert document["gpu"] == {
        "cc_enabled": True, "environment": "prod", "dev_tools": False, "ready": True,
        "devices": [{"index": 0, "uuid": "GPU-1", "report": "EeBzcGRt", "cert_chain": "UEVN"}],
    }
    assert SNP_EVIDENCE.trusted


@pytest.mark.parametrize("evidence", [NONE_EVIDENCE, SNP_EVIDENCE, NONE_V2, SNP_V2],
                         ids=["none", "sev-snp", "none-v2", "sev-snp-v2-no-tls"])
def test_documents_round_trip_through_json(evidence: Evidence) -> None:
    text = json.dumps(evidence.document())
    assert Evidence.from_document(json.loads(text)) == evidence


def test_the_digest_ignores_key_order_and_changes_with_any_field() -> None:
    document = SNP_EVIDENCE.document()
    assert evidence_digest(dict(reversed(list(document.items())))) == evidence_digest(document)
    assert evidence_digest({**document, "boot_id": "boot-c"}) != evidence_digest(document)


def malformed(document: Any) -> str:
    with pytest.raises(VerificationError) as refused:
        Evidence.from_document(document)
    assert refused.value.reason == "malformed-document"
    return refused.value.message


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "v0"}, "format must be 'tenzro-evidence-v1' or 'tenzro-evidence-v2', got 'v0'"),
        ({"type": "sgx"}, "type must be one of sev-snp, tdx, none, got 'sgx'"),
        ({"type": "tdx"}, "source 'sev-guest' cannot produce tdx evidence"),
        ({"report": "not base64!"}, "report is not valid base64: Only base64 data is allowed"),
        ({"report": None}, "sev-snp evidence needs a report"),
        ({"public_key": "AB" * 32}, "public_key must be lowercase hex"),
        ({"public_key": "ab" * 31}, "public key must be the 32 raw bytes of an Ed25519 key, got 31 bytes"),
        ({"nonce": "00" * 16}, "nonce must be exactly 32 bytes, got 16 bytes"),
        ({"boot_id": "../etc"}, "boot_id must be 1-64 characters of A-Z a-z 0-9 _ -, got '../etc'"),
        ({"gpu": {"cc_enabled": "yes"}}, "gpu: missing members ['dev_tools', 'devices', 'environment', 'ready'], "
                                         "unknown members []"),
        ({"extra": 1}, "evidence document: missing members [], unknown members ['extra']"),
    ],
)
def test_each_malformed_field_is_named(changes: dict[str, Any], message: str) -> None:
    assert malformed({**SNP_EVIDENCE.document(), **changes}).startswith(message)


def test_none_evidence_cannot_carry_a_report() -> None:
    document = {**NONE_EVIDENCE.document(), "report": "cmVwb3J0"}
    assert malformed(document) == "none evidence carries no report and no aux blob"


def test_a_document_must_be_an_object() -> None:
    assert malformed([]) == "evidence document must be a JSON object"


def test_gpu_evidence_with_cc_off_carries_nothing() -> None:
    with pytest.raises(MalformedEvidence, match="CC off carries no device reports"):
        GpuEvidence(cc_enabled=False, environment="prod", dev_tools=False, ready=True, devices=())


def test_v2_document_names_every_bound_value() -> None:
    document = NONE_V2.document()
    assert document == {
        "format": "tenzro-evidence-v2", "type": "none", "source": "none", "report": None, "aux": None, "gpu": None,
        "public_key": "00" * 32, "boot_id": "boot-a", "nonce": bytes(range(32)).hex(),
        "tls_spki_sha256": "11" * 32, "code_digest": "22" * 32,
        "models": [{"id": "alt", "digest": "44" * 32}, {"id": "default", "digest": "33" * 32}],
    }
    # printf '%s' '<the canonical JSON>' | sha256sum
    assert evidence_digest(document) == "93af6c04636efb3efad0f8fd90142e3fc8ae9440f3bb083346dbfccf1e09e35f"
    assert SNP_V2.document()["tls_spki_sha256"] is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tls_spki_sha256": "11" * 31}, "tls_spki_sha256 must be a 32-byte SHA-256 digest, got 31 bytes"),
        ({"tls_spki_sha256": "AA" * 32}, "tls_spki_sha256 must be lowercase hex"),
        ({"code_digest": None}, "code_digest must be lowercase hex"),
        ({"models": {"id": "a"}}, "models must be a list"),
        ({"models": []}, "a binding names 1 to 65535 models, got 0"),
        ({"models": [{"id": "a"}]}, "model: missing members ['digest'], unknown members []"),
        ({"models": [{"id": 7, "digest": "00" * 32}]}, "model id must be 1-256 printable ASCII characters, got 7"),
        ({"models": [{"id": "b", "digest": "00" * 32}, {"id": "a", "digest": "00" * 32}]},
         "models must be in ascending order of id, each id once; got ids ['b', 'a']"),
        ({"models": [{"id": "a", "digest": "00" * 32}, {"id": "a", "digest": "00" * 32}]},
         "models must be in ascending order of id, each id once; got ids ['a', 'a']"),
        ({"format": "tenzro-evidence-v1"}, "evidence document: missing members [], unknown members "
                                           "['code_digest', 'models', 'tls_spki_sha256']"),
    ],
)
def test_each_malformed_v2_field_is_named(changes: dict[str, Any], message: str) -> None:
    assert malformed({**NONE_V2.document(), **changes}) == message


def test_a_v2_document_without_its_bound_values_is_refused() -> None:
    document = {**NONE_EVIDENCE.document(), "format": "tenzro-evidence-v2"}
    assert malformed(document) == (
        "evidence document: missing members ['code_digest', 'models', 'tls_spki_sha256'], unknown members []"
    )
