"""SEV-SNP on real public vectors (Turin VCEK, Milan reports, the Milan VLEK chain) and on forged PKIs with AMD's
real subject names where no public vector exists (revocation, VLEK reports, Turin reports, product mismatch).

Vectors, each under tests/attestation/vectors/ (README.md there names the commits):
    virtee-sev/    virtee/sev tests/certs_data/ (vcek_turin.der, cert_chain_turin, report_milan.hex, vcek_milan.der,
                   cert_chain_milan) and src/certs/snp/builtin/<product>/ (ark_*.pem, ask_*.pem)
    go-sev-guest/  google/go-sev-guest verify/testdata/ (attestation.bin, vcek.testcer, milanvlek.testcer) and
                   verify/trust/ (ask_ark_milan.pem, ask_ark_milan_vlek.pem)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from amd_forge import (
    MILAN_TCB,
    NONCE,
    NOW,
    TURIN_HWID,
    TURIN_TCB,
    AmdPki,
    amd_name,
    cert_table,
    certificate,
    der,
    ia5,
    make_amd_pki,
    make_crl,
    make_turin_vcek,
    make_vcek,
    make_vlek,
    pem,
    snp_evidence,
    snp_report,
    vcek_and_ask,
    vcek_extensions,
    vlek_and_asvk,
    with_serial_zero,
)
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.utils import CryptographyDeprecationWarning
from verifying import refusal, verified

from attestation.chain import AMD_SCHEME, describe, describe_path, load_trust_roots, verify_chain
from attestation.checks import Check, SnpGuest
from attestation.collateral import Collateral
from attestation.errors import VerificationError
from attestation.evidence import Evidence
from attestation.snp_report import ASK_GUID, VCEK_GUID, VLEK_GUID
from attestation.snp_verify import SIGNING_KEYS, chain_product, read_vcek
from attestation.verify import verify_evidence

VECTORS = Path(__file__).parent / "vectors"
AMD_DN = "O=Advanced Micro Devices,ST=CA,L=Santa Clara,C=US,OU=Engineering"
VCEK, VLEK = SIGNING_KEYS[0], SIGNING_KEYS[1]
COLLATERAL_DIR = Path("/collateral")
Key = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


def vector(path: str) -> bytes:
    return (VECTORS / path).read_bytes()


def pem_vector(path: str) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(vector(path))


def trust_directory(directory: Path, arks: list[x509.Certificate], asks: Sequence[x509.Certificate] = ()) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "ark.pem").write_bytes(pem(*arks))
    if asks:
        (directory / "ask.pem").write_bytes(pem(*asks))
    return directory


def checks_until_refused(evidence: Evidence, trust_dir: Path, now: datetime) -> tuple[str, list[Check]]:
    """The reason evidence is refused with, and every check that passed before it."""
    passed: list[Check] = []
    with pytest.raises(VerificationError) as refused:
        verify_evidence(evidence, trust_dir, expected_nonce=NONCE, now=now, on_check=passed.append)
    return refused.value.reason, passed


# Real vectors.

SERIAL_ZERO_VCEKS = ("virtee-sev/vcek_turin.der", "virtee-sev/vcek_milan.der", "go-sev-guest/vcek.testcer")


def test_amd_vceks_have_serial_zero_and_read_vcek_loads_them_even_where_warnings_are_errors() -> None:
    """cryptography warns on serial 0 (and announces an exception for it); AMD issues every VCEK with it.
    Vectors: virtee-sev/vcek_turin.der, virtee-sev/vcek_milan.der, go-sev-guest/vcek.testcer."""
    with pytest.warns(CryptographyDeprecationWarning, match="serial number"):
        x509.load_der_x509_certificate(vector("virtee-sev/vcek_turin.der"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vceks = [read_vcek(vector(path)) for path in SERIAL_ZERO_VCEKS]
    assert [vcek.product for vcek in vceks] == ["Turin", "Milan-B0", "Milan-B0"]
    with pytest.warns(CryptographyDeprecationWarning, match="serial number"):
        assert [vcek.certificate.serial_number for vcek in vceks] == [0, 0, 0]


def test_the_real_turin_vcek_is_read_and_chains_to_the_turin_ark(tmp_path: Path) -> None:
    """virtee/sev tests/certs_data/vcek_turin.der with cert_chain_turin, against src/certs/snp/builtin/turin/."""
    vcek = read_vcek(vector("virtee-sev/vcek_turin.der"))
    assert (vcek.product, vcek.hwid, vcek.csp_id) == ("Turin", bytes.fromhex("1e550a8ee5cf9f4d"), None)
    assert dict(vcek.spls) == {"fmc": 0, "bl": 0, "tee": 0, "snp": 0, "spl5": 0, "spl6": 0, "spl7": 0, "ucode": 9}
    assert vcek.tcb("turin") == bytes([0, 0, 0, 0, 0, 0, 0, 9])
    ask, ark = pem_vector("virtee-sev/cert_chain_turin")
    roots = load_trust_roots(trust_directory(tmp_path / "trust", pem_vector("virtee-sev/ark_turin.pem"),
                                             pem_vector("virtee-sev/ask_turin.pem")))
    inside_validity = datetime(2026, 1, 1, tzinfo=UTC)  # the VCEK is valid from 2024-11-06 to 2031-11-06
    for carried in ([ask], list(roots.amd_asks)):
        path = verify_chain(vcek.certificate, carried, roots.amd_arks, AMD_SCHEME, inside_validity)
        assert describe_path(path, AMD_SCHEME) == (
            f"CN=SEV-VCEK,{AMD_DN} <- CN=SEV-Turin,{AMD_DN} <- CN=ARK-Turin,{AMD_DN} (RSASSA-PSS SHA-384 salt 48)"
        )
        assert chain_product(path, VCEK) == "Turin"
    assert path[2] == ark


def test_the_virtee_milan_report_passes_every_layer_up_to_the_key_binding(tmp_path: Path) -> None:
    """virtee/sev tests/certs_data/report_milan.hex (a v2 report, debug off) with vcek_milan.der and the ASK of
    cert_chain_milan, against builtin/milan/ark.pem: the report was not made for this project's binding, so only
    the key binding can fail."""
    report = bytes.fromhex(vector("virtee-sev/report_milan.hex").decode().strip())
    ask, _ = pem_vector("virtee-sev/cert_chain_milan")
    evidence = snp_evidence(report, cert_table({VCEK_GUID: vector("virtee-sev/vcek_milan.der"), ASK_GUID: der(ask)}))
    trust_dir = trust_directory(tmp_path / "trust", pem_vector("virtee-sev/ark_milan.pem"))
    reason, passed = checks_until_refused(evidence, trust_dir, datetime(2026, 1, 1, tzinfo=UTC))
    assert reason == "key-binding-mismatch"
    measurement = report[0x90:0xC0].hex()
    assert [str(check) for check in passed] == [
        "report: SEV-SNP version 2, VMPL 0, 1184 bytes",
        f"certificate chain: CN=SEV-VCEK,{AMD_DN} <- CN=SEV-Milan,{AMD_DN} <- CN=ARK-Milan,{AMD_DN} "
        "(RSASSA-PSS SHA-384 salt 48)",
        "report signature: ECDSA P-384 SHA-384 over bytes [0x000, 0x2A0) by the VCEK",
        "product: Milan, from the chain (a version 2 report names no CPUID)",
        "tcb: milan-genoa bl=3 tee=0 spl4=0 spl5=0 spl6=0 spl7=0 snp=8 ucode=115 equals the VCEK's; current equals "
        "committed",
        "chip id: d49554ec717f4e5b... equals the VCEK's HWID",
        "policy: 0x30000, debug off",
        f"measurement: MEASUREMENT {measurement} (not compared: no expected value given)",
    ]


def test_the_go_sev_guest_report_is_refused_for_debug_after_its_signature_verifies(tmp_path: Path) -> None:
    """google/go-sev-guest verify/testdata/attestation.bin (v2, policy 0xb0000: DEBUG) with vcek.testcer, against
    verify/trust/ask_ark_milan.pem (ASK and ARK, both in the trust directory)."""
    ask, ark = pem_vector("go-sev-guest/ask_ark_milan.pem")
    evidence = snp_evidence(vector("go-sev-guest/attestation.bin"), cert_table({VCEK_GUID: vector(
        "go-sev-guest/vcek.testcer")}))
    trust_dir = trust_directory(tmp_path / "trust", [ark], [ask])
    reason, passed = checks_until_refused(evidence, trust_dir, datetime(2026, 1, 1, tzinfo=UTC))
    assert reason == "debug-enabled"
    assert [check.name for check in passed] == [
        "report", "certificate chain", "report signature", "product", "tcb", "chip id",
    ]
    assert passed[4].detail == (
        "milan-genoa bl=2 tee=0 spl4=0 spl5=0 spl6=0 spl7=0 snp=5 ucode=68 equals the VCEK's; current equals committed"
    )


def test_the_milan_vlek_chain_verifies(tmp_path: Path) -> None:
    """google/go-sev-guest verify/testdata/milanvlek.testcer (the ASVK SEV-VLEK-Milan, then ARK-Milan) against the
    ARK of verify/trust/ask_ark_milan_vlek.pem and virtee/sev's builtin/milan/ark.pem: the same ARK-Milan."""
    asvk, _ = pem_vector("go-sev-guest/milanvlek.testcer")
    _, go_ark = pem_vector("go-sev-guest/ask_ark_milan_vlek.pem")
    inside_validity = datetime(2026, 1, 1, tzinfo=UTC)
    for ark in (go_ark, *pem_vector("virtee-sev/ark_milan.pem")):
        path = verify_chain(asvk, [], [ark], AMD_SCHEME, inside_validity)
        assert describe_path(path, AMD_SCHEME) == (
            f"CN=SEV-VLEK-Milan,{AMD_DN} <- CN=ARK-Milan,{AMD_DN} (RSASSA-PSS SHA-384 salt 48)"
        )
    ask, _ = pem_vector("go-sev-guest/ask_ark_milan.pem")
    roots = load_trust_roots(trust_directory(tmp_path / "trust", [go_ark], [ask, asvk]))
    assert [describe(cert).split(",")[0] for cert in roots.amd_asks] == ["CN=SEV-Milan", "CN=SEV-VLEK-Milan"]


