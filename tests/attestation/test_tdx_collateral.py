"""Intel collateral on a forged Intel PKI with Intel's subject names: what no public vector shows (a forged QE whose
chain verifies, an OutOfDate platform, a revoked PCK, absent or broken collateral) is refused or reported exactly."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from amd_forge import NOW, pem
from cryptography.hazmat.primitives.asymmetric import ec
from intel_forge import (
    FMSPC,
    OUT_OF_DATE,
    PCESVN,
    PCK_TCB,
    PLATFORM_CA_NAME,
    QE_MRSIGNER,
    SGX_OID,
    TCB_SIGNING_NAME,
    TEE_TCB_SVN,
    IntelPki,
    certificate,
    crl,
    intel_collateral,
    make_intel_pki,
    qe_identity,
    sgx_extension,
    tcb_info,
    tcb_level,
    tdx_quote,
)
from test_tdx_verify import ATTESTATION_KEY, tdx_evidence
from verifying import refusal, verified

from attestation.pck_extensions import read_pck_extensions
from attestation.verify import VerificationResult

FORGED_QE_SIGNER = bytes(range(32))
TCB_FILE = "forged/intel/tcb_info_50806f000000.json"


@pytest.fixture(scope="module")
def pki() -> IntelPki:
    return make_intel_pki()


@pytest.fixture(scope="module")
def roots(pki: IntelPki, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("intel-trust")
    (directory / "intel_root.pem").write_bytes(pem(pki.root))
    return directory


@pytest.fixture(scope="module")
def quote(pki: IntelPki) -> bytes:
    return tdx_quote(pki, attestation_key=ATTESTATION_KEY)


def judged(pki: IntelPki, quote: bytes, roots: Path, **files: bytes) -> VerificationResult:
    return verified(tdx_evidence(quote), roots, collateral=intel_collateral(pki, **files))


def rejected(pki: IntelPki, quote: bytes, roots: Path, **files: Any) -> tuple[str, str]:
    return refusal(tdx_evidence(quote), roots, collateral=intel_collateral(pki, **files))


def test_full_collateral_judges_the_platform_up_to_date(pki: IntelPki, quote: bytes, roots: Path) -> None:
    result = judged(pki, quote, roots)
    assert [str(check) for check in result.checks[5:12]] == [
        "pck platform: FMSPC 50806f000000, PCEID 0000, PCESVN 11, SGX TCB components 3.3.2.2.2.1.0.2.0.0.0.0.0.0.0.0",
        "revocation: PCK certificate not on forged/intel/pck_crl_platform.der; CN=Intel SGX PCK Platform CA and "
        "CN=Intel SGX TCB Signing not on forged/intel/root_crl.der",
        f"tcb info: {TCB_FILE}, signed by CN=Intel SGX TCB Signing <- CN=Intel SGX Root CA (ECDSA P-256 SHA-256), "
        "current until 2026-12-31T00:00:00+00:00",
        "qe identity: forged/intel/qe_identity.json, signed by CN=Intel SGX TCB Signing <- CN=Intel SGX Root CA "
        "(ECDSA P-256 SHA-256), current until 2026-12-31T00:00:00+00:00",
        f"qe identity match: MRSIGNER {QE_MRSIGNER.hex()}, ISVPRODID 2, MISCSELECT and ATTRIBUTES under Intel's "
        "masks; ISVSVN 4: UpToDate",
        f"tdx module: MRSIGNERSEAM {bytes(48).hex()} and SEAM attributes 0000000000000000 are Intel's",
        "tcb status: UpToDate (FMSPC 50806f000000, TCB eval 17; platform level UpToDate of 2026-01-01T00:00:00Z)",
    ]
    assert (result.tcb_status, result.advisory_ids, result.not_checked) == ("UpToDate", (), ())


def test_a_forged_quoting_enclave_whose_chain_verifies_is_refused(pki: IntelPki, roots: Path) -> None:
    """The PCK key signs this QE report, so every signature holds; only Intel's QE identity tells it is not the TD QE:
    anyone with an SGX machine could otherwise run their own enclave that certifies any attestation key."""
    forged = tdx_quote(pki, attestation_key=ATTESTATION_KEY, qe_mrsigner=FORGED_QE_SIGNER)
    assert rejected(pki, forged, roots) == (
        "qe-identity-mismatch", "the quoting enclave is not the TD QE forged/intel/qe_identity.json describes: "
        f"MRSIGNER is {FORGED_QE_SIGNER.hex()}, Intel's is {QE_MRSIGNER.hex()}")


def test_an_out_of_date_platform_is_reported_with_its_advisories(pki: IntelPki, quote: bytes, roots: Path) -> None:
    higher = tcb_level((4, *PCK_TCB[1:]), PCESVN, TEE_TCB_SVN, "UpToDate")
    result = judged(pki, quote, roots, **{"tcb_info_50806f000000.json": tcb_info(pki, (higher, OUT_OF_DATE))})
    assert (result.tcb_status, result.advisory_ids) == ("OutOfDate", ("INTEL-SA-00837", "INTEL-SA-00960"))
    assert str(result.checks[11]) == (
        "tcb status: OutOfDate (FMSPC 50806f000000, TCB eval 17; platform level OutOfDate of 2026-01-01T00:00:00Z; "
        "advisories INTEL-SA-00837, INTEL-SA-00960)")


def test_an_out_of_date_quoting_enclave_makes_an_up_to_date_platform_out_of_date(
        pki: IntelPki, quote: bytes, roots: Path) -> None:
    """Intel's QVL converges the two: the platform is no better than the enclave that signs its quotes."""
    identity = qe_identity(pki, ((5, "UpToDate"), (4, "OutOfDate")))
    result = judged(pki, quote, roots, **{"qe_identity.json": identity})
    assert (result.tcb_status, str(result.checks[9]).endswith("ISVSVN 4: OutOfDate")) == ("OutOfDate", True)


