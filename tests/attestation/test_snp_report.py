"""The SEV-SNP report layout, TCB layouts per generation, the certificate table and the VCEK's extensions."""

from __future__ import annotations

import pytest
from amd_forge import (
    CHIP_ID,
    CSP_ID,
    MEASUREMENT,
    MILAN_TCB,
    REPORT_DATA,
    AmdPki,
    cert_table,
    certificate,
    der,
    der_integer,
    ia5,
    make_vcek,
    make_vlek,
    snp_report,
    vcek_extensions,
)
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.errors import VerificationError
from attestation.snp_report import (
    ARK_GUID,
    ASK_GUID,
    VCEK_GUID,
    parse_cert_table,
    parse_snp_report,
    tcb_components,
    trimmed_cert_table,
)
from attestation.snp_verify import read_vcek

KEY = ec.derive_private_key(11, ec.SECP384R1())


def test_fields_are_read_at_their_offsets() -> None:
    report = parse_snp_report(snp_report(KEY, policy=0xB0000, signer_info=0b10))
    assert (report.version, report.policy, report.signature_algo, report.vmpl) == (3, 0xB0000, 1, 0)
    assert (report.report_data, report.measurement, report.chip_id) == (REPORT_DATA, MEASUREMENT, CHIP_ID)
    assert (report.reported_tcb, report.current_tcb, report.committed_tcb) == (MILAN_TCB, MILAN_TCB, MILAN_TCB)
    assert (report.debug, report.mask_chip_key, report.signing_key, report.cpuid_family) == (True, True, 0, 0x19)
    assert (report.cpuid_model, report.product, report.author_key_en) == (0x01, "Milan", False)
    assert len(report.signed_bytes) == 0x2A0 and len(report.signature_r) == len(report.signature_s) == 72


def test_the_id_block_fields_and_host_data_are_read_at_their_offsets() -> None:
    data = bytearray(snp_report(KEY, signer_info=0b1))
    for offset, size, fill in ((0x010, 16, 1), (0x020, 16, 2), (0x0C0, 32, 3), (0x0E0, 48, 4), (0x110, 48, 5)):
        data[offset : offset + size] = bytes([fill]) * size
    report = parse_snp_report(bytes(data))
    assert (report.family_id, report.image_id, report.host_data) == (bytes([1]) * 16, bytes([2]) * 16, bytes([3]) * 32)
    assert (report.id_key_digest, report.author_key_digest) == (bytes([4]) * 48, bytes([5]) * 48)
    assert report.author_key_en is True


def test_version_2_has_no_cpuid_so_names_no_product() -> None:
    report = parse_snp_report(snp_report(KEY, version=2))
    assert (report.cpuid_family, report.cpuid_model, report.product) == (None, None, None)


@pytest.mark.parametrize(
    ("family", "model", "product"),
    [(0x19, 0x01, "Milan"), (0x19, 0x0F, "Milan"), (0x19, 0x11, "Genoa"), (0x19, 0xA0, "Genoa"),
     (0x1A, 0x02, "Turin"), (0x1A, 0x11, "Turin")],
)
def test_the_product_comes_from_cpuid_family_and_model(family: int, model: int, product: str) -> None:
    assert parse_snp_report(snp_report(KEY, cpuid_family=family, cpuid_model=model)).product == product


def test_turin_reads_its_own_tcb_layout() -> None:
    assert tcb_components(bytes([1, 2, 3, 4, 0, 0, 0, 5]), "turin") == {"fmc": 1, "bl": 2, "tee": 3, "snp": 4,
                                                                         "ucode": 5}
    assert tcb_components(MILAN_TCB, "milan-genoa") == {"bl": 3, "tee": 0, "spl4": 0, "spl5": 0, "spl6": 0,
                                                         "spl7": 0, "snp": 8, "ucode": 209}


@pytest.mark.parametrize(("family", "model"), [(0x17, 0x01), (0x19, 0x20), (0x1A, 0x12)])
def test_an_unknown_processor_is_unsupported(family: int, model: int) -> None:
    with pytest.raises(VerificationError) as refused:
        parse_snp_report(snp_report(KEY, cpuid_family=family, cpuid_model=model)).product  # noqa: B018 - it raises
    assert (refused.value.reason, refused.value.message) == (
        "unsupported-report",
        f"CPUID family {family:#x} model {model:#x} is no SEV-SNP processor this verifier knows (Milan, Genoa: family "
        "0x19; Turin: family 0x1a models 0x00-0x11)",
    )


@pytest.mark.parametrize(
    ("version", "offset", "message"),
    [
        (3, 0x04C, "reserved bytes [0x04C, 0x050) are not zero"),
        (3, 0x19F, "reserved bytes [0x18B, 0x1A0) are not zero"),
        (2, 0x188, "reserved bytes [0x188, 0x1A0) are not zero"),
        (5, 0x1EB, "reserved bytes [0x1EB, 0x1EC) are not zero"),
        (5, 0x1EF, "reserved bytes [0x1EF, 0x1F0) are not zero"),
        (4, 0x29F, "reserved bytes [0x208, 0x2A0) are not zero"),
    ],
)
def test_reserved_bytes_must_be_zero(version: int, offset: int, message: str) -> None:
    report = bytearray(snp_report(KEY, version=version))
    report[offset] = 1
    with pytest.raises(VerificationError) as refused:
        parse_snp_report(bytes(report))
    assert (refused.value.reason, refused.value.message) == ("malformed-report", message)


def test_bytes_after_the_signature_must_be_zero() -> None:
    report = bytearray(snp_report(KEY))
    report[0x400] = 1
    with pytest.raises(VerificationError) as refused:
        parse_snp_report(bytes(report))
    assert (refused.value.reason, refused.value.message) == (
        "malformed-report", "bytes [0x330, 0x4A0) after the signature must be zero"
    )


