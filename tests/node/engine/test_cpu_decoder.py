"""The CPU kernels' decoder gives transformers' logits and writes transformers' K/V, for the chunk sizes a
resumed prompt and decoding give it; models it does not reproduce are left to transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from cache.adapters import ModelStateAdapter
from cache.state_spec import model_state_specs
from cache.working_cache import GrowableKVLayer
from node.engine import forward
from node.engine.cpu_decoder import PIECE_TOKENS, CpuDecoder
from node.engine.cpu_kernels import CpuKernels
from node.engine.cpu_layout import NATIVE_ROWS, NativeLinear, transpose_linear_weights
from node.engine.loader import load_model
from node.engine.prediction import Logits
from node.engine.synthetic import init_model

TOLERANCE = 1e-4
"""Of the largest |logit|, as the engine's other resume checks."""
VOCAB = 300


def llama(**overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    settings: dict[str, object] = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       max_position_embeddings=512, initializer_range=0.1)
    settings.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    transpose_linear_weights(model)  # as the loader leaves a CPU model
    return model


def full_pass(model: LlamaForCausalLM, ids: list[int]) -> tuple[torch.Tensor, DynamicCache]:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return logits, cache


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max()) / max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True, "mlp_bias": True},
                                     {"num_key_value_heads": 4, "head_dim": 64}, {"tie_word_embeddings": True},
                                     {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}])
def test_chunks_after_a_prefill_match_one_pass(kernels: CpuKernels, variant: dict[str, object]) -> None:
    model = llama(**variant)
    decoder = CpuDecoder.build(model, kernels)
    assert decoder is not None
    state = ModelStateAdapter(model_state_specs(model.config), model.config)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (200,), generator=generator).tolist()
    # A prefill by transformers, then chunks of every kind the decoder takes: torch attention (1, 5),
    # kernel attention (16, 33, 64), a chunk of two pieces (72: 64 and 8), and the decode steps after them.
    cache = state.working_cache(len(ids))
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:8]]), cache=cache, use_cache=True)
    position = 8
    for size in (PIECE_TOKENS + 8, 16, 1, 33, 5, PIECE_TOKENS, 1):
        prediction = decoder.forward(ids[position:position + size], position, cache)
        greedy = prediction.greedy()  # screened on the truncated head, before any logits exist
        got = prediction.logits()
        assert greedy == int(torch.argmax(got))
        position += size
        expected, reference = full_pass(model, ids[:position])
        assert relative(got, expected) <= TOLERANCE, (size, relative(got, expected))
        for mine, theirs in zip(cache.layers, reference.layers, strict=True):
            assert relative(mine.keys, theirs.keys) <= TOLERANCE and relative(mine.values, theirs.values) <= TOLERANCE
    assert position == 200


def test_extend_writes_the_state_forward_would(kernels: CpuKernels) -> None:
    model = llama()
    decoder = CpuDecoder.build(model, kernels)
    assert decoder is not None
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowableKVLayer(len(ids)) for _ in cache.layers]
    decoder.forward(ids[:40], 0, cache)
    decoder.extend(ids[40:41], 40, cache)  # a reply's last token, fed only for its state
    decoder.extend(ids[41:58], 41, cache)
    got = decoder.forward(ids[58:], 58, cache).logits()
    expected, reference = full_pass(model, ids)
    assert relative(got, expected) <= TOLERANCE
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        assert relative(mine.keys, theirs.keys) <= TOLERANCE and relative(mine.values, theirs.values) <= TOLERANCE


def test_decoder_refuses_what_it_does_not_compute(kernels: CpuKernels) -> None:
    assert CpuDecoder.build(llama(head_dim=24), kernels) is None
    assert CpuDecoder.build(llama(hidden_act="gelu"), kernels) is None
    assert CpuDecoder.build(llama(), None) is None
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                               sliding_window=8))
    assert CpuDecoder.build(mistral, kernels) is None
    decoder = CpuDecoder.build(llama(), kernels)
    assert decoder is not None
    working = DynamicCache(config=decoder._model.config)
    working.layers = [GrowableKVLayer(10) for _ in working.layers]
    assert decoder.takes(PIECE_TOKENS, working) and decoder.takes(4 * PIECE_TOKENS + 1, working)
    assert not decoder.takes(0, working)
    assert not decoder.takes(1, DynamicCache(config=decoder._model.config))  # layers it cannot write in place


