"""Process hygiene at start: no core dumps, not dumpable, memory locked, and a policy that can require more.

Prompts, completions and the keys that seal stored state live in this process's memory. A core dump, a
debugger attaching as the same user, or a page written to swap would each put them on disk or in another
process. `apply_hygiene` closes what the process can close for itself and reports what it could not; the
node policy (`policies/node_policy.py`) says which of those a node refuses to serve without.

Linux only: on another system nothing but the core-size limit is changed, and the state says so.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from policies.node_policy import NodePolicy

# From <sys/mman.h> and <linux/prctl.h>.
MCL_CURRENT = 1
MCL_FUTURE = 2
MADV_DONTDUMP = 16
PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
CAP_IPC_LOCK = 14
LOCK_ALL = "mlockall(MCL_CURRENT|MCL_FUTURE)"


@dataclass(frozen=True, slots=True)
class HygieneState:
    """What `apply_hygiene` achieved; served under `GET /v1/node` so a caller can see it."""

    core_dumps_off: bool  # RLIMIT_CORE soft and hard are both 0
    dumpable: bool  # prctl(PR_GET_DUMPABLE) after the change; False keeps same-user debuggers out too
    memory_locked: bool
    memory_lock_reason: str  # LOCK_ALL when locked, else why not
    swap_active: tuple[str, ...] | None  # devices and files in /proc/swaps; None when it cannot be read
    dump_exclusion: bool  # madvise(MADV_DONTDUMP) works here, so `exclude_from_dumps` can mark buffers
    freed_memory_overwritten: bool = False
    """glibc overwrites what is freed (`mallopt(M_PERTURB)`), and the interpreter's objects are glibc's too
    (`PYTHONMALLOC=malloc`): tensors a forward frees (projections, rotary outputs) do not leave a request's
    state behind in the heap, nor do a request's strings and id lists (its text, its token ids)."""

    def as_json(self) -> dict[str, Any]:
        return {"core_dumps_off": self.core_dumps_off, "dumpable": self.dumpable,
                "memory_locked": self.memory_locked, "memory_lock_reason": self.memory_lock_reason,
                "swap_active": None if self.swap_active is None else list(self.swap_active),
                "dump_exclusion": self.dump_exclusion, "freed_memory_overwritten": self.freed_memory_overwritten}


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _error_text() -> str:
    number = ctypes.get_errno()
    return os.strerror(number) if number else "unknown error"


def _size_text(limit: int) -> str:
    if limit == resource.RLIM_INFINITY:
        return "unlimited"
    for unit, name in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if limit >= unit and limit % unit == 0:
            return f"{limit // unit} {name}"
    return f"{limit} bytes"


def _has_ipc_lock() -> bool:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


def parse_swaps(text: str) -> tuple[str, ...]:
    """The names in a /proc/swaps text; the kernel writes a space in a name as `\\040`."""
    return tuple(line.split()[0].replace("\\040", " ") for line in text.splitlines()[1:] if line.strip())


def _whole_pages(address: int, nbytes: int) -> tuple[int, int] | None:
    """(start, length) of the whole pages inside [address, address + nbytes), None when there are none."""
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    return (start, end - start) if end > start else None


def exclude_from_dumps(address: int, nbytes: int) -> bool:
    """Leave the whole pages of a buffer out of any core dump, should dumps ever be turned back on.

    Only whole pages: the partial pages at either end may hold other objects, which stay dumpable."""
    pages = _whole_pages(address, nbytes)
    if sys.platform != "linux" or pages is None:
        return False
    return _libc().madvise(ctypes.c_void_p(pages[0]), ctypes.c_size_t(pages[1]), ctypes.c_int(MADV_DONTDUMP)) == 0


def lock_region(address: int, nbytes: int) -> bool:
    """Keep the whole pages of a buffer out of swap (for when `mlockall` was not possible)."""
    pages = _whole_pages(address, nbytes)
    if sys.platform != "linux" or pages is None:
        return False
    return _libc().mlock(ctypes.c_void_p(pages[0]), ctypes.c_size_t(pages[1])) == 0


def _dump_exclusion_works() -> bool:
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        anchor = ctypes.c_char.from_buffer(page)
        try:
            return exclude_from_dumps(ctypes.addressof(anchor), mmap.PAGESIZE)
        finally:
            del anchor  # the mapping cannot close while a ctypes object points into it


def _lock_all() -> tuple[bool, str]:
    """mlockall, attempted only where it cannot break later allocations.

    Under MCL_FUTURE every later mapping counts against RLIMIT_MEMLOCK unless the process holds
    CAP_IPC_LOCK: with a finite limit, loading the model's weights would fail part way rather than now."""
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    capable = _has_ipc_lock()
    if not capable and limit != resource.RLIM_INFINITY:
        return False, (f"RLIMIT_MEMLOCK is {_size_text(limit)} and no CAP_IPC_LOCK (mlockall not attempted: under "
                       f"MCL_FUTURE, allocations past the limit would fail later)")
    if _libc().mlockall(ctypes.c_int(MCL_CURRENT | MCL_FUTURE)) == 0:
        return True, LOCK_ALL
    capability = "CAP_IPC_LOCK held" if capable else "no CAP_IPC_LOCK"
    return False, f"{LOCK_ALL} failed ({_error_text()}; RLIMIT_MEMLOCK {_size_text(limit)}; {capability})"


