"""Intel's own quotes and collateral judged as go-tdx-guest judges them.

Every file read here is a copy from google/go-tdx-guest @ 91f9a52 (tests/attestation/vectors/README.md names each
file's path there): the SPR quote `testing/testdata/tdx_prod_quote_SPR_E4.dat`, the v5 quote
`testing/testdata/quote_v5_sample.dat`, the PCS responses `testing/testdata/sample_tcbInfo_response`,
`sample_tcbinfo_response_v5`, `sample_qeIdentity_response`, `pckcrl`, `rootcrl.der`, the issuer chains of
`testing/test_cases.go` and the root `verify/trusted_root.pem`. The quotes were made for go-tdx-guest's report data,
not for a tenzro key, so these tests stop short of the key binding (`attestation.tdx.verify_quote`).
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.chain import TrustRoots, load_trust_roots
from attestation.checks import Check, Expectations
from attestation.collateral import Collateral, load_collateral
from attestation.errors import VerificationError
from attestation.intel_signature import verifies
from attestation.intel_tcb import qe_identity_of, signed_member, tcb_info_of
from attestation.pck_extensions import read_pck_extensions
from attestation.tdx import TdxQuote, parse_tdx_quote, verify_quote
from attestation.tdx_collateral import QeReport, QuotedTcb, platform_tcb, qe_tcb

VECTORS = Path(__file__).parent / "vectors" / "go-tdx-guest"
SPR_TIME = datetime(2023, 7, 1, 1, tzinfo=UTC)  # go-tdx-guest's verify_test.go `currentTime`
V5_TIME = datetime(2026, 2, 3, 1, tzinfo=UTC)  # go-tdx-guest's TestVerifyQuoteV5
SPR_FMSPC, V5_FMSPC = "50806f000000", "90c06f000000"
INTEL_FILES = {"tcb_info_issuer_chain.pem": "tcb_info_issuer_chain.pem",
               "qe_identity.json": "sample_qeIdentity_response",
               "qe_identity_issuer_chain.pem": "qe_identity_issuer_chain.pem", "pck_crl_platform.der": "pckcrl",
               "pck_crl_issuer_chain.pem": "pck_crl_issuer_chain.pem", "root_crl.der": "rootcrl.der"}
"""The collateral directory's names (attestation/collateral.py) -> go-tdx-guest's files."""
SIGNING = "C=US,ST=CA,L=Santa Clara,O=Intel Corporation,CN=Intel SGX TCB Signing"


def collateral_directory(directory: Path, fmspc: str, tcb_info: str) -> Collateral:
    (directory / "intel").mkdir(parents=True)
    for name, source in {**INTEL_FILES, f"tcb_info_{fmspc}.json": tcb_info}.items():
        shutil.copyfile(VECTORS / source, directory / "intel" / name)
    return load_collateral(directory)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> TrustRoots:
    directory = tmp_path_factory.mktemp("intel-root")
    shutil.copyfile(VECTORS / "trusted_root.pem", directory / "intel_root.pem")
    return load_trust_roots(directory)


@pytest.fixture(scope="module")
def spr_collateral(tmp_path_factory: pytest.TempPathFactory) -> Collateral:
    return collateral_directory(tmp_path_factory.mktemp("spr"), SPR_FMSPC, "sample_tcbInfo_response")


@pytest.fixture(scope="module")
def v5_collateral(tmp_path_factory: pytest.TempPathFactory) -> Collateral:
    return collateral_directory(tmp_path_factory.mktemp("v5"), V5_FMSPC, "sample_tcbinfo_response_v5")


def quote(name: str) -> TdxQuote:
    return parse_tdx_quote((VECTORS / name).read_bytes())


def judge(quoted: TdxQuote, roots: TrustRoots, collateral: Collateral, now: datetime) -> tuple[list[str], str, str]:
    """The checks that passed, then the reason and message of the refusal."""
    checks: list[Check] = []
    with pytest.raises(VerificationError) as refused:
        verify_quote(quoted, roots, Expectations(nonce=None, measurement=None, now=now, collateral=collateral),
                     checks.append)
    return [str(check) for check in checks], refused.value.reason, refused.value.message


def quoted_tcb(quoted: TdxQuote) -> QuotedTcb:
    path = tuple(x509.load_pem_x509_certificates(quoted.pck_chain_pem))
    return QuotedTcb(tee_tcb_svn=quoted.tee_tcb_svn, mrsignerseam=quoted.mrsignerseam,
                     seam_attributes=quoted.seam_attributes, qe=QeReport.read(quoted.qe_report), pck_path=path,
                     pck=read_pck_extensions(path[0]))


def test_the_spr_pck_extension_reads_as_go_tdx_guest_reads_it() -> None:
    """go-tdx-guest's TestPckCertificateExtensions expects exactly these values."""
    pck = quoted_tcb(quote("tdx_prod_quote_SPR_E4.dat")).pck
    assert (pck.ppid.hex(), pck.fmspc.hex(), pck.pceid.hex(), pck.pcesvn, pck.cpusvn, pck.tcb_components) == (
        "089ddfdb9c0359c82a3bc7719239574e", SPR_FMSPC, "0000", 11, bytes([3, 3, 2, 2, 2, 1, 0, 2]) + bytes(8),
        (3, 3, 2, 2, 2, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0))


