"""The GPU verifier on NVIDIA's own vectors (NVIDIA/nvtrust @ 0281730, guest_tools/gpu_verifiers/local_gpu_verifier/
src/verifier/samples/ and certs/, copied under tests/attestation/vectors/nvtrust/):

- hopperAttestationReport.txt + hopperCertChain.txt: a real H100's SPDM report and its device chain;
- verifier_device_root.pem, verifier_RIM_root.pem: NVIDIA's device identity and RIM signing roots;
- 1010_0200_882_96005E0001_PROD.swidtag (a VBIOS RIM for the sample's board) and Driver_RIM_test_no_gpu.swidtag.

The sample's nonce is not a binding digest, so these call `verify_device` with the report's own nonce. Its driver
(550.90.07) and VBIOS (96.00.9f.00.01) match none of nvtrust's sample RIMs (driver 545.00, VBIOS 96.00.5e.00.01...):
the RIMs are checked here on their own, and measurements against RIMs in test_gpu_verify.py on a forged report.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from amd_forge import NOW
from nvidia_forge import (
    DEVICE_ROOT,
    HOPPER_CHAIN,
    HOPPER_REPORT,
    RIM_ROOT,
    SAMPLE_DRIVER_RIM,
    SAMPLE_VBIOS_RIM,
    VECTORS,
    nvidia_pki,
)

from attestation.chain import TrustRoots
from attestation.errors import VerificationError
from attestation.evidence import GpuDeviceReport
from attestation.gpu_verify import verify_device
from attestation.nvidia_rim import load_rim, select_rim

ROOTS = TrustRoots(directory=VECTORS, amd_arks=(), amd_asks=(), intel_roots=(), nvidia_device_roots=(DEVICE_ROOT,),
                   nvidia_rim_roots=(RIM_ROOT,))
SAMPLE_NONCE = bytes.fromhex("931d8dd0add203ac3d8b4fbde75e115278eefcdceac5b87671a748f32364dfcb")
RIM_TIME = datetime(2024, 6, 1, tzinfo=UTC)
"""Inside the sample RIMs' L4 signer validity (2023-06-23 to 2025-06-22)."""
DEVICE_PATH = [
    "CN=GH100 A01 GSP FMC LF,O=NVIDIA Corporation,C=US,2.5.4.5=53C22BA15E5D68088282DA074ED9FB37AA585771",
    "CN=GH100 A01 GSP BROM,O=NVIDIA Corporation,C=US,2.5.4.5=41431D480FE5E87274",
    "C=US,O=NVIDIA Corporation,CN=NVIDIA GH100 Provisioner ICA 1",
    "O=NVIDIA Corporation,CN=NVIDIA GH100 Identity",
    "O=NVIDIA,CN=NVIDIA Device Identity CA",
]
RIM_PATH = [
    "CN=HCC RIM L4 Signer,O=NVIDIA Corporation,L=Santa Clara,ST=CA,C=US",
    "C=US,O=NVIDIA Corporation,CN=NVIDIA Reference Value L3 GH100 001",
    "C=US,O=NVIDIA Corporation,CN=NVIDIA Reference Value GH100 CA",
    "CN=NVIDIA CoRIM signing Root CA,O=NVIDIA,C=US",
]
SAMPLE = "GPU 0 (GPU-hopper-sample)"


def device(report: bytes = HOPPER_REPORT, chain: bytes = HOPPER_CHAIN) -> GpuDeviceReport:
    return GpuDeviceReport(index=0, uuid="GPU-hopper-sample", report=report, cert_chain=chain)


def refusal(report: GpuDeviceReport, nonce: bytes = SAMPLE_NONCE, roots: TrustRoots = ROOTS) -> tuple[str, str]:
    with pytest.raises(VerificationError) as refused:
        verify_device(report, roots, nonce, NOW)
    return refused.value.reason, refused.value.message


def patched(offset: int) -> bytes:
    return HOPPER_REPORT[:offset] + bytes([HOPPER_REPORT[offset] ^ 0x01]) + HOPPER_REPORT[offset + 1:]


def test_the_hopper_sample_verifies_against_its_own_nonce() -> None:
    proof = verify_device(device(), ROOTS, SAMPLE_NONCE, NOW)
    assert [certificate.subject.rfc4514_string() for certificate in proof.path] == DEVICE_PATH
    report = proof.report
    assert (report.request_nonce, report.driver_version, report.vbios_version, report.board()) == (
        SAMPLE_NONCE, "550.90.07", "96.00.9f.00.01", "1010_0200_882")
    assert report.fwid is not None and report.fwid.hex()[:16] == "f5c384aebb579217"
    assert sorted(report.measurements) == list(range(1, 65))
    assert {len(value) for value in report.measurements.values()} == {48}


@pytest.mark.parametrize("offset", [4, 35, 37 + 8, 4117 - 96 - 200, 4117 - 1], ids=[
    "first nonce byte", "last nonce byte", "first measurement block", "opaque data", "last signature byte"])
