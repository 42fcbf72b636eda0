"""Mamba-1 mixers (Mamba, FalconMamba, Jamba) that continue from the cached state in every forward.

transformers' torch path (5.24, no `mamba_ssm` kernels) starts the selective scan of every multi-token
forward from a zero SSM state, even when the cache holds the state of earlier tokens; only one-token steps
continue from it. Chunked prefill and resuming a stored prefix with several new tokens therefore give wrong
logits (errors of 0.1 to 21 on tiny random models). The conv part is right upstream: `update_conv_state`
puts the cached inputs in front of the chunk, so the causal conv sees the last `kernel - 1` real inputs.
Upstream also reads `dt_proj.weight` directly, which the CPU layout (`cpu_layout`) removes. `install`
replaces the forward of each mixer instance with `mixer_forward`, whose scan starts from the cached state;
one-token steps and fresh prompts go through the same code, so there is one recurrence, not two.

The recurrence, per channel d and state index n (Δ = softplus(dt_proj(·) + bias), A = -exp(A_log)):
    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t,    y_t = (C_t · h_t + D x_t) * silu(z_t)
It runs in float32 whatever the model dtype, and the cached SSM state is float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
from transformers.models.jamba.modeling_jamba import JambaMambaMixer
from transformers.models.mamba.modeling_mamba import MambaMixer

SCAN_BLOCK_BYTES = 2 << 20
"""Size of the per-block buffers of discretized terms (two of them): small enough to stay in cache, where
whole-chunk buffers at 2048 channels spill to memory (RESULTS.md, 2026-11-30), large enough to amortize the
per-block ops. The block is at least one token."""


@dataclass(frozen=True, slots=True)
class MixerSpec:
    """How one mixer class derives Δ, B and C from the output of its `x_proj`."""

    norms_dt_b_c: bool
    """RMS-normalize the Δ input, B and C (`dt_layernorm`, `b_layernorm`, `c_layernorm`) before use."""


# Exact mixer class -> its spec. Subclasses are not matched: a subclass may change the math.
MIXER_SPECS: dict[type, MixerSpec] = {
    MambaMixer: MixerSpec(norms_dt_b_c=False),
    FalconMambaMixer: MixerSpec(norms_dt_b_c=True),
    JambaMambaMixer: MixerSpec(norms_dt_b_c=True),
}


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM part of the recurrence, `C_t · h_t`, starting from `initial_state` (zeros when None).

    Shapes: `x`, `dt` (Δ after softplus) `[batch, seq, channels]`; `A` `[channels, state]`; `B`, `C`
    `[batch, seq, state]`; `initial_state` `[batch, channels, state]`. Returns `y` `[batch, seq, channels]`
    and the state after the last token `[batch, channels, state]`, both float32.

    Time runs sequentially, channels and state indices are vectorized: per token one fused multiply-add
    over `[batch, channels, state]`, written in place into the buffer of input terms, which then holds
    h_t for every t of the block, and one contraction with C per block.
    """
    batch, seq_len, channels = x.shape
    A = A.float()
    state = (torch.zeros(batch, channels, A.shape[-1], dtype=torch.float32, device=x.device)
             if initial_state is None else initial_state.float())
    y = torch.empty(seq_len, batch, channels, dtype=torch.float32, device=x.device)
    # Time-major: the slice of one token is contiguous.
    dt_t = dt.float().transpose(0, 1)
    dtx_t = dt_t * x.float().transpose(0, 1)
    B_t, C_t = B.float().transpose(0, 1), C.float().transpose(0, 1)
    block = max(1, SCAN_BLOCK_BYTES // (4 * batch * channels * A.shape[-1]))
    for start in range(0, seq_len, block):
        end = min(start + block, seq_len)
        decay = torch.exp(dt_t[start:end, :, :, None] * A)  # [block, batch, channels, state]
        states = dtx_t[start:end, :, :, None] * B_t[start:end, :, None, :]  # Δ B x, becomes h in place
        states[0].addcmul_(decay[0], state)
        for t in range(1, end - start):
            states[t].addcmul_(decay[t], states[t - 1])
        state = states[-1].clone()
        y[start:end] = torch.einsum("lbdn,lbn->lbd", states, C_t[start:end])
    return y.transpose(0, 1), state


def mask_padding(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded positions of `hidden_states` `[batch, seq, features]`.

    `attention_mask` `[batch, >= seq]` may span the cached tokens too (Mamba passes the caller's mask
    as is, Jamba trims it): its last `seq` columns are the chunk's.
    """
    if attention_mask is None:
        return hidden_states
    mask = attention_mask[:, -hidden_states.shape[1]:, None]
    return (hidden_states * mask).to(hidden_states.dtype)


def causal_conv(mixer: Any, x: torch.Tensor, cache: Any) -> torch.Tensor:
    """Depthwise causal conv of `x` `[batch, channels, seq]` -> `[batch, channels, seq]`, activation applied.

    With a cache, the cached inputs are the left context and the cache's conv state moves to the chunk's
    end (through `update_conv_state`, which also honours past recording for `crop`); without one, or before
    the first chunk, the left context is zeros.
    """
    seq_len, kernel = x.shape[-1], mixer.conv_kernel_size
    window = x if cache is None else cache.update_conv_state(x, mixer.layer_idx, conv_kernel_size=kernel)
    needed = seq_len + kernel - 1
    window = window[..., -needed:] if window.shape[-1] >= needed else F.pad(window, (needed - window.shape[-1], 0))
    conv = mixer.conv1d
    out = F.conv1d(window.to(conv.weight.dtype), conv.weight, conv.bias, groups=conv.weight.shape[0])
    return mixer.act(out).to(x.dtype)


def _delta(dt_proj: nn.Module, time_step: torch.Tensor) -> torch.Tensor:
    """Δ `[batch, seq, channels]` float32 from the low-rank `time_step` `[batch, seq, rank]`.

    A plain `nn.Linear` adds its bias in float32 after the matmul, as upstream and the CUDA kernel do;
    any other module (the CPU-transposed layout, a quantized layer) is called whole.
    """
    if type(dt_proj) is nn.Linear:
        pre = F.linear(time_step, dt_proj.weight).float()
        if dt_proj.bias is not None:
            pre = pre + dt_proj.bias.float()
    else:
        pre = dt_proj(time_step).float()
    return F.softplus(pre)


def mixer_forward(mixer: Any, spec: MixerSpec, hidden_states: torch.Tensor, cache: Any = None,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mixer's output `[batch, seq, hidden]` for `hidden_states` `[batch, seq, hidden]`.

    Continues from the cache's conv and SSM states when it has them (any chunk length) and leaves both at
    the chunk's end. Takes no other keywords: the old `cache_params=` spelling raises rather than being
    dropped, which would silently run without the cache.
    """
    dtype = hidden_states.dtype
    initial_state = cache.get_recurrent_state(mixer.layer_idx) if cache is not None else None
    projected = mixer.in_proj(mask_padding(hidden_states, attention_mask))
    x, gate = projected.chunk(2, dim=-1)  # [batch, seq, channels] each
    x = causal_conv(mixer, x.transpose(1, 2), cache).transpose(1, 2)
    x = mask_padding(x, attention_mask)
    time_step, B, C = torch.split(mixer.x_proj(x), [mixer.time_step_rank, mixer.ssm_state_size,
                                                     mixer.ssm_state_size], dim=-1)
    if spec.norms_dt_b_c:
        time_step, B, C = mixer.dt_layernorm(time_step), mixer.b_layernorm(B), mixer.c_layernorm(C)
    y, final_state = selective_scan(x, _delta(mixer.dt_proj, time_step), -torch.exp(mixer.A_log.float()), B, C,
                                    initial_state)
    if cache is not None:
        cache.update_recurrent_state(final_state, mixer.layer_idx)
    y = (y + x.float() * mixer.D.float()) * F.silu(gate.float())
    return mixer.out_proj(y.to(dtype))


def patch_mixers(model: nn.Module, specs: Mapping[type, Any], forward: Callable[..., Any]) -> int:
    """Give every module of `model` whose exact class is in `specs` the forward `forward(module, spec, ...)`.

    Replaces `forward` on the instances only, so other models of the same classes are untouched; calling
    it again rebinds the same forward. Returns how many modules were patched.
    """
    patched = 0
    for module in model.modules():
        spec = specs.get(type(module))
        if spec is not None:
            module.forward = functools.partial(forward, module, spec)
            patched += 1
    return patched


def install(model: nn.Module) -> int:
    """Make every Mamba-1 mixer of `model` continue from cached state; returns how many were patched."""
    return patch_mixers(model, MIXER_SPECS, mixer_forward)
