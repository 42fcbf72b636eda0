"""SPDM 1.1 GET_MEASUREMENTS as an NVIDIA GPU answers it: the request, the signed response, its blocks and opaque data.

A GPU attestation report is the request NVML sent followed by the GPU's response (DMTF DSP0274 1.1, NVIDIA nvtrust):

    request  (37 bytes)  0 SPDMVersion 0x11 | 1 code 0xE0 | 2 Param1 (bit 0: sign) | 3 Param2 | 4 Nonce [32] | 36 SlotID
    response             0 SPDMVersion 0x11 | 1 code 0x60 | 2 Param1 | 3 Param2 | 4 NumberOfBlocks
                         5 MeasurementRecordLength L1 (u24) | 8 MeasurementRecord [L1] | 8+L1 Nonce [32]
                         40+L1 OpaqueLength L2 (u16) | 42+L1 OpaqueData [L2] | 42+L1+L2 Signature [96]
    measurement block    0 Index | 1 MeasurementSpecification (1: DMTF) | 2 MeasurementSize (u16) | 4 Measurement
    DMTF measurement     0 ValueType | 1 ValueSize (u16) | 3 Value
    opaque data          [Type (u16) | Size (u16) | Value [Size]] ...   NVIDIA's fields: driver version, VBIOS, FWID...

Integers are little-endian. The signature is ECDSA P-384 with SHA-384, r || s, over request || response minus the
signature: so the request's nonce, which the verifier chose, is covered by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import NoReturn

from attestation.errors import VerificationError

REQUEST_BYTES = 37
NONCE_BYTES = 32
SIGNATURE_BYTES = 96
"""ECDSA P-384 r || s, 48 bytes each (Hopper and Blackwell)."""
SPDM_VERSION_1_1 = 0x11
GET_MEASUREMENTS = 0xE0
MEASUREMENTS = 0x60
SIGNATURE_REQUESTED = 0x01
"""Request Param1 bit 0: without it the GPU signs nothing."""
DMTF_SPECIFICATION = 0x01
_RESPONSE_HEAD = 8
_BLOCK_HEAD = 4
_DMTF_HEAD = 3
_OPAQUE_HEAD = 4
MINIMUM_REPORT_BYTES = REQUEST_BYTES + _RESPONSE_HEAD + NONCE_BYTES + 2 + SIGNATURE_BYTES


class OpaqueField(IntEnum):
    """NVIDIA's opaque data fields a verifier reads (nvtrust `OpaqueData.OPAQUE_DATA_TYPES`)."""

    DRIVER_VERSION = 3  # ASCII, NUL-terminated: "550.90.07"
    VBIOS_VERSION = 6  # 8 bytes, read as "96.00.9f.00.01"
    CHIP_SKU = 15
    PROJECT = 17
    PROJECT_SKU = 18
    FWID = 20  # [48] the GSP firmware's digest, also in the leaf certificate


@dataclass(frozen=True, slots=True)
class GpuReport:
    """One parsed GPU attestation report; only `signed` and `signature` are trusted before the signature is checked."""

    request_nonce: bytes  # [32] the nonce the requester chose: the binding digest
    measurements: Mapping[int, bytes]  # SPDM block index (1-based) -> DMTF measurement value ([48] SHA-384 on Hopper)
    opaque: Mapping[int, bytes]  # opaque field type -> value
    signed: bytes  # request || response without the signature
    signature: bytes  # [96] r || s

    @property
    def driver_version(self) -> str | None:
        value = self.opaque.get(OpaqueField.DRIVER_VERSION)
        return None if value is None else value.rstrip(b"\x00").decode("ascii", errors="replace")

    @property
    def vbios_version(self) -> str | None:
        """nvtrust's reading of the 8-byte field: the low u32 as 8 hex digits, then byte 4 ("96.00.9f.00.01")."""
        value = self.opaque.get(OpaqueField.VBIOS_VERSION)
        if value is None or len(value) != 8:
            return None
        digits = f"{int.from_bytes(value[:4], 'little'):08x}{value[4]:02x}"
        return ".".join(digits[i:i + 2] for i in range(0, len(digits), 2))

    @property
    def fwid(self) -> bytes | None:
        return self.opaque.get(OpaqueField.FWID)

    def board(self) -> str:
        """Project, project SKU and chip SKU, as nvtrust names a VBIOS RIM: "1010_0200_882"."""
        fields = (OpaqueField.PROJECT, OpaqueField.PROJECT_SKU, OpaqueField.CHIP_SKU)
        return "_".join(self.opaque.get(field, b"").rstrip(b"\x00").decode("ascii", errors="replace")
                        for field in fields)


