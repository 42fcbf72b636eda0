"""SEV-SNP reports through the `/dev/sev-guest` ioctls, for kernels without configfs-tsm.

    SNP_GET_EXT_REPORT = _IOWR('S', 0x2, struct snp_guest_request_ioctl)   (report + certificate table)
    SNP_GET_REPORT     = _IOWR('S', 0x0, struct snp_guest_request_ioctl)   (report only)

Structures (include/uapi/linux/sev-guest.h), little-endian:

    snp_guest_request_ioctl (32): msg_version u8 (non-zero), pad 7, req_data u64, resp_data u64,
                                  fw_error u32, vmm_error u32
    snp_report_req (96):          user_data[64], vmpl u32, rsvd[28]
    snp_ext_report_req (112):     snp_report_req, certs_address u64, certs_len u32, pad 4
    snp_report_resp (4000):       status u32, report_size u32, rsvd[24], report at 0x20

A certificate buffer that is too small makes the ioctl fail with EIO, vmm_error 1, and the needed
length written back into certs_len; we retry once with that length.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attestation.binding import REPORT_DATA_BYTES
from attestation.errors import EvidenceUnavailable, VerificationError
from attestation.snp_report import trimmed_cert_table

SEV_GUEST_DEVICE = Path("/dev/sev-guest")

GUEST_REQUEST = struct.Struct("<B7xQQII")
REPORT_REQUEST = struct.Struct("<64sI28s")
EXT_REPORT_REQUEST = struct.Struct("<64sI28sQI4x")
REPORT_RESPONSE_BYTES = 4000
RESPONSE_HEADER = struct.Struct("<II24x")
MSG_VERSION = 1
PAGE_BYTES = 4096
FIRST_CERTS_LEN = 4 * PAGE_BYTES
"""VCEK, ASK and ARK in DER are about 5 KiB together; four pages leave room without a retry."""
VMM_ERR_INVALID_LEN = 1


def _iowr(kind: str, number: int, size: int) -> int:
    """Linux `_IOWR(kind, number, size)` on x86-64 (direction bits 3 << 30)."""
    return (3 << 30) | (size << 16) | (ord(kind) << 8) | number


SNP_GET_REPORT = _iowr("S", 0x0, GUEST_REQUEST.size)
SNP_GET_EXT_REPORT = _iowr("S", 0x2, GUEST_REQUEST.size)

Ioctl = Callable[[int, int, bytearray, bool], object]
"""`fcntl.ioctl`'s shape as we call it: (fd, request, mutable buffer, mutate flag)."""


@dataclass(frozen=True, slots=True)
class SevGuestReport:
    report: bytes  # the 0x4A0-byte attestation report
    cert_table: bytes  # the certificate table trimmed to its end; empty from SNP_GET_REPORT


def pack_guest_request(request_address: int, response_address: int) -> bytes:
    return GUEST_REQUEST.pack(MSG_VERSION, request_address, response_address, 0, 0)


def pack_report_request(user_data: bytes, vmpl: int = 0) -> bytes:
    return REPORT_REQUEST.pack(_checked(user_data), vmpl, bytes(28))


def pack_ext_report_request(user_data: bytes, certs_address: int, certs_len: int, vmpl: int = 0) -> bytes:
    if certs_len % PAGE_BYTES:
        raise ValueError(f"certs_len must be a multiple of {PAGE_BYTES} bytes, got {certs_len}")
    return EXT_REPORT_REQUEST.pack(_checked(user_data), vmpl, bytes(28), certs_address, certs_len)


def sev_guest_report(
    user_data: bytes, device: Path = SEV_GUEST_DEVICE, ioctl: Ioctl = fcntl.ioctl
) -> SevGuestReport | None:
    """A report over `user_data` (64 bytes) with its certificates, or None when `device` does not exist."""
    _checked(user_data)
    try:
        fd = os.open(device, os.O_RDWR)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EvidenceUnavailable(f"{device} exists but cannot be opened: {exc}") from exc
    try:
        return _extended_report(fd, user_data, ioctl) or _plain_report(fd, user_data, ioctl)
    finally:
        os.close(fd)


def _extended_report(fd: int, user_data: bytes, ioctl: Ioctl) -> SevGuestReport | None:
    """None when the host does not serve extended reports (then the plain report is asked for)."""
    certs_len = FIRST_CERTS_LEN
    for _ in range(2):
        certs = ctypes.create_string_buffer(certs_len)
        request = ctypes.create_string_buffer(
            pack_ext_report_request(user_data, ctypes.addressof(certs), certs_len), EXT_REPORT_REQUEST.size
        )
        try:
            report = _request(fd, SNP_GET_EXT_REPORT, request, ioctl)
        except _IoctlFailed as failure:
            if failure.errno == errno.EIO and failure.vmm_error == VMM_ERR_INVALID_LEN:
                certs_len = EXT_REPORT_REQUEST.unpack(request.raw)[4]
                continue
            if failure.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                return None
            raise EvidenceUnavailable(f"SNP_GET_EXT_REPORT failed: {failure}") from None
        try:
            return SevGuestReport(report=report, cert_table=trimmed_cert_table(certs.raw))
        except VerificationError as exc:
            raise EvidenceUnavailable(f"SNP_GET_EXT_REPORT returned a broken certificate table: {exc}") from exc
    raise EvidenceUnavailable(f"SNP_GET_EXT_REPORT asked twice for a larger certificate buffer ({certs_len} bytes)")


def _plain_report(fd: int, user_data: bytes, ioctl: Ioctl) -> SevGuestReport:
    request = ctypes.create_string_buffer(pack_report_request(user_data), REPORT_REQUEST.size)
    try:
        return SevGuestReport(report=_request(fd, SNP_GET_REPORT, request, ioctl), cert_table=b"")
    except _IoctlFailed as failure:
        raise EvidenceUnavailable(f"SNP_GET_REPORT failed: {failure}") from None


class _IoctlFailed(Exception):
    def __init__(self, error: OSError, fw_error: int, vmm_error: int) -> None:
        super().__init__(f"{error} (fw_error {fw_error:#x}, vmm_error {vmm_error})")
        self.errno = error.errno
        self.vmm_error = vmm_error


def _request(fd: int, number: int, request: ctypes.Array[ctypes.c_char], ioctl: Ioctl) -> bytes:
    response = ctypes.create_string_buffer(REPORT_RESPONSE_BYTES)
    guest = bytearray(pack_guest_request(ctypes.addressof(request), ctypes.addressof(response)))
    try:
        ioctl(fd, number, guest, True)
    except OSError as exc:
        _, _, _, fw_error, vmm_error = GUEST_REQUEST.unpack(guest)
        raise _IoctlFailed(exc, fw_error, vmm_error) from exc
    status, size = RESPONSE_HEADER.unpack_from(response.raw)
    if status != 0 or not 0 < size <= REPORT_RESPONSE_BYTES - RESPONSE_HEADER.size:
        raise EvidenceUnavailable(f"SEV firmware answered status {status:#x} with a {size}-byte report")
    return response.raw[RESPONSE_HEADER.size : RESPONSE_HEADER.size + size]


def _checked(user_data: bytes) -> bytes:
    if len(user_data) != REPORT_DATA_BYTES:
        raise ValueError(f"SNP user_data must be exactly {REPORT_DATA_BYTES} bytes, got {len(user_data)}")
    return user_data
