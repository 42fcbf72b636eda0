"""What keeping a model's state sealed costs against computing it again, measured once when the node loads it.

A sealed entry is worth keeping only if opening it is faster than computing its tokens again. On a CPU node the
model is slow and the cipher fast, so everything is kept; a small model on a GPU computes a token faster than the
CPU opens its state, and there an entry is dropped instead of sealed (`SealCost`, `StateArena.seal_cold`).
Both rates are measured through the paths that serve: the engine's forward for a prefill, and the arena's
seal and restore with the node's own sealer for opening: on a device, opening includes the copy from host
staging to the device (`cache/device_copy.py`), and each round waits for the device before its clock stops.
"""

from __future__ import annotations

import time

import torch

from cache.arena import SealCost, StateArena
from cache.device_copy import PAGEABLE, HostCopies
from cache.lanes import Lanes
from cache.scope import Scope
from cache.sealing import Sealer
from node.engine.loader import LoadedModel

SAMPLE_TOKENS = 256
"""Tokens prefilled and sealed to measure: a prompt chunk long enough to run at the prefill's rate."""
ROUNDS = 2
"""Each rate is the fastest of at least two rounds: the first may still meet cold code paths."""
MAX_ROUNDS = 8
CHEAP_ROUNDS_S = 0.05
"""Rounds go on, up to `MAX_ROUNDS`, while all of them so far took less than this: a small model on a fast CPU
computes and opens its sample in a fraction of a millisecond each, near parity, and one stall of a thread on a
busy machine in each of two rounds decided against keeping its state (a CI run's test saw no cached writes).
A large model's two rounds already take longer, and its start does not wait for more."""
PROBE_MODEL_SUFFIX = "\0seal-cost"
"""The probe's scope names no model a request can reach, and its key is destroyed once measured."""


@torch.inference_mode()
def measure_seal_cost(loaded: LoadedModel, sealer: Sealer, lanes: Lanes, host_copies: HostCopies = PAGEABLE
                      ) -> SealCost:
    """Prefill random tokens in lane 0 of `lanes`, seal their state under a probe scope and open it into a working
    cache there (state on a device through `host_copies`, as the node's arena), timing both; the probe's state is
    zeroed and its key destroyed afterwards."""
    state = loaded.state
    assert state is not None
    tokens = min(SAMPLE_TOKENS, loaded.context_length - 1)
    vocab = int(loaded.model.config.get_text_config(decoder=True).vocab_size)
    ids = torch.randint(min(100, vocab - 1), vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    compute_s: list[float] = []
    while more_rounds(compute_s):
        cache, _ = lanes.new_cache(0, tokens)
        started = time.perf_counter()
        loaded.forward.prefill(ids, 0, cache)
        _finish(loaded.device)
        compute_s.append(time.perf_counter() - started)
    state.materialize(cache)
    scope = Scope("", loaded.model_id + PROBE_MODEL_SUFFIX)
    probe = StateArena(sealer)
    probe.host_copies = host_copies
    probe.register_model(scope.model, state)
    handle = probe.put(scope, 0, tokens, state.extract(cache, 0, tokens))
    snapshot = handle if state.needs_snapshots else None
    if snapshot is not None:
        probe.attach_snapshot(handle, state.snapshot(cache))
    probe.seal_cold()
    open_s: list[float] = []
    try:
        while more_rounds(open_s):
            target, _ = lanes.new_cache(0, tokens)
            started = time.perf_counter()
            probe.restore(state, target, [(handle, tokens)], skip=0, snapshot=snapshot, position=tokens)
            _finish(loaded.device)
            open_s.append(time.perf_counter() - started)
        nbytes = probe.nbytes(handle)
    finally:
        probe.free(handle)
        probe.forget(scope)
        probe.wipe_scratch()
        lanes.wipe(0, 0, tokens)
    return SealCost(min(open_s) / nbytes, min(compute_s) / tokens, nbytes, tokens)


def _finish(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA forward returns before it has run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def more_rounds(rounds: list[float]) -> bool:
    """Whether to time another round after `rounds` (seconds each)."""
    return len(rounds) < ROUNDS or (len(rounds) < MAX_ROUNDS and sum(rounds) < CHEAP_ROUNDS_S)
