"""Intel's collateral judges a verified TDX quote: is its quoting enclave Intel's, what TCB status has its platform,
and is its PCK chain revoked.

The steps follow go-tdx-guest (`verify/verify.go`, `testing/testdata/README.md`) and Intel's QVL:

1. TCB info and QE identity: signed to the trust directory's Intel root, current, `TDX` v3 / `TD_QE` v2, for the
   PCK certificate's FMSPC and PCEID (`intel_tcb`).
2. Revocation: the PCK leaf against its issuing CA's CRL (Platform or Processor CA, by the issuer's CN); that CA and
   the TCB signing certificate against the root CA's CRL (`chain.check_crl`).
3. The QE report against the QE identity: MRSIGNER, ISVPRODID, MISCSELECT and ATTRIBUTES under Intel's masks
   (`qe-identity-mismatch`), then the first level whose ISVSVN the QE reaches gives its status.
4. The TD's MRSIGNERSEAM and SEAM attributes against the TCB info's TDX module (`tdx-module-mismatch`).
5. The platform's level: the first whose SGX components the PCK certificate's all reach, whose PCESVN it reaches
   and whose TDX components TEE_TCB_SVN all reach. With TEE_TCB_SVN[1] > 0 (a TDX 1.5 module) components 0 and 1
   are skipped and the module identity `TDX_<SVN[1]>` judges TEE_TCB_SVN[0] instead, as go-tdx-guest and the QVL
   do; that also settles the README's step 4 (a level's component 1 must equal TEE_TCB_SVN[1]), which with
   SVN[1] = 0 the comparison already enforces. No level: `tcb-level-not-found`.
6. One status, as the QVL converges them: an OutOfDate QE or TDX module makes UpToDate and SWHardeningNeeded
   OutOfDate and the Configuration statuses OutOfDateConfigurationNeeded; anything Revoked is Revoked. Advisory
   IDs of every matched level are reported. Which statuses are trusted is the trust policy's choice.

TCB info and QE identity are judged together or not at all: a TCB status without the QE identity would let a
forged quoting enclave through. So a collateral directory holding some of the four TCB files (`tcb_info_<fmspc>.json`,
its issuer chain, `qe_identity.json`, its issuer chain) but not all is `missing-collateral`; one holding none leaves
the status unevaluated and says so, for the trust policy to refuse. CRLs are optional the same way, each named
when absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509
from cryptography.x509.oid import NameOID

from attestation.chain import INTEL_ROOT_FILE, INTEL_SCHEME, TrustRoots, check_crl, describe, describe_path
from attestation.checks import Check, CheckSink, Expectations
from attestation.collateral import Collateral
from attestation.errors import VerificationError
from attestation.intel_tcb import (
    ModuleIdentity,
    PlatformLevel,
    QeIdentity,
    SvnLevel,
    TcbInfo,
    read_qe_identity,
    read_tcb_info,
)
from attestation.pck_extensions import PckExtensions

PCK_CRLS = {"Intel SGX PCK Platform CA": "pck_crl_platform.der", "Intel SGX PCK Processor CA": "pck_crl_processor.der"}
"""The PCK CA's common name -> the file of its CRL."""
ROOT_CRL = "root_crl.der"
_OUT_OF_DATE = {"UpToDate": "OutOfDate", "SWHardeningNeeded": "OutOfDate",
                "ConfigurationNeeded": "OutOfDateConfigurationNeeded",
                "ConfigurationAndSWHardeningNeeded": "OutOfDateConfigurationNeeded"}
"""A platform status -> what it becomes when its QE or TDX module is OutOfDate (QVL's convergence)."""


@dataclass(frozen=True, slots=True)
class QeReport:
    """The quoting enclave's SGX report body (384 bytes): the values its QE identity judges."""

    miscselect: int  # u32 at 0x10
    attributes: bytes  # [16] at 0x30
    mrsigner: bytes  # [32] at 0x80
    isvprodid: int  # u16 at 0x100
    isvsvn: int  # u16 at 0x102

    @classmethod
    def read(cls, report: bytes) -> QeReport:
        return cls(miscselect=int.from_bytes(report[0x10:0x14], "little"), attributes=report[0x30:0x40],
                   mrsigner=report[0x80:0xA0], isvprodid=int.from_bytes(report[0x100:0x102], "little"),
                   isvsvn=int.from_bytes(report[0x102:0x104], "little"))


