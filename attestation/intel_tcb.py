"""Intel's signed TCB documents, TDX TCB info and TD QE identity, read from the bytes Intel PCS serves.

A PCS body is `{"tcbInfo": {...}, "signature": "<r||s hex>"}` (or `"enclaveIdentity"`), and the signature covers the
inner object's bytes exactly as served, so they are cut from the body without re-encoding: re-serialised JSON would
not verify. The signer is the Intel SGX TCB Signing certificate, whose chain (the issuer-chain header) must reach the
trust directory's Intel root; a document not signed to that root or outside its issueDate..nextUpdate window is
refused (`bad-collateral`, `expired-collateral`) before any of its values is used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from attestation.chain import INTEL_SCHEME, verify_chain
from attestation.errors import VerificationError
from attestation.intel_signature import verifies

TCB_SIGNING_NAME = "Intel SGX TCB Signing"
TCB_INFO_ID, TCB_INFO_VERSION = "TDX", 3
QE_IDENTITY_ID, QE_IDENTITY_VERSION = "TD_QE", 2
TCB_STATUSES = ("UpToDate", "SWHardeningNeeded", "ConfigurationNeeded", "ConfigurationAndSWHardeningNeeded",
                "OutOfDate", "OutOfDateConfigurationNeeded", "Revoked")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class SvnLevel:
    """A TCB level judged by one SVN: the QE's ISVSVN, or the TDX module's (TEE_TCB_SVN[0])."""

    isvsvn: int
    date: str  # tcbDate as served
    status: str  # one of TCB_STATUSES
    advisory_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PlatformLevel:
    sgx_components: tuple[int, ...]  # [16], against the PCK certificate's SGX TCB components
    pcesvn: int
    tdx_components: tuple[int, ...]  # [16], against the TD report's TEE_TCB_SVN
    date: str
    status: str
    advisory_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModuleIdentity:
    """A TDX module version's identity (`TDX_<major version, 2 hex digits>`), for TEE_TCB_SVN[1] > 0."""

    id: str
    mrsigner: bytes  # [48]
    attributes: bytes  # [8]
    attributes_mask: bytes  # [8]
    levels: tuple[SvnLevel, ...]


@dataclass(frozen=True, slots=True)
class TcbInfo:
    source: str  # the file, for messages
    signing_path: tuple[x509.Certificate, ...]  # TCB signing certificate, trusted root: verified
    issue_date: datetime
    next_update: datetime
    fmspc: str  # 12 lowercase hex digits
    pce_id: str  # 4 lowercase hex digits
    evaluation_number: int
    module: ModuleIdentity  # `tdxModule`: the TDX module's MRSIGNER and attributes (its `levels` are empty)
    module_identities: tuple[ModuleIdentity, ...]
    levels: tuple[PlatformLevel, ...]  # in the order served: highest first


@dataclass(frozen=True, slots=True)
class QeIdentity:
    source: str
    signing_path: tuple[x509.Certificate, ...]
    issue_date: datetime
    next_update: datetime
    evaluation_number: int
    miscselect: int  # u32
    miscselect_mask: int  # u32
    attributes: bytes  # [16]
    attributes_mask: bytes  # [16]
    mrsigner: bytes  # [32]
    isvprodid: int
    levels: tuple[SvnLevel, ...]  # highest ISVSVN first


def read_tcb_info(body: bytes, issuer_chain: bytes, roots: Sequence[x509.Certificate], now: datetime, source: str
                  ) -> TcbInfo:
    """The TDX TCB info of a PCS body, its signature verified to `roots` and its window holding `now`."""
    signed, signing_path = _signed(body, "tcbInfo", issuer_chain, roots, now, source)
    return tcb_info_of(signed, signing_path, source)


def read_qe_identity(body: bytes, issuer_chain: bytes, roots: Sequence[x509.Certificate], now: datetime,
                     source: str) -> QeIdentity:
    """The TD QE identity of a PCS body, its signature verified to `roots` and its window holding `now`."""
    signed, signing_path = _signed(body, "enclaveIdentity", issuer_chain, roots, now, source)
    return qe_identity_of(signed, signing_path, source)


def tcb_info_of(signed: bytes, signing_path: tuple[x509.Certificate, ...], source: str) -> TcbInfo:
    """The values of the `tcbInfo` object `signed`, whose signature by `signing_path` the caller verified."""
    fields = _Fields(json.loads(signed), source, "tcbInfo")
    _identify(fields, TCB_INFO_ID, TCB_INFO_VERSION)
    if fields.integer("tcbType") != 0:
        raise fields.bad(f"has tcbType {fields.integer('tcbType')}; only type 0 (SGX components then PCESVN) exists")
    levels = tuple(PlatformLevel(
        sgx_components=_svns(level.object("tcb"), "sgxtcbcomponents"), pcesvn=level.object("tcb").integer("pcesvn"),
        tdx_components=_svns(level.object("tcb"), "tdxtcbcomponents"), date=level.text("tcbDate"),
        status=_status(level), advisory_ids=_advisories(level)) for level in fields.objects("tcbLevels"))
    if not levels:
        raise fields.bad("has no TCB levels")
    return TcbInfo(
        source=source, signing_path=signing_path, issue_date=fields.date("issueDate"),
        next_update=fields.date("nextUpdate"), fmspc=fields.hex("fmspc", 6).hex(), pce_id=fields.hex("pceId", 2).hex(),
        evaluation_number=fields.integer("tcbEvaluationDataNumber"),
        module=_module_identity(fields.object("tdxModule"), "tdxModule", with_levels=False),
        module_identities=tuple(_module_identity(identity, identity.text("id"), with_levels=True)
                                for identity in fields.objects("tdxModuleIdentities", optional=True)),
        levels=levels)


