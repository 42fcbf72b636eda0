"""Binding v2 end to end: collected through the fake TEE interfaces, verified, and every bound value held to it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from amd_forge import (
    BOOT_ID,
    BOUND,
    CODE_DIGEST,
    MODEL_DIGEST,
    NODE_KEY,
    NONCE,
    OTHER_NODE_KEY,
    REPORT_DATA,
    REPORT_DATA_V2,
    TLS_SPKI,
    AmdPki,
    snp_evidence,
    snp_report,
    vcek_and_ask,
)
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from fake_nvml import FakeNvml
from fake_tsm import FakeTsm
from intel_forge import IntelPki, tdx_quote
from verifying import refusal, verified

from attestation.binding import binding_digest, report_data_for
from attestation.collect import collect_evidence
from attestation.evidence import Evidence
from attestation.nvml_cc import NvmlLoader, gpu_evidence

Vcek = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]
MADE_FOR_OTHER = "the report was made for another key, TLS certificate, code, model set or nonce"


def no_nvml() -> None:
    return None


def collect_v2(tmp_path: Path, tsm: FakeTsm | None = None, nvml: NvmlLoader = no_nvml) -> Evidence:
    root = tmp_path / "no-tsm" if tsm is None else tsm.root
    return collect_evidence(NODE_KEY, NONCE, BOOT_ID, tsm_root=root, sev_guest=tmp_path / "no-sev-guest",
                            nvml=nvml, tsm_files=tsm, bound=BOUND)


@pytest.fixture
def snp_tsm(tmp_path: Path, amd: AmdPki, vcek: Vcek) -> FakeTsm:
    table = vcek_and_ask(amd, vcek[1])
    return FakeTsm(tmp_path / "tsm", "sev_guest", lambda inblob: (snp_report(vcek[0], inblob), table))


@pytest.fixture
def good_v2(amd: AmdPki, vcek: Vcek) -> dict[str, Any]:
    """A v2 SEV-SNP document whose report binds NODE_KEY, BOUND and NONCE."""
    return snp_evidence(snp_report(vcek[0], REPORT_DATA_V2), vcek_and_ask(amd, vcek[1]), bound=BOUND).document()


def test_snp_v2_round_trips_through_configfs_tsm_and_json(tmp_path: Path, snp_tsm: FakeTsm, trust_dir: Path) -> None:
    evidence = collect_v2(tmp_path, snp_tsm)
    assert snp_tsm.inblobs == [REPORT_DATA_V2]
    document = json.loads(json.dumps(evidence.document()))
    assert (document["format"], document["tls_spki_sha256"], document["code_digest"], document["models"]) == (
        "tenzro-evidence-v2", TLS_SPKI.hex(), CODE_DIGEST.hex(), [{"id": "default", "digest": MODEL_DIGEST.hex()}]
    )
    result = verified(document, trust_dir)
    assert (result.trusted, result.digest, result.binding_version) == (True, evidence.digest(), 2)
    assert (result.tls_spki_sha256_hex, result.code_digest_hex, result.model_digests) == (
        TLS_SPKI.hex(), CODE_DIGEST.hex(), (("default", MODEL_DIGEST.hex()),)
    )
    assert {check.name: check.detail for check in result.checks}["key binding"] == (
        f"report_data binds public key {NODE_KEY.hex()}, TLS SPKI SHA-256 {TLS_SPKI.hex()}, code "
        f"{CODE_DIGEST.hex()}, models [default={MODEL_DIGEST.hex()}] and the nonce"
    )


def test_tdx_v2_round_trips(tmp_path: Path, intel: IntelPki, trust_dir: Path) -> None:
    tsm = FakeTsm(tmp_path / "tsm", "tdx_guest", lambda inblob: (tdx_quote(intel, inblob), b""))
    result = verified(collect_v2(tmp_path, tsm).document(), trust_dir)
    assert (result.evidence_type, result.trusted, result.binding_version, result.code_digest_hex) == (
        "tdx", True, 2, CODE_DIGEST.hex()
    )


def test_v2_gpu_reports_are_requested_with_the_v2_digest(
    tmp_path: Path, snp_tsm: FakeTsm, trust_dir: Path
) -> None:
    evidence = collect_v2(tmp_path, snp_tsm, nvml=FakeNvml)
    assert evidence.gpu is not None
    assert [device.report[4:36] for device in evidence.gpu.devices] == [REPORT_DATA_V2[:32]]
    assert verified(evidence.document(), trust_dir).checks[-1].name == "gpu"


def test_a_node_without_tls_binds_code_and_models(tmp_path: Path, amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    bound = replace(BOUND, tls_spki_sha256=None)
    report = snp_report(vcek[0], report_data_for(NODE_KEY, NONCE, bound))
    result = verified(snp_evidence(report, vcek_and_ask(amd, vcek[1]), bound=bound).document(), trust_dir)
    assert (result.binding_version, result.tls_spki_sha256_hex, result.code_digest_hex) == (
        2, None, CODE_DIGEST.hex()
    )


OTHER = bytes(range(1, 33)).hex()


@pytest.mark.parametrize(
    ("changes", "shown"),
    [
        ({"public_key": OTHER_NODE_KEY.hex()}, f"public key {OTHER_NODE_KEY.hex()}"),
        ({"tls_spki_sha256": OTHER}, f"TLS SPKI SHA-256 {OTHER}"),
        ({"tls_spki_sha256": None}, "TLS SPKI SHA-256 none (plain HTTP)"),
        ({"code_digest": OTHER}, f"code {OTHER}"),
        ({"models": [{"id": "default", "digest": OTHER}]}, f"models [default={OTHER}]"),
        ({"models": [{"id": "other", "digest": MODEL_DIGEST.hex()}]}, f"models [other={MODEL_DIGEST.hex()}]"),
        ({"models": [{"id": "default", "digest": MODEL_DIGEST.hex()}, {"id": "extra", "digest": OTHER}]},
         f"models [default={MODEL_DIGEST.hex()}, extra={OTHER}]"),
        ({"nonce": OTHER}, f"nonce {OTHER}"),
    ],
    ids=["public_key", "tls_spki", "tls_dropped", "code", "model_digest", "model_id", "model_added", "nonce"],
)
def test_each_changed_bound_value_fails_the_binding_naming_the_values(
    good_v2: dict[str, Any], trust_dir: Path, changes: dict[str, Any], shown: str
) -> None:
    tampered = {**good_v2, **changes}
    evidence = Evidence.from_document(tampered)
    assert evidence.bound is not None
    assert refusal(tampered, trust_dir) == (
        "key-binding-mismatch",
        f"report_data is {REPORT_DATA_V2.hex()}, the binding v2 of public key {evidence.public_key.hex()}, "
        f"{evidence.bound.describe()} and nonce {evidence.nonce.hex()} is "
        f"{report_data_for(evidence.public_key, evidence.nonce, evidence.bound).hex()}: {MADE_FOR_OTHER}",
    )
    assert shown in refusal(tampered, trust_dir)[1]


def test_a_v1_document_still_verifies_and_binds_no_more(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    document = snp_evidence(snp_report(vcek[0], REPORT_DATA), vcek_and_ask(amd, vcek[1])).document()
    assert document["format"] == "tenzro-evidence-v1"
    result = verified(document, trust_dir)
    assert (result.trusted, result.binding_version, result.tls_spki_sha256_hex, result.code_digest_hex,
            result.model_digests) == (True, 1, None, None, ())


def test_a_v1_report_in_a_v2_document_is_refused(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    """A report made under v1 cannot be dressed up as binding a TLS key, code and models."""
    document = snp_evidence(snp_report(vcek[0], REPORT_DATA), vcek_and_ask(amd, vcek[1]), bound=BOUND).document()
    reason, message = refusal(document, trust_dir)
    assert (reason, message.startswith(f"report_data is {REPORT_DATA.hex()}, the binding v2 of")) == (
        "key-binding-mismatch", True
    )


def test_a_v2_report_in_a_v1_document_is_refused(good_v2: dict[str, Any], trust_dir: Path) -> None:
    """Stripping the bound values (a downgrade to v1) leaves a report that binds nothing the document names."""
    v1 = {key: value for key, value in good_v2.items() if key not in ("tls_spki_sha256", "code_digest", "models")}
    reason, message = refusal({**v1, "format": "tenzro-evidence-v1"}, trust_dir)
    assert (reason, message.endswith("the report was made for another key or nonce")) == (
        "key-binding-mismatch", True
    )


def test_anything_in_the_second_half_of_report_data_is_refused(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    report = snp_report(vcek[0], REPORT_DATA_V2[:32] + bytes([1]) * 32)
    assert refusal(snp_evidence(report, vcek_and_ask(amd, vcek[1]), bound=BOUND), trust_dir)[0] == (
        "key-binding-mismatch"
    )


def test_none_v2_carries_the_values_and_passes_only_when_allowed(tmp_path: Path, trust_dir: Path) -> None:
    evidence = collect_v2(tmp_path)
    assert (evidence.evidence_type, evidence.bound, evidence.document()["format"]) == (
        "none", BOUND, "tenzro-evidence-v2"
    )
    assert refusal(evidence.document(), trust_dir)[0] == "none-evidence"
    result = verified(evidence.document(), tmp_path / "absent", allow_none=True)
    assert (result.trusted, result.binding_version, result.tls_spki_sha256_hex, result.model_digests) == (
        False, 2, TLS_SPKI.hex(), (("default", MODEL_DIGEST.hex()),)
    )
    assert [str(check) for check in result.checks] == [
        "evidence: none: no TEE report; accepted because none evidence was allowed, UNTRUSTED",
        f"key binding: none: the node claims {BOUND.describe()}; no report binds them",
        f"nonce: {NONCE.hex()} matches",
        "gpu: no GPU evidence (no NVIDIA driver on the node)",
    ]


def test_none_v2_gpu_reports_must_answer_the_v2_digest(tmp_path: Path, trust_dir: Path) -> None:
    """Without a CPU report the GPU reports are what binds the values: one asked under v1 is refused."""
    v1_gpu = gpu_evidence(binding_digest(NODE_KEY, NONCE), FakeNvml(uuids=("GPU-x",)))
    evidence = replace(collect_v2(tmp_path), gpu=v1_gpu)
    assert refusal(evidence, trust_dir, allow_none=True) == (
        "gpu-binding-mismatch",
        f"GPU 0 (GPU-x) report was requested with nonce {binding_digest(NODE_KEY, NONCE).hex()}, not the binding "
        f"digest {REPORT_DATA_V2[:32].hex()}",
    )


def test_bound_values_must_be_a_bound_identity() -> None:
    with pytest.raises(ValueError, match="bound values must be a BoundIdentity, got a dict"):
        Evidence(evidence_type="none", source="none", report=b"", aux=b"", gpu=None, public_key=NODE_KEY,
                 boot_id=BOOT_ID, nonce=NONCE, bound={"code_digest": CODE_DIGEST})  # type: ignore[arg-type]


def test_collect_refuses_malformed_bound_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bound values must be a BoundIdentity, got a tuple"):
        collect_evidence(NODE_KEY, NONCE, BOOT_ID, tsm_root=tmp_path / "x", sev_guest=tmp_path / "y", nvml=no_nvml,
                         bound=(TLS_SPKI, CODE_DIGEST))  # type: ignore[arg-type]