@dataclass(frozen=True, slots=True)
class QuotedTcb:
    """What a verified quote says of its platform, for the collateral to judge."""

    tee_tcb_svn: bytes  # [16], the TD report's
    mrsignerseam: bytes  # [48]
    seam_attributes: bytes  # [8]
    qe: QeReport
    pck_path: tuple[x509.Certificate, ...]  # PCK leaf, its CA, the trusted root: as `verify_chain` returned it
    pck: PckExtensions  # the leaf's SGX extension


@dataclass(frozen=True, slots=True)
class TcbJudgement:
    status: str | None  # the converged TCB status; None: not evaluated (`not_checked` says why)
    advisory_ids: tuple[str, ...]
    not_checked: tuple[str, ...]


def judge_tcb(quoted: QuotedTcb, roots: TrustRoots, expect: Expectations, emit: CheckSink) -> TcbJudgement:
    """Run every collateral check on a quote whose signatures verified, emitting each that passes."""
    collateral, pck = expect.collateral, quoted.pck
    emit(Check("pck platform", f"FMSPC {pck.fmspc.hex()}, PCEID {pck.pceid.hex()}, PCESVN {pck.pcesvn}, "
                               f"SGX TCB components {_dotted(pck.tcb_components)}"))
    documents = _documents(quoted, roots, expect)
    not_checked = _check_revocation(quoted, () if documents is None else documents[2], collateral, expect, emit)
    if documents is None:
        emit(Check("tcb", f"TEE_TCB_SVN {quoted.tee_tcb_svn.hex()} (not evaluated: no Intel TCB info or QE identity "
                          "given)"))
        return TcbJudgement(None, (), (f"tcb status: neither {_intel(collateral, 'tcb_info_' + pck.fmspc.hex())}"
                                       f".json nor {_intel(collateral, 'qe_identity.json')} was given: the quoting "
                                       "enclave's identity and the platform's TCB were not judged", *not_checked))
    tcb_info, qe_identity, _ = documents
    for name, document in (("tcb info", tcb_info), ("qe identity", qe_identity)):
        emit(Check(name, f"{document.source}, signed by {describe_path(document.signing_path, INTEL_SCHEME)}, "
                         f"current until {document.next_update.isoformat()}"))
    qe_level = qe_tcb(quoted.qe, qe_identity)
    emit(Check("qe identity match", f"MRSIGNER {quoted.qe.mrsigner.hex()}, ISVPRODID {quoted.qe.isvprodid}, "
                                    f"MISCSELECT and ATTRIBUTES under Intel's masks; ISVSVN {quoted.qe.isvsvn}: "
                                    f"{qe_level.status}"))
    status, levels = platform_tcb(tcb_info, quoted)
    emit(Check("tdx module", f"MRSIGNERSEAM {quoted.mrsignerseam.hex()} and SEAM attributes "
                             f"{quoted.seam_attributes.hex()} are Intel's"))
    status = _converge(status, qe_level.status)
    advisories = tuple(dict.fromkeys(advisory for level in (*levels, qe_level) for advisory in level.advisory_ids))
    emit(Check("tcb status", f"{status} (FMSPC {tcb_info.fmspc}, TCB eval {tcb_info.evaluation_number}; platform "
                             f"level {levels[0].status} of {levels[0].date}"
                             + (f"; advisories {', '.join(advisories)}" if advisories else "") + ")"))
    return TcbJudgement(status, advisories, not_checked)


