"""The /dev/sev-guest fallback: ioctl numbers, exact request structs, an absent device, and the ioctl protocol.

The protocol tests stand a fake in for `fcntl.ioctl` that reads and writes the caller's buffers at
the addresses the request struct carries, as the kernel does.
"""

from __future__ import annotations

import ctypes
import errno
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from amd_forge import cert_table

from attestation.errors import EvidenceUnavailable
from attestation.sev_guest import (
    EXT_REPORT_REQUEST,
    FIRST_CERTS_LEN,
    GUEST_REQUEST,
    SNP_GET_EXT_REPORT,
    SNP_GET_REPORT,
    SevGuestReport,
    pack_ext_report_request,
    pack_guest_request,
    pack_report_request,
    sev_guest_report,
)
from attestation.snp_report import VCEK_GUID

USER_DATA = bytes(range(64))
REPORT = bytes([0xA5]) * 0x4A0
TABLE = cert_table({VCEK_GUID: b"vcek der"})


def test_ioctl_numbers_are_the_kernels() -> None:
    assert (SNP_GET_REPORT, SNP_GET_EXT_REPORT) == (0xC0205300, 0xC0205302)
    assert GUEST_REQUEST.size == 32


def test_report_request_is_user_data_vmpl_and_28_reserved_bytes() -> None:
    packed = pack_report_request(USER_DATA, vmpl=2)
    assert packed == USER_DATA + b"\x02\x00\x00\x00" + bytes(28)
    assert len(packed) == 96


def test_extended_request_appends_address_length_and_padding() -> None:
    packed = pack_ext_report_request(USER_DATA, certs_address=0x1122334455667788, certs_len=0x4000)
    assert packed == (
        USER_DATA + bytes(4) + bytes(28) + bytes.fromhex("8877665544332211") + bytes.fromhex("00400000") + bytes(4)
    )
    assert len(packed) == EXT_REPORT_REQUEST.size == 112


def test_guest_request_is_version_addresses_and_zero_exitinfo2() -> None:
    assert pack_guest_request(0x1000, 0x2000).hex() == (
        "01" + "00" * 7 + "0010000000000000" + "0020000000000000" + "00" * 8
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pack_report_request(bytes(63)), "SNP user_data must be exactly 64 bytes, got 63"),
        (lambda: pack_ext_report_request(USER_DATA, 0, 1000), "certs_len must be a multiple of 4096 bytes, got 1000"),
    ],
)
def test_bad_requests_are_refused(call: Callable[[], bytes], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        call()
    assert str(refused.value) == message


def test_an_absent_device_means_no_report(tmp_path: Path) -> None:
    assert sev_guest_report(USER_DATA, tmp_path / "sev-guest") is None


class FakeSevGuest:
    """Answers SNP_GET_EXT_REPORT / SNP_GET_REPORT like the driver; `needed_certs_len` forces one EIO retry."""

    def __init__(self, needed_certs_len: int = FIRST_CERTS_LEN, extended: bool = True) -> None:
        self.needed_certs_len = needed_certs_len
        self.extended = extended
        self.calls: list[tuple[int, int]] = []  # (ioctl number, certs_len offered)

    def __call__(self, fd: int, number: int, guest: bytearray, mutate: bool) -> int:
        version, request_address, response_address, _, _ = GUEST_REQUEST.unpack(guest)
        assert (version, mutate) == (1, True)
        if number == SNP_GET_EXT_REPORT:
            user_data, _, _, certs_address, certs_len = EXT_REPORT_REQUEST.unpack(
                ctypes.string_at(request_address, EXT_REPORT_REQUEST.size)
            )
            self.calls.append((number, certs_len))
            if not self.extended:
                raise OSError(errno.ENOTTY, "Inappropriate ioctl for device")
            if certs_len < self.needed_certs_len:
                ctypes.memmove(request_address + 104, struct.pack("<I", self.needed_certs_len), 4)
                struct.pack_into("<II", guest, 24, 0, 1)  # vmm_error 1: SNP_GUEST_VMM_ERR_INVALID_LEN
                raise OSError(errno.EIO, "Input/output error")
            ctypes.memmove(certs_address, TABLE, len(TABLE))
        else:
            user_data = ctypes.string_at(request_address, 64)
            self.calls.append((number, 0))
        assert user_data == USER_DATA
        response = struct.pack("<II24x", 0, len(REPORT)) + REPORT
        ctypes.memmove(response_address, response, len(response))
        return 0


@pytest.fixture
def device(tmp_path: Path) -> Path:
    path = tmp_path / "sev-guest"
    path.write_bytes(b"")
    return path


def test_the_extended_report_brings_the_certificate_table(device: Path) -> None:
    fake = FakeSevGuest()
    assert sev_guest_report(USER_DATA, device, fake) == SevGuestReport(report=REPORT, cert_table=TABLE)
    assert fake.calls == [(SNP_GET_EXT_REPORT, FIRST_CERTS_LEN)]


def test_a_too_small_certificate_buffer_is_retried_with_the_length_the_host_names(device: Path) -> None:
    fake = FakeSevGuest(needed_certs_len=8 * 4096)
    assert sev_guest_report(USER_DATA, device, fake) == SevGuestReport(report=REPORT, cert_table=TABLE)
    assert fake.calls == [(SNP_GET_EXT_REPORT, FIRST_CERTS_LEN), (SNP_GET_EXT_REPORT, 8 * 4096)]


def test_without_extended_reports_the_plain_report_is_asked_for(device: Path) -> None:
    fake = FakeSevGuest(extended=False)
    assert sev_guest_report(USER_DATA, device, fake) == SevGuestReport(report=REPORT, cert_table=b"")
    assert fake.calls == [(SNP_GET_EXT_REPORT, FIRST_CERTS_LEN), (SNP_GET_REPORT, 0)]


def test_a_failing_device_is_an_error_not_none(device: Path) -> None:
    def failing(fd: int, number: int, guest: bytearray, mutate: bool) -> int:
        raise OSError(errno.EPERM, "Operation not permitted")

    with pytest.raises(EvidenceUnavailable, match=r"SNP_GET_EXT_REPORT failed: \[Errno 1\] Operation not permitted"):
        sev_guest_report(USER_DATA, device, failing)
