"""Static decode steps over the lanes' slabs (`node/engine/static_decode.py`): what a GPU replays as CUDA graphs,
run eagerly here and checked against the per-row step and against each request alone.

On CUDA (TENZRO_TEST_DEVICE=cuda, the device check) the runners here capture and replay the steps as graphs; on a
CPU the same steps run eagerly, which checks everything but the capture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cache.lanes import Lanes
from cache.working_cache import GrowableKVLayer
from node.engine.batch_forward import BatchedDecode
from node.engine.forward import static_blocker
from node.engine.loader import LoadedModel
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from node.engine.synthetic import init_model
from tests.node.conftest import TEST_DEVICE
from tests.node.engine.test_batching import alone, load, requests, reuse_runner, run_together, tokens

STATIC = ["llama", "qwen2-moe", "bamba", "granite-moe-hybrid", "lfm2", "qwen3-next", "jamba", "mamba", "mamba2"]
"""Families whose every layer is full attention or recurrent (dense, MoE, Mamba-2, short conv, gated delta-net and
Mamba-1 hybrids, and the state-space models without attention): their steps run over the slabs and state buffers."""


def row_bytes(loaded: LoadedModel) -> int:
    """Bytes of one token row in a lane: keys and values of each full-attention layer, float32."""
    config = loaded.model.config
    attention = sum(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
    if not attention:
        return 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return attention * 2 * config.num_key_value_heads * head_dim * 4


def static_runner(loaded: LoadedModel, lanes: int, rows: int = 1024) -> ModelRunner:
    """A runner whose lanes hold `rows` rows each (none without attention), its decode steps static."""
    runner = reuse_runner(loaded)
    per_row = row_bytes(loaded)
    assert runner.reserve_lanes(lanes, lanes * rows * max(per_row, 1), static=True) == (rows if per_row else 0)
    assert runner._batched.static is not None
    return runner


@pytest.mark.parametrize("family", STATIC)
async def test_callers_decoding_over_the_slabs_get_what_they_get_alone(family: str, tmp_path: Path) -> None:
    loaded = load(family, init_model(family, tmp_path / family, size="small"))
    batch = requests(loaded.model_id)
    expected = alone(loaded, batch)
    runner = static_runner(loaded, 4)
    for request in batch[:2]:  # callers 0 and 1 resume where they stored the first part of their prompt
        runner.generate(GenerationRequest(request.scope, request.prompt[:-11], SamplingParams(max_tokens=1)),
                        lambda _: None, lambda: False)
    results = await run_together(runner, batch, max_running=4)
    assert [result.output_ids for result in results] == expected
    assert results[0].cached_read_tokens > 0 and results[1].cached_read_tokens > 0
    state = runner.engine_state()
    # Every decode step ran over the slabs (the batch's steps and the lone ones of the stores before).
    assert state["static_steps"] == state["decode_steps"] > 0 and state["largest_batch"] >= 2
    graphs = TEST_DEVICE == "cuda"
    assert state["static_decode"] == {
        "graphs": graphs, "batches": [1, 2, 4], "lengths": [256, 512, 1024] if row_bytes(loaded) else [1],
        "reason": ("decode steps replay as CUDA graphs, one per batch size and history length" if graphs
                   else f"decode steps run eagerly over the lanes' slabs on {TEST_DEVICE}")}


def prefilled(loaded: LoadedModel, lanes: Lanes, lane: int, prompt: list[int]) -> DynamicCache:
    cache, _ = lanes.new_cache(lane, len(prompt) + 8)
    with torch.inference_mode():
        loaded.forward.prefill(prompt, 0, cache)
    return cache


def test_a_step_over_some_lanes_matches_the_per_row_step_and_leaves_the_other_lanes_alone(tmp_path: Path) -> None:
    """Rows in lanes 0, 2 and 5 of 8 (lanes 1 and 3 hold other sequences' rows, lane 2 an earlier sequence's past
    its length): one static step over lanes [0, 8) gives each row the per-row step's logits within float32 noise,
    writes each row's new key and value where the per-row step does, and changes nothing in lanes 1 and 3."""
    loaded = load("llama", init_model("llama", tmp_path / "llama", size="small"))
    runner = static_runner(loaded, 8, rows=512)
    lanes = runner.reuse.lanes
    assert lanes is not None and runner._batched.static is not None
    static = runner._batched.static
    prompts = {lane: tokens(lane, 20 + 37 * lane) for lane in (0, 1, 2, 3, 5)}
    prefilled(loaded, lanes, 2, tokens(77, 300))  # rows past the next sequence's length in lane 2: masked out
    caches = {lane: prefilled(loaded, lanes, lane, prompt) for lane, prompt in prompts.items()}
    stepping = [0, 2, 5]
    others = {slot: slab[[1, 3]].clone() for slot, slab in lanes.slabs.items()}
    placed = static.place([caches[lane] for lane in stepping])
    assert placed is not None and placed.lanes == (0, 2, 5) and placed.lengths == (20, 94, 205)
    got = static.step([7, 8, 9], [20, 94, 205], placed)
    assert all(torch.equal(slab[[1, 3]], others[slot]) for slot, slab in lanes.slabs.items())
    written = {slot: slab[stepping].clone() for slot, slab in lanes.slabs.items()}
    assert all(cache.get_seq_length() == len(prompts[lane]) + 1 for lane, cache in caches.items() if lane in stepping)

    twin_lanes = Lanes(lanes._build)  # buffers of their own, lane by lane
    twins = [prefilled(loaded, twin_lanes, index, prompts[lane]) for index, lane in enumerate(stepping)]
    want = BatchedDecode(loaded.model, portable=True).step([7, 8, 9], [20, 94, 205], twins, loaded.device)
    scale = want.abs().max()
    assert float((got - want).abs().max() / scale) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for index, twin in enumerate(twins):
        for layer, (keys, values) in zip(twin.layers, ((written[2 * i], written[2 * i + 1]) for i in
                                                       range(len(twin.layers))), strict=True):
            end = layer.get_seq_length()
            assert torch.allclose(keys[index, :, :end], layer.keys[0], atol=1e-5)
            assert torch.allclose(values[index, :, :end], layer.values[0], atol=1e-5)


