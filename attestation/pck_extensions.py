"""The SGX extension of an Intel PCK certificate: which platform the certificate speaks for, and at which TCB.

Intel's TCB info is selected by the FMSPC and judged against the TCB the PCK certificate was issued for, so these
values must come from the certificate the chain verified, never from the quote. The extension (OID
1.2.840.113741.1.13.1, Intel's "PCK Certificate and CRL Profile") is DER:

    SEQUENCE {
      SEQUENCE { OID .1  PPID,   OCTET STRING (16) }
      SEQUENCE { OID .2  TCB,    SEQUENCE { SEQUENCE { OID .2.1 .. .2.16, INTEGER (0..255) } x16,
                                            SEQUENCE { OID .2.17 PCESVN, INTEGER (0..65535) },
                                            SEQUENCE { OID .2.18 CPUSVN, OCTET STRING (16) } } }
      SEQUENCE { OID .3  PCEID,  OCTET STRING (2) }
      SEQUENCE { OID .4  FMSPC,  OCTET STRING (6) }
      SEQUENCE { OID .5  SGX type, ENUMERATED }
      ... (Platform CA certificates add a platform instance id and a configuration; they are not read)
    }

A small DER walker reads it: the structure is fixed, and every length is checked against its enclosing element.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509

from attestation.errors import VerificationError

SGX_EXTENSION_OID = "1.2.840.113741.1.13.1"
TCB_COMPONENTS = 16
_SEQUENCE, _INTEGER, _OCTET_STRING, _OID, _ENUMERATED = 0x30, 0x02, 0x04, 0x06, 0x0A
_PPID, _TCB, _PCEID, _FMSPC, _SGX_TYPE = (f"{SGX_EXTENSION_OID}.{arc}" for arc in range(1, 6))
_PCESVN, _CPUSVN = f"{_TCB}.17", f"{_TCB}.18"


@dataclass(frozen=True, slots=True)
class PckExtensions:
    ppid: bytes  # [16]
    tcb_components: tuple[int, ...]  # the 16 SGX TCB component SVNs (CPUSVN as Intel's TCB info names them)
    pcesvn: int
    cpusvn: bytes  # [16], the raw CPUSVN
    pceid: bytes  # [2]
    fmspc: bytes  # [6]
    sgx_type: int  # 0 Standard, 1 Scalable, 2 Scalable with integrity


def read_pck_extensions(certificate: x509.Certificate) -> PckExtensions:
    """The SGX extension's values; raises `VerificationError("bad-certificate")` naming what is absent or malformed."""
    try:
        extension = certificate.extensions.get_extension_for_oid(x509.ObjectIdentifier(SGX_EXTENSION_OID))
    except x509.ExtensionNotFound as exc:
        raise VerificationError(
            "bad-certificate", f"the PCK certificate has no SGX extension ({SGX_EXTENSION_OID})") from exc
    if not isinstance(extension.value, x509.UnrecognizedExtension):
        raise VerificationError("bad-certificate", "the PCK certificate's SGX extension is not raw DER")
    fields = _fields(_one(extension.value.value, _SEQUENCE, "the SGX extension"), "the SGX extension")
    for oid, what in ((_PPID, "PPID"), (_TCB, "TCB"), (_PCEID, "PCEID"), (_FMSPC, "FMSPC"), (_SGX_TYPE, "SGX type")):
        if oid not in fields:
            raise VerificationError("bad-certificate", f"the PCK certificate's SGX extension has no {what} ({oid})")
    tcb = _fields(_content(fields[_TCB], _SEQUENCE, "TCB"), "the TCB")
    components = tuple(_integer(tcb, f"{_TCB}.{arc}", f"TCB component {arc}", 0xFF)
                       for arc in range(1, TCB_COMPONENTS + 1))
    return PckExtensions(
        ppid=_octets(fields[_PPID], 16, "PPID"),
        tcb_components=components,
        pcesvn=_integer(tcb, _PCESVN, "PCESVN", 0xFFFF),
        cpusvn=_octets(_required(tcb, _CPUSVN, "CPUSVN"), 16, "CPUSVN"),
        pceid=_octets(fields[_PCEID], 2, "PCEID"),
        fmspc=_octets(fields[_FMSPC], 6, "FMSPC"),
        sgx_type=_unsigned(_content(fields[_SGX_TYPE], _ENUMERATED, "SGX type"), "SGX type", 0xFF),
    )


