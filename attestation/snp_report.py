"""The AMD SEV-SNP attestation report (0x4A0 bytes, versions 2 to 5), its TCB versions and its certificate table.

Report offsets (SEV-SNP ABI, as go-sev-guest and virtee/sev read them), little-endian:

    0x000 VERSION u32         0x004 GUEST_SVN u32               0x008 POLICY u64
    0x010 FAMILY_ID [16]      0x020 IMAGE_ID [16]               0x030 VMPL u32
    0x034 SIGNATURE_ALGO u32 (1 = P-384/SHA-384)                0x038 CURRENT_TCB [8]
    0x040 PLATFORM_INFO u64   0x048 signer info u32 (bit 0 AUTHOR_KEY_EN, bit 1 MASK_CHIP_KEY,
                                    bits 4:2 SIGNING_KEY: 0 VCEK, 1 VLEK, 7 none; bits 31:5 reserved)
    0x050 REPORT_DATA [64]    0x090 MEASUREMENT [48]            0x0C0 HOST_DATA [32]
    0x0E0 ID_KEY_DIGEST [48]  0x110 AUTHOR_KEY_DIGEST [48]      0x180 REPORTED_TCB [8]
    0x188 CPUID family, model, stepping (v3+; reserved in v2)  0x1A0 CHIP_ID [64]
    0x1E0 COMMITTED_TCB [8]   0x2A0 SIGNATURE: R [72] || S [72], little-endian, rest zero up to 0x4A0

The signature covers [0x000, 0x2A0). Every version has the same size and signed range. Guest policy
bits: 16 SMT, 17 reserved (must be 1), 18 MIGRATE_MA, 19 DEBUG, 20 SINGLE_SOCKET, 21-25 newer
features, 63:26 reserved (must be 0). Reserved fields must be zero, as go-sev-guest's parser requires:
a report that sets one was not made by AMD firmware of a version this verifier knows.

The certificate table (configfs-tsm auxblob, or SNP_GET_EXT_REPORT's buffer) holds DER certificates:

    entry (24 bytes) = GUID (16, RFC 4122 byte order) || offset u32 || length u32, little-endian
    the table ends at the first all-zero entry; offsets count from the start of the table
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass
from typing import Literal

from attestation.errors import VerificationError

REPORT_BYTES = 0x4A0
SIGNED_BYTES = 0x2A0
SIGNATURE_COMPONENT_BYTES = 72
"""R and S are 384-bit integers zero-padded to 72 bytes; the upper 24 bytes of each must be zero."""
SUPPORTED_VERSIONS = range(2, 6)
SIGNATURE_ALGO_ECDSA_P384_SHA384 = 1
POLICY_DEBUG_BIT = 19
POLICY_RESERVED_ONE_BIT = 17
POLICY_FIRST_RESERVED_ZERO_BIT = 26
SIGNER_INFO_FIRST_RESERVED_BIT = 5
SIGNING_KEY_VCEK = 0
SIGNING_KEY_VLEK = 1
SIGNING_KEY_NAMES = {0: "VCEK", 1: "VLEK", 7: "none"}

Product = Literal["Milan", "Genoa", "Turin"]
Generation = Literal["milan-genoa", "turin"]
TCB_LAYOUTS: dict[Generation, dict[str, int]] = {
    # Zen 3/4: [0] BL, [1] TEE, [2..5] reserved SPL4-7, [6] SNP, [7] UCODE
    "milan-genoa": {"bl": 0, "tee": 1, "spl4": 2, "spl5": 3, "spl6": 4, "spl7": 5, "snp": 6, "ucode": 7},
    # Zen 5: [0] FMC, [1] BL, [2] TEE, [3] SNP, [4..6] reserved, [7] UCODE
    "turin": {"fmc": 0, "bl": 1, "tee": 2, "snp": 3, "ucode": 7},
}
"""TCB_VERSION byte index of each named component, per processor generation (virtee/sev)."""
GENERATIONS: dict[Product, Generation] = {"Milan": "milan-genoa", "Genoa": "milan-genoa", "Turin": "turin"}
CPUID_MODELS: dict[int, tuple[tuple[Product, range], ...]] = {
    0x19: (("Milan", range(0x00, 0x10)), ("Genoa", range(0x10, 0x20)), ("Genoa", range(0xA0, 0xB0))),
    0x1A: (("Turin", range(0x00, 0x12)),),
}
"""CPUID family -> the model ranges of each product (virtee/sev `Generation::identify_cpu`; go-sev-guest names
one model each, Milan 0x01, Genoa 0x11, Turin 0x02, all inside these). Family 0x1a's other models are Venice."""