def test_any_patched_byte_breaks_the_spdm_signature(offset: int) -> None:
    assert refusal(device(patched(offset))) == (
        "gpu-bad-signature", f"{SAMPLE}'s SPDM signature does not verify under its leaf {DEVICE_PATH[0]}: the report "
        "was altered or signed by another GPU")


def test_a_patched_nonce_is_a_bad_signature_even_when_the_verifier_expects_that_nonce() -> None:
    report = patched(4)
    assert refusal(device(report), nonce=report[4:36])[0] == "gpu-bad-signature"


def test_the_genuine_sample_under_another_nonce_is_a_binding_mismatch() -> None:
    assert refusal(device(), nonce=bytes(32)) == (
        "gpu-binding-mismatch", f"{SAMPLE} report was requested with nonce {SAMPLE_NONCE.hex()}, not the binding "
        f"digest {bytes(32).hex()}")


@pytest.mark.parametrize(("report", "expected"), [
    (HOPPER_REPORT[:37], ("gpu-truncated-report", "the GPU report is 37 bytes; an SPDM GET_MEASUREMENTS request and "
                          "signed response take at least 175")),
    (HOPPER_REPORT[:-1], ("gpu-truncated-report", "the response has 95 bytes after its opaque data, the signature "
                          "takes 96")),
    (HOPPER_REPORT[:2000], ("gpu-truncated-report", "the measurement record length overruns the response by 1565 "
                            "bytes")),
    (HOPPER_REPORT + b"\x00", ("gpu-malformed-report", "the response has 1 bytes after its 96-byte signature")),
    (HOPPER_REPORT[:2] + b"\x00" + HOPPER_REPORT[3:], ("gpu-malformed-report", "the request did not ask for a signed "
                                                       "response (Param1 bit 0 clear)")),
    (HOPPER_REPORT[:41] + b"\x3f" + HOPPER_REPORT[42:], ("gpu-malformed-report", "the response announces 63 "
                                                         "measurement blocks and carries 64")),
    (HOPPER_REPORT[:38] + b"\x61" + HOPPER_REPORT[39:], ("gpu-malformed-report", "the response is SPDM version 0x11 "
                                                         "code 0x61, not 1.1 MEASUREMENTS")),
], ids=["request only", "one byte short", "cut in the record", "trailing byte", "no signature asked",
        "block count", "response code"])
def test_a_report_of_the_wrong_shape_is_refused_with_its_reason(report: bytes, expected: tuple[str, str]) -> None:
    assert refusal(device(report)) == expected


@pytest.mark.parametrize("chain", [b"garbage", b"-----BEGIN CERTIFICATE-----\nZmFrZQ==\n-----END CERTIFICATE-----\n"],
                         ids=["not PEM", "PEM of no certificate"])
def test_a_garbage_chain_is_a_bad_certificate(chain: bytes) -> None:
    reason, message = refusal(device(chain=chain))
    assert (reason, message.startswith(f"{SAMPLE}'s certificate chain is not PEM certificates: ")) == (
        "gpu-bad-certificate", True)


def test_a_chain_to_another_root_is_untrusted() -> None:
    forged_root = TrustRoots(directory=Path("/forged"), amd_arks=(), amd_asks=(), intel_roots=(),
                             nvidia_device_roots=(nvidia_pki().device_root,))
    assert refusal(device(), roots=forged_root) == (
        "gpu-untrusted-chain", f"{SAMPLE}: {DEVICE_PATH[3]} names issuer {DEVICE_PATH[4]}, but its signature does not "
        "verify under that certificate's key: the chain was signed by another root")


def test_a_chain_without_its_leaf_certifies_no_firmware() -> None:
    without_leaf = HOPPER_CHAIN[HOPPER_CHAIN.index(b"-----END CERTIFICATE-----") + 26:]
    assert refusal(device(chain=without_leaf)) == (
        "gpu-untrusted-chain", f"{SAMPLE}'s report names firmware f5c384aebb579217a2c66b17ed0f28e6a9b8d639041acd7b4721"
        f"cec004f7275494ba94bb5cdfdb3055ee051762b1f75d, its leaf {DEVICE_PATH[1]} certifies no firmware")


def test_no_device_root_configured_is_a_missing_trust_root() -> None:
    empty = TrustRoots(directory=Path("/trust"), amd_arks=(), amd_asks=(), intel_roots=())
    assert refusal(device(), roots=empty) == (
        "missing-trust-root", "GPU evidence needs /trust/nvidia_device_root.pem, which is absent")