_Element = tuple[int, bytes]
"""(tag, content) of one DER element."""


def _elements(data: bytes, what: str) -> list[_Element]:
    """The consecutive DER elements that fill `data` exactly."""
    elements, offset = [], 0
    while offset < len(data):
        if offset + 2 > len(data):
            raise _malformed(what, "ends inside an element header")
        tag, length = data[offset], data[offset + 1]
        offset += 2
        if length & 0x80:
            size = length & 0x7F
            if size == 0 or size > 3 or offset + size > len(data):
                raise _malformed(what, f"has an unsupported DER length form {length:#x}")
            length = int.from_bytes(data[offset : offset + size], "big")
            offset += size
        if offset + length > len(data):
            raise _malformed(what, f"has an element of {length} bytes past its end")
        elements.append((tag, data[offset : offset + length]))
        offset += length
    return elements


def _one(data: bytes, tag: int, what: str) -> bytes:
    elements = _elements(data, what)
    if len(elements) != 1:
        raise _malformed(what, f"holds {len(elements)} DER elements, expected one")
    return _content(elements[0], tag, what)


def _content(element: _Element, tag: int, what: str) -> bytes:
    if element[0] != tag:
        raise _malformed(what, f"has DER tag {element[0]:#04x}, expected {tag:#04x}")
    return element[1]


def _fields(data: bytes, what: str) -> dict[str, _Element]:
    """A SEQUENCE OF SEQUENCE { OID, value } as OID -> value; a repeated OID is malformed."""
    fields: dict[str, _Element] = {}
    for element in _elements(data, what):
        pair = _elements(_content(element, _SEQUENCE, what), what)
        if len(pair) != 2:
            raise _malformed(what, f"has an entry of {len(pair)} elements, expected an OID and a value")
        oid = _oid(_content(pair[0], _OID, what))
        if oid in fields:
            raise _malformed(what, f"names {oid} twice")
        fields[oid] = pair[1]
    return fields


def _oid(content: bytes) -> str:
    arcs, value = [], 0
    for byte in content:
        value = value << 7 | byte & 0x7F
        if not byte & 0x80:
            arcs.append(value)
            value = 0
    if not arcs:
        raise _malformed("an OID", "is empty")
    first = min(arcs[0] // 40, 2)
    return ".".join(str(arc) for arc in (first, arcs[0] - 40 * first, *arcs[1:]))


def _required(fields: dict[str, _Element], oid: str, what: str) -> _Element:
    if oid not in fields:
        raise VerificationError("bad-certificate", f"the PCK certificate's TCB has no {what} ({oid})")
    return fields[oid]


def _integer(fields: dict[str, _Element], oid: str, what: str, maximum: int) -> int:
    return _unsigned(_content(_required(fields, oid, what), _INTEGER, what), what, maximum)


def _unsigned(content: bytes, what: str, maximum: int) -> int:
    value = int.from_bytes(content, "big", signed=True) if content else -1
    if not 0 <= value <= maximum:
        raise _malformed(what, f"is {value}, outside 0..{maximum}")
    return value


def _octets(element: _Element, size: int, what: str) -> bytes:
    content = _content(element, _OCTET_STRING, what)
    if len(content) != size:
        raise _malformed(what, f"is {len(content)} bytes, expected {size}")
    return content


def _malformed(what: str, problem: str) -> VerificationError:
    return VerificationError("bad-certificate", f"the PCK certificate's {what} {problem}")