# Forged PKIs with AMD's subject names.

@pytest.fixture(scope="module")
def milan() -> AmdPki:
    return make_amd_pki("Milan", amd_name)


@pytest.fixture(scope="module")
def forger() -> AmdPki:
    """Another Milan hierarchy under the same names: what a forger can make."""
    return make_amd_pki("Milan", amd_name)


@pytest.fixture(scope="module")
def turin() -> AmdPki:
    return make_amd_pki("Turin", amd_name)


@pytest.fixture(scope="module")
def vcek(milan: AmdPki) -> Key:
    return make_vcek(milan)


@pytest.fixture(scope="module")
def vlek(milan: AmdPki) -> Key:
    return make_vlek(milan)


@pytest.fixture(scope="module")
def turin_vcek(turin: AmdPki) -> Key:
    return make_turin_vcek(turin)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory, milan: AmdPki, turin: AmdPki) -> Path:
    """One ark.pem with both products' ARKs; the ASK or ASVK comes from the evidence."""
    return trust_directory(tmp_path_factory.mktemp("trust"), [milan.ark, turin.ark])


@pytest.fixture(scope="module")
def milan_evidence(milan: AmdPki, vcek: Key) -> Evidence:
    return snp_evidence(snp_report(vcek[0]), vcek_and_ask(milan, vcek[1]))