def _documents(quoted: QuotedTcb, roots: TrustRoots, expect: Expectations
               ) -> tuple[TcbInfo, QeIdentity, tuple[x509.Certificate, ...]] | None:
    """The TCB info and QE identity, verified, and their signing certificates; None when neither is given."""
    collateral, fmspc = expect.collateral, quoted.pck.fmspc.hex()
    tcb_info_body = collateral.intel_tcb_infos.get(fmspc)
    files = {f"tcb_info_{fmspc}.json": tcb_info_body, **{name: collateral.intel.get(name) for name in (
        "tcb_info_issuer_chain.pem", "qe_identity.json", "qe_identity_issuer_chain.pem")}}
    if not collateral.intel_tcb_infos and "qe_identity.json" not in collateral.intel:
        return None
    missing = [_intel(collateral, name) for name, data in files.items() if data is None]
    if missing:
        others = f" (it has TCB info for FMSPC {', '.join(sorted(collateral.intel_tcb_infos))})" if (
            tcb_info_body is None and collateral.intel_tcb_infos) else ""
        raise VerificationError("missing-collateral", f"{', '.join(missing)} absent{others}: this platform's "
                                f"TCB status (FMSPC {fmspc}) needs the TCB info and QE identity with their issuer "
                                "chains together")
    intel_roots = roots.roots_in(INTEL_ROOT_FILE, "tdx")
    assert tcb_info_body is not None
    tcb_info = read_tcb_info(tcb_info_body, files["tcb_info_issuer_chain.pem"] or b"", intel_roots, expect.now,
                             _intel(collateral, f"tcb_info_{fmspc}.json"))
    qe_identity = read_qe_identity(files["qe_identity.json"] or b"", files["qe_identity_issuer_chain.pem"] or b"",
                                   intel_roots, expect.now, _intel(collateral, "qe_identity.json"))
    if tcb_info.fmspc != fmspc:
        raise VerificationError("bad-collateral", f"{tcb_info.source} is TCB info for FMSPC {tcb_info.fmspc}, not "
                                f"{fmspc} as its name says")
    if tcb_info.pce_id != quoted.pck.pceid.hex():
        raise VerificationError("tcb-level-not-found", f"{tcb_info.source} is for PCEID {tcb_info.pce_id}, the PCK "
                                f"certificate names PCEID {quoted.pck.pceid.hex()}: it has no level for this platform")
    signing = (tcb_info.signing_path[0], qe_identity.signing_path[0])
    return tcb_info, qe_identity, tuple(dict.fromkeys(signing))


def _check_revocation(quoted: QuotedTcb, signing: tuple[x509.Certificate, ...], collateral: Collateral,
                      expect: Expectations, emit: CheckSink) -> tuple[str, ...]:
    """Check each certificate whose CRL is given, emitting what was checked; returns what was not."""
    leaf, issuer, root = quoted.pck_path[0], quoted.pck_path[1], quoted.pck_path[-1]
    issuer_name = _common_name(issuer)
    if issuer_name not in PCK_CRLS:
        raise VerificationError("bad-certificate", f"the PCK certificate is issued by {describe(issuer)}, neither "
                                f"of Intel's PCK CAs ({', '.join(PCK_CRLS)}): no CRL covers it")
    checked, not_checked = [], []
    pck_crl = PCK_CRLS[issuer_name]
    if pck_crl in collateral.intel:
        check_crl(leaf, issuer, collateral.intel[pck_crl], _intel(collateral, pck_crl), expect.now)
        checked.append(f"PCK certificate not on {_intel(collateral, pck_crl)}")
    else:
        not_checked.append(f"revocation: {_intel(collateral, pck_crl)} was not given: the PCK certificate was not "
                           f"checked against the CRL of {issuer_name}")
    below_root = [*quoted.pck_path[1:-1], *signing]
    names = " and ".join(describe(certificate) for certificate in below_root)
    if ROOT_CRL in collateral.intel:
        for certificate in below_root:
            check_crl(certificate, root, collateral.intel[ROOT_CRL], _intel(collateral, ROOT_CRL), expect.now)
        checked.append(f"{names} not on {_intel(collateral, ROOT_CRL)}")
    else:
        not_checked.append(f"revocation: {_intel(collateral, ROOT_CRL)} was not given: {names} not checked against "
                           "the Intel SGX Root CA's CRL")
    if checked:
        emit(Check("revocation", "; ".join(checked)))
    return tuple(not_checked)


def platform_tcb(tcb_info: TcbInfo, quoted: QuotedTcb) -> tuple[str, tuple[PlatformLevel | SvnLevel, ...]]:
    """The platform's status under `tcb_info` (steps 4 and 5, converged with the TDX module's), and the levels
    that gave it: the platform's, then the module identity's when TEE_TCB_SVN[1] > 0."""
    _check_module(tcb_info.module, quoted, tcb_info.source)
    platform = _platform_level(tcb_info, quoted)
    if quoted.tee_tcb_svn[1] == 0:
        return platform.status, (platform,)
    module = _module_level(tcb_info, quoted)
    return _converge(platform.status, module.status), (platform, module)