def test_a_quoting_enclave_below_every_level_is_refused(pki: IntelPki, quote: bytes, roots: Path) -> None:
    assert rejected(pki, quote, roots, **{"qe_identity.json": qe_identity(pki, ((5, "UpToDate"),))}) == (
        "tcb-level-not-found", "the quoting enclave's ISVSVN 4 is below every level of forged/intel/qe_identity.json "
        "(lowest ISVSVN 5)")


def test_a_pck_certificate_on_the_platform_crl_is_revoked(pki: IntelPki, quote: bytes, roots: Path) -> None:
    revoking = crl(pki.platform_key, PLATFORM_CA_NAME, revoked=[pki.pck.serial_number])
    assert rejected(pki, quote, roots, **{"pck_crl_platform.der": revoking}) == (
        "revoked", f"CN=Intel SGX PCK Certificate (serial {pki.pck.serial_number:#x}) is revoked by CN=Intel SGX PCK "
        f"Platform CA since {(NOW - timedelta(days=2)).isoformat()} (forged/intel/pck_crl_platform.der)")


def test_a_platform_with_no_tcb_info_for_its_fmspc_is_missing_collateral(
        pki: IntelPki, quote: bytes, roots: Path) -> None:
    other = bytes.fromhex("00906ed50000")
    files = {"tcb_info_50806f000000.json": b"", "tcb_info_00906ed50000.json": tcb_info(pki, fmspc=other)}
    assert rejected(pki, quote, roots, **files) == (
        "missing-collateral", f"{TCB_FILE} absent (it has TCB info for FMSPC 00906ed50000): this platform's TCB "
        "status (FMSPC 50806f000000) needs the TCB info and QE identity with their issuer chains together")


def test_without_crls_the_tcb_is_judged_and_revocation_named_not_checked(
        pki: IntelPki, quote: bytes, roots: Path) -> None:
    result = judged(pki, quote, roots, **{"pck_crl_platform.der": b"", "root_crl.der": b""})
    assert (result.tcb_status, result.not_checked) == ("UpToDate", (
        "revocation: forged/intel/pck_crl_platform.der was not given: the PCK certificate was not checked against "
        "the CRL of Intel SGX PCK Platform CA",
        "revocation: forged/intel/root_crl.der was not given: CN=Intel SGX PCK Platform CA and CN=Intel SGX TCB "
        "Signing not checked against the Intel SGX Root CA's CRL"))


def test_tcb_info_signed_by_another_hierarchy_is_bad_collateral(pki: IntelPki, quote: bytes, roots: Path) -> None:
    other = make_intel_pki()
    files = {"tcb_info_50806f000000.json": tcb_info(other), "tcb_info_issuer_chain.pem": pem(other.tcb_signing)}
    assert rejected(pki, quote, roots, **files) == (
        "bad-collateral", f"the issuer chain of {TCB_FILE}: CN=Intel SGX TCB Signing names issuer CN=Intel SGX Root "
        "CA, but its signature does not verify under that certificate's key: the chain was signed by another root")


def test_tcb_info_past_its_next_update_is_expired(pki: IntelPki, quote: bytes, roots: Path) -> None:
    stale = tcb_info(pki, next_update=NOW - timedelta(hours=1))
    assert rejected(pki, quote, roots, **{"tcb_info_50806f000000.json": stale}) == (
        "expired-collateral", f"{TCB_FILE} is current from 2026-11-30T00:00:00+00:00 to 2026-11-30T23:00:00+00:00, "
        "not at 2026-12-01T00:00:00+00:00: fetch it again")