def parse_report(report: bytes) -> GpuReport:
    """Parse request || response; raises `gpu-truncated-report` when bytes are missing, `gpu-malformed-report` when
    a field breaks the format (another message, no signature asked for, lengths that disagree, trailing bytes)."""
    if len(report) < MINIMUM_REPORT_BYTES:
        _truncated(f"the GPU report is {len(report)} bytes; an SPDM GET_MEASUREMENTS request and signed response "
                   f"take at least {MINIMUM_REPORT_BYTES}")
    request, response = report[:REQUEST_BYTES], report[REQUEST_BYTES:]
    if request[0] != SPDM_VERSION_1_1 or request[1] != GET_MEASUREMENTS:
        _malformed(f"the request is SPDM version {request[0]:#04x} code {request[1]:#04x}, not 1.1 GET_MEASUREMENTS")
    if not request[2] & SIGNATURE_REQUESTED:
        _malformed("the request did not ask for a signed response (Param1 bit 0 clear)")
    if response[0] != SPDM_VERSION_1_1 or response[1] != MEASUREMENTS:
        _malformed(f"the response is SPDM version {response[0]:#04x} code {response[1]:#04x}, not 1.1 MEASUREMENTS")
    record_end = _RESPONSE_HEAD + int.from_bytes(response[5:8], "little")
    measurements = _measurement_record(response[_RESPONSE_HEAD:record_end], response[4], len(response) - record_end)
    opaque_start = record_end + NONCE_BYTES + 2
    if opaque_start > len(response):
        _truncated(f"the response ends inside its nonce or opaque length ({len(response)} bytes)")
    opaque_end = opaque_start + int.from_bytes(response[opaque_start - 2:opaque_start], "little")
    opaque = _opaque_data(response[opaque_start:opaque_end], len(response) - opaque_end)
    after = len(response) - opaque_end
    if after < SIGNATURE_BYTES:
        _truncated(f"the response has {after} bytes after its opaque data, the signature takes {SIGNATURE_BYTES}")
    if after > SIGNATURE_BYTES:
        _malformed(f"the response has {after - SIGNATURE_BYTES} bytes after its {SIGNATURE_BYTES}-byte signature")
    return GpuReport(request_nonce=request[4:4 + NONCE_BYTES], measurements=measurements, opaque=opaque,
                     signed=report[:-SIGNATURE_BYTES], signature=report[-SIGNATURE_BYTES:])


def _measurement_record(record: bytes, blocks: int, spare: int) -> dict[int, bytes]:
    if spare < 0:
        _truncated(f"the measurement record length overruns the response by {-spare} bytes")
    if blocks == 0:
        _malformed("the response has no measurement blocks")
    measurements: dict[int, bytes] = {}
    offset = 0
    while offset < len(record):
        if offset + _BLOCK_HEAD > len(record):
            _malformed(f"measurement block {len(measurements) + 1} header crosses the record's end")
        index, specification = record[offset], record[offset + 1]
        size = int.from_bytes(record[offset + 2:offset + 4], "little")
        block = record[offset + _BLOCK_HEAD:offset + _BLOCK_HEAD + size]
        if len(block) != size or size < _DMTF_HEAD:
            _malformed(f"measurement block {index} of {size} bytes crosses the record's end")
        if specification != DMTF_SPECIFICATION:
            _malformed(f"measurement block {index} follows specification {specification:#04x}, not DMTF")
        if int.from_bytes(block[1:3], "little") != size - _DMTF_HEAD:
            _malformed(f"measurement block {index}'s value size disagrees with its block size {size}")
        if index in measurements:
            _malformed(f"measurement block {index} appears twice")
        measurements[index] = block[_DMTF_HEAD:]
        offset += _BLOCK_HEAD + size
    if len(measurements) != blocks:
        _malformed(f"the response announces {blocks} measurement blocks and carries {len(measurements)}")
    return measurements


def _opaque_data(data: bytes, spare: int) -> dict[int, bytes]:
    if spare < 0:
        _truncated(f"the opaque data length overruns the response by {-spare} bytes")
    fields: dict[int, bytes] = {}
    offset = 0
    while offset < len(data):
        if offset + _OPAQUE_HEAD > len(data):
            _malformed("an opaque data field header crosses the opaque data's end")
        kind = int.from_bytes(data[offset:offset + 2], "little")
        size = int.from_bytes(data[offset + 2:offset + 4], "little")
        value = data[offset + _OPAQUE_HEAD:offset + _OPAQUE_HEAD + size]
        if len(value) != size:
            _malformed(f"opaque field {kind} of {size} bytes crosses the opaque data's end")
        if kind in fields:
            _malformed(f"opaque field {kind} appears twice")
        fields[kind] = value
        offset += _OPAQUE_HEAD + size
    return fields


def _truncated(message: str) -> NoReturn:
    raise VerificationError("gpu-truncated-report", message)


def _malformed(message: str) -> NoReturn:
    raise VerificationError("gpu-malformed-report", message)