VCEK_GUID = uuid.UUID("63da758d-e664-4564-adc5-f4b93be8accd")
VLEK_GUID = uuid.UUID("a8074bc2-a25a-483e-aae6-39c045a0b8a1")
ASK_GUID = uuid.UUID("4ab7b379-bbac-4fe4-a02f-05aef327c782")
ARK_GUID = uuid.UUID("c0b406a4-a803-4952-9743-3fb6014cd0ae")

ENTRY = struct.Struct("<16sII")
_END = bytes(ENTRY.size)


@dataclass(frozen=True, slots=True)
class SnpReport:
    version: int
    guest_svn: int
    policy: int
    vmpl: int
    signature_algo: int
    current_tcb: bytes  # [8], TCB_VERSION
    platform_info: int
    signer_info: int
    report_data: bytes  # [64]
    measurement: bytes  # [48], the launch digest
    host_data: bytes  # [32]
    family_id: bytes  # [16], from the ID block
    image_id: bytes  # [16], from the ID block
    id_key_digest: bytes  # [48], SHA-384 of the ID block's signing key; zero without an ID block
    author_key_digest: bytes  # [48], SHA-384 of the ID key's author key; zero unless AUTHOR_KEY_EN
    reported_tcb: bytes  # [8], the TCB the signing VCEK was derived at
    cpuid_family: int | None  # family id byte at 0x188; None before v3
    cpuid_model: int | None  # model id byte at 0x189; None before v3
    chip_id: bytes  # [64]; all zero when MASK_CHIP_KEY is set
    committed_tcb: bytes  # [8]
    signed_bytes: bytes  # [0x000, 0x2A0)
    signature_r: bytes  # [72], little-endian
    signature_s: bytes  # [72], little-endian

    @property
    def debug(self) -> bool:
        return bool(self.policy >> POLICY_DEBUG_BIT & 1)

    @property
    def signing_key(self) -> int:
        return self.signer_info >> 2 & 0b111

    @property
    def mask_chip_key(self) -> bool:
        return bool(self.signer_info >> 1 & 1)

    @property
    def author_key_en(self) -> bool:
        return bool(self.signer_info & 1)

    @property
    def product(self) -> Product | None:
        """The processor the report's CPUID fields name (v3+); None for v2, where only the chain names it."""
        if self.cpuid_family is None or self.cpuid_model is None:
            return None
        for product, models in CPUID_MODELS.get(self.cpuid_family, ()):
            if self.cpuid_model in models:
                return product
        raise VerificationError(
            "unsupported-report",
            f"CPUID family {self.cpuid_family:#x} model {self.cpuid_model:#x} is no SEV-SNP processor this verifier "
            "knows (Milan, Genoa: family 0x19; Turin: family 0x1a models 0x00-0x11)",
        )


def tcb_components(tcb: bytes, generation: Generation) -> dict[str, int]:
    """Named SPL values of an 8-byte TCB_VERSION."""
    return {name: tcb[index] for name, index in TCB_LAYOUTS[generation].items()}


def format_tcb(tcb: bytes, generation: Generation) -> str:
    return " ".join(f"{name}={value}" for name, value in tcb_components(tcb, generation).items())