def qe_identity_of(signed: bytes, signing_path: tuple[x509.Certificate, ...], source: str) -> QeIdentity:
    """The values of the `enclaveIdentity` object `signed`, whose signature by `signing_path` the caller verified."""
    fields = _Fields(json.loads(signed), source, "enclaveIdentity")
    _identify(fields, QE_IDENTITY_ID, QE_IDENTITY_VERSION)
    return QeIdentity(
        source=source, signing_path=signing_path, issue_date=fields.date("issueDate"),
        next_update=fields.date("nextUpdate"), evaluation_number=fields.integer("tcbEvaluationDataNumber"),
        miscselect=int.from_bytes(fields.hex("miscselect", 4), "little"),
        miscselect_mask=int.from_bytes(fields.hex("miscselectMask", 4), "little"),
        attributes=fields.hex("attributes", 16), attributes_mask=fields.hex("attributesMask", 16),
        mrsigner=fields.hex("mrsigner", 32), isvprodid=fields.integer("isvprodid"), levels=_svn_levels(fields))


def signed_member(body: bytes, member: str, source: str) -> tuple[bytes, bytes]:
    """(the exact bytes of `member`'s value, the raw r || s signature) of a PCS body `{member: {...}, "signature"}`."""
    try:
        members = _raw_members(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise VerificationError("bad-collateral", f"{source} is not a JSON object as PCS serves it: {exc}") from exc
    if sorted(members) != sorted((member, "signature")):
        raise VerificationError("bad-collateral", f"{source} has members {sorted(members)}, expected "
                                f"{member!r} and 'signature'")
    signature = json.loads(members["signature"])
    if not isinstance(signature, str) or not re.fullmatch("[0-9a-fA-F]{128}", signature):
        raise VerificationError("bad-collateral", f"{source}'s signature is not 64 bytes of hex (r || s)")
    return members[member].encode("utf-8"), bytes.fromhex(signature)


class _Fields:
    """A JSON object of a collateral file; every accessor raises `bad-collateral` naming the file and member."""

    def __init__(self, value: Any, source: str, where: str) -> None:
        self.source, self.where = source, where
        if not isinstance(value, dict):
            raise self.bad("is not a JSON object")
        self.value: dict[str, Any] = value

    def bad(self, problem: str) -> VerificationError:
        return VerificationError("bad-collateral", f"{self.source}: {self.where} {problem}")

    def _get(self, key: str, kind: type | tuple[type, ...], what: str) -> Any:
        value = self.value.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise self.bad(f"has no {what} {key!r}")
        return value

    def text(self, key: str) -> str:
        return str(self._get(key, str, "string"))

    def integer(self, key: str) -> int:
        value = int(self._get(key, int, "integer"))
        if value < 0:
            raise self.bad(f"has a negative {key!r}")
        return value

    def hex(self, key: str, size: int) -> bytes:
        text = self.text(key)
        if not re.fullmatch(f"[0-9a-fA-F]{{{2 * size}}}", text):
            raise self.bad(f"has {key!r} {text!r}, not {size} bytes of hex")
        return bytes.fromhex(text)

    def date(self, key: str) -> datetime:
        text = self.text(key)
        try:
            value = datetime.fromisoformat(text)
        except ValueError as exc:
            raise self.bad(f"has {key!r} {text!r}, not an ISO 8601 time") from exc
        if value.tzinfo is None:
            raise self.bad(f"has {key!r} {text!r} without a time zone")
        return value

    def object(self, key: str) -> _Fields:
        return _Fields(self._get(key, dict, "object"), self.source, f"{self.where}.{key}")

    def objects(self, key: str, optional: bool = False) -> list[_Fields]:
        if optional and key not in self.value:
            return []
        return [_Fields(item, self.source, f"{self.where}.{key}[{index}]")
                for index, item in enumerate(self._get(key, list, "array"))]


def _signed(body: bytes, member: str, issuer_chain: bytes, roots: Sequence[x509.Certificate], now: datetime,
            source: str) -> tuple[bytes, tuple[x509.Certificate, ...]]:
    """The signed inner object of a PCS body, after its signature and window hold; and its signing path."""
    signed, signature = signed_member(body, member, source)
    signing = _signing_certificate(issuer_chain, roots, now, source)
    key = signing[0].public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not verifies(key, signature, signed):
        raise VerificationError("bad-collateral", f"{source}: the {member} signature does not verify under "
                                f"{signing[0].subject.rfc4514_string()}: the file was changed or not signed by Intel")
    fields = _Fields(json.loads(signed), source, member)
    issued, next_update = fields.date("issueDate"), fields.date("nextUpdate")
    if not issued <= now <= next_update:
        raise VerificationError("expired-collateral", f"{source} is current from {issued.isoformat()} to "
                                f"{next_update.isoformat()}, not at {now.isoformat()}: fetch it again")
    return signed, signing


def _signing_certificate(issuer_chain: bytes, roots: Sequence[x509.Certificate], now: datetime, source: str
                         ) -> tuple[x509.Certificate, ...]:
    """The path from the TCB signing certificate (first in the issuer chain) to a trusted Intel root."""
    try:
        chain = x509.load_pem_x509_certificates(issuer_chain)
    except ValueError as exc:
        raise VerificationError("bad-collateral", f"the issuer chain of {source} has no PEM certificate") from exc
    names = chain[0].subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if [name.value for name in names] != [TCB_SIGNING_NAME]:
        raise VerificationError("bad-collateral", f"the issuer chain of {source} starts with "
                                f"{chain[0].subject.rfc4514_string()}, not the {TCB_SIGNING_NAME} certificate")
    try:
        return verify_chain(chain[0], chain[1:], roots, INTEL_SCHEME, now)
    except VerificationError as exc:
        reason = "expired-collateral" if exc.reason == "expired-certificate" else "bad-collateral"
        raise VerificationError(reason, f"the issuer chain of {source}: {exc.message}") from exc


def _raw_members(text: str) -> dict[str, str]:
    """The members of the JSON object `text`, each value as its exact source text."""
    members: dict[str, str] = {}
    index = _skip(text, 0)
    if text[index : index + 1] != "{":
        raise ValueError("it does not start with '{'")
    index = _skip(text, index + 1)
    while text[index : index + 1] != "}":
        name, index = _DECODER.raw_decode(text, index)
        index = _skip(text, index)
        if not isinstance(name, str) or text[index : index + 1] != ":":
            raise ValueError(f"a member name is not a string followed by ':' at character {index}")
        start = _skip(text, index + 1)
        _, index = _DECODER.raw_decode(text, start)
        if name in members:
            raise ValueError(f"member {name!r} appears twice")
        members[name] = text[start:index]
        index = _skip(text, index)
        if text[index : index + 1] == ",":
            index = _skip(text, index + 1)
        elif text[index : index + 1] != "}":
            raise ValueError(f"expected ',' or '}}' at character {index}")
    if text[index + 1 :].strip(" \t\n\r"):
        raise ValueError("it has text after the object")
    return members


def _skip(text: str, index: int) -> int:
    """The index of the first non-whitespace character (JSON's whitespace) at or after `index`."""
    while index < len(text) and text[index] in " \t\n\r":
        index += 1
    return index


def _identify(fields: _Fields, expected_id: str, expected_version: int) -> None:
    if (fields.text("id"), fields.integer("version")) != (expected_id, expected_version):
        raise fields.bad(f"is {fields.text('id')!r} version {fields.integer('version')}; this verifier reads "
                         f"{expected_id!r} version {expected_version}")


def _module_identity(fields: _Fields, identity: str, with_levels: bool) -> ModuleIdentity:
    return ModuleIdentity(id=identity, mrsigner=fields.hex("mrsigner", 48), attributes=fields.hex("attributes", 8),
                          attributes_mask=fields.hex("attributesMask", 8),
                          levels=_svn_levels(fields) if with_levels else ())


def _svn_levels(fields: _Fields) -> tuple[SvnLevel, ...]:
    levels = tuple(SvnLevel(isvsvn=level.object("tcb").integer("isvsvn"), date=level.text("tcbDate"),
                            status=_status(level), advisory_ids=_advisories(level))
                   for level in fields.objects("tcbLevels"))
    if not levels:
        raise fields.bad("has no TCB levels")
    return levels


def _svns(tcb: _Fields, key: str) -> tuple[int, ...]:
    components = tuple(component.integer("svn") for component in tcb.objects(key))
    if len(components) != 16 or max(components) > 0xFF:
        raise tcb.bad(f"has {len(components)} {key!r}, expected 16 SVNs of one byte")
    return components


def _status(level: _Fields) -> str:
    status = level.text("tcbStatus")
    if status not in TCB_STATUSES:
        raise level.bad(f"has tcbStatus {status!r}, not one of {', '.join(TCB_STATUSES)}")
    return status


def _advisories(level: _Fields) -> tuple[str, ...]:
    advisories = level.value.get("advisoryIDs", [])
    if not isinstance(advisories, list) or not all(isinstance(advisory, str) for advisory in advisories):
        raise level.bad("has advisoryIDs that are not a list of strings")
    return tuple(advisories)
