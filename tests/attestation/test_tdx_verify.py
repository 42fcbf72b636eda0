"""TDX verification: a good quote passes every check; each broken link fails with its own reason."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
from amd_forge import MEASUREMENT, NODE_KEY, NONCE, OTHER_NODE_KEY, pem
from cryptography.hazmat.primitives.asymmetric import ec
from intel_forge import INTEL_QE_VENDOR, MRTD, QE_AUTH_DATA, TEE_TCB_SVN, IntelPki, point, tdx_quote
from verifying import refusal, verified

from attestation.binding import report_data_for
from attestation.evidence import Evidence
from attestation.tdx import parse_tdx_quote

ATTESTATION_KEY = ec.derive_private_key(7, ec.SECP256R1())


def tdx_evidence(quote: bytes, public_key: bytes = NODE_KEY) -> Evidence:
    return Evidence(evidence_type="tdx", source="configfs-tsm", report=quote, aux=b"", gpu=None,
                    public_key=public_key, boot_id="boot-a", nonce=NONCE)


@pytest.fixture(scope="module")
def good_quote(intel: IntelPki) -> bytes:
    return tdx_quote(intel, attestation_key=ATTESTATION_KEY)


def test_a_good_quote_passes_every_check_in_order(good_quote: bytes, trust_dir: Path) -> None:
    result = verified(tdx_evidence(good_quote), trust_dir, expected_measurement=MRTD)
    assert [str(check) for check in result.checks[:-2]] == [
        f"quote: TDX v4, ECDSA P-256 attestation key, QE vendor {INTEL_QE_VENDOR.hex()}",
        "pck chain: CN=Intel SGX PCK Certificate <- CN=Intel SGX PCK Platform CA <- CN=Intel SGX Root CA "
        "(ECDSA P-256 SHA-256)",
        "qe report signature: ECDSA P-256 SHA-256 by the PCK key",
        "qe binding: QE REPORTDATA = SHA-256(attestation key || QE auth data) || zero",
        "quote signature: ECDSA P-256 SHA-256 over bytes [0x000, 0x278) by the attestation key",
        "pck platform: FMSPC 50806f000000, PCEID 0000, PCESVN 11, SGX TCB components 3.3.2.2.2.1.0.2.0.0.0.0.0.0.0.0",
        f"tcb: TEE_TCB_SVN {TEE_TCB_SVN.hex()} (not evaluated: no Intel TCB info or QE identity given)",
        "td attributes: 0x0, debug off",
        f"measurement: MRTD {MRTD.hex()} matches",
        f"key binding: report_data binds public key {NODE_KEY.hex()} and the nonce",
    ]
    assert (result.evidence_type, result.trusted, result.measurement_hex) == ("tdx", True, MRTD.hex())


def test_without_collateral_the_tcb_status_is_none_and_what_was_not_checked_is_named(
        good_quote: bytes, trust_dir: Path) -> None:
    """The trust policy, not the verifier, refuses an unevaluated TCB: each absent file is named."""
    result = verified(tdx_evidence(good_quote), trust_dir)
    assert (result.tcb_status, result.advisory_ids) == (None, ())
    assert result.not_checked == (
        "tcb status: neither <no collateral given>/intel/tcb_info_50806f000000.json nor <no collateral given>/intel/"
        "qe_identity.json was given: the quoting enclave's identity and the platform's TCB were not judged",
        "revocation: <no collateral given>/intel/pck_crl_platform.der was not given: the PCK certificate was not "
        "checked against the CRL of Intel SGX PCK Platform CA",
        "revocation: <no collateral given>/intel/root_crl.der was not given: CN=Intel SGX PCK Platform CA not "
        "checked against the Intel SGX Root CA's CRL",
    )


@pytest.mark.parametrize(("body_type", "signed_end", "name"), [(2, 0x27E, "TD 1.0"), (3, 0x2BE, "TD 1.5")])
def test_a_v5_quote_verifies_over_its_descriptor_and_body(
        intel: IntelPki, trust_dir: Path, body_type: int, signed_end: int, name: str) -> None:
    quote = tdx_quote(intel, attestation_key=ATTESTATION_KEY, body_type=body_type)
    parsed = parse_tdx_quote(quote)
    assert (parsed.version, parsed.body_type, parsed.mrtd, parsed.report_data, len(parsed.signed_bytes)) == (
        5, body_type, MRTD, report_data_for(NODE_KEY, NONCE), signed_end)
    assert (parsed.tee_tcb_svn2, parsed.mrservicetd) == ((bytes(16), bytes(48)) if body_type == 3 else (None, None))
    checks = [str(check) for check in verified(tdx_evidence(quote), trust_dir).checks]
    assert checks[0] == f"quote: TDX v5 ({name} body), ECDSA P-256 attestation key, QE vendor {INTEL_QE_VENDOR.hex()}"
    assert checks[4] == (
        f"quote signature: ECDSA P-256 SHA-256 over bytes [0x000, {signed_end:#x}) by the attestation key")


def test_a_changed_v5_body_fails(intel: IntelPki, trust_dir: Path) -> None:
    quote = bytearray(tdx_quote(intel, body_type=3))
    quote[0x2BD] ^= 1  # the last byte of MRSERVICETD
    assert refusal(tdx_evidence(bytes(quote)), trust_dir)[0] == "bad-report-signature"


def test_a_v5_body_type_of_an_sgx_enclave_is_unsupported(intel: IntelPki, trust_dir: Path) -> None:
    assert refusal(tdx_evidence(tdx_quote(intel, body_type=1)), trust_dir) == (
        "unsupported-report", "v5 quote body type 1; this verifier reads types 2 (TD 1.0 report) and 3 (TD 1.5 report)")


def test_the_quote_parses_at_the_documented_offsets(good_quote: bytes) -> None:
    quote = parse_tdx_quote(good_quote + b"padding after the signature data")
    assert (quote.version, quote.att_key_type, quote.tee_type, quote.qe_vendor_id) == (4, 2, 0x81, INTEL_QE_VENDOR)
    assert (quote.mrtd, quote.report_data, quote.td_attributes) == (MRTD, report_data_for(NODE_KEY, NONCE), 0)
    assert (quote.attestation_key, quote.qe_auth_data) == (point(ATTESTATION_KEY), QE_AUTH_DATA)
    assert quote.qe_report_data == hashlib.sha256(point(ATTESTATION_KEY) + QE_AUTH_DATA).digest() + bytes(32)
    assert quote.signed_bytes == good_quote[:0x278]


@pytest.mark.parametrize("offset", [0x030, 0x0B8, 0x238, 0x277])
def test_a_changed_td_report_fails(good_quote: bytes, trust_dir: Path, offset: int) -> None:
    quote = bytearray(good_quote)
    quote[offset] ^= 0x80
    assert refusal(tdx_evidence(bytes(quote)), trust_dir) == (
        "bad-report-signature", "the quote's signature does not verify under its attestation key: the quote was changed"
    )


def test_a_quote_for_another_key_fails_the_key_binding(good_quote: bytes, trust_dir: Path) -> None:
    reason, message = refusal(tdx_evidence(good_quote, public_key=OTHER_NODE_KEY), trust_dir)
    assert (reason, message.endswith("the report was made for another key or nonce")) == ("key-binding-mismatch", True)


def test_a_qe_report_that_does_not_bind_the_attestation_key_fails(intel: IntelPki, trust_dir: Path) -> None:
    quote = tdx_quote(intel, attestation_key=ATTESTATION_KEY, qe_report_data=bytes(64))
    reason, message = refusal(tdx_evidence(quote), trust_dir)
    assert reason == "qe-binding-mismatch"
    assert message.endswith("the attestation key was not certified by this quoting enclave")


def test_a_qe_report_not_signed_by_the_pck_key_fails(intel: IntelPki, trust_dir: Path) -> None:
    quote = tdx_quote(intel, qe_signing_key=ec.generate_private_key(ec.SECP256R1()))
    assert refusal(tdx_evidence(quote), trust_dir) == (
        "bad-qe-signature", "the quoting enclave report's signature does not verify under the PCK key"
    )


def test_a_pck_chain_from_another_root_fails(other_intel: IntelPki, trust_dir: Path) -> None:
    assert refusal(tdx_evidence(tdx_quote(other_intel)), trust_dir) == (
        "untrusted-chain",
        "CN=Intel SGX PCK Platform CA names issuer CN=Intel SGX Root CA, but its signature does not verify under "
        "that certificate's key: the chain was signed by another root",
    )


def test_a_pck_chain_without_its_root_verifies(intel: IntelPki, trust_dir: Path) -> None:
    assert verified(tdx_evidence(tdx_quote(intel, chain_pem=pem(intel.pck, intel.platform))), trust_dir).trusted


def test_a_pck_leaf_alone_does_not_reach_the_root(intel: IntelPki, trust_dir: Path) -> None:
    assert refusal(tdx_evidence(tdx_quote(intel, chain_pem=pem(intel.pck))), trust_dir) == (
        "untrusted-chain",
        "CN=Intel SGX PCK Certificate is issued by CN=Intel SGX PCK Platform CA, which is neither a trusted root "
        "nor in the evidence",
    )


def test_the_debug_attribute_fails(intel: IntelPki, trust_dir: Path) -> None:
    assert refusal(tdx_evidence(tdx_quote(intel, td_attributes=1)), trust_dir) == (
        "debug-enabled", "TDATTRIBUTES 0x1 has DEBUG (bit 0) set: the host can read the TD"
    )


def test_an_unexpected_mrtd_fails(good_quote: bytes, trust_dir: Path) -> None:
    assert refusal(tdx_evidence(good_quote), trust_dir, expected_measurement=MEASUREMENT) == (
        "measurement-mismatch", f"MRTD is {MRTD.hex()}, expected {MEASUREMENT.hex()}"
    )


@pytest.mark.parametrize(
    ("cut", "what"),
    [
        (4, "the quote ends before its header (8 bytes at 0x0 of a 4-byte region)"),
        (0x100, "the quote ends before its TD report body (584 bytes at 0x30 of a 256-byte region)"),
        (0x27C, "the quote ends before its signature data ({} bytes at 0x27c of a 636-byte region)"),
    ],
)
def test_a_truncated_quote_fails(good_quote: bytes, trust_dir: Path, cut: int, what: str) -> None:
    (signature_data_len,) = struct.unpack_from("<I", good_quote, 0x278)
    expected = ("truncated-report", what.format(signature_data_len))
    assert refusal(tdx_evidence(good_quote[:cut]), trust_dir) == expected


def test_a_quote_of_another_version_is_unsupported(intel: IntelPki, trust_dir: Path) -> None:
    assert refusal(tdx_evidence(tdx_quote(intel, version=3)), trust_dir) == (
        "unsupported-report", "quote version 3, attestation key type 2, TEE type 0x81; this verifier reads versions 4 "
        "and 5, key type 2 (ECDSA P-256), TEE type 0x81 (TDX)")


def test_a_signature_data_length_past_the_end_is_truncation(good_quote: bytes, trust_dir: Path) -> None:
    quote = bytearray(good_quote)
    struct.pack_into("<I", quote, 0x278, len(good_quote))
    assert refusal(tdx_evidence(bytes(quote)), trust_dir)[0] == "truncated-report"


def test_a_trust_directory_without_the_intel_root_fails(good_quote: bytes, tmp_path: Path) -> None:
    assert refusal(tdx_evidence(good_quote), tmp_path) == (
        "missing-trust-root", f"tdx evidence needs {tmp_path / 'intel_root.pem'}, which is absent"
    )
