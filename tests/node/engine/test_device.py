"""The device plan (`node/engine/device.py`): the hot tier's budget, pinned or pageable host copies from NVML's
confidential-computing answer (through the NVML fake the attestation tests use), the prefill chunk per device,
and a node on a (faked) CUDA device in CC mode that asks for no pinned memory."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest
import torch

from cache.adapters import KVPiece
from cache.arena import Scope, StateArena, new_prefix_cache
from cache.budget import CacheBudget
from cache.sealed_payload import open_payload, seal_payload
from cache.sealing import Place
from node.config import Limits
from node.engine import reuse as reuse_module
from node.engine.device import CC_OFF, CC_ON, DevicePlan, lane_bytes, plan_device, prefill_chunk
from node.engine.loader import LoadedModel, load_model
from node.service import ModelService

sys.path.insert(0, str(Path(__file__).parents[2] / "attestation"))  # the fake imports its neighbours by name
from fake_nvml import FakeNvml  # noqa: E402

GIB = 1024**3
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
H200_FREE = (100 * GIB, 141 * GIB)


def never() -> Any:
    raise AssertionError("asked on a device that has no device tier")


def test_a_cpu_node_keeps_its_plaintext_tier_in_host_memory_and_asks_no_gpu_question() -> None:
    assert plan_device(CPU, None, 3 * GIB, free_memory=never, nvml=never) == DevicePlan(
        "cpu", 3 * GIB, "none", "state is in host memory")
    assert plan_device(CPU, 5 * GIB, 0, free_memory=never, nvml=never).hot_bytes == 0  # device_bytes is a GPU's


def test_on_cuda_the_hot_tier_is_half_the_free_memory_and_copies_are_pinned_when_cc_is_off() -> None:
    nvml = FakeNvml(cc_feature=pynvml.NVML_CC_SYSTEM_FEATURE_DISABLED)
    plan = plan_device(CUDA, None, 3 * GIB, free_memory=lambda: H200_FREE, nvml=lambda: nvml)
    assert plan == DevicePlan("cuda", 50 * GIB, "pinned", CC_OFF)
    assert plan.host_copies.pinned is True
    assert nvml.calls == ["nvmlInit", "nvmlSystemGetConfComputeState", "nvmlShutdown"]
    assert plan.describe() == {"type": "cuda", "hot_bytes": 50 * GIB, "host_copies": "pinned", "reason": CC_OFF}


def test_cache_device_bytes_sets_the_hot_tier_without_asking_free_memory() -> None:
    plan = plan_device(CUDA, 7 * GIB, 0, free_memory=never, nvml=lambda: FakeNvml(cc_feature=0))
    assert (plan.hot_bytes, plan.copy_mode) == (7 * GIB, "pinned")


def test_confidential_computing_on_makes_copies_pageable() -> None:
    plan = plan_device(CUDA, None, 0, free_memory=lambda: H200_FREE, nvml=lambda: FakeNvml(cc_feature=1))
    assert plan == DevicePlan("cuda", 50 * GIB, "pageable", CC_ON)
    assert plan.reason.startswith("confidential computing is on: the driver refuses pinned host memory")
    assert plan.host_copies.pinned is False


@pytest.mark.parametrize(("nvml", "pinned", "reason"), [
    (None, False, "NVML is not installed (nvidia-ml-py): confidential computing cannot be ruled out, so copies "
                  "are pageable"),
    (FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), False,
     "NVML failed to initialise (Driver Not Loaded): confidential computing cannot be ruled out, so copies are "
     "pageable"),
    (FakeNvml(state_error=pynvml.NVML_ERROR_UNKNOWN), False,
     "NVML's confidential computing query failed (Unknown Error): copies are pageable"),
    (FakeNvml(state_error=pynvml.NVML_ERROR_NOT_SUPPORTED), True,
     "this GPU or driver has no confidential computing: staging host memory is pinned"),
])
def test_what_nvml_cannot_answer_reads_as_cc_possibly_on(nvml: FakeNvml | None, pinned: bool, reason: str) -> None:
    plan = plan_device(CUDA, GIB, 0, nvml=lambda: nvml)
    assert (plan.copy_mode, plan.reason) == ("pinned" if pinned else "pageable", reason)
    if nvml is not None and nvml.init_error is None:
        assert nvml.calls[-1] == "nvmlShutdown"


def test_an_unset_prefill_chunk_resolves_by_device_type() -> None:
    assert [prefill_chunk(torch.device(kind), None) for kind in ("cpu", "cuda", "meta")] == [256, 2048, 256]
    assert prefill_chunk(CUDA, 64) == prefill_chunk(CPU, 64) == 64


def test_unset_lane_bytes_resolve_by_device_type_within_a_quarter_of_free_gpu_memory() -> None:
    assert lane_bytes(CPU, None) == 2 * GIB and lane_bytes(torch.device("meta"), None) == 2 * GIB
    assert lane_bytes(CUDA, None, lambda: (80 * GIB, 141 * GIB)) == 8 * GIB
    assert lane_bytes(CUDA, None, lambda: (12 * GIB, 16 * GIB)) == 3 * GIB
    assert lane_bytes(CUDA, 0, never) == 0 and lane_bytes(CPU, GIB) == GIB


@pytest.fixture(scope="module")
def loaded(small_model_dir: Path) -> LoadedModel:
    return load_model(small_model_dir.name, small_model_dir)


def service_on(loaded: LoadedModel, device: torch.device, cc_feature: int, monkeypatch: pytest.MonkeyPatch
               ) -> ModelService:
    """A sealing node whose model (on this CPU) reports `device`, asking the NVML fake; the hot tier is 0 bytes.
    The load-time seal-cost probe waits for a CUDA device's queue: there is none to wait for."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cache = new_prefix_cache(CacheBudget(GIB, GIB), plaintext_bytes=GIB)
    return ModelService.create(dataclasses.replace(loaded, device=device), cache, Limits(max_running=2, lane_bytes=0),
                               device_bytes=0, free_memory=never, nvml=lambda: FakeNvml(cc_feature=cc_feature))


