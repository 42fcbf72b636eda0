"""The engine's paths for a model on a device other than the CPU, run on a CPU: the batched decode step with no
CPU-only operator (`BatchedDecode(portable=True)`), and the load-time seal-cost probe through host staging."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cache.device_copy import PAGEABLE, HostCopies
from cache.lanes import Lanes
from cache.sealing import Sealer
from node.engine import batch_forward
from node.engine.batch_forward import BatchedDecode, Shared, batchable, equal_rows
from node.engine.loader import load_model
from node.engine.seal_cost import SAMPLE_TOKENS, measure_seal_cost
from node.engine.synthetic import init_model
from tests.node.engine.test_batching import prefilled, tokens


class CpuOnly:
    """Stands for the native kernels, which do not run off the CPU: any use fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the portable step used the CPU kernels ({name})")


def cpu_flash(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("SDPA's CPU flash kernel has no CUDA kernel")


@pytest.mark.parametrize("family", ["llama", "gemma3", "granite-moe-hybrid"])
@torch.inference_mode()  # as the runner steps: recurrent states are updated in place
def test_a_portable_batched_step_gives_each_sequence_what_it_gets_alone(family: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences, two of them holding the same 300 first rows (a group the runner would form where the
    layers allow it), decode four greedy steps as one forward each with the CPU-only operators made to fail:
    each row's logits within float32 noise of the same sequence stepped alone, the same greedy tokens."""
    monkeypatch.setattr(batch_forward, "_FLASH", cpu_flash)
    loaded = load_model(family, init_model(family, tmp_path / family, size="small"))
    system = tokens(99, 300)
    prompts = [system + tokens(1, 9), tokens(2, 40), system + tokens(3, 22)]
    alone = [prefilled(loaded, prompt) for prompt in prompts]
    together = [prefilled(loaded, prompt) for prompt in prompts]
    assert all(batchable(cache) for cache in together)
    shared = equal_rows(together[0], together[2], 300)
    # Rows beside recurrent state form no group. Otherwise a group forms: its first chunk's rows agree bit for bit
    # on either CPU forward, and on the library's the rows after it may not (SDPA over chunks of other lengths).
    assert (shared == 0) == (family == "granite-moe-hybrid") and shared <= 300
    groups = (Shared((0, 2), shared),) if shared else ()
    steps = BatchedDecode(loaded.model, CpuOnly(), portable=True)  # type: ignore[arg-type]
    ids, positions = [500, 501, 502], [len(prompt) for prompt in prompts]
    for step in range(4):
        got = steps.step(ids, positions, together, loaded.device, groups)
        want = [loaded.forward.prefill([ids[row]], positions[row], alone[row]).logits() for row in range(3)]
        for row in range(3):
            assert float((got[row] - want[row]).abs().max() / want[row].abs().max()) < 1e-5, (family, step, row)
        assert got.argmax(-1).tolist() == [int(logits.argmax()) for logits in want]
        ids, positions = got.argmax(-1).tolist(), [position + 1 for position in positions]
    assert steps.shared_rows == 0


def test_the_cpu_step_keeps_its_kernels_and_shared_rows(small_model_dir: Path) -> None:
    """Without `portable`, a CPU step still takes what it is given: the group's rows attended once."""
    loaded = load_model("small", small_model_dir)
    system = tokens(99, 300)
    prompts = [system + tokens(i, 9 + 13 * i) for i in range(3)]
    caches = [prefilled(loaded, prompt) for prompt in prompts]
    steps = BatchedDecode(loaded.model)
    steps.step([5, 6, 7], [len(prompt) for prompt in prompts], caches, loaded.device, (Shared((0, 2), 300),))
    assert steps.shared_rows == 2 * 2  # two members, both layers


def test_the_seal_cost_probe_opens_through_host_staging(tmp_path: Path, stagings: list[torch.Tensor]) -> None:
    """A model whose state is staged (as on a GPU) is measured: the same sample as in place, opening timed with
    the copies, every staging zeroed after."""
    loaded = load_model("gemma3", init_model("gemma3", tmp_path / "gemma3", size="small"))
    assert loaded.state is not None and loaded.state.needs_snapshots  # a span and a snapshot to open
    costs = [measure_seal_cost(loaded, Sealer(threads=2), Lanes(loaded.state.working_cache), copies)
             for copies in (PAGEABLE, HostCopies(stage_host=True))]
    assert [(cost.sample_tokens, cost.sample_bytes) for cost in costs] == [(SAMPLE_TOKENS, costs[0].sample_bytes)] * 2
    assert all(cost.open_s_per_byte > 0 for cost in costs)
    assert stagings and all(not tensor.any() for tensor in stagings)