def test_every_step_size_is_prepared_at_start_over_idle_inputs_that_change_no_lane(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare` captures the step of every batch size and history length before any request (on this CPU the
    capture is stood in for by the warm-up's eager run): lanes holding sequences' rows are left as they were, and a
    failed capture leaves every step eager, with its reason."""
    loaded = load("llama", init_model("llama", tmp_path / "llama", size="small"))
    runner = static_runner(loaded, 3)
    lanes, static = runner.reuse.lanes, runner._batched.static
    assert lanes is not None and static is not None and static.capture is (TEST_DEVICE == "cuda")
    for lane in range(3):
        prefilled(loaded, lanes, lane, tokens(lane, 50 + 100 * lane))
    held = {slot: slab[:3].clone() for slot, slab in lanes.slabs.items()}
    captured: list[tuple[int, int]] = []

    def capture(rows: int, length: int) -> tuple[object, torch.Tensor]:
        captured.append((rows, length))
        return object(), static._run(rows, length)

    monkeypatch.setattr(static, "capture", True)
    monkeypatch.setattr(static, "_graphs", {})
    monkeypatch.setattr(static, "_capture", capture)
    assert static.prepare() == 9
    assert captured == [(rows, length) for rows in (1, 2, 3) for length in (256, 512, 1024)]
    assert all(torch.equal(slab[:3], held[slot]) for slot, slab in lanes.slabs.items())

    def fail(rows: int, length: int) -> tuple[object, torch.Tensor]:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(static, "_graphs", {})
    monkeypatch.setattr(static, "_capture", fail)
    assert static.prepare() == 0 and not static.capture
    assert static.reason == "capturing a decode step failed (RuntimeError): decode steps run eagerly"


def test_a_lane_that_outgrew_its_rows_steps_per_row_until_a_request_fits_again(tmp_path: Path) -> None:
    loaded = load("llama", init_model("llama", tmp_path / "llama", size="small"))
    runner = static_runner(loaded, 2, rows=512)
    lanes = runner.reuse.lanes
    static = runner._batched.static
    assert lanes is not None and static is not None
    home = lanes.slabs[0][1:2].data_ptr()
    long = prefilled(loaded, lanes, 1, tokens(1, 600))  # past the lane's 512 rows: buffers of its own
    assert isinstance(long.layers[0], GrowableKVLayer) and long.layers[0].keys.data_ptr() != home
    assert static.place([long]) is None
    short = prefilled(loaded, lanes, 1, tokens(2, 40))  # fits again: back in the slab, the own buffers zeroed
    assert short.layers[0].keys.data_ptr() == home
    placed = static.place([short])
    assert placed is not None and placed.lanes == (1,)


def test_static_steps_are_chosen_on_cuda_for_full_attention_by_sdpa(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    llama = load("llama", init_model("llama", tmp_path / "llama", size="small"))
    cuda = torch.device("cuda")
    assert static_blocker(llama.model, cuda) is None
    assert static_blocker(llama.model, torch.device("cpu")) == (
        "on cpu a decode step attends each row's own cache: graphs are for a GPU's launches")
    assert static_blocker(llama.model, cuda, remote_experts=True) == (
        "the routed experts run on expert holders: a step's exchange with them cannot be replayed")
    monkeypatch.setenv("TENZRO_STATIC_DECODE", "on")  # the whole node's use of the steps, tested on a CPU
    assert static_blocker(llama.model, torch.device("cpu")) is None
    monkeypatch.setenv("TENZRO_CUDA_GRAPHS", "off")
    assert static_blocker(llama.model, cuda) == "switched off (TENZRO_CUDA_GRAPHS=off)"
    monkeypatch.delenv("TENZRO_CUDA_GRAPHS")
    monkeypatch.delenv("TENZRO_STATIC_DECODE")
    blocked = {
        "mistral": "layers of kind DynamicSlidingWindowLayer keep state a static step does not hold (only full "
                   "attention and recurrent)",
        "falcon-h1": "layers of kind LinearAttentionAndFullAttentionLayer keep state a static step does not hold "
                     "(only full attention and recurrent)",
        "mamba": None, "bamba": None}
    for family, reason in blocked.items():
        model = load(family, init_model(family, tmp_path / family, size="small")).model
        assert static_blocker(model, cuda) == reason, family
    runner = reuse_runner(llama)
    runner.reserve_lanes(2, 2 * 512 * row_bytes(llama))  # on this CPU: as the forward says, no slabs
    assert runner.reuse.lanes is not None and runner.reuse.lanes.slabs == {} and runner._batched.static is None
    if TEST_DEVICE == "cpu":
        assert runner.engine_config()["static_decode"] == {
            "graphs": False, "reason": "on cpu a decode step attends each row's own cache: graphs are for a GPU's "
                                       "launches"}
