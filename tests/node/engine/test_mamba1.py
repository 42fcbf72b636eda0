"""Mamba-1 mixers after `install`: chunked, resumed and decoded prompts equal one upstream pass."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    DynamicCache,
    FalconMambaConfig,
    FalconMambaForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)
from transformers.cache_utils import LinearAttentionLayer

from node.engine import mamba1
from node.engine.cpu_layout import transpose_linear_weights
from tests.node.engine.model_calls import forward, prefill
from tests.numeric import relative_error

TOLERANCE = 1e-4  # of the largest |logit| (tests/numeric.py); float32 logits are of order 5 to 15
UPSTREAM_ERROR = 1e-3  # relative: the least error the upstream two-chunk prefill shows on these models
A_LEN, B_LEN = 60, 25


def tiny_mamba(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, state_size=16, conv_kernel=4,
                         initializer_range=0.5)
    return MambaForCausalLM(config).to(dtype).eval(), config


def tiny_falcon_mamba() -> tuple[Any, Any]:
    torch.manual_seed(0)
    config = FalconMambaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, state_size=16, conv_kernel=4)
    return FalconMambaForCausalLM(config).eval(), config


def tiny_jamba() -> tuple[Any, Any]:
    """Layers: mamba, attention + MoE, mamba, attention + MoE."""
    torch.manual_seed(0)
    config = JambaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
                         attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                         mamba_d_state=16, mamba_d_conv=4, use_mamba_kernels=False, initializer_range=0.3)
    return JambaForCausalLM(config).eval(), config


FAMILIES: dict[str, Callable[[], tuple[Any, Any]]] = {
    "mamba": tiny_mamba,
    "falcon_mamba": tiny_falcon_mamba,
    "jamba": tiny_jamba,
}


class Pair:
    """The same seeded model twice: `patched` after `install`, `upstream` untouched."""

    def __init__(self, build: Callable[[], tuple[Any, Any]]) -> None:
        self.patched, self.config = build()
        self.upstream, _ = build()
        self.patch_count = mamba1.install(self.patched)

    def reference(self, ids: list[int]) -> torch.Tensor:
        """Upstream logits `[len, vocab]` of one pass over `ids`, which upstream computes correctly."""
        return forward(self.upstream, ids, 0, None)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request: pytest.FixtureRequest) -> Pair:
    return Pair(FAMILIES[request.param])


def tokens(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=generator).tolist()


def snapshot(cache: DynamicCache, config: Any) -> DynamicCache:
    """A fresh cache holding a copy of `cache`'s state, rebuilt through the public per-layer API."""
    fresh = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer):
            conv = layer.conv_states[0]
            fresh.update_conv_state(conv.clone(), index, conv_kernel_size=conv.shape[-1])
            fresh.update_recurrent_state(layer.recurrent_states[0].clone(), index)
        else:
            fresh.update(layer.keys.clone(), layer.values.clone(), index)
    return fresh



def test_install_patches_each_mamba1_mixer_and_nothing_else(pair: Pair) -> None:
    assert pair.patch_count == 2  # jamba: layers 0 and 2; the others: both layers
    assert mamba1.install(pair.patched) == 2  # again: the same forward, rebound
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert mamba1.install(llama) == 0


def test_one_pass_is_unchanged(pair: Pair) -> None:
    prompt = tokens(1, A_LEN + B_LEN)
    assert relative_error(forward(pair.patched, prompt, 0, pair.new_cache()), pair.reference(prompt)) < TOLERANCE
    assert relative_error(forward(pair.patched, prompt, 0, None), pair.reference(prompt)) < TOLERANCE


def test_two_chunks_equal_one_pass(pair: Pair) -> None:
    a, b = tokens(1, A_LEN), tokens(2, B_LEN)
    cache = pair.new_cache()
    forward(pair.patched, a, 0, cache)
    got = forward(pair.patched, b, A_LEN, cache)
    assert relative_error(got, pair.reference(a + b)[A_LEN:]) < TOLERANCE


def test_chunks_shorter_than_the_conv_kernel_equal_one_pass(pair: Pair) -> None:
    a, b = tokens(1, A_LEN), tokens(2, B_LEN)
    cache = pair.new_cache()
    got = prefill(pair.patched, a + b, 0, cache, [2, 3, A_LEN - 5, 1, 2, 3, 7, 12])
    assert relative_error(got, pair.reference(a + b)) < TOLERANCE


def test_resume_from_a_snapshot_equals_one_pass(pair: Pair) -> None:
    a, b = tokens(1, A_LEN), tokens(2, B_LEN)
    cache = pair.new_cache()
    forward(pair.patched, a, 0, cache)
    resumed = snapshot(cache, pair.config)
    forward(pair.patched, tokens(3, 10), A_LEN, cache)  # the original moves on; the snapshot must not
    got = forward(pair.patched, b, A_LEN, resumed)
    assert relative_error(got, pair.reference(a + b)[A_LEN:]) < TOLERANCE


