"""A configfs-tsm report directory that answers writes the way the kernel does, for tests.

The tree is the real interface's: `<root>/<entry>/{provider, generation, inblob, outblob[, auxblob]}`.
Writing `inblob` bumps `generation` and produces `outblob` (and `auxblob` for sev_guest) from the
written bytes through `answer`, as the TEE driver would. `racing_writes` simulates another process
writing to the entry between our write and our read: each one bumps `generation` once more.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

from attestation.configfs_tsm import TsmFiles

Answer = Callable[[bytes], tuple[bytes, bytes]]
"""inblob -> (outblob, auxblob)."""


class FakeTsm(TsmFiles):
    def __init__(self, root: Path, provider: str, answer: Answer, racing_writes: int = 0) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.provider = provider
        self.answer = answer
        self.racing_writes = racing_writes
        self.inblobs: list[bytes] = []  # every inblob written, in order
        self.removed: list[str] = []  # entry names removed

    def make_entry(self, entry: Path) -> None:
        super().make_entry(entry)
        (entry / "provider").write_text(f"{self.provider}\n" if self.provider else "")
        (entry / "generation").write_text("0\n")
        for name in ("inblob", "outblob", "auxblob") if self.provider == "sev_guest" else ("inblob", "outblob"):
            (entry / name).write_bytes(b"")

    def remove_entry(self, entry: Path) -> None:
        shutil.rmtree(entry)
        self.removed.append(entry.name)

    def read(self, path: Path) -> bytes:
        if path.name == "provider" and not self.provider:
            raise OSError(errno.ENXIO, "No such device or address", str(path))
        if path.name == "outblob" and self.racing_writes:
            self.racing_writes -= 1
            self._bump(path.parent)
        return super().read(path)

    def write(self, path: Path, data: bytes) -> None:
        if path.name == "inblob" and len(data) != 64:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))  # both TEE drivers insist on 64 bytes
        super().write(path, data)
        if path.name == "inblob":
            self.inblobs.append(data)
            self._bump(path.parent)
            outblob, auxblob = self.answer(data)
            (path.parent / "outblob").write_bytes(outblob)
            if self.provider == "sev_guest":
                (path.parent / "auxblob").write_bytes(auxblob)

    def _bump(self, entry: Path) -> None:
        generation = int((entry / "generation").read_text())
        (entry / "generation").write_text(f"{generation + 1}\n")