def arena_of(service: ModelService) -> StateArena:
    assert service.arena is not None
    return service.arena


def pinned_requests(arena: StateArena, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Seal and open a span as the arena stages a device's state (host tensors staged too, `stage_host`), recording
    each allocation's `pin_memory` (allocated unpinned: this machine may have no CUDA to pin with)."""
    asked: list[bool] = []
    empty = torch.empty

    def recording(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        asked.append(pin_memory)
        return empty(*args, **kwargs)

    keys = torch.arange(64, dtype=torch.float32).reshape(1, 2, 8, 4)
    span = (KVPiece(keys, keys + 1),)
    scope, place = Scope(caller="alice", model="m"), Place(1, 0, 8, "span")
    copies = dataclasses.replace(arena.host_copies, stage_host=True)
    assert arena.sealer is not None
    monkeypatch.setattr(torch, "empty", recording)
    sealed = seal_payload(arena.sealer, arena.memory, scope, place, span, lambda: False, copies)
    assert sealed is not None
    opened = open_payload(arena.sealer, scope, place, sealed, copies)
    monkeypatch.undo()
    assert torch.equal(opened[0].keys, keys) and torch.equal(opened[0].values, keys + 1)
    return asked


def test_a_node_on_a_gpu_in_cc_mode_pins_no_host_memory(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    service = service_on(loaded, CUDA, 1, monkeypatch)
    assert service.device == DevicePlan("cuda", 0, "pageable", CC_ON)
    assert service.runner.prefill_chunk == 2048
    arena = arena_of(service)
    assert (arena.plaintext_bytes, arena.host_copies.pinned) == (0, False)
    asked = pinned_requests(arena, monkeypatch)
    assert asked and not any(asked)


def test_the_same_node_with_cc_off_pins_its_staging(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin of the CC test: the recording sees pinning when the plan allows it, so its silence above counts."""
    arena = arena_of(service_on(loaded, CUDA, 0, monkeypatch))
    assert arena.host_copies.pinned is True
    assert any(pinned_requests(arena, monkeypatch))


def test_a_cpu_node_keeps_its_configured_tier_and_chunk(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    service = service_on(loaded, CPU, 1, monkeypatch)
    assert service.device == DevicePlan("cpu", GIB, "none", "state is in host memory")
    assert (arena_of(service).plaintext_bytes, service.runner.prefill_chunk) == (GIB, 256)


def test_with_reuse_off_a_gpu_node_plans_no_hot_tier(loaded: LoadedModel) -> None:
    service = ModelService.create(dataclasses.replace(loaded, device=CUDA), None, Limits(max_running=1, lane_bytes=0),
                                  free_memory=never, nvml=lambda: FakeNvml(cc_feature=1))
    assert service.device == DevicePlan("cuda", 0, "pageable", CC_ON)


@pytest.mark.parametrize(("cc_feature", "pinned"), [(1, False), (0, True)])
def test_the_load_time_seal_probe_stages_state_as_the_plan_says(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch,
                                                                cc_feature: int, pinned: bool) -> None:
    """The seal-cost probe runs while the runner is built, before the hot tier is planned: it already copies
    through the host as the node will (pageable under CC), so its figures are the node's."""
    staged: list[bool] = []
    measure = reuse_module.measure_seal_cost

    def recording(loaded: LoadedModel, sealer: Any, lanes: Any, host_copies: Any) -> Any:
        staged.append(host_copies.pinned)
        return measure(loaded, sealer, lanes, host_copies)

    monkeypatch.setattr(reuse_module, "measure_seal_cost", recording)
    service_on(loaded, CUDA, cc_feature, monkeypatch)
    assert staged == [pinned]


def test_the_device_tier_never_exceeds_the_nodes_budget_for_stored_state() -> None:
    """Half of an H200's free memory is far more than `cache.node_bytes`: past that budget the node evicts, so the
    tier is the budget."""
    nvml = lambda: FakeNvml(cc_feature=1)  # noqa: E731
    assert plan_device(CUDA, None, 0, free_memory=lambda: H200_FREE, nvml=nvml, node_bytes=4 * GIB).hot_bytes == 4 * GIB
    assert plan_device(CUDA, 2 * GIB, 0, free_memory=never, nvml=nvml, node_bytes=4 * GIB).hot_bytes == 2 * GIB