def amd_crls(crls: dict[tuple[str, str], bytes]) -> Collateral:
    return Collateral(directory=COLLATERAL_DIR, amd_crls=crls)


def test_a_clean_crl_is_checked_and_revocation_is_no_longer_unchecked(
    milan: AmdPki, milan_evidence: Evidence, roots: Path
) -> None:
    result = verified(milan_evidence, roots, collateral=amd_crls({("vcek", "Milan"): make_crl(milan)}))
    assert (result.trusted, result.not_checked) == (True, ())
    assert [str(check) for check in result.checks if check.name == "revocation"] == [
        f"revocation: neither the ASK nor the VCEK is on CN=ARK-Milan,{AMD_DN}'s CRL /collateral/amd/vcek_crl_Milan.der"
    ]


def test_without_the_product_crl_revocation_is_reported_unchecked(
    milan: AmdPki, milan_evidence: Evidence, roots: Path
) -> None:
    other_product = amd_crls({("vcek", "Turin"): make_crl(milan), ("vlek", "Milan"): make_crl(milan)})
    assert verified(milan_evidence, roots, collateral=other_product).not_checked == (
        "revocation: no AMD CRL for Milan in the collateral (/collateral/amd/vcek_crl_Milan.der)",
    )
    assert verified(milan_evidence, roots).not_checked == (
        "revocation: no AMD CRL for Milan in the collateral (no collateral given)",
    )


@pytest.mark.parametrize("whom", ["vcek", "ask"])
def test_a_certificate_named_on_the_milan_crl_is_revoked(
    milan: AmdPki, vcek: Key, milan_evidence: Evidence, roots: Path, whom: str
) -> None:
    revoked = vcek[1] if whom == "vcek" else milan.ask
    collateral = amd_crls({("vcek", "Milan"): make_crl(milan, [revoked])})
    assert refusal(milan_evidence, roots, collateral=collateral) == (
        "revoked",
        f"{describe(revoked)} (serial {revoked.serial_number:#x}) is revoked by CN=ARK-Milan,{AMD_DN} since "
        "2026-11-29T00:00:00+00:00 (/collateral/amd/vcek_crl_Milan.der)",
    )