def test_decoding_after_a_multi_token_continuation_equals_one_pass(pair: Pair) -> None:
    a, b = tokens(1, A_LEN), tokens(2, B_LEN)
    cache = pair.new_cache()
    got = prefill(pair.patched, a + b, 0, cache, [A_LEN, 10] + [1] * (B_LEN - 10))
    assert relative_error(got, pair.reference(a + b)) < TOLERANCE


def test_upstream_two_chunks_are_wrong(pair: Pair) -> None:
    """The bug `install` fixes, on the unpatched twin: install patched instances, not the class."""
    a, b = tokens(1, A_LEN), tokens(2, B_LEN)
    cache = pair.new_cache()
    forward(pair.upstream, a, 0, cache)
    assert relative_error(forward(pair.upstream, b, A_LEN, cache), pair.reference(a + b)[A_LEN:]) > UPSTREAM_ERROR


def test_bf16_model_keeps_a_float32_state() -> None:
    model, config = tiny_mamba(torch.bfloat16)
    mamba1.install(model)
    a, b = tokens(1, A_LEN), tokens(2, B_LEN)
    one_pass = forward(model, a + b, 0, DynamicCache(config=config))
    cache = DynamicCache(config=config)
    forward(model, a, 0, cache)
    assert {layer.recurrent_states[0].dtype for layer in cache.layers} == {torch.float32}
    got = forward(model, b, A_LEN, cache)
    assert relative_error(got, one_pass[A_LEN:]) < 0.02  # two bf16 steps at logits of 16 (0.25); upstream errs by 21


def test_cpu_transposed_linears_continue_exactly() -> None:
    """The loader's CPU layout replaces `dt_proj` too, whose weight the upstream forward reads directly."""
    upstream, config = tiny_mamba()
    model = copy.deepcopy(upstream)
    transpose_linear_weights(model)
    assert mamba1.install(model) == 2
    a, b = tokens(1, A_LEN), tokens(2, B_LEN)
    cache = DynamicCache(config=config)
    got = prefill(model, a + b, 0, cache, [A_LEN, B_LEN])
    assert relative_error(got, forward(upstream, a + b, 0, None)) < TOLERANCE


def test_left_padding_is_masked_out_in_the_prompt_and_its_continuation() -> None:
    """A batch row padded on the left equals the row alone; the mask spans the cached tokens too."""
    model, config = tiny_mamba()
    mamba1.install(model)
    a, b = tokens(1, 20), tokens(2, 8)
    ids = torch.tensor([[0] * 5 + a, tokens(3, 25)])
    mask = torch.ones(2, 25 + len(b), dtype=torch.long)
    mask[0, :5] = 0
    cache = DynamicCache(config=config)
    with torch.inference_mode():
        first = model(input_ids=ids, attention_mask=mask[:, :25], cache=cache, use_cache=True)
        then = model(input_ids=torch.tensor([b, tokens(4, 8)]), attention_mask=mask, cache=cache, use_cache=True)
    alone = prefill(model, a + b, 0, DynamicCache(config=config), [len(a), len(b)])
    assert relative_error(torch.cat([first.logits[0, 5:], then.logits[0]]).float(), alone) < TOLERANCE


def naive_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence written out in float64, one batch row and one token at a time."""
    x, dt, A, B, C, h = (t.double() for t in (x, dt, A, B, C, h))
    ys = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for t in range(x.shape[1]):
            h[row] = torch.exp(dt[row, t, :, None] * A) * h[row] + (dt[row, t] * x[row, t])[:, None] * B[row, t]
            ys[row, t] = h[row] @ C[row, t]
    return ys, h


def test_selective_scan_matches_the_recurrence_across_blocks_and_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    batch, seq_len, channels, state = 2, 30, 12, 5
    monkeypatch.setattr(mamba1, "SCAN_BLOCK_BYTES", 8 * 4 * batch * channels * state)  # blocks of 8 tokens
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    x, dt = rand(batch, seq_len, channels), torch.rand(batch, seq_len, channels, generator=generator)
    A = -torch.rand(channels, state, generator=generator)
    B, C = rand(batch, seq_len, state), rand(batch, seq_len, state)
    h0 = rand(batch, channels, state)
    want_y, want_h = naive_scan(x, dt, A, B, C, h0.clone())
    y1, h1 = mamba1.selective_scan(x[:, :13], dt[:, :13], A, B[:, :13], C[:, :13], h0)
    y2, h2 = mamba1.selective_scan(x[:, 13:], dt[:, 13:], A, B[:, 13:], C[:, 13:], h1)
    assert relative_error(torch.cat([y1, y2], dim=1).double(), want_y) < 1e-5
    assert relative_error(h2.double(), want_h) < 1e-5
    y_zero, _ = mamba1.selective_scan(x, dt, A, B, C, None)
    assert relative_error(y_zero.double(), naive_scan(x, dt, A, B, C, torch.zeros_like(h0))[0]) < 1e-5
