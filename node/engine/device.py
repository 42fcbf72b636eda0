"""What the node knows of its device at start: where the hot tier of stored state lives and its budget, how state
crosses between host and device memory (pinned or pageable host copies, and why), and the prefill chunk there.

Confidential computing. Under NVIDIA CC the driver refuses pinned host memory (`cudaHostAlloc`,
`cudaHostRegister`): every CPU<->GPU copy goes through its encrypted bounce buffers, from pageable memory. A node
that pinned its staging memory there would fail at its first seal, so the choice is made once, at start, from
NVML's answer; where NVML cannot answer, pageable is the choice that works on every GPU (only slower).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from attestation.nvml_cc import NO_CC_ERRORS, NvmlLoader, load_pynvml
from cache.device_copy import HostCopies

CopyMode = Literal["pinned", "pageable", "none"]
"""pinned: staging host memory is page-locked (DMA straight from it); pageable: ordinary memory, which the driver
copies through its own buffers; none: the state is in host memory already (a CPU node)."""

FreeMemory = Callable[[], tuple[int, int]]
"""(free, total) bytes of device memory now, as `torch.cuda.mem_get_info` returns them."""

DEVICE_SHARE = 0.5
"""The share of the device memory free after the model and the lanes are loaded that the hot tier may hold when
`cache.device_bytes` is not set. The rest is working memory the hot tier must not starve: lanes grow past
`limits.lane_bytes` when requests need more, a prefill chunk's activations and logits (a 2048-token chunk of a
128k vocabulary is a gigabyte of float32 logits), captured graphs' pools, and the caching allocator's
fragmentation. Half leaves room for all of them at once and still keeps tens of gigabytes of state on a large GPU;
an operator who measured their load sets `cache.device_bytes` instead."""

PREFILL_CHUNKS: dict[str, int] = {"cpu": 256, "cuda": 2048}
"""Prompt tokens per prefill chunk when `limits.prefill_chunk` is not set, per device type (others take the
CPU's). A request arriving while a long prompt prefills waits about one chunk per prefilling request: on a CPU a
token of prefill costs enough that 256 keeps that wait short. On a GPU a 256-token chunk is too small to fill the
chip's matrix units, so each chunk's time is kernel launches, not arithmetic; 2048 rows fill them while one chunk
still takes a fraction of a CPU chunk's time."""

LANE_BYTES: dict[str, int] = {"cpu": 2 << 30, "cuda": 8 << 30}
"""Working memory of the lanes at start when `limits.lane_bytes` is not set, per device type (others take the
CPU's). On a GPU the lanes are also the slabs that decode steps replay over as CUDA graphs (`static_decode.py`): a
sequence that outgrows its lane's rows steps eagerly, so the rows should cover the conversations served (8 GiB
gives the 1B shape's 32 lanes 4,096 rows each). Never more than `LANE_SHARE` of the device memory free after the
model loaded."""
LANE_SHARE = 0.25
"""The share of free device memory the lanes' default takes at most: the hot tier, prefill activations and the
graphs' pool need the rest (`DEVICE_SHARE`)."""

CC_ON = "confidential computing is on: the driver refuses pinned host memory; copies go through its bounce buffers"
CC_OFF = "confidential computing is off: staging host memory is pinned"


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """The device's part of the node's start, fixed for the process (`GET /v1/node`'s `device` section)."""

    device_type: str
    hot_bytes: int
    """Bytes of stored state kept unsealed: on a GPU in device memory (`cache.device_bytes`), on a CPU in host
    memory (`cache.plaintext_bytes`). The arena seals the rest into host memory, or drops it."""
    copy_mode: CopyMode
    reason: str

    @property
    def host_copies(self) -> HostCopies:
        """How sealing stages this device's state on the host (`StateArena.host_copies`): pinned only when the
        plan says so."""
        return HostCopies(pinned=self.copy_mode == "pinned")

    def describe(self) -> dict[str, Any]:
        return {"type": self.device_type, "hot_bytes": self.hot_bytes, "host_copies": self.copy_mode,
                "reason": self.reason}


def prefill_chunk(device: torch.device, configured: int | None) -> int:
    """`limits.prefill_chunk` when set, else the device type's (`PREFILL_CHUNKS`)."""
    if configured is not None:
        return configured
    return PREFILL_CHUNKS.get(device.type, PREFILL_CHUNKS["cpu"])


def lane_bytes(device: torch.device, configured: int | None, free_memory: FreeMemory | None = None) -> int:
    """`limits.lane_bytes` when set, else the device type's (`LANE_BYTES`; on CUDA at most `LANE_SHARE` of the free
    memory, asked of `free_memory` or `torch.cuda.mem_get_info`)."""
    if configured is not None:
        return configured
    default = LANE_BYTES.get(device.type, LANE_BYTES["cpu"])
    if device.type != "cuda":
        return default
    free, _ = (free_memory or functools.partial(torch.cuda.mem_get_info, device))()
    return min(default, int(free * LANE_SHARE))


def host_copy_mode(device: torch.device, nvml: NvmlLoader = load_pynvml) -> tuple[CopyMode, str]:
    """How state on `device` crosses to the host, and why: asked before anything is sealed (the load-time seal-cost
    probe stages state as the node will), and kept in the plan. `nvml` is asked only on CUDA."""
    if device.type != "cuda":
        return "none", ("state is in host memory" if device.type == "cpu"
                        else f"no device tier is planned on {device.type}")
    pinned, reason = pinning_allowed(nvml())
    return "pinned" if pinned else "pageable", reason


def plan_device(device: torch.device, device_bytes: int | None, plaintext_bytes: int,
                free_memory: FreeMemory | None = None, nvml: NvmlLoader = load_pynvml,
                copies: tuple[CopyMode, str] | None = None, node_bytes: int | None = None) -> DevicePlan:
    """The plan for `device`, asked once the model and the lanes are in memory (so free memory is what is left for
    stored state). `device_bytes`: `cache.device_bytes` (None: `DEVICE_SHARE` of the free memory);
    `plaintext_bytes`: `cache.plaintext_bytes`, the hot tier of a node whose state is in host memory.
    `free_memory` and `nvml` are asked only on CUDA (tests pass fakes); None: `torch.cuda.mem_get_info`.
    `copies`: `host_copy_mode`'s answer when it was asked already. `node_bytes`: `cache.node_bytes`, the budget of
    all stored state, which the device tier never exceeds (past it the node evicts, so a larger tier never fills)."""
    mode, reason = copies or host_copy_mode(device, nvml)
    if device.type != "cuda":
        return DevicePlan(device.type, plaintext_bytes, mode, reason)
    if device_bytes is None:
        free, _ = (free_memory or functools.partial(torch.cuda.mem_get_info, device))()
        device_bytes = int(free * DEVICE_SHARE)
    if node_bytes is not None:
        device_bytes = min(device_bytes, node_bytes)
    return DevicePlan(device.type, device_bytes, mode, reason)


def pinning_allowed(nvml: Any) -> tuple[bool, str]:
    """(whether host staging memory may be pinned, why), from NVML's confidential-computing state. Pinned only when
    NVML says CC is off or not supported by this GPU or driver; anything it cannot answer reads as CC possibly on."""
    if nvml is None:
        return False, "NVML is not installed (nvidia-ml-py): confidential computing cannot be ruled out, so copies " \
                      "are pageable"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return False, f"NVML failed to initialise ({exc}): confidential computing cannot be ruled out, so copies " \
                      "are pageable"
    try:
        state = nvml.nvmlSystemGetConfComputeState()
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) in {getattr(nvml, name) for name in NO_CC_ERRORS}:
            return True, "this GPU or driver has no confidential computing: staging host memory is pinned"
        return False, f"NVML's confidential computing query failed ({exc}): copies are pageable"
    finally:
        nvml.nvmlShutdown()
    if state.ccFeature != nvml.NVML_CC_SYSTEM_FEATURE_DISABLED:
        return False, CC_ON
    return True, CC_OFF