def test_a_td_under_another_tdx_module_signer_is_refused(pki: IntelPki, quote: bytes, roots: Path) -> None:
    signer = bytes([1]) * 48
    assert rejected(pki, quote, roots, **{"tcb_info_50806f000000.json": tcb_info(pki, module_mrsigner=signer)}) == (
        "tdx-module-mismatch", f"MRSIGNERSEAM {bytes(48).hex()} with SEAM attributes 0000000000000000 is not "
        f"tdxModule of {TCB_FILE} (MRSIGNER {signer.hex()}, attributes 0000000000000000 under mask ffffffffffffffff): "
        "the TDX module is not Intel's")


def test_a_pck_certificate_without_the_sgx_extension_is_refused(pki: IntelPki, roots: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    bare = certificate("Intel SGX PCK Certificate", PLATFORM_CA_NAME, key.public_key(), pki.platform_key)
    quote = tdx_quote(pki, qe_signing_key=key, chain_pem=pem(bare, pki.platform, pki.root))
    assert refusal(tdx_evidence(quote), roots) == (
        "bad-certificate", "the PCK certificate has no SGX extension (1.2.840.113741.1.13.1)")


def test_the_forged_pck_reads_as_intel_lays_it_out(pki: IntelPki) -> None:
    extensions = read_pck_extensions(pki.pck)
    assert (extensions.fmspc, extensions.pceid, extensions.tcb_components, extensions.pcesvn, extensions.cpusvn) == (
        FMSPC, bytes(2), PCK_TCB, PCESVN, bytes(PCK_TCB))


def test_a_pck_certificate_minted_with_a_platforms_own_pck_key_is_refused(
        pki: IntelPki, quote: bytes, roots: Path) -> None:
    """Whoever extracts the PCK key of one out-of-date platform could sign a "PCK Platform CA" and under it a PCK
    certificate claiming a current TCB: every link's signature holds and the path reaches Intel's root, but the real
    PCK certificate is no CA. go-tdx-guest (x509 Verify) refuses it; this verifier judged it UpToDate."""
    ca_key, pck_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    minted_ca = certificate(PLATFORM_CA_NAME, "Intel SGX PCK Certificate", ca_key.public_key(), pki.pck_key, ca=True)
    current = (4, *PCK_TCB[1:])
    minted = certificate("Intel SGX PCK Certificate", PLATFORM_CA_NAME, pck_key.public_key(), ca_key,
                         {SGX_OID: sgx_extension(tcb=current)})
    forged = tdx_quote(pki, attestation_key=ATTESTATION_KEY, qe_signing_key=pck_key,
                       chain_pem=pem(minted, minted_ca, pki.pck, pki.platform, pki.root))
    intel = {"tcb_info_50806f000000.json": tcb_info(pki, (tcb_level(current, PCESVN, TEE_TCB_SVN, "UpToDate"),
                                                          OUT_OF_DATE)), "pck_crl_platform.der": b""}
    assert judged(pki, quote, roots, **intel).tcb_status == "OutOfDate"  # the platform the key came from
    assert rejected(pki, forged, roots, **intel) == (
        "untrusted-chain", "CN=Intel SGX PCK Platform CA is signed by CN=Intel SGX PCK Certificate, which is no CA "
        "(basic constraints): it cannot issue")


def test_tcb_info_signed_under_a_tcb_signing_certificate_a_pck_key_minted_is_bad_collateral(
        pki: IntelPki, quote: bytes, roots: Path) -> None:
    """The same extracted PCK key could certify its own "Intel SGX TCB Signing" key and sign TCB info and QE identity
    of its choosing; go-tdx-guest takes the signing certificate only as issued by the root."""
    key = ec.generate_private_key(ec.SECP256R1())
    minted = certificate(TCB_SIGNING_NAME, "Intel SGX PCK Certificate", key.public_key(), pki.pck_key)
    files = {"tcb_info_50806f000000.json": tcb_info(dataclasses.replace(pki, tcb_signing_key=key)),
             "tcb_info_issuer_chain.pem": pem(minted, pki.pck, pki.platform, pki.root)}
    assert rejected(pki, quote, roots, **files) == (
        "bad-collateral", f"the issuer chain of {TCB_FILE}: CN=Intel SGX TCB Signing is signed by CN=Intel SGX PCK "
        "Certificate, which is no CA (basic constraints): it cannot issue")