def test_an_expired_crl_is_expired_collateral(milan: AmdPki, milan_evidence: Evidence, roots: Path) -> None:
    stale = amd_crls({("vcek", "Milan"): make_crl(milan, next_update=NOW - timedelta(days=1))})
    assert refusal(milan_evidence, roots, collateral=stale) == (
        "expired-collateral",
        "/collateral/amd/vcek_crl_Milan.der is current from 2026-11-01T00:00:00+00:00 to 2026-11-30T00:00:00+00:00, "
        "not at 2026-12-01T00:00:00+00:00",
    )


def test_a_crl_signed_by_another_ark_is_bad_collateral(
    milan: AmdPki, forger: AmdPki, milan_evidence: Evidence, roots: Path
) -> None:
    """The forged CRL names ARK-Milan as its issuer and verifies under the forger's ARK, not AMD's (RSASSA-PSS)."""
    forged = amd_crls({("vcek", "Milan"): make_crl(milan, signer=forger.ark_key)})
    assert refusal(milan_evidence, roots, collateral=forged) == (
        "bad-collateral",
        f"/collateral/amd/vcek_crl_Milan.der's signature does not verify under CN=ARK-Milan,{AMD_DN}",
    )


def test_a_serial_zero_vcek_is_looked_up_on_the_crl_even_where_warnings_are_errors(
    milan: AmdPki, roots: Path
) -> None:
    """The CRL lookup reads the VCEK's serial, which cryptography warns about when it is 0, as AMD's are."""
    key, vcek_serial_one = make_vcek(milan, serial_number=1)
    table = cert_table({VCEK_GUID: with_serial_zero(vcek_serial_one, milan.ask_key), ASK_GUID: der(milan.ask)})
    evidence = snp_evidence(snp_report(key), table)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = verified(evidence, roots, collateral=amd_crls({("vcek", "Milan"): make_crl(milan, [milan.asvk])}))
    assert (result.trusted, result.not_checked) == (True, ())


def test_a_vlek_report_verifies_end_to_end(milan: AmdPki, vlek: Key, roots: Path) -> None:
    evidence = snp_evidence(snp_report(vlek[0], signer_info=1 << 2), vlek_and_asvk(milan, vlek[1]))
    result = verified(evidence, roots, collateral=amd_crls({("vlek", "Milan"): make_crl(milan)}))
    assert (result.trusted, result.not_checked) == (True, ())
    details = {check.name: check.detail for check in result.checks}
    assert details["certificate chain"] == (
        f"CN=SEV-VLEK,{AMD_DN} <- CN=SEV-VLEK-Milan,{AMD_DN} <- CN=ARK-Milan,{AMD_DN} (RSASSA-PSS SHA-384 salt 48)"
    )
    assert details["revocation"] == (
        f"neither the ASVK nor the VLEK is on CN=ARK-Milan,{AMD_DN}'s CRL /collateral/amd/vlek_crl_Milan.der"
    )
    assert details["report signature"] == "ECDSA P-384 SHA-384 over bytes [0x000, 0x2A0) by the VLEK"
    assert details["chip id"] == "not compared: a VLEK names a cloud provider (CSP_ID Microsoft Azure), not a chip"
    assert result.snp is not None and (result.snp.signing_key, result.snp.product) == ("VLEK", "Milan")


def test_a_vlek_whose_asvk_is_on_the_vlek_crl_is_revoked(milan: AmdPki, vlek: Key, roots: Path) -> None:
    evidence = snp_evidence(snp_report(vlek[0], signer_info=1 << 2), vlek_and_asvk(milan, vlek[1]))
    collateral = amd_crls({("vlek", "Milan"): make_crl(milan, [milan.asvk]), ("vcek", "Milan"): make_crl(milan)})
    assert refusal(evidence, roots, collateral=collateral)[0] == "revoked"