def qe_tcb(qe: QeReport, identity: QeIdentity) -> SvnLevel:
    """The QE identity's level for this quoting enclave, after its identity matched (step 3)."""
    mismatches = []
    if qe.mrsigner != identity.mrsigner:
        mismatches.append(f"MRSIGNER is {qe.mrsigner.hex()}, Intel's is {identity.mrsigner.hex()}")
    if qe.isvprodid != identity.isvprodid:
        mismatches.append(f"ISVPRODID is {qe.isvprodid}, Intel's is {identity.isvprodid}")
    if qe.miscselect & identity.miscselect_mask != identity.miscselect:
        mismatches.append(f"MISCSELECT {qe.miscselect:#010x} under mask {identity.miscselect_mask:#010x} is not "
                          f"{identity.miscselect:#010x}")
    if _masked(qe.attributes, identity.attributes_mask) != identity.attributes:
        mismatches.append(f"ATTRIBUTES {qe.attributes.hex()} under mask {identity.attributes_mask.hex()} are not "
                          f"{identity.attributes.hex()}")
    if mismatches:
        raise VerificationError("qe-identity-mismatch", f"the quoting enclave is not the TD QE {identity.source} "
                                f"describes: {'; '.join(mismatches)}")
    for level in identity.levels:
        if qe.isvsvn >= level.isvsvn:
            return level
    raise VerificationError("tcb-level-not-found", f"the quoting enclave's ISVSVN {qe.isvsvn} is below every level "
                            f"of {identity.source} (lowest ISVSVN {min(level.isvsvn for level in identity.levels)})")


def _check_module(module_identity: ModuleIdentity, quoted: QuotedTcb, source: str) -> None:
    if quoted.mrsignerseam != module_identity.mrsigner or _masked(
            quoted.seam_attributes, module_identity.attributes_mask) != module_identity.attributes:
        raise VerificationError(
            "tdx-module-mismatch", f"MRSIGNERSEAM {quoted.mrsignerseam.hex()} with SEAM attributes "
            f"{quoted.seam_attributes.hex()} is not {module_identity.id} of {source} (MRSIGNER "
            f"{module_identity.mrsigner.hex()}, attributes {module_identity.attributes.hex()} under mask "
            f"{module_identity.attributes_mask.hex()}): the TDX module is not Intel's")


def _platform_level(tcb_info: TcbInfo, quoted: QuotedTcb) -> PlatformLevel:
    tee, pck = quoted.tee_tcb_svn, quoted.pck
    first_tdx = 2 if tee[1] > 0 else 0
    shortfalls = []
    for level in tcb_info.levels:
        short = [f"SGX TCB component {index:02d} is {have}, needs {need}" for index, (have, need) in
                 enumerate(zip(pck.tcb_components, level.sgx_components, strict=True), start=1) if have < need]
        if pck.pcesvn < level.pcesvn:
            short.append(f"PCESVN is {pck.pcesvn}, needs {level.pcesvn}")
        short += [f"TEE_TCB_SVN[{index}] is {tee[index]}, needs {level.tdx_components[index]}"
                  for index in range(first_tdx, 16) if tee[index] < level.tdx_components[index]]
        if not short:
            return level
        shortfalls.append(f"{level.status} of {level.date}: {', '.join(short)}")
    raise VerificationError("tcb-level-not-found", f"no TCB level of {tcb_info.source} is met by the PCK certificate "
                            f"and TEE_TCB_SVN {tee.hex()}: {'; '.join(shortfalls)}")


def _module_level(tcb_info: TcbInfo, quoted: QuotedTcb) -> SvnLevel:
    """The TDX module identity `TDX_<TEE_TCB_SVN[1]>`'s level for TEE_TCB_SVN[0]."""
    version, svn = quoted.tee_tcb_svn[1], quoted.tee_tcb_svn[0]
    wanted = f"TDX_{version:02X}"
    identity = next((identity for identity in tcb_info.module_identities if identity.id.upper() == wanted), None)
    if identity is None:
        raise VerificationError("tcb-level-not-found", f"{tcb_info.source} has no TDX module identity {wanted} "
                                f"(TEE_TCB_SVN[1] is {version}); it has "
                                f"{[identity.id for identity in tcb_info.module_identities]}")
    _check_module(identity, quoted, tcb_info.source)
    for level in identity.levels:
        if svn >= level.isvsvn:
            return level
    raise VerificationError("tcb-level-not-found", f"the TDX module's SVN {svn} (TEE_TCB_SVN[0]) is below every "
                            f"level of {wanted} in {tcb_info.source}")


def _converge(status: str, other: str) -> str:
    if "Revoked" in (status, other):
        return "Revoked"
    if other == "OutOfDate":
        return _OUT_OF_DATE.get(status, status)
    return status


def _masked(value: bytes, mask: bytes) -> bytes:
    return bytes(a & b for a, b in zip(value, mask, strict=True))


def _common_name(certificate: x509.Certificate) -> str:
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _intel(collateral: Collateral, name: str) -> str:
    return collateral.path(f"intel/{name}")


def _dotted(values: tuple[int, ...]) -> str:
    return ".".join(str(value) for value in values)