def test_the_spr_quote_has_intels_qe_but_no_tcb_level(roots: TrustRoots, spr_collateral: Collateral) -> None:
    """What go-tdx-guest's verifier gives for this quote and its sample collateral: the QE matches Intel's TD QE
    identity (UpToDate at ISVSVN 4, verifyQeReport passes in TestVerifyUsingQeIdentityV4) and no TCB level matches
    (TestVerifyUsingTcbInfoV4 has to zero the sample's SVNs to pass; unchanged it gives "no matching TCB level
    found"). Both levels of the TCB info need SGX components 01, 02 at 5 and 05, 08 at 3 where the PCK certificate
    has CPUSVN components 3, 3, 2, 2, and TEE_TCB_SVN[2] (TDX late microcode) at 5 where the TD report has 4; its
    PCESVN 11 meets both (11 and 5). The CRLs of the same date clear the PCK chain."""
    checks, reason, message = judge(quote("tdx_prod_quote_SPR_E4.dat"), roots, spr_collateral, SPR_TIME)
    intel = spr_collateral.path("intel")
    assert checks[5:] == [
        "pck platform: FMSPC 50806f000000, PCEID 0000, PCESVN 11, SGX TCB components 3.3.2.2.2.1.0.2.0.0.0.0.0.0.0.0",
        f"revocation: PCK certificate not on {intel}/pck_crl_platform.der; C=US,ST=CA,L=Santa Clara,O=Intel "
        f"Corporation,CN=Intel SGX PCK Platform CA and {SIGNING} not on {intel}/root_crl.der",
        f"tcb info: {intel}/tcb_info_50806f000000.json, signed by {SIGNING} <- C=US,ST=CA,L=Santa Clara,O=Intel "
        "Corporation,CN=Intel SGX Root CA (ECDSA P-256 SHA-256), current until 2023-07-18T08:42:58+00:00",
        f"qe identity: {intel}/qe_identity.json, signed by {SIGNING} <- C=US,ST=CA,L=Santa Clara,O=Intel "
        "Corporation,CN=Intel SGX Root CA (ECDSA P-256 SHA-256), current until 2023-07-08T07:24:59+00:00",
        "qe identity match: MRSIGNER dc9e2a7c6f948f17474e34a7fc43ed030f7c1563f1babddf6340c82e0e54a8c5, ISVPRODID 2, "
        "MISCSELECT and ATTRIBUTES under Intel's masks; ISVSVN 4: UpToDate",
    ]
    shortfall = ("SGX TCB component 01 is 3, needs 5, SGX TCB component 02 is 3, needs 5, SGX TCB component 05 is 2, "
                 "needs 3, SGX TCB component 08 is 2, needs 3, TEE_TCB_SVN[2] is 4, needs 5")
    assert (reason, message) == ("tcb-level-not-found", (
        f"no TCB level of {intel}/tcb_info_50806f000000.json is met by the PCK certificate and TEE_TCB_SVN "
        f"03000400000000000000000000000000: UpToDate of 2023-02-15T00:00:00Z: {shortfall}; "
        f"OutOfDate of 2018-01-04T00:00:00Z: {shortfall}"))


def test_the_v5_quote_with_its_2026_tcb_info_is_refused_for_expired_collateral(
        roots: TrustRoots, v5_collateral: Collateral) -> None:
    """go-tdx-guest, asked to check this collateral on 2026-02-03, refuses too ("QeIdentity has expired"): the
    vectors' QE identity was current until 2023-07-08, and the TCB Signing certificate of the issuer chains until
    2025-05-21. This verifier reads the TCB info first and meets the certificate."""
    checks, reason, message = judge(quote("quote_v5_sample.dat"), roots, v5_collateral, V5_TIME)
    assert checks[0] == ("quote: TDX v5 (TD 1.5 body), ECDSA P-256 attestation key, QE vendor "
                         "939a7233f79c4ca9940a0db3957f0607")
    assert checks[4] == "quote signature: ECDSA P-256 SHA-256 over bytes [0x000, 0x2be) by the attestation key"
    assert (reason, message) == ("expired-collateral", (
        f"the issuer chain of {v5_collateral.path('intel/tcb_info_90c06f000000.json')}: {SIGNING} is valid from "
        "2018-05-21T10:50:10+00:00 to 2025-05-21T10:50:10+00:00, not at 2026-02-03T01:00:00+00:00"))


