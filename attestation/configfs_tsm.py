"""SEV-SNP and TDX reports through Linux configfs-tsm (`/sys/kernel/config/tsm/report/`, Linux 6.7+).

One report, as the kernel ABI (Documentation/ABI/testing/configfs-tsm-report) lays it out:

    mkdir <root>/<entry>          the kernel populates the entry's files
    read  provider                "sev_guest" or "tdx_guest"; ENXIO when no TEE driver registered
    read  generation              g0
    write inblob                  exactly 64 bytes (both drivers refuse any other length)
    read  outblob                 the report (SNP) or quote (TDX)
    read  auxblob                 SNP only: the certificate table
    read  generation              must be g0 + 1, else another writer changed inblob in between: retry
    rmdir <root>/<entry>

File access goes through `TsmFiles`, so tests drive the same sequence against a directory that
answers writes like the kernel does.
"""

from __future__ import annotations

import errno
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from attestation.binding import REPORT_DATA_BYTES
from attestation.errors import EvidenceUnavailable

TSM_REPORT_ROOT = Path("/sys/kernel/config/tsm/report")
TSM_ATTEMPTS = 3
"""Reports made before giving up when `generation` keeps moving: one writer racing us twice is already odd."""

PROVIDER_TYPES: dict[str, Literal["sev-snp", "tdx"]] = {"sev_guest": "sev-snp", "tdx_guest": "tdx"}
"""The configfs-tsm provider names (the drivers' KBUILD_MODNAME) and the evidence type each produces."""


@dataclass(frozen=True, slots=True)
class TsmReport:
    provider: str  # a key of PROVIDER_TYPES
    outblob: bytes  # SNP: the 0x4A0-byte report; TDX: the quote
    auxblob: bytes  # SNP: the certificate table, empty when the host supplied none; TDX: always empty
    generation: int  # the entry's write counter after our write

    @property
    def evidence_type(self) -> Literal["sev-snp", "tdx"]:
        return PROVIDER_TYPES[self.provider]


class TsmFiles:
    """The file operations of one report, as plain system calls on configfs."""

    def make_entry(self, entry: Path) -> None:
        os.mkdir(entry)

    def remove_entry(self, entry: Path) -> None:
        os.rmdir(entry)  # configfs removes the attribute files with the directory

    def read(self, path: Path) -> bytes:
        with open(path, "rb", buffering=0) as file:
            return file.read()

    def write(self, path: Path, data: bytes) -> None:
        with open(path, "wb", buffering=0) as file:
            written = file.write(data)
        if written != len(data):
            raise OSError(errno.EIO, f"short write to {path}: {written} of {len(data)} bytes")


def tsm_report(inblob: bytes, root: Path = TSM_REPORT_ROOT, files: TsmFiles | None = None) -> TsmReport | None:
    """A report over `inblob` (exactly 64 bytes), or None when this machine has no configfs-tsm provider.

    Raises `EvidenceUnavailable` when a provider exists but no consistent report came back.
    """
    if len(inblob) != REPORT_DATA_BYTES:
        raise ValueError(f"configfs-tsm inblob must be exactly {REPORT_DATA_BYTES} bytes, got {len(inblob)}")
    if not root.is_dir():
        return None
    if files is None:
        files = TsmFiles()
    # One entry per report: no other requester shares our inblob, and the generation check catches the rest.
    entry = root / f"tenzro-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        files.make_entry(entry)
    except OSError as exc:
        raise EvidenceUnavailable(f"configfs-tsm: cannot create report entry {entry}: {exc}") from exc
    try:
        provider = _provider(files, entry)
        if provider is None:
            return None
        return _report(files, entry, provider, inblob)
    finally:
        try:
            files.remove_entry(entry)
        except OSError:
            pass  # a leftover entry holds no secret: the report is public evidence


def _provider(files: TsmFiles, entry: Path) -> str | None:
    try:
        name = files.read(entry / "provider").decode("ascii", "replace").strip()
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None  # the tsm core is loaded, but no TEE guest driver registered with it
        raise EvidenceUnavailable(f"configfs-tsm: cannot read {entry / 'provider'}: {exc}") from exc
    if name in PROVIDER_TYPES:
        return name
    raise EvidenceUnavailable(f"configfs-tsm provider {name!r} is not one of {', '.join(PROVIDER_TYPES)}")


def _report(files: TsmFiles, entry: Path, provider: str, inblob: bytes) -> TsmReport:
    moves: list[str] = []
    for _ in range(TSM_ATTEMPTS):
        try:
            before = _generation(files, entry)
            files.write(entry / "inblob", inblob)
            outblob = files.read(entry / "outblob")
            auxblob = files.read(entry / "auxblob") if provider == "sev_guest" else b""
            after = _generation(files, entry)
        except OSError as exc:
            raise EvidenceUnavailable(f"configfs-tsm ({provider}): report failed: {exc}") from exc
        if after == before + 1:
            if not outblob:
                raise EvidenceUnavailable(f"configfs-tsm ({provider}): the provider returned an empty outblob")
            return TsmReport(provider=provider, outblob=outblob, auxblob=auxblob, generation=after)
        moves.append(f"{before} -> {after}")
    raise EvidenceUnavailable(
        f"configfs-tsm: generation moved by more than our one write in each of {TSM_ATTEMPTS} attempts "
        f"({', '.join(moves)}); another process is writing to {entry}"
    )


def _generation(files: TsmFiles, entry: Path) -> int:
    text = files.read(entry / "generation").decode("ascii", "replace").strip()
    if not text.isdigit():
        raise EvidenceUnavailable(f"configfs-tsm: generation of {entry} is {text!r}, not a decimal counter")
    return int(text)