def test_the_sample_rims_verify_to_nvidias_rim_root() -> None:
    vbios = load_rim("vbios.swidtag", SAMPLE_VBIOS_RIM, (RIM_ROOT,), RIM_TIME)
    driver = load_rim("driver.swidtag", SAMPLE_DRIVER_RIM, (RIM_ROOT,), RIM_TIME)
    assert [certificate.subject.rfc4514_string() for certificate in vbios.signer_path] == RIM_PATH
    assert (vbios.version, driver.version) == ("96.00.5e.00.01", "545.00")
    assert (len(vbios.values), len(driver.values)) == (64, 64)
    assert [value.index for value in vbios.values if value.active] == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12]
    assert [value.index for value in driver.values if value.active] == [7, *range(21, 41)]
    assert vbios.values[1].name == "HashedMeasurement_1_FSP"
    assert vbios.values[1].values[0].hex()[:16] == "c3f65ef79a19c029"


def test_the_sample_rims_do_not_match_the_sample_reports_versions() -> None:
    files = {"vbios.swidtag": SAMPLE_VBIOS_RIM, "driver.swidtag": SAMPLE_DRIVER_RIM}
    with pytest.raises(VerificationError) as refused:
        select_rim(files, "550.90.07", f"driver 550.90.07 of {SAMPLE}", (RIM_ROOT,), RIM_TIME)
    assert (refused.value.reason, refused.value.message) == (
        "missing-collateral", f"no RIM file for the driver 550.90.07 of {SAMPLE} (RIM files given: driver.swidtag, "
        "vbios.swidtag)")


def test_only_the_rim_a_report_names_is_verified() -> None:
    """An auditor's collateral keeps RIMs of drivers met before: one that no longer verifies (here the VBIOS RIM
    past its signer's expiry, and a file that is not XML at all is refused only when chosen) never refuses a
    report of another version."""
    files = {"vbios.swidtag": SAMPLE_VBIOS_RIM, "driver.swidtag": SAMPLE_DRIVER_RIM}
    later = RIM_TIME.replace(year=2100)
    with pytest.raises(VerificationError) as refused:
        select_rim(files, "96.00.5E.00.01", "VBIOS 96.00.5E.00.01", (RIM_ROOT,), later)
    assert refused.value.reason == "expired-collateral"
    chosen = select_rim(files, "96.00.5E.00.01", "VBIOS 96.00.5E.00.01", (RIM_ROOT,), RIM_TIME)
    assert (chosen.source, chosen.version) == ("vbios.swidtag", "96.00.5e.00.01")
    with pytest.raises(VerificationError) as refused:
        select_rim({**files, "other.swidtag": SAMPLE_VBIOS_RIM}, "96.00.5e.00.01", "VBIOS", (RIM_ROOT,), RIM_TIME)
    assert (refused.value.reason, refused.value.message) == (
        "bad-collateral", "several RIM files for the VBIOS: other.swidtag, vbios.swidtag; keep the one for this board")


def rim_refusal(data: bytes, roots: tuple = (RIM_ROOT,), now: datetime = RIM_TIME) -> tuple[str, str]:
    with pytest.raises(VerificationError) as refused:
        load_rim("sample.swidtag", data, roots, now)
    return refused.value.reason, refused.value.message


def test_a_sample_rim_with_a_patched_reference_value_is_bad_collateral() -> None:
    tampered = SAMPLE_VBIOS_RIM.replace(b'ns2:Hash0="c3f65ef7', b'ns2:Hash0="c3f65ef8', 1)
    assert tampered != SAMPLE_VBIOS_RIM
    reason, message = rim_refusal(tampered)
    assert (reason, message) == ("bad-collateral", f"RIM sample.swidtag signature does not verify under {RIM_PATH[0]}: "
                                 "Digest mismatch for reference 0 ()")


def test_a_sample_rim_without_its_signature_is_unsigned() -> None:
    unsigned = SAMPLE_VBIOS_RIM[:SAMPLE_VBIOS_RIM.index(b"<ds:Signature")] + b"</SoftwareIdentity>"
    assert rim_refusal(unsigned) == (
        "bad-collateral", "RIM sample.swidtag carries no signature with an X.509 certificate chain: it is not signed")


def test_a_sample_rim_under_another_rim_root_is_bad_collateral() -> None:
    reason, message = rim_refusal(SAMPLE_VBIOS_RIM, roots=(nvidia_pki().rim_root,))
    assert (reason, message.startswith("sample.swidtag's signing chain: ")) == ("bad-collateral", True)


def test_a_sample_rim_past_its_signers_validity_is_expired_collateral() -> None:
    assert rim_refusal(SAMPLE_VBIOS_RIM, now=NOW) == (
        "expired-collateral", f"sample.swidtag's signing chain: {RIM_PATH[0]} is valid from 2023-06-23T09:30:33+00:00 "
        "to 2025-06-22T09:30:33+00:00, not at 2026-12-01T00:00:00+00:00")


def test_rims_are_xml_parsed_without_entities() -> None:
    bomb = b'<!DOCTYPE x [<!ENTITY a "aaaa">]><SoftwareIdentity>&a;</SoftwareIdentity>'
    assert rim_refusal(bomb)[0] == "bad-collateral"