def test_the_v5_tcb_info_judges_the_td_15_platform_up_to_date() -> None:
    """go-tdx-guest's TestVerifyUsingTcbInfoV5 passes (checkTcbInfoTcbStatus demands UpToDate) on the same pair.
    TEE_TCB_SVN is 0b 01 04 ..: a TDX 1.5 module (SVN[1] = 1), so components 0 and 1 are skipped and module identity
    TDX_01 judges SVN[0] = 11 (its UpToDate level needs 6); the platform's first level (2024-11-13) is met. The QE
    (ISVSVN 7) matches the vectors' only QE identity, UpToDate from ISVSVN 4, but that identity expired in 2023:
    the v5 collateral has no QE identity current at 2026-02-03, so the full verdict above is a refusal."""
    quoted = quoted_tcb(quote("quote_v5_sample.dat"))
    signing_path = tuple(x509.load_pem_x509_certificates((VECTORS / "tcb_info_issuer_chain.pem").read_bytes()))
    key = signing_path[0].public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    signed, signature = signed_member((VECTORS / "sample_tcbinfo_response_v5").read_bytes(), "tcbInfo", "v5")
    assert verifies(key, signature, signed)
    status, levels = platform_tcb(tcb_info_of(signed, signing_path, "v5"), quoted)
    assert (status, [(level.status, level.date) for level in levels]) == (
        "UpToDate", [("UpToDate", "2024-11-13T00:00:00Z"), ("UpToDate", "2024-11-13T00:00:00Z")])
    signed, signature = signed_member((VECTORS / "sample_qeIdentity_response").read_bytes(), "enclaveIdentity", "qe")
    assert verifies(key, signature, signed)
    identity = qe_identity_of(signed, signing_path, "qe")
    assert (quoted.qe.isvsvn, qe_tcb(quoted.qe, identity).status, identity.next_update.isoformat()) == (
        7, "UpToDate", "2023-07-08T07:24:59+00:00")


def test_the_spr_collateral_today_is_expired(roots: TrustRoots, spr_collateral: Collateral) -> None:
    now = datetime.now(UTC)
    _, reason, message = judge(quote("tdx_prod_quote_SPR_E4.dat"), roots, spr_collateral, now)
    assert (reason, message) == ("expired-collateral", (
        f"the issuer chain of {spr_collateral.path('intel/tcb_info_50806f000000.json')}: {SIGNING} is valid from "
        f"2018-05-21T10:50:10+00:00 to 2025-05-21T10:50:10+00:00, not at {now.isoformat()}"))


def test_one_changed_byte_of_the_tcb_info_is_bad_collateral(
        roots: TrustRoots, spr_collateral: Collateral, tmp_path: Path) -> None:
    """The forger lowers the TDX late microcode SVN the UpToDate level needs from 5 to 4, which the SPR platform
    has: the signature over the served bytes no longer holds."""
    body = (VECTORS / "sample_tcbInfo_response").read_bytes()
    needle = b'{"svn":5,"category":"OS/VMM","type":"TDX Late Microcode Update"}'
    changed = body.replace(needle, needle.replace(b"5", b"4"), 1)
    assert len(changed) == len(body) and changed != body
    tampered = collateral_directory(tmp_path, SPR_FMSPC, "sample_tcbInfo_response")
    (tmp_path / "intel" / f"tcb_info_{SPR_FMSPC}.json").write_bytes(changed)
    _, reason, message = judge(quote("tdx_prod_quote_SPR_E4.dat"), roots, load_collateral(tmp_path), SPR_TIME)
    assert (reason, message) == ("bad-collateral", (
        f"{tampered.path('intel/tcb_info_50806f000000.json')}: the tcbInfo signature does not verify under "
        f"{SIGNING}: the file was changed or not signed by Intel"))


def test_the_spr_quote_without_collateral_names_what_was_not_checked(roots: TrustRoots) -> None:
    platform = verify_quote(quote("tdx_prod_quote_SPR_E4.dat"), roots,
                            Expectations(nonce=None, measurement=None, now=SPR_TIME), lambda check: None)
    assert (platform.tcb_status, [line.split(":")[0] for line in platform.not_checked]) == (
        None, ["tcb status", "revocation", "revocation"])