def test_loader_serves_the_small_model_through_the_decoder_on_one_thread(
        kernels: CpuKernels, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch.get_num_threads() == 1  # tests/conftest.py
    loaded = load_model("small", small_model_dir)
    assert loaded.forward.decoder is not None and loaded.state is not None
    assert (loaded.forward.backend, loaded.forward.decode_attention) == ("native-cpu", "native")
    assert loaded.forward.reason.endswith("checked against transformers' forward at load")
    monkeypatch.setattr(forward, "available_memory", lambda: 2 * 1024 * 1024)
    roomless = load_model("small", small_model_dir).forward  # no room for a packed copy of its weights and screens
    assert (roomless.decoder, roomless.backend, roomless.reason, roomless.decode_attention) == (
        None, "library", "no room for the packed copy of the weights (12 MiB; 2 MiB of memory available)", "native")
    monkeypatch.setattr(forward, "available_memory", lambda: None)
    assert load_model("small", small_model_dir).forward.decoder is not None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    threaded = load_model("small", small_model_dir).forward
    assert (threaded.decoder, threaded.backend, threaded.decode_attention, threaded.reason) == (
        None, "library", "sdpa", "the native kernels are single-threaded and the node runs 2 torch threads")


def test_the_switch_keeps_a_model_on_transformers_forward(kernels: CpuKernels, small_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENZRO_NATIVE", "off")
    loaded = load_model("small", small_model_dir)
    assert loaded.forward.decoder is None and loaded.state is not None
    assert (loaded.forward.backend, loaded.forward.reason, loaded.forward.decode_attention) == (
        "library", "switched off by TENZRO_NATIVE=off", "sdpa")


def test_a_model_class_without_a_native_decoder_says_so(kernels: CpuKernels, tmp_path: Path) -> None:
    loaded = load_model("m", init_model("mistral", tmp_path / "m", "small"))
    assert (loaded.forward.backend, loaded.forward.reason) == ("library", "MistralForCausalLM has no CPU decoder")


def test_a_decoder_that_disagrees_with_transformers_is_not_used(
        kernels: CpuKernels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = init_model("dense", tmp_path / "dense", "small")
    monkeypatch.setattr(forward.CpuDecoder, "forward", lambda self, ids, start, cache: Logits(torch.zeros(32000)))
    loaded = load_model("small", directory)
    assert loaded.forward.decoder is None and loaded.state is not None
    assert loaded.forward.reason == "the native forward failed its check against transformers' forward at load"


class CountingKernels:
    """The kernels, counting the GEMMs run through them."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels, self.calls = kernels, 0

    def gemm(self, *args: object, **kwargs: object) -> None:
        self.calls += 1
        self.kernels.gemm(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True, "mlp_bias": True}])
def test_lent_panels_give_each_layer_its_own_product_up_to_native_rows(kernels: CpuKernels,
                                                                        variant: dict[str, object]) -> None:
    """Each linear layer multiplies inputs of up to NATIVE_ROWS rows on its columns of the decoder's fused panels
    (q, k and v of one panel set; gate and up of another), as the library would, and longer inputs as before."""
    model = llama(**variant)
    decoder = CpuDecoder.build(model, kernels)
    assert decoder is not None and decoder.lend_panels() == 3 * 7
    generator = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            lent = module.native
            counting = CountingKernels(kernels)
            module.native = NativeLinear(counting, lent.weight)  # type: ignore[arg-type]
            for rows in (1, 8, NATIVE_ROWS, NATIVE_ROWS + 1):
                x = torch.randn(rows, 1, module.in_features, generator=generator)
                with torch.inference_mode():
                    got = module(x)
                    module.native = None
                    expected = module(x)
                    module.native = NativeLinear(counting, lent.weight)  # type: ignore[arg-type]
                assert got.shape == (rows, 1, module.out_features)
                assert relative(got, expected) <= 1e-5
            assert counting.calls == 3  # not the input of NATIVE_ROWS + 1 rows
