"""An expert holder: the routed experts of one rank, computing what rank 0 sends until rank 0 closes.

The holder learns the world and the dtype from rank 0's store, keeps only its own experts' weights, and serves
one epoch's group after another (`experts.py`): when a group fails (rank 0 dropped it after losing another
holder, or this holder's connection broke) it waits for the next epoch and joins again. It sees hidden rows,
expert ids and routing weights, never token ids or text, and logs counts only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from node.engine.experts import (
    CLOSE,
    DTYPES,
    HEADER_FIELDS,
    HOLDER_IDLE,
    STORE_TIMEOUT,
    ExpertPlacement,
    ExpertsError,
    find_experts,
    keep_experts,
    new_group,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HeldExperts:
    rank: int
    experts: range
    """Global ids of the experts held; the modules number them from 0."""
    modules: list[torch.nn.Module]
    """One experts module per MoE layer, in layer order, cut to `experts`."""
    kept_bytes: int
    """Bytes of expert weights held after loading."""

    def compute(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted outputs `[pairs, hidden]` of (row, local expert) pairs: the library's experts forward, top-1."""
        with torch.inference_mode():
            return self.modules[layer](hidden, ids, weights).contiguous()


def load_held(path: Path, rank: int, world: int, dtype: torch.dtype) -> HeldExperts:
    """Load the model in `path` and keep the experts of `rank`.

    The checkpoint is read whole: the families save their experts in layouts of their own (per-expert `w1/w3`
    or `gate_proj/up_proj` tensors, or fused 3D ones) that transformers' loader converts; after the conversion
    every other weight is dropped."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    modules = find_experts(model)
    if not modules:
        raise ExpertsError(f"{path} has no routed experts to hold")
    owned = ExpertPlacement(modules[0].get_parameter("down_proj").shape[0], world).experts_of(rank)
    kept = sum(keep_experts(module, owned) for module in modules)
    del model
    return HeldExperts(rank, owned, modules, kept)


def _next_epoch(store: dist.Store, after: int) -> int:
    while True:
        epoch = int(store.get("epoch"))
        if epoch > after:
            return epoch
        time.sleep(0.05)


def _serve_group(group: object, held: HeldExperts) -> bool:
    """Answer rank 0 until it closes (True) or the group fails (RuntimeError)."""
    header = torch.empty(HEADER_FIELDS, dtype=torch.int64)
    hidden_size = held.modules[0].get_parameter("down_proj").shape[1]
    while True:
        group.recv([header], 0, 0).wait()  # type: ignore[attr-defined]
        op, layer, pairs, hidden_code, weight_code = (int(v) for v in header.tolist())
        if op == CLOSE:
            return True
        hidden = torch.empty(pairs, hidden_size, dtype=DTYPES[hidden_code])
        ids = torch.empty(pairs, 1, dtype=torch.int64)
        weights = torch.empty(pairs, 1, dtype=DTYPES[weight_code])
        for part in (hidden, ids, weights):
            group.recv([part], 0, 0).wait()  # type: ignore[attr-defined]
        group.send([held.compute(layer, hidden, ids, weights)], 0, 0).wait()  # type: ignore[attr-defined]


def serve_holder(path: Path, rank: int, host: str, port: int) -> int:
    """`tenzro experts serve`: join rank 0 at host:port, hold `rank`'s experts, serve until rank 0 closes."""
    store = dist.TCPStore(host, port, None, False, STORE_TIMEOUT)
    world = int(store.get("world"))
    if not 1 <= rank < world:
        raise ExpertsError(f"--rank {rank} is not a holder of a world of {world}: pass 1 to {world - 1}")
    held = load_held(path, rank, world, DTYPES[int(store.get("dtype"))])
    print(f"expert holder {rank}: experts {held.experts.start}-{held.experts.stop - 1} of "
          f"{len(held.modules)} MoE layers, {held.kept_bytes} bytes of expert weights", flush=True)
    epoch = -1
    while True:
        try:
            epoch = _next_epoch(store, epoch)
            store.set(f"ready/{epoch}/{rank}", "1")
            group = new_group(store, epoch, rank, world, HOLDER_IDLE)
            log.info("holder %d joined epoch %d", rank, epoch)
            if _serve_group(group, held):
                return 0
        except RuntimeError as exc:
            if not _reachable(store):
                print(f"expert holder {rank}: rank 0 at {host}:{port} is gone", flush=True)
                return 1
            log.warning("holder %d: epoch %d ended (%s); waiting for the next", rank, epoch, type(exc).__name__)


def _reachable(store: dist.Store) -> bool:
    try:
        store.get("world")
    except RuntimeError:
        return False
    return True
