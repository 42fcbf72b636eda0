"""Mamba2-family mixers after `install`: short forwards run the recurrence and equal one upstream pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    DynamicCache,
    FalconH1Config,
    FalconH1ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Zamba2Config,
    Zamba2ForCausalLM,
)
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from node.engine import mamba2
from node.engine.cpu_layout import TransposedLinear
from node.engine.loader import load_model
from node.engine.synthetic import SIZES, init_model
from tests.node.engine.model_calls import forward, prefill
from tests.numeric import relative_error

TOLERANCE = 1e-4  # of the largest |logit| (tests/numeric.py); float32 logits are of order 1 to 5
STATE_EFFECT = 1e-3  # relative: how far a forgotten state moves the logits, at the least
"""The least logit change that zeroing the recurrent state causes on these models (measured 4e-3 to 5):
a recurrence that lost the state could not pass within TOLERANCE."""
CHUNK = SIZES["small"].ssm_chunk  # 16: the sequential path takes tails of up to 8 tokens
A_LEN = 70  # four whole chunks and a tail of 6
FAMILIES = ["mamba2", "bamba", "granite-moe-hybrid", "falcon-h1"]
MIXERS = {"mamba2": 2, "bamba": 3, "granite-moe-hybrid": 3, "falcon-h1": 2}  # at size small


def make_state_matter(model: Any) -> None:
    """Long memory and loud mixers. At their seeded init these models forget a token within a few steps
    (Δ about 1.3, A from -1 to -8) and their mixers barely reach the logits, so zeroing the state moved
    them by 3e-6 or less: no check at 1e-4 could fail. Changed identically in both twins."""
    with torch.no_grad():
        for module in model.modules():
            if type(module) in mamba2.MIXER_SPECS:
                module.A_log.copy_(torch.log(torch.linspace(0.02, 0.2, module.num_heads)))
                module.dt_bias.copy_(torch.linspace(-9.0, -2.0, module.num_heads))  # across the tiny models' clamps
                module.in_proj.weight.mul_(10)  # a view of the CPU layout's transposed weight: scaled in place
                module.out_proj.weight.mul_(10)
                for projection in (module.in_proj, module.out_proj):
                    if isinstance(projection, TransposedLinear):
                        projection.repack()  # its oneDNN-packed copy, which inputs of several rows run on


class Pair:
    """The same model twice: `patched` after `install`, `upstream` untouched."""

    def __init__(self, mixers: int, load: Callable[[], Any]) -> None:
        self.mixers = mixers
        self.patched, self.upstream = load(), load()
        for module in self.upstream.modules():  # the loader installs the scan: take it off the reference twin
            if type(module) in mamba2.MIXER_SPECS:
                vars(module).pop("forward", None)
        for model in (self.patched, self.upstream):
            make_state_matter(model)
        self.config = self.patched.config
        self.patch_count = mamba2.install(self.patched)

    def reference(self, ids: list[int]) -> torch.Tensor:
        """Upstream logits `[len, vocab]` of one pass over `ids`."""
        return forward(self.upstream, ids, 0, None)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mamba2")
    return {family: init_model(family, root / family, size="small") for family in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Pair:
    family = request.param
    return Pair(MIXERS[family], lambda: load_model(family, model_dirs[family]).model)


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Token counts of the `ssd_recurrence` calls, one entry per mixer per sequential forward."""
    lengths: list[int] = []
    recurrence = mamba2.ssd_recurrence

    def counting(x: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lengths.append(x.shape[1])
        return recurrence(x, *args)

    monkeypatch.setattr(mamba2, "ssd_recurrence", counting)
    return lengths


def tokens(seed: int, n: int, vocab: int = 30000) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def snapshot(cache: DynamicCache, config: Any, zero_recurrent: bool = False) -> DynamicCache:
    """A fresh cache holding a copy of `cache`'s state, rebuilt through the public per-layer API.

    FalconH1's layers are both recurrent and attention layers, so both checks apply to one layer.
    """
    fresh = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
            fresh.update_conv_state(conv.clone(), index, conv_kernel_size=conv.shape[-1])
            fresh.update_recurrent_state(torch.zeros_like(recurrent) if zero_recurrent else recurrent.clone(), index)
        if isinstance(layer, DynamicLayer):
            fresh.update(layer.keys.clone(), layer.values.clone(), index)
    return fresh



def test_install_patches_each_mamba2_mixer_and_nothing_else(pair: Pair) -> None:
    assert pair.patch_count == pair.mixers
    assert mamba2.install(pair.patched) == pair.mixers  # again: the same forward, rebound
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert mamba2.install(llama) == 0


def test_short_chunks_after_a_prompt_equal_one_pass(pair: Pair, scans: list[int]) -> None:
    ids = tokens(1, A_LEN + 31)
    got = prefill(pair.patched, ids, 0, pair.new_cache(), [A_LEN, 1, 3, 7, 20])
    assert relative_error(got, pair.reference(ids)) < TOLERANCE
    mixers = pair.mixers
    # 70 = 64 upstream + 6; the one-token step is the recurrence's too; 20 = 16 upstream + 4.
    assert scans == [6] * mixers + [1] * mixers + [3] * mixers + [7] * mixers + [4] * mixers


def test_resume_from_a_snapshot_equals_one_pass(pair: Pair) -> None:
    a, b = tokens(1, A_LEN), tokens(2, 7)
    cache = pair.new_cache()
    forward(pair.patched, a, 0, cache)
    resumed, forgotten = snapshot(cache, pair.config), snapshot(cache, pair.config, zero_recurrent=True)
    forward(pair.patched, tokens(3, 5), A_LEN, cache)  # the original moves on; the snapshot must not
    want = pair.reference(a + b)[A_LEN:]
    assert relative_error(forward(pair.patched, b, A_LEN, resumed), want) < TOLERANCE
    assert relative_error(forward(pair.patched, b, A_LEN, forgotten), want) > STATE_EFFECT


def test_long_chunks_run_upstream_and_equal_one_pass(pair: Pair, scans: list[int]) -> None:
    ids = tokens(4, A_LEN + 65)
    got = prefill(pair.patched, ids, 0, pair.new_cache(), [A_LEN, 12, 32, 21])
    assert relative_error(got, pair.reference(ids)) < TOLERANCE
    mixers = pair.mixers
    # A tail of 12 is not short (> 8) and 32 is whole chunks: both upstream; 21 = 16 upstream + 5.
    assert scans == [6] * mixers + [5] * mixers


def test_decoding_after_a_short_continuation_equals_one_pass(pair: Pair) -> None:
    ids = tokens(5, A_LEN + 15)
    got = prefill(pair.patched, ids, 0, pair.new_cache(), [A_LEN, 5] + [1] * 10)
    assert relative_error(got, pair.reference(ids)) < TOLERANCE


def test_short_prompts_with_and_without_a_cache(pair: Pair, scans: list[int]) -> None:
    ids = tokens(6, 12)
    want = pair.reference(ids)
    assert relative_error(forward(pair.patched, ids[:7], 0, None), want[:7]) < TOLERANCE
    assert relative_error(prefill(pair.patched, ids, 0, pair.new_cache(), [1, 4, 7]), want) < TOLERANCE
    assert scans == [7] * pair.mixers + [1] * pair.mixers + [4] * pair.mixers + [7] * pair.mixers


def test_left_padding_is_masked_in_the_prompt_and_its_continuation(pair: Pair, scans: list[int]) -> None:
    """A batch row padded on the left: the patched model equals upstream on the same batch and mask."""
    prompt = torch.tensor([[0] * 5 + tokens(7, 30), tokens(8, 35)])
    more = torch.tensor([tokens(9, 6), tokens(10, 6)])
    mask = torch.ones(2, 41, dtype=torch.long)
    mask[0, :5] = 0
    outputs = []
    for model in (pair.patched, pair.upstream):
        cache = pair.new_cache()
        with torch.inference_mode():
            first = model(input_ids=prompt, attention_mask=mask[:, :35], position_ids=torch.arange(35)[None],
                          cache=cache, use_cache=True).logits
            then = model(input_ids=more, attention_mask=mask, position_ids=torch.arange(35, 41)[None], cache=cache,
                         use_cache=True).logits
        outputs.append(torch.cat([first[:, 5:], then], dim=1).float())
    assert relative_error(*outputs) < TOLERANCE
    assert scans == [3] * pair.mixers + [6] * pair.mixers  # 35 = 32 upstream + 3


def test_bf16_model_keeps_a_float32_state(model_dirs: dict[str, Path]) -> None:
    family = "granite-moe-hybrid"
    bf16 = Pair(MIXERS[family], lambda: load_model(family, model_dirs[family], dtype="bfloat16").model)
    ids = tokens(11, A_LEN + 7)
    logits = []
    for model in (bf16.patched, bf16.upstream):
        cache = bf16.new_cache()
        logits.append(prefill(model, ids, 0, cache, [5, A_LEN - 5, 7]))
        states = [layer.recurrent_states[0] for layer in cache.layers
                  if isinstance(layer, LinearAttentionCacheLayerMixin)]
        assert {state.dtype for state in states} == {torch.float32}
    # Both run the recurrence in float32 from the same bf16 inputs; the rest rounds to bf16 (logits of 1).
    assert relative_error(*logits) < 0.02  # measured 0; a bf16 step at logits of 1 is 0.008


def naive_recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence written out in float64, one batch row, token and head at a time."""
    x, dt, A, B, C, h = (t.double() for t in (x, dt, A, B, C, h))
    ys = torch.zeros_like(x)
    batch, seq_len, heads, _ = x.shape
    for row in range(batch):
        for t in range(seq_len):
            for head in range(heads):
                h[row, head] = (torch.exp(dt[row, t, head] * A[head]) * h[row, head]
                                + dt[row, t, head] * torch.outer(x[row, t, head], B[row, t, head]))
                ys[row, t, head] = h[row, head] @ C[row, t, head]
    return ys, h


def test_ssd_recurrence_matches_the_recurrence_across_blocks_and_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    batch, seq_len, groups, heads, head_dim, state = 2, 30, 2, 4, 3, 5
    monkeypatch.setattr(mamba2, "SCAN_BLOCK_BYTES", 8 * 4 * batch * heads * head_dim * state)  # blocks of 8
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    x, dt = rand(batch, seq_len, heads, head_dim), torch.rand(batch, seq_len, heads, generator=generator)
    A = -torch.rand(heads, generator=generator)
    # Heads 0, 1 share group 0's B and C; heads 2, 3 group 1's.
    B, C = (rand(batch, seq_len, groups, state).repeat_interleave(heads // groups, dim=2) for _ in range(2))
    h0 = rand(batch, heads, head_dim, state)
    want_y, want_h = naive_recurrence(x, dt, A, B, C, h0.clone())
    y1, h1 = mamba2.ssd_recurrence(x[:, :13], dt[:, :13], A, B[:, :13], C[:, :13], h0)
    y2, h2 = mamba2.ssd_recurrence(x[:, 13:], dt[:, 13:], A, B[:, 13:], C[:, 13:], h1)
    assert relative_error(torch.cat([y1, y2], dim=1).double(), want_y) < 1e-5
    assert relative_error(h2.double(), want_h) < 1e-5
    y_zero, _ = mamba2.ssd_recurrence(x, dt, A, B, C, None)
    assert relative_error(y_zero.double(), naive_recurrence(x, dt, A, B, C, torch.zeros_like(h0))[0]) < 1e-5


def tiny_zamba2() -> Any:
    """Mamba2 layers with a shared attention block at layer 2; two groups; `time_step_limit` clamps Δ from
    below. No synthetic recipe exists."""
    torch.manual_seed(0)
    config = Zamba2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=8, mamba_d_state=16,
                          mamba_ngroups=2, chunk_size=CHUNK, time_step_min=0.01, adapter_rank=8, num_mem_blocks=1,
                          layers_block_type=["linear_attention", "linear_attention", "hybrid", "linear_attention"])
    return Zamba2ForCausalLM(config).eval()


def tiny_nemotron_h() -> Any:
    """Mamba2, attention, Mamba2, MLP; two groups; `time_step_limit` clamps Δ from below."""
    torch.manual_seed(0)
    config = NemotronHConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                             n_groups=2, chunk_size=CHUNK, time_step_min=0.01,
                             layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"])
    return NemotronHForCausalLM(config).eval()


def tiny_falcon_h1() -> Any:
    """The FalconH1 options the synthetic recipe leaves at their defaults: the gated norm on, µP multipliers,
    two groups, and a `time_step_limit` that clamps Δ at both ends."""
    torch.manual_seed(0)
    config = FalconH1Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=8,
                            mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=CHUNK, mamba_rms_norm=True,
                            mamba_norm_before_gate=False, ssm_in_multiplier=0.7,
                            ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], time_step_limit=(0.01, 0.1))
    return FalconH1ForCausalLM(config).eval()


@pytest.mark.parametrize(("build", "mixers"), [(tiny_zamba2, 4), (tiny_nemotron_h, 2), (tiny_falcon_h1, 2)])
def test_other_mamba2_mixers_continue_exactly(build: Callable[[], Any], mixers: int, scans: list[int]) -> None:
    twins = Pair(mixers, build)
    assert twins.patch_count == mixers
    ids = tokens(1, A_LEN + 7, vocab=1000)
    got = prefill(twins.patched, ids, 0, twins.new_cache(), [A_LEN, 1, 3, 3])
    assert relative_error(got, twins.reference(ids)) < TOLERANCE
    assert scans == [6] * mixers + [1] * mixers + [3] * mixers + [3] * mixers


def test_install_lowers_a_large_scan_chunk_on_the_cpu_and_the_outputs_stay(model_dirs: dict[str, Path]) -> None:
    # A model's chunk_size is the chunked scan's, not the model's: 128 on the CPU (scripts/ssd_chunk_ab.py).
    pair = Pair(MIXERS["granite-moe-hybrid"], lambda: load_model("g", model_dirs["granite-moe-hybrid"]).model)
    for model in (pair.patched, pair.upstream):
        for module in model.modules():
            if type(module) in mamba2.MIXER_SPECS:
                module.chunk_size = 256
    mamba2.install(pair.patched)
    assert {m.chunk_size for m in pair.patched.modules() if type(m) in mamba2.MIXER_SPECS} == {128}
    ids = tokens(5, 300)
    assert relative_error(forward(pair.patched, ids, 0, None), pair.reference(ids)) <= TOLERANCE
    small = load_model("g", model_dirs["granite-moe-hybrid"]).model
    assert {m.chunk_size for m in small.modules() if type(m) in mamba2.MIXER_SPECS} == {CHUNK}  # 16: kept
