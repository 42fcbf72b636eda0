"""SEV-SNP verification: a good report passes every check; each tampering fails with its own reason."""

from __future__ import annotations

import struct
from datetime import timedelta
from pathlib import Path

import pytest
from amd_forge import (
    BOOT_ID,
    CHIP_ID,
    CSP_ID,
    MEASUREMENT,
    NODE_KEY,
    NONCE,
    NOW,
    OLD_NONCE,
    OTHER_NODE_KEY,
    AmdPki,
    cert_table,
    certificate,
    der,
    make_vcek,
    make_vlek,
    pem,
    snp_evidence,
    snp_report,
    vcek_and_ask,
    vcek_extensions,
)
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from verifying import refusal, verified

from attestation.binding import report_data_for
from attestation.checks import SnpGuest
from attestation.evidence import Evidence
from attestation.snp_report import ASK_GUID, VCEK_GUID

Vcek = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


@pytest.fixture(scope="module")
def good(amd: AmdPki, vcek: Vcek) -> Evidence:
    return snp_evidence(snp_report(vcek[0]), vcek_and_ask(amd, vcek[1]))


def test_a_good_report_passes_every_check_in_order(good: Evidence, trust_dir: Path) -> None:
    result = verified(good, trust_dir, expected_measurement=MEASUREMENT)
    assert [check.name for check in result.checks] == [
        "report", "certificate chain", "report signature", "product", "tcb", "chip id", "policy", "measurement",
        "key binding", "nonce", "gpu",
    ]
    details = {check.name: check.detail for check in result.checks}
    assert details["report"] == "SEV-SNP version 3, VMPL 0, 1184 bytes"
    assert details["certificate chain"] == "CN=SEV-VCEK <- CN=SEV-Milan <- CN=ARK-Milan (RSASSA-PSS SHA-384 salt 48)"
    assert details["tcb"] == (
        "milan-genoa bl=3 tee=0 spl4=0 spl5=0 spl6=0 spl7=0 snp=8 ucode=209 equals the VCEK's; current equals committed"
    )
    assert details["product"] == "Milan: the report's CPUID family 0x19 model 0x01 and the chain agree"
    assert details["policy"] == "0x30000, debug off"
    assert details["measurement"] == f"MEASUREMENT {MEASUREMENT.hex()} matches"
    assert details["nonce"] == f"{NONCE.hex()} matches"
    assert (result.evidence_type, result.trusted, result.public_key_hex, result.boot_id) == (
        "sev-snp", True, NODE_KEY.hex(), BOOT_ID
    )
    assert (result.measurement_hex, result.nonce_hex, result.nonce_checked) == (MEASUREMENT.hex(), NONCE.hex(), True)
    assert result.digest == good.digest()
    assert result.snp == SnpGuest(signing_key="VCEK", product="Milan", vmpl=0, policy=0x30000, host_data=bytes(32),
                                  id_key_digest=bytes(48), author_key_digest=bytes(48), family_id=bytes(16),
                                  image_id=bytes(16))
    assert result.not_checked == ("revocation: no AMD CRL for Milan in the collateral (no collateral given)",)


def test_the_document_form_verifies_like_the_object(good: Evidence, trust_dir: Path) -> None:
    assert verified(good.document(), trust_dir).checks == verified(good, trust_dir).checks


def test_the_ask_may_come_from_the_trust_directory(amd: AmdPki, vcek: Vcek, tmp_path: Path) -> None:
    (tmp_path / "ark.pem").write_bytes(pem(amd.ark))
    (tmp_path / "ask.pem").write_bytes(pem(amd.ask))
    evidence = snp_evidence(snp_report(vcek[0]), cert_table({VCEK_GUID: der(vcek[1])}))
    assert verified(evidence, tmp_path).trusted


@pytest.mark.parametrize("offset", [0x010, 0x050, 0x090, 0x0C0, 0x180, 0x1FF])
def test_a_flipped_report_byte_breaks_the_signature(good: Evidence, trust_dir: Path, offset: int) -> None:
    report = bytearray(good.report)
    report[offset] ^= 0x01
    evidence = snp_evidence(bytes(report), good.aux)
    assert refusal(evidence, trust_dir) == (
        "bad-report-signature", "the report's signature does not verify under the VCEK: the report was changed"
    )