def _read_swaps() -> tuple[str, ...] | None:
    try:
        return parse_swaps(Path("/proc/swaps").read_text())
    except OSError:
        return None


M_PERTURB = -6
PERTURB_BYTE = 0xA5
TCACHE_OFF = "glibc.malloc.tcache_count=0"
"""glibc's per-thread cache keeps freed chunks of up to 1032 bytes without overwriting them."""
PYTHON_MALLOC = "malloc"
"""The interpreter's own allocator (pymalloc) keeps freed objects of up to 512 bytes (a message's text, a list of
a few dozen token ids) in its pools as they were; with `PYTHONMALLOC=malloc` they are glibc's, which overwrites
them when freed."""


def _overwrites_freed() -> bool:
    """Both settings that only a process's start reads are in force."""
    return (TCACHE_OFF in os.environ.get("GLIBC_TUNABLES", "")
            and os.environ.get("PYTHONMALLOC") == PYTHON_MALLOC and not sys.flags.ignore_environment)


def without_freed_memory_caches() -> dict[str, str] | None:
    """The environment to re-execute this process with so that neither glibc nor the interpreter keeps freed
    memory unwritten (read only at start), or None when it already does not (or this is not Linux)."""
    if sys.platform != "linux" or _overwrites_freed():
        return None
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if TCACHE_OFF not in tunables:
        tunables = ":".join(filter(None, [tunables, TCACHE_OFF]))
    return {**os.environ, "GLIBC_TUNABLES": tunables, "PYTHONMALLOC": PYTHON_MALLOC}


def apply_hygiene(lock_memory: bool = True) -> HygieneState:
    """Turn core dumps off, make the process undumpable, lock its memory; report, never raise.

    Call it first, before the model loads: `MCL_FUTURE` then locks the weights and the cache as they are
    allocated, and nothing sensitive exists yet that a dump taken in between could hold."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # lowering a limit is always allowed
    core_dumps_off = resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)
    if sys.platform != "linux":
        return HygieneState(core_dumps_off=core_dumps_off, dumpable=True, memory_locked=False,
                            memory_lock_reason=f"not Linux ({sys.platform})", swap_active=None,
                            dump_exclusion=False)
    libc = _libc()
    zero = ctypes.c_ulong(0)
    libc.prctl(ctypes.c_int(PR_SET_DUMPABLE), zero, zero, zero, zero)
    dumpable = libc.prctl(ctypes.c_int(PR_GET_DUMPABLE), zero, zero, zero, zero) != 0
    locked, reason = _lock_all() if lock_memory else (False, "not requested")
    # Freed heap memory is overwritten with this byte (and new allocations with its complement). glibc's
    # per-thread cache of chunks up to 1032 bytes and the interpreter's pools are exempt; the CLI turns both off
    # at start (GLIBC_TUNABLES and PYTHONMALLOC, read only when a process starts).
    perturbed = libc.mallopt(ctypes.c_int(M_PERTURB), ctypes.c_int(PERTURB_BYTE)) == 1 and _overwrites_freed()
    return HygieneState(core_dumps_off=core_dumps_off, dumpable=dumpable, memory_locked=locked,
                        memory_lock_reason=reason, swap_active=_read_swaps(), dump_exclusion=_dump_exclusion_works(),
                        freed_memory_overwritten=perturbed)


@dataclass(frozen=True, slots=True)
class HygienePolicy:
    """A node policy as the process checks it at start: its `require` rules against what `apply_hygiene`
    achieved. (`require.confidential_hardware` is checked against the attestation evidence, by
    `policies.node_policy.hardware_unmet`.)"""

    policy: NodePolicy

    @property
    def name(self) -> str:
        return self.policy.name

    def missing(self, state: HygieneState, sealing: bool) -> list[str]:
        """One sentence per requirement not met: what is missing and how to fix it; empty when all are."""
        require = self.policy.require
        sentences = []
        if require.memory_locked and not state.memory_locked:
            sentences.append(f"memory is not locked: {state.memory_lock_reason}: run as root (CAP_IPC_LOCK) or "
                             f"raise the limit with `ulimit -l unlimited`")
        if require.no_swap and state.swap_active is None:
            sentences.append("swap cannot be checked: /proc/swaps is not readable on this system")
        elif require.no_swap and state.swap_active:
            sentences.append(f"swap is active ({', '.join(state.swap_active)}): turn it off with `swapoff -a`")
        if require.sealing and not sealing:
            sentences.append("stored prompt state is not sealed: serve without --no-seal, or with --no-reuse so "
                             "that no prompt state is stored")
        return sentences