def test_a_turin_report_verifies_with_the_turin_tcb_layout(turin: AmdPki, turin_vcek: Key, roots: Path) -> None:
    chip_id = TURIN_HWID + bytes(56)
    report = snp_report(turin_vcek[0], current_tcb=TURIN_TCB, reported_tcb=TURIN_TCB, chip_id=chip_id,
                        cpuid_family=0x1A, cpuid_model=0x02)
    result = verified(snp_evidence(report, vcek_and_ask(turin, turin_vcek[1])), roots)
    assert result.trusted is True
    assert result.tcb == {"fmc": 1, "bl": 4, "tee": 0, "snp": 3, "ucode": 72}
    details = {check.name: check.detail for check in result.checks}
    assert details["product"] == "Turin: the report's CPUID family 0x1a model 0x02 and the chain agree"
    assert details["tcb"] == "turin fmc=1 bl=4 tee=0 snp=3 ucode=72 equals the VCEK's; current equals committed"
    assert details["chip id"] == "0102030405060708... equals the VCEK's HWID (its 56 bytes after the HWID are zero)"
    assert result.snp == SnpGuest(signing_key="VCEK", product="Turin", vmpl=0, policy=0x30000, host_data=bytes(32),
                                  id_key_digest=bytes(48), author_key_digest=bytes(48), family_id=bytes(16),
                                  image_id=bytes(16))
    assert result.not_checked == ("revocation: no AMD CRL for Turin in the collateral (no collateral given)",)


def test_a_turin_chip_id_with_bytes_after_the_hwid_fails(turin: AmdPki, turin_vcek: Key, roots: Path) -> None:
    chip_id = TURIN_HWID + bytes(55) + b"\x01"
    report = snp_report(turin_vcek[0], current_tcb=TURIN_TCB, reported_tcb=TURIN_TCB, chip_id=chip_id,
                        cpuid_family=0x1A, cpuid_model=0x02)
    assert refusal(snp_evidence(report, vcek_and_ask(turin, turin_vcek[1])), roots) == (
        "chip-id-mismatch",
        f"CHIP_ID {chip_id.hex()} is not the VCEK's HWID {TURIN_HWID.hex()} followed by 56 zero bytes",
    )


def test_a_report_whose_cpuid_names_another_product_than_its_chain_is_refused(
    turin: AmdPki, turin_vcek: Key, roots: Path
) -> None:
    """A Turin-chained VCEK signing a report whose CPUID says Milan (with the Turin TCB, so only the product
    differs)."""
    report = snp_report(turin_vcek[0], current_tcb=TURIN_TCB, reported_tcb=TURIN_TCB, chip_id=TURIN_HWID + bytes(56),
                        cpuid_family=0x19, cpuid_model=0x01)
    assert refusal(snp_evidence(report, vcek_and_ask(turin, turin_vcek[1])), roots) == (
        "untrusted-chain",
        "the report's CPUID family 0x19 model 0x01 is Milan, but its VCEK chains to ARK-Turin: the chain is another "
        "processor's",
    )


def test_a_version_2_report_whose_vcek_names_another_product_than_its_chain_is_refused(
    milan: AmdPki, roots: Path
) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    genoa_named = certificate("SEV-VCEK", "SEV-Milan", key.public_key(), milan.ask_key,
                              {**vcek_extensions(), "1.3.6.1.4.1.3704.1.2": ia5("Genoa-B1")}, naming=amd_name)
    evidence = snp_evidence(snp_report(key, version=2), vcek_and_ask(milan, genoa_named))
    assert refusal(evidence, roots) == (
        "bad-certificate", "the VCEK's product extension is Genoa-B1, but it chains to ARK-Milan"
    )


def test_a_vcek_presented_as_a_vlek_is_refused(milan: AmdPki, vcek: Key, roots: Path) -> None:
    """The VLEK slot holding a VCEK (and the report claiming a VLEK) is refused before its signature is checked."""
    evidence = snp_evidence(snp_report(vcek[0], signer_info=1 << 2), vlek_and_asvk(milan, vcek[1]))
    assert refusal(evidence, roots) == (
        "bad-certificate", "a VLEK has a CSP_ID extension and no HWID; this one does not"
    )


def test_a_vlek_under_an_ask_is_not_amds_chain(milan: AmdPki, roots: Path) -> None:
    """A VLEK-shaped certificate (CSP_ID) issued by the ASK: the walk verifies, the chain's shape does not."""
    key = ec.generate_private_key(ec.SECP384R1())
    extensions = {**vcek_extensions(MILAN_TCB, None, "Milan"), "1.3.6.1.4.1.3704.1.5": ia5("Forger")}
    under_ask = certificate("SEV-VLEK", "SEV-Milan", key.public_key(), milan.ask_key, extensions, naming=amd_name)
    evidence = snp_evidence(snp_report(key, signer_info=1 << 2),
                            cert_table({VLEK_GUID: der(under_ask), ASK_GUID: der(milan.ask)}))
    assert refusal(evidence, roots) == (
        "untrusted-chain",
        "the VLEK is issued by CN=SEV-Milan, not by an ASVK (SEV-VLEK-Milan, SEV-VLEK-Genoa, SEV-VLEK-Turin)",
    )