def parse_snp_report(data: bytes) -> SnpReport:
    """Parse a report; raises `VerificationError` for a wrong size, version or signature padding."""
    if len(data) < REPORT_BYTES:
        raise VerificationError(
            "truncated-report", f"an SEV-SNP report is {REPORT_BYTES} bytes, this one has only {len(data)}"
        )
    if len(data) > REPORT_BYTES:
        raise VerificationError(
            "malformed-report", f"an SEV-SNP report is {REPORT_BYTES} bytes, this one has {len(data)}"
        )
    version = _u32(data, 0x000)
    if version not in SUPPORTED_VERSIONS:
        raise VerificationError(
            "unsupported-report",
            f"SEV-SNP report version {version}; this verifier reads versions 2 to 5",
        )
    tail = data[SIGNED_BYTES + 2 * SIGNATURE_COMPONENT_BYTES :]
    if any(tail):
        raise VerificationError("malformed-report", "bytes [0x330, 0x4A0) after the signature must be zero")
    _check_reserved(data, version)
    signature = data[SIGNED_BYTES : SIGNED_BYTES + 2 * SIGNATURE_COMPONENT_BYTES]
    return SnpReport(
        version=version,
        guest_svn=_u32(data, 0x004),
        policy=int.from_bytes(data[0x008:0x010], "little"),
        vmpl=_u32(data, 0x030),
        signature_algo=_u32(data, 0x034),
        current_tcb=data[0x038:0x040],
        platform_info=int.from_bytes(data[0x040:0x048], "little"),
        signer_info=_u32(data, 0x048),
        report_data=data[0x050:0x090],
        measurement=data[0x090:0x0C0],
        host_data=data[0x0C0:0x0E0],
        family_id=data[0x010:0x020],
        image_id=data[0x020:0x030],
        id_key_digest=data[0x0E0:0x110],
        author_key_digest=data[0x110:0x140],
        reported_tcb=data[0x180:0x188],
        cpuid_family=data[0x188] if version >= 3 else None,
        cpuid_model=data[0x189] if version >= 3 else None,
        chip_id=data[0x1A0:0x1E0],
        committed_tcb=data[0x1E0:0x1E8],
        signed_bytes=data[:SIGNED_BYTES],
        signature_r=signature[:SIGNATURE_COMPONENT_BYTES],
        signature_s=signature[SIGNATURE_COMPONENT_BYTES:],
    )


def _check_reserved(data: bytes, version: int) -> None:
    policy = int.from_bytes(data[0x008:0x010], "little")
    if not policy >> POLICY_RESERVED_ONE_BIT & 1:
        raise VerificationError(
            "malformed-report",
            f"guest policy {policy:#x} has reserved bit {POLICY_RESERVED_ONE_BIT} clear; it must be 1",
        )
    if policy >> POLICY_FIRST_RESERVED_ZERO_BIT:
        raise VerificationError(
            "malformed-report", f"guest policy {policy:#x} sets reserved bits 63:{POLICY_FIRST_RESERVED_ZERO_BIT}"
        )
    signer_info = _u32(data, 0x048)
    if signer_info >> SIGNER_INFO_FIRST_RESERVED_BIT:
        raise VerificationError(
            "malformed-report", f"signer info {signer_info:#x} sets reserved bits 31:{SIGNER_INFO_FIRST_RESERVED_BIT}"
        )
    for start, end in ((0x04C, 0x050), (0x18B if version >= 3 else 0x188, 0x1A0), (0x1EB, 0x1EC), (0x1EF, 0x1F0),
                       (0x208, SIGNED_BYTES)):
        if any(data[start:end]):
            raise VerificationError("malformed-report", f"reserved bytes [0x{start:03X}, 0x{end:03X}) are not zero")


def _u32(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset : offset + 4], "little")


def parse_cert_table(table: bytes) -> dict[uuid.UUID, bytes]:
    """GUID -> certificate bytes; empty for an empty table (the host supplied no certificates).

    Raises `VerificationError("malformed-document")` on a broken table.
    """
    certs: dict[uuid.UUID, bytes] = {}
    if not table:
        return certs
    for position in range(0, len(table), ENTRY.size):
        raw = table[position : position + ENTRY.size]
        if raw == _END:
            return certs
        if len(raw) < ENTRY.size:
            break
        guid_bytes, offset, length = ENTRY.unpack(raw)
        guid = uuid.UUID(bytes=guid_bytes)
        if offset + length > len(table):
            raise VerificationError(
                "malformed-document",
                f"certificate table entry {guid} points at [{offset}, {offset + length}), past the end of the "
                f"{len(table)}-byte table",
            )
        if guid in certs:
            raise VerificationError("malformed-document", f"certificate table names {guid} twice")
        certs[guid] = table[offset : offset + length]
    raise VerificationError("malformed-document", "certificate table has no all-zero terminating entry")


def trimmed_cert_table(buffer: bytes) -> bytes:
    """The table at the start of `buffer`, cut to its last certificate's end (as the kernel trims auxblob).

    Empty when the buffer holds no certificate (the host supplied none).
    """
    certs = parse_cert_table(buffer)
    if not certs:
        return b""
    end = (len(certs) + 1) * ENTRY.size
    for position in range(0, len(certs) * ENTRY.size, ENTRY.size):
        _, offset, length = ENTRY.unpack_from(buffer, position)
        end = max(end, offset + length)
    return buffer[:end]
