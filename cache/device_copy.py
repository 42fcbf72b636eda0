"""How sealing reaches the bytes of state held on a device: through host staging memory, since the cipher runs on
the host CPU.

A tensor in host memory is sealed and opened where it lies (zero copy). A tensor on a device (a GPU) is copied
into a host staging tensor before it is sealed, and opened into one before it is copied to its device target;
the staging holds plaintext, so whoever takes it zeroes it once the copy is done. Whether staging memory is
pinned (page-locked: the device copies it directly, without a bounce through pageable memory) is the caller's
choice: under NVIDIA confidential computing the driver refuses pinned memory and copies through its own
encrypted bounce buffers, so it must not be pinned there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class HostCopies:
    """Where the sealed bytes of tensors on a device are staged on the host."""

    pinned: bool = False
    """Stage in pinned host memory; never where the GPU runs in confidential-computing mode."""
    stage_host: bool = False
    """Stage tensors that are already in host memory too: the device path run on a CPU, for tests."""

    def staged(self, device: torch.device) -> bool:
        """Whether state on `device` is sealed and opened through host staging (else where it lies)."""
        return self.stage_host or device.type != "cpu"

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor to stage plaintext in (uninitialized, contiguous); the caller zeroes it after use."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)


def byte_view(tensor: torch.Tensor) -> Any:
    """A writable byte buffer over a contiguous host tensor's memory (no copy): what the cipher reads and writes."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def to_host(tensor: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
    """`tensor` copied into `staging` (same shape), complete on return (a blocking copy): `staging`."""
    staging.copy_(tensor)
    return staging


def to_device(host: torch.Tensor, target: torch.Tensor) -> None:
    """`host` copied into `target` (same shape), complete on return (a blocking copy): `host` may be zeroed
    right after, even when it is pinned."""
    target.copy_(host)


PAGEABLE = HostCopies()
"""The default: host tensors sealed where they lie, device tensors staged in pageable host memory."""