def test_r_and_s_stored_big_endian_fail(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    evidence = snp_evidence(snp_report(vcek[0], signature_byte_order="big"), vcek_and_ask(amd, vcek[1]))
    assert refusal(evidence, trust_dir) == (
        "bad-report-signature",
        "signature R is not a little-endian 384-bit integer (its top 24 bytes are not zero; was it stored big-endian?)",
    )


def test_a_report_for_another_key_fails_the_key_binding(good: Evidence, trust_dir: Path) -> None:
    evidence = snp_evidence(good.report, good.aux, public_key=OTHER_NODE_KEY)
    reason, message = refusal(evidence, trust_dir)
    assert reason == "key-binding-mismatch"
    assert message == (
        f"report_data is {report_data_for(NODE_KEY, NONCE).hex()}, the binding of public key {OTHER_NODE_KEY.hex()} "
        f"and nonce {NONCE.hex()} is {report_data_for(OTHER_NODE_KEY, NONCE).hex()}: the report was made for another "
        "key or nonce"
    )


def test_a_document_claiming_the_fresh_nonce_for_an_old_report_fails_the_binding(
    amd: AmdPki, vcek: Vcek, trust_dir: Path
) -> None:
    old = snp_report(vcek[0], report_data_for(NODE_KEY, OLD_NONCE))
    assert refusal(snp_evidence(old, vcek_and_ask(amd, vcek[1])), trust_dir)[0] == "key-binding-mismatch"


def test_a_stale_nonce_fails(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    stale = snp_evidence(snp_report(vcek[0], report_data_for(NODE_KEY, OLD_NONCE)), vcek_and_ask(amd, vcek[1]),
                         nonce=OLD_NONCE)
    assert refusal(stale, trust_dir) == (
        "nonce-mismatch",
        f"the evidence answers nonce {OLD_NONCE.hex()}, this verifier issued {NONCE.hex()}: the document is stale or "
        "replayed",
    )
    result = verified(stale, trust_dir, expected_nonce=None)
    assert (result.nonce_checked, result.checks[-2].detail) == (
        False, f"{OLD_NONCE.hex()} (not compared: no expected nonce given, freshness unchecked)"
    )


def test_the_debug_bit_fails(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    evidence = snp_evidence(snp_report(vcek[0], policy=0xB0000), vcek_and_ask(amd, vcek[1]))
    assert refusal(evidence, trust_dir) == (
        "debug-enabled", "guest policy 0xb0000 has DEBUG (bit 19) set: the host can read guest memory"
    )


def test_a_vcek_of_another_tcb_fails(amd: AmdPki, trust_dir: Path) -> None:
    key, vcek_cert = make_vcek(amd, tcb=bytes([3, 0, 0, 0, 0, 0, 9, 209]))
    evidence = snp_evidence(snp_report(key), vcek_and_ask(amd, vcek_cert))
    assert refusal(evidence, trust_dir) == (
        "tcb-mismatch",
        "REPORTED_TCB is bl=3 tee=0 spl4=0 spl5=0 spl6=0 spl7=0 snp=8 ucode=209, the VCEK certifies "
        "bl=3 tee=0 spl4=0 spl5=0 spl6=0 spl7=0 snp=9 ucode=209",
    )


def test_a_current_tcb_below_the_vcek_fails(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    older = bytes([3, 0, 0, 0, 0, 0, 8, 200])
    evidence = snp_evidence(snp_report(vcek[0], current_tcb=older), vcek_and_ask(amd, vcek[1]))
    assert refusal(evidence, trust_dir) == (
        "tcb-mismatch",
        "CURRENT_TCB bl=3 tee=0 spl4=0 spl5=0 spl6=0 spl7=0 snp=8 ucode=200 is below the VCEK's TCB in ucode",
    )


def test_provisional_firmware_fails(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    provisional = snp_report(vcek[0], committed_tcb=bytes([3, 0, 0, 0, 0, 0, 8, 210]))
    evidence = snp_evidence(provisional, vcek_and_ask(amd, vcek[1]))
    reason, message = refusal(evidence, trust_dir)
    assert (reason, message.endswith("differs from CURRENT_TCB: the firmware runs provisionally")) == (
        "tcb-mismatch", True
    )


def test_a_chip_id_other_than_the_vcek_hwid_fails(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    other_chip = bytes(63) + b"\x01"
    evidence = snp_evidence(snp_report(vcek[0], chip_id=other_chip), vcek_and_ask(amd, vcek[1]))
    assert refusal(evidence, trust_dir) == (
        "chip-id-mismatch", f"CHIP_ID {other_chip.hex()} is not the VCEK's HWID {CHIP_ID.hex()}"
    )


def test_a_masked_chip_id_is_reported_not_compared(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    evidence = snp_evidence(snp_report(vcek[0], chip_id=bytes(64), signer_info=0b10), vcek_and_ask(amd, vcek[1]))
    checks = {check.name: check.detail for check in verified(evidence, trust_dir).checks}
    assert checks["chip id"] == "masked by the guest (MASK_CHIP_KEY); the VCEK's signature still names one chip"


def test_an_unexpected_measurement_fails(good: Evidence, trust_dir: Path) -> None:
    expected = bytes(48)
    assert refusal(good, trust_dir, expected_measurement=expected) == (
        "measurement-mismatch", f"MEASUREMENT is {MEASUREMENT.hex()}, expected {expected.hex()}"
    )


@pytest.mark.parametrize("cut", [0, 0x2A0, 0x4A0 - 1])
def test_a_truncated_report_fails(good: Evidence, trust_dir: Path, cut: int) -> None:
    evidence = snp_evidence(good.report[:cut] or b"\x00", good.aux)
    assert refusal(evidence, trust_dir) == (
        "truncated-report", f"an SEV-SNP report is 1184 bytes, this one has only {max(cut, 1)}"
    )


def test_a_chain_signed_by_another_root_fails(other_amd: AmdPki, trust_dir: Path) -> None:
    key, forged_vcek = make_vcek(other_amd)
    evidence = snp_evidence(snp_report(key), vcek_and_ask(other_amd, forged_vcek))
    assert refusal(evidence, trust_dir) == (
        "untrusted-chain",
        "CN=SEV-Milan names issuer CN=ARK-Milan, but its signature does not verify under that certificate's key: the "
        "chain was signed by another root",
    )


def test_a_vcek_signed_by_a_forged_ask_fails_even_with_the_real_ask_trusted(
    amd: AmdPki, other_amd: AmdPki, tmp_path: Path
) -> None:
    (tmp_path / "ark.pem").write_bytes(pem(amd.ark))
    (tmp_path / "ask.pem").write_bytes(pem(amd.ask))
    key, forged_vcek = make_vcek(other_amd)
    evidence = snp_evidence(snp_report(key), vcek_and_ask(other_amd, forged_vcek))
    assert refusal(evidence, tmp_path)[0] == "untrusted-chain"


def test_an_expired_vcek_fails(amd: AmdPki, trust_dir: Path) -> None:
    key, vcek_cert = make_vcek(amd, not_after=NOW - timedelta(days=1))
    reason, message = refusal(snp_evidence(snp_report(key), vcek_and_ask(amd, vcek_cert)), trust_dir)
    assert (reason, message.startswith("CN=SEV-VCEK is valid from ")) == ("expired-certificate", True)


def test_a_report_without_a_vcek_fails(good: Evidence, trust_dir: Path) -> None:
    assert refusal(snp_evidence(good.report, b""), trust_dir) == (
        "missing-certificate",
        "the evidence carries no VCEK: the host supplied no certificate table (auxblob) or none with that key, so the "
        "report's signing key cannot be checked",
    )


def test_a_trust_directory_without_an_ark_fails(good: Evidence, tmp_path: Path) -> None:
    assert refusal(good, tmp_path) == (
        "missing-trust-root", f"sev-snp evidence needs {tmp_path / 'ark.pem'}, which is absent"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (0x000, struct.pack("<I", 6), "SEV-SNP report version 6; this verifier reads versions 2 to 5"),
        (0x034, struct.pack("<I", 2), "signature algorithm 2; only 1 (ECDSA P-384 SHA-384) is known"),
        (0x048, struct.pack("<I", 7 << 2), "the report is signed by none; only VCEK and VLEK reports are checked"),
        (0x048, struct.pack("<I", 2 << 2),
         "the report is signed by reserved value 2; only VCEK and VLEK reports are checked"),
    ],
    ids=["version-6", "algorithm-2", "no-signing-key", "reserved-signing-key"],
)
def test_unsupported_reports_are_named(good: Evidence, trust_dir: Path, field: int, value: bytes, message: str) -> None:
    report = bytearray(good.report)
    report[field : field + 4] = value
    assert refusal(snp_evidence(bytes(report), good.aux), trust_dir) == ("unsupported-report", message)


@pytest.mark.parametrize("version", [2, 3, 4, 5])
def test_report_versions_2_to_5_verify(amd: AmdPki, vcek: Vcek, trust_dir: Path, version: int) -> None:
    evidence = snp_evidence(snp_report(vcek[0], version=version), vcek_and_ask(amd, vcek[1]))
    details = {check.name: check.detail for check in verified(evidence, trust_dir).checks}
    assert details["report"] == f"SEV-SNP version {version}, VMPL 0, 1184 bytes"
    assert details["product"] == ("Milan, from the chain (a version 2 report names no CPUID)" if version == 2 else
                                  "Milan: the report's CPUID family 0x19 model 0x01 and the chain agree")


def test_a_vlek_report_without_a_vlek_fails(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    evidence = snp_evidence(snp_report(vcek[0], signer_info=1 << 2), vcek_and_ask(amd, vcek[1]))
    assert refusal(evidence, trust_dir) == (
        "missing-certificate",
        "the evidence carries no VLEK: the host supplied no certificate table (auxblob) or none with that key, so the "
        "report's signing key cannot be checked",
    )


def test_a_vlek_in_the_vcek_slot_is_not_a_vcek(amd: AmdPki, trust_dir: Path) -> None:
    key, vlek = make_vlek(amd)
    evidence = snp_evidence(snp_report(key), cert_table({VCEK_GUID: der(vlek), ASK_GUID: der(amd.asvk)}))
    assert refusal(evidence, trust_dir) == (
        "bad-certificate", f"the VCEK has a CSP_ID ({CSP_ID}): it is a VLEK"
    )


def test_a_vcek_issued_by_the_ark_itself_is_not_amds_chain(amd: AmdPki, trust_dir: Path) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    under_ark = certificate("SEV-VCEK", "ARK-Milan", key.public_key(), amd.ark_key, vcek_extensions())
    evidence = snp_evidence(snp_report(key), cert_table({VCEK_GUID: der(under_ark)}))
    assert refusal(evidence, trust_dir) == (
        "untrusted-chain", "the VCEK is issued by CN=ARK-Milan, not by an ASK (SEV-Milan, SEV-Genoa, SEV-Turin)"
    )



def test_a_processor_this_verifier_does_not_know_is_unsupported(amd: AmdPki, vcek: Vcek, trust_dir: Path) -> None:
    venice = snp_evidence(snp_report(vcek[0], cpuid_family=0x1A, cpuid_model=0x50), vcek_and_ask(amd, vcek[1]))
    assert refusal(venice, trust_dir) == (
        "unsupported-report",
        "CPUID family 0x1a model 0x50 is no SEV-SNP processor this verifier knows (Milan, Genoa: family 0x19; Turin: "
        "family 0x1a models 0x00-0x11)",
    )


@pytest.mark.parametrize(
    ("policy", "signer_info", "message"),
    [
        (0x10000, 0, "guest policy 0x10000 has reserved bit 17 clear; it must be 1"),
        (0x30000 | 1 << 26, 0, "guest policy 0x4030000 sets reserved bits 63:26"),
        (0x30000, 1 << 5, "signer info 0x20 sets reserved bits 31:5"),
    ],
    ids=["policy-bit-17-clear", "policy-bit-26", "signer-info-bit-5"],
)
def test_reserved_policy_and_signer_bits_are_malformed(
    amd: AmdPki, vcek: Vcek, trust_dir: Path, policy: int, signer_info: int, message: str
) -> None:
    evidence = snp_evidence(snp_report(vcek[0], policy=policy, signer_info=signer_info), vcek_and_ask(amd, vcek[1]))
    assert refusal(evidence, trust_dir) == ("malformed-report", message)
