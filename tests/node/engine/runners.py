"""Runners over a sealed prefix cache, and the prompt logits of a runner (`prompt_logits`).

Runners over a sealed prefix cache whose keep-or-drop choice does not hang on this machine's speed.

A runner measures at construction whether opening a sealed entry beats computing its tokens again
(`seal_cost.py`); on a fast CPU shared with other test processes the small test models can compute faster than
they open, and the runner then keeps nothing (a CI run saw 0 cached writes where 64 were due). Tests of reuse
pin the choice; the tests of the choice itself measure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cache.arena import Scope, SealCost, new_prefix_cache
from cache.budget import CacheBudget
from node.engine.loader import LoadedModel, load_model
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from node.engine.synthetic import init_model

KEEP_ALL = SealCost(0.0, 1.0, 1, 1)
"""Every entry worth sealing, whatever this machine measures."""


def sealed_runner(loaded: LoadedModel, budget_bytes: int = 1 << 30, **kwargs: Any) -> ModelRunner:
    """A runner storing every caller's state sealed, within `budget_bytes` per caller and for the node."""
    kwargs.setdefault("seal_cost", KEEP_ALL)
    return ModelRunner(loaded, new_prefix_cache(CacheBudget(budget_bytes, budget_bytes)), **kwargs)


@torch.inference_mode()
def prompt_logits(runner: ModelRunner, scope: Scope, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """(Last-position logits `[vocab]`, tokens restored) of `prompt` with reuse as `runner` has it configured; its
    state is then stored, as a request's would be."""
    seq = runner.start(GenerationRequest(scope, prompt, SamplingParams(max_tokens=1)), lambda _: None, lambda: False)
    seq.finish_reason = "length"  # the prompt's logits, no reply
    while seq.prefilling:
        runner.prefill(seq)
    assert seq.prediction is not None
    logits = seq.prediction.logits()
    runner.reuse.snapshot_end(seq, len(prompt))
    runner.release(seq)
    runner.reuse.store(seq.lane, scope, prompt, seq.cache, seq.snapshots)
    return logits, seq.restored


def dense_or_hybrid(kind: str, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The embedded dense test model ("dense"), or the small model of the `models init` architecture `kind`, as
    model "m": what the engine tests parametrise over."""
    if kind == "dense":
        return load_model("m", small_model_dir)
    return load_model("m", init_model(kind, tmp_path_factory.mktemp("hybrid") / "m", size="small"))


def tokens(seed: int, n: int) -> list[int]:
    """`n` seeded random token ids."""
    return torch.randint(100, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