def test_an_oversized_report_is_malformed() -> None:
    with pytest.raises(VerificationError) as refused:
        parse_snp_report(snp_report(KEY) + b"\x00")
    assert refused.value.reason == "malformed-report"


def test_the_certificate_table_round_trips_and_is_trimmed_like_auxblob() -> None:
    certs = {VCEK_GUID: b"vcek", ASK_GUID: b"ask-der", ARK_GUID: b"ark"}
    table = cert_table(certs)
    assert parse_cert_table(table) == certs
    assert trimmed_cert_table(table + bytes(4096)) == table
    assert trimmed_cert_table(bytes(4096)) == b""
    assert parse_cert_table(b"") == {}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (VCEK_GUID.bytes + (100).to_bytes(4, "little") + (8).to_bytes(4, "little") + bytes(24),
         "certificate table entry 63da758d-e664-4564-adc5-f4b93be8accd points at [100, 108), past the end of the "
         "48-byte table"),
        (VCEK_GUID.bytes + (24).to_bytes(4, "little") + bytes(4),
         "certificate table has no all-zero terminating entry"),
    ],
    ids=["past-the-end", "unterminated"],
)
def test_a_broken_certificate_table_is_a_malformed_document(table: bytes, message: str) -> None:
    with pytest.raises(VerificationError) as refused:
        parse_cert_table(table)
    assert (refused.value.reason, refused.value.message) == ("malformed-document", message)


def test_the_vcek_extensions_are_read(amd: AmdPki) -> None:
    vcek = read_vcek(der(make_vcek(amd)[1]))
    assert vcek.product == "Milan-B0"
    assert dict(vcek.spls) == {"bl": 3, "tee": 0, "snp": 8, "spl4": 0, "spl5": 0, "spl6": 0, "spl7": 0, "ucode": 209}
    assert (vcek.hwid, vcek.tcb("milan-genoa")) == (CHIP_ID, MILAN_TCB)
    assert der_integer(209) == bytes.fromhex("020200d1")  # >= 128 needs a leading zero byte


def test_a_vleks_extensions_are_read(amd: AmdPki) -> None:
    vlek = read_vcek(der(make_vlek(amd)[1]), "VLEK")
    assert (vlek.name, vlek.product, vlek.hwid, vlek.csp_id, vlek.tcb("milan-genoa")) == (
        "VLEK", "Milan", None, CSP_ID, MILAN_TCB
    )


@pytest.mark.parametrize(
    ("name", "extensions", "message"),
    [
        ("VCEK", {**vcek_extensions(), "1.3.6.1.4.1.3704.1.5": ia5("x")}, "the VCEK has a CSP_ID (x): it is a VLEK"),
        ("VLEK", vcek_extensions(), "a VLEK has a CSP_ID extension and no HWID; this one does not"),
        ("VLEK", {**vcek_extensions(hwid=None)}, "a VLEK has a CSP_ID extension and no HWID; this one does not"),
        ("VLEK", {**vcek_extensions(), "1.3.6.1.4.1.3704.1.5": ia5("x")},
         "a VLEK has a CSP_ID extension and no HWID; this one does not"),
    ],
    ids=["vcek-with-csp-id", "vlek-with-hwid-only", "vlek-with-neither", "vlek-with-both"],
)
def test_a_vcek_and_a_vlek_are_told_apart(amd: AmdPki, name: str, extensions: dict[str, bytes], message: str) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    with pytest.raises(VerificationError) as refused:
        read_vcek(der(certificate(f"SEV-{name}", "SEV-Milan", key.public_key(), amd.ask_key, extensions)), name)
    assert (refused.value.reason, refused.value.message) == ("bad-certificate", message)


def test_a_vcek_without_a_required_spl_is_a_bad_certificate(amd: AmdPki) -> None:
    extensions = vcek_extensions()
    del extensions["1.3.6.1.4.1.3704.1.3.3"]
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = read_vcek(der(certificate("SEV-VCEK", "SEV-Milan", key.public_key(), amd.ask_key, extensions)))
    with pytest.raises(VerificationError) as refused:
        vcek.tcb("milan-genoa")
    assert (refused.value.reason, refused.value.message) == (
        "bad-certificate", "the VCEK has no SNP_SPL extension (1.3.6.1.4.1.3704.1.3.3)"
    )


@pytest.mark.parametrize(
    ("curve", "extensions", "message"),
    [
        (ec.SECP256R1(), vcek_extensions(), "the VCEK's key is not an EC P-384 key"),
        (ec.SECP384R1(), vcek_extensions(hwid=bytes(32)),
         "the VCEK's HWID is 32 bytes, not 64 (Milan, Genoa) or 8 (Turin)"),
        (ec.SECP384R1(), {**vcek_extensions(), "1.3.6.1.4.1.3704.1.3.8": der_integer(256)},
         "the VCEK's UCODE_SPL is 256, not a byte"),
        (ec.SECP384R1(), {**vcek_extensions(), "1.3.6.1.4.1.3704.1.3.1": b"\x04\x01\x00"},
         "the VCEK's BL_SPL extension is not a short DER value"),
    ],
    ids=["p256-key", "short-hwid", "spl-over-255", "spl-not-integer"],
)
def test_a_malformed_vcek_is_named(
    amd: AmdPki, curve: ec.EllipticCurve, extensions: dict[str, bytes], message: str
) -> None:
    key = ec.generate_private_key(curve)
    cert = certificate("SEV-VCEK", "SEV-Milan", key.public_key(), amd.ask_key, extensions)
    with pytest.raises(VerificationError) as refused:
        read_vcek(der(cert))
    assert (refused.value.reason, refused.value.message) == ("bad-certificate", message)
