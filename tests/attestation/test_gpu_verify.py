"""The GPU part of whole evidence documents, on a forged NVIDIA PKI with the real subject names (nvidia_forge.py):
reports requested with the binding digest, measurements against signed RIMs, OCSP, and the CC state."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from amd_forge import BOOT_ID, NODE_KEY, NONCE, NOW, pem
from nvidia_forge import MEASUREMENTS, NvidiaPki, make_nvidia_pki, nvidia_pki, ocsp_response, ocsp_responses, rim, rims
from nvidia_forge import spdm_report as forged_report
from verifying import refusal, verified

from attestation.binding import binding_digest
from attestation.checks import GpuResult
from attestation.collateral import Collateral
from attestation.evidence import Evidence, GpuDeviceReport, GpuEvidence
from attestation.gpu_verify import NO_OCSP, NO_RIMS

DIGEST = binding_digest(NODE_KEY, NONCE)
PKI = nvidia_pki()
GPU = "GPU 0 (GPU-a)"


@pytest.fixture(scope="module")
def other() -> NvidiaPki:
    """Same names, other keys: what a forger can make."""
    return make_nvidia_pki()


def evidence(report: bytes | None = None, **gpu: Any) -> Evidence:
    device = GpuDeviceReport(index=0, uuid="GPU-a", report=report or forged_report(PKI, DIGEST),
                             cert_chain=PKI.chain_pem())
    state = {"cc_enabled": True, "environment": "prod", "dev_tools": False, "ready": True, "devices": (device,), **gpu}
    return Evidence(evidence_type="none", source="none", report=b"", aux=b"", gpu=GpuEvidence(**state),
                    public_key=NODE_KEY, boot_id=BOOT_ID, nonce=NONCE)


def collateral(rim_files: dict[str, bytes] | None = None, ocsp_files: dict[str, bytes] | None = None) -> Collateral:
    return Collateral(directory=Path("/collateral"), nvidia_rims=rims(PKI) if rim_files is None else rim_files,
                      nvidia_ocsp=ocsp_responses(PKI) if ocsp_files is None else ocsp_files)


def test_a_whole_document_with_rims_and_ocsp_verifies_the_gpu(trust_dir: Path) -> None:
    result = verified(evidence().document(), trust_dir, allow_none=True, collateral=collateral())
    assert result.gpu == GpuResult(verified=True, devices=1, measurements_checked=True, not_checked=())
    assert result.not_checked == ()
    gpu_checks = [str(check) for check in result.checks if check.name.startswith("gpu")]
    assert gpu_checks[0] == "gpu: confidential computing on (environment prod, devtools off, ready True)"
    assert gpu_checks[1] == (
        f"gpu report: {GPU}: SPDM measurements signed by CN=GH100 A01 GSP FMC LF,O=NVIDIA Corporation,C=US,"
        "2.5.4.5=53C22BA15E5D68088282DA074ED9FB37AA585771 <- CN=GH100 A01 GSP BROM,O=NVIDIA Corporation,C=US,"
        "2.5.4.5=41431D480FE5E87274 <- C=US,O=NVIDIA Corporation,CN=NVIDIA GH100 Provisioner ICA 1 <- "
        "O=NVIDIA Corporation,CN=NVIDIA GH100 Identity <- O=NVIDIA,CN=NVIDIA Device Identity CA (ECDSA P-384 SHA-384)"
        ", requested with the binding digest")
    assert gpu_checks[2] == (f"gpu measurements: {GPU}: 64 measurements match NVIDIA's reference values in "
                             "driver.swidtag (550.90.07) and vbios.swidtag (96.00.9f.00.01)")
    assert gpu_checks[3].startswith("gpu revocation: good: CN=GH100 A01 GSP BROM,")
    assert gpu_checks[3].count(".der)") == 6
    assert gpu_checks[4] == "gpu: 1 GPU(s) verified"


def test_without_collateral_measurements_and_revocation_are_not_checked(trust_dir: Path) -> None:
    result = verified(evidence(), trust_dir, allow_none=True)
    assert result.gpu == GpuResult(verified=True, devices=1, measurements_checked=False, not_checked=(NO_RIMS, NO_OCSP))
    assert result.not_checked == ("gpu measurements: no NVIDIA RIM files", "gpu revocation: no OCSP responses")


def test_a_measurement_that_differs_from_the_rim_is_refused(trust_dir: Path) -> None:
    report = forged_report(PKI, DIGEST, {**MEASUREMENTS, 5: bytes(48), 40: bytes(48)})
    assert refusal(evidence(report), trust_dir, allow_none=True, collateral=collateral()) == (
        "gpu-measurement-mismatch", f"{GPU}: measurements at RIM index 4 (HashedMeasurement_4, vbios.swidtag), "
        "39 (HashedMeasurement_39, driver.swidtag) differ from NVIDIA's reference values")


def test_a_measurement_the_report_lacks_is_refused(trust_dir: Path) -> None:
    report = forged_report(PKI, DIGEST, {index: value for index, value in MEASUREMENTS.items() if index != 64})
    assert refusal(evidence(report), trust_dir, allow_none=True, collateral=collateral()) == (
        "gpu-measurement-mismatch", f"{GPU}: measurements at RIM index 63 (HashedMeasurement_63, driver.swidtag) "
        "differ from NVIDIA's reference values")


def test_no_rim_for_the_reports_driver_is_missing_collateral(trust_dir: Path) -> None:
    files = {"vbios.swidtag": rims(PKI)["vbios.swidtag"], "old.swidtag": rim(PKI, "535.00", MEASUREMENTS, [40])}
    assert refusal(evidence(), trust_dir, allow_none=True, collateral=collateral(files)) == (
        "missing-collateral", f"no RIM file for the driver 550.90.07 of {GPU} (RIM files given: old.swidtag, "
        "vbios.swidtag)")


def test_rims_active_at_the_same_index_are_bad_collateral(trust_dir: Path) -> None:
    files = {**rims(PKI), "driver.swidtag": rim(PKI, "550.90.07", MEASUREMENTS, [3, 40])}
    assert refusal(evidence(), trust_dir, allow_none=True, collateral=collateral(files)) == (
        "bad-collateral", "RIM index 3 is active in both driver.swidtag and vbios.swidtag")


def test_a_rim_signed_by_another_pki_is_bad_collateral(trust_dir: Path, other: NvidiaPki) -> None:
    files = {**rims(PKI), "driver.swidtag": rims(other)["driver.swidtag"]}
    reason, message = refusal(evidence(), trust_dir, allow_none=True, collateral=collateral(files))
    assert (reason, message.startswith("driver.swidtag's signing chain: ")) == ("bad-collateral", True)


def test_a_rim_whose_values_were_edited_is_bad_collateral(trust_dir: Path) -> None:
    genuine = rims(PKI)
    edited = genuine["vbios.swidtag"].replace(MEASUREMENTS[5].hex().encode(), bytes(48).hex().encode())
    files = {**genuine, "vbios.swidtag": edited}
    reason, message = refusal(evidence(forged_report(PKI, DIGEST, {**MEASUREMENTS, 5: bytes(48)})), trust_dir,
                              allow_none=True, collateral=collateral(files))
    assert (reason, message.split(": ")[-1]) == ("bad-collateral", "Digest mismatch for reference 0 ()")


def test_a_revoked_gpu_certificate_is_refused(trust_dir: Path) -> None:
    ica = PKI.device[2].certificate
    files = ocsp_responses(PKI, revoked=ica)
    reason, message = refusal(evidence(), trust_dir, allow_none=True, collateral=collateral(ocsp_files=files))
    assert (reason, message) == (
        "revoked", f"C=US,O=NVIDIA Corporation,CN=NVIDIA GH100 Provisioner ICA 1 (serial {ica.serial_number:#x}) is "
        f"revoked since {(NOW - timedelta(days=1)).isoformat()} (key_compromise), says {ica.serial_number:x}.der")


def test_a_revoked_rim_signer_is_refused(trust_dir: Path) -> None:
    files = ocsp_responses(PKI, revoked=PKI.rim[0].certificate)
    assert refusal(evidence(), trust_dir, allow_none=True, collateral=collateral(ocsp_files=files))[0] == "revoked"


def test_certificates_without_an_ocsp_response_are_named_not_checked(trust_dir: Path) -> None:
    files = ocsp_responses(PKI)
    brom = PKI.device[1].certificate
    del files[f"{brom.serial_number:x}.der"]
    result = verified(evidence(), trust_dir, allow_none=True, collateral=collateral(ocsp_files=files))
    assert result.not_checked == (
        "gpu revocation: no OCSP response for CN=GH100 A01 GSP BROM,O=NVIDIA Corporation,C=US,"
        "2.5.4.5=41431D480FE5E87274",)
    assert result.gpu is not None and result.gpu.verified


def test_an_ocsp_response_from_another_responder_is_bad_collateral(trust_dir: Path, other: NvidiaPki) -> None:
    brom, ica = PKI.device[1].certificate, PKI.device[2].certificate
    files = {**ocsp_responses(PKI), f"{brom.serial_number:x}.der": ocsp_response(brom, ica, other.device_responder)}
    assert refusal(evidence(), trust_dir, allow_none=True, collateral=collateral(ocsp_files=files)) == (
        "bad-collateral", f"{brom.serial_number:x}.der is signed neither by C=US,O=NVIDIA Corporation,CN=NVIDIA GH100 "
        "Provisioner ICA 1 nor by an OCSP responder certificate (id-kp-OCSPSigning, valid now) that the verified path "
        "issued")


def test_a_stale_ocsp_response_is_expired_collateral(trust_dir: Path) -> None:
    brom, ica = PKI.device[1].certificate, PKI.device[2].certificate
    stale = ocsp_response(brom, ica, PKI.device_responder, this_update=NOW - timedelta(days=30))
    files = {**ocsp_responses(PKI), f"{brom.serial_number:x}.der": stale}
    assert refusal(evidence(), trust_dir, allow_none=True, collateral=collateral(ocsp_files=files))[0] == (
        "expired-collateral")


def test_a_report_requested_with_another_nonce_is_a_binding_mismatch(trust_dir: Path) -> None:
    assert refusal(evidence(forged_report(PKI, bytes(32))), trust_dir, allow_none=True)[0] == "gpu-binding-mismatch"


def test_a_report_signed_by_another_gpu_is_a_bad_signature(trust_dir: Path, other: NvidiaPki) -> None:
    assert refusal(evidence(forged_report(other, DIGEST)), trust_dir, allow_none=True)[0] == "gpu-bad-signature"


def test_a_chain_from_a_forged_pki_is_untrusted(tmp_path: Path, other: NvidiaPki) -> None:
    (tmp_path / "nvidia_device_root.pem").write_bytes(pem(other.device_root))
    assert refusal(evidence(), tmp_path, allow_none=True)[0] == "gpu-untrusted-chain"


def test_rim_files_without_a_rim_root_are_a_missing_trust_root(tmp_path: Path) -> None:
    (tmp_path / "nvidia_device_root.pem").write_bytes(pem(PKI.device_root))
    assert refusal(evidence(), tmp_path, allow_none=True, collateral=collateral()) == (
        "missing-trust-root", f"GPU RIM evidence needs {tmp_path / 'nvidia_rim_root.pem'}, which is absent")


def test_cc_off_is_an_unverified_gpu(trust_dir: Path) -> None:
    off = evidence(cc_enabled=False, environment="prod", ready=None, devices=())
    result = verified(off, trust_dir, allow_none=True)
    assert result.gpu == GpuResult(verified=False, devices=0, measurements_checked=False)


@pytest.mark.parametrize(("state", "line"), [
    ({"environment": "sim"}, "gpu: NOT verified: environment sim is not production"),
    ({"dev_tools": True}, "gpu: NOT verified: devtools mode is on, so a debugger can read GPU memory"),
    ({"devices": ()}, "gpu: NOT verified: confidential computing is on but the node brought no GPU report"),
], ids=["sim", "devtools", "no devices"])
def test_a_gpu_outside_production_is_reported_unverified(trust_dir: Path, state: dict[str, Any], line: str) -> None:
    result = verified(evidence(**state), trust_dir, allow_none=True)
    assert str(result.checks[-1]) == line
    assert result.gpu is not None and result.gpu.verified is False


def test_a_truncated_report_is_refused_before_any_root_is_needed(tmp_path: Path) -> None:
    assert refusal(evidence(forged_report(PKI, DIGEST)[:100]), tmp_path, allow_none=True)[0] == "gpu-truncated-report"
