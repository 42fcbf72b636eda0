"""Mamba2-family mixers that run short multi-token forwards as a token-by-token SSD recurrence.

transformers' torch path (5.24, no `mamba_ssm` kernels) runs every multi-token forward as the chunked SSD
algorithm over chunks of `chunk_size` tokens (256 by default), padding the last chunk: 5 new
tokens after a resumed prefix cost about as much as 256. The chunked algorithm continues from the cached
state correctly; only its cost is the problem. `install` replaces the forward of each mixer instance with
`mixer_forward`: the tail of a forward after its whole chunks, when short (`SEQUENTIAL_SHARE`), runs through
`ssd_recurrence`, and so does a decode step (a tail of one token); the whole chunks and longer tails run
upstream. Upstream's own recurrent decode step expands Δ and A to the whole state (`[batch, heads, head_dim,
state]`) and exponentiates there; the recurrence exponentiates per head and updates the state in one fused
multiply-add, which is what a batched decode step of many sequences' states is bound by.

The recurrence, per head h (one scalar A_h; B, C shared by the heads of a group), with Δ = clamp(softplus(dt
+ dt_bias), time_step_limit) and A = -exp(A_log):
    h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t^T,    y_t = h_t C_t + D x_t     (h_t `[head_dim, state]`)
then the gated RMSNorm with z and `out_proj`, exactly as upstream. It runs in float32 whatever the model
dtype; the cached recurrent state is float32, as upstream keeps it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.bamba.modeling_bamba import BambaMixer
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

from node.engine.mamba1 import SCAN_BLOCK_BYTES, causal_conv, mask_padding, patch_mixers

SEQUENTIAL_SHARE: dict[str, float] = {"cpu": 0.5}
"""Per device type: a tail of at most this share of the mixer's `chunk_size` runs sequentially.

On a CPU a short tail run sequentially costs its tokens, while upstream's chunked scan pads it to a whole chunk;
the two broke even at about two thirds of a chunk, for a small mixer and for the scan alone at a wide one
(RESULTS.md, 2026-11-30). Half a chunk keeps a margin to both. Devices not listed keep upstream: there a Python
loop's per-token launches are unmeasured against the chunked kernels.
"""


SCAN_CHUNK: dict[str, int] = {"cpu": 128}
"""Per device type: the most tokens one chunk of upstream's chunked SSD scan holds (a model's larger `chunk_size`
is lowered to it at load). The chunk size is the algorithm's, not the model's: any size gives the same outputs up
to float rounding. On the CPU a prefill cut into pieces of 128 tokens (the snapshot grid's spacing, `cache/
snapshot_policy.py`) padded each piece to a chunk of 256; at 128 nothing is padded, and whole prompts run faster
too (`scripts/ssd_chunk_ab.py`, RESULTS.md). Devices not listed keep the model's."""


@dataclass(frozen=True, slots=True)
class MixerSpec:
    """What one mixer class does around the shared SSD core."""

    scales_projection: bool
    """Multiply the input by `ssm_in_multiplier` before `in_proj` and the projection by `mup_vector` (FalconH1)."""
    norm_is_optional: bool
    """Without `mamba_rms_norm` the gate multiplies the scan output directly, unnormalized (FalconH1)."""


_PLAIN = MixerSpec(scales_projection=False, norm_is_optional=False)

# Exact mixer class -> its spec. Subclasses are not matched: a subclass may change the math.
MIXER_SPECS: dict[type, MixerSpec] = {
    Mamba2Mixer: _PLAIN,
    BambaMixer: _PLAIN,
    GraniteMoeHybridMambaLayer: _PLAIN,
    Zamba2MambaMixer: _PLAIN,
    NemotronHMamba2Mixer: _PLAIN,
    FalconH1Mixer: MixerSpec(scales_projection=True, norm_is_optional=True),
}


def ssd_recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`y_t = h_t C_t` of the recurrence, starting from `initial_state` (zeros when None).

    Shapes: `x` `[batch, seq, heads, head_dim]`; `dt` (Δ, discretized) `[batch, seq, heads]`; `A` `[heads]`;
    `B`, `C` `[batch, seq, heads, state]` (groups already repeated per head); `initial_state`
    `[batch, heads, head_dim, state]`. Returns `y` `[batch, seq, heads, head_dim]` and the state after the
    last token `[batch, heads, head_dim, state]`, both float32.

    Time runs sequentially, heads and state are vectorized: per token one fused multiply-add over the state,
    written in place into the block's buffer of input terms, which then holds h_t for every t of the block,
    and one contraction with C per block (blocked as in `mamba1.selective_scan`).
    """
    batch, seq_len, heads, head_dim = x.shape
    state_size = B.shape[-1]
    state = (torch.zeros(batch, heads, head_dim, state_size, dtype=torch.float32, device=x.device)
             if initial_state is None else initial_state.float())
    y = torch.empty(seq_len, batch, heads, head_dim, dtype=torch.float32, device=x.device)
    # Time-major: the slice of one token is contiguous.
    dt_t = dt.float().transpose(0, 1)
    decay = torch.exp(dt_t * A.float())[..., None, None]  # [seq, batch, heads, 1, 1]
    dtx_t = (x.float() * dt.float()[..., None]).transpose(0, 1)
    B_t, C_t = B.float().transpose(0, 1), C.float().transpose(0, 1)
    block = max(1, SCAN_BLOCK_BYTES // (4 * batch * heads * head_dim * state_size))
    for start in range(0, seq_len, block):
        end = min(start + block, seq_len)
        states = dtx_t[start:end, ..., None] * B_t[start:end, :, :, None, :]  # Δ x B^T, becomes h in place
        states[0].addcmul_(decay[start], state)
        for t in range(1, end - start):
            states[t].addcmul_(decay[start + t], states[t - 1])
        state = states[-1].clone()
        y[start:end] = torch.einsum("lbhpn,lbhn->lbhp", states, C_t[start:end])
    return y.transpose(0, 1), state


def _discretized_dt(mixer: Any, dt: torch.Tensor) -> torch.Tensor:
    """Δ `[batch, seq, heads]` float32 from the raw `dt`, in upstream's order and dtype (bias and softplus
    in the model dtype, then the clamp)."""
    dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype))
    low, high = mixer.time_step_limit
    return torch.clamp(dt, min=low, max=high).float()


def sequential_forward(mixer: Any, spec: MixerSpec, hidden_states: torch.Tensor, cache: Any,
                       attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The mixer's output `[batch, seq, hidden]` for `hidden_states` `[batch, seq, hidden]`, any length.

    Continues from the cache's conv and recurrent states when it has them and leaves both at the chunk's
    end; `cache` None starts from zeros and keeps nothing.
    """
    batch, seq_len, _ = hidden_states.shape
    dtype = hidden_states.dtype
    # Read before the conv update, which marks the layer as having a previous state.
    initial_state = cache.get_recurrent_state(mixer.layer_idx) if cache is not None else None
    hidden_states = mask_padding(hidden_states, attention_mask)
    if spec.scales_projection:
        hidden_states = hidden_states * mixer.ssm_in_multiplier
    projected = mixer.in_proj(hidden_states)
    if spec.scales_projection:
        projected = projected * mixer.mup_vector
    gate, x_B_C, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    x_B_C = causal_conv(mixer, x_B_C.transpose(1, 2), cache).transpose(1, 2)
    x_B_C = mask_padding(x_B_C, attention_mask)
    group_width = mixer.n_groups * mixer.ssm_state_size
    x, B, C = torch.split(x_B_C, [mixer.intermediate_size, group_width, group_width], dim=-1)
    x = x.reshape(batch, seq_len, mixer.num_heads, mixer.head_dim)
    heads_per_group = mixer.num_heads // mixer.n_groups
    B, C = (t.reshape(batch, seq_len, mixer.n_groups, mixer.ssm_state_size)
            .repeat_interleave(heads_per_group, dim=2) for t in (B, C))
    y, final_state = ssd_recurrence(x, _discretized_dt(mixer, dt), -torch.exp(mixer.A_log.float()), B, C,
                                    initial_state)
    if cache is not None:
        cache.update_recurrent_state(final_state, mixer.layer_idx)
    y = (y + x.float() * mixer.D.float()[:, None]).reshape(batch, seq_len, -1)
    if spec.norm_is_optional and not mixer.mamba_rms_norm:
        y = y * F.silu(gate)
    else:
        y = mixer.norm(y, gate)
    return mixer.out_proj(y.to(dtype))


def sequential_tail(mixer: Any, seq_len: int, cache: Any, device: torch.device) -> int:
    """How many trailing tokens of a forward of `seq_len` tokens run sequentially; 0: all of it upstream.

    With a cache, the whole chunks before the tail run upstream, which leaves the state for the tail in
    the cache; without one there is no state to carry, so the forward is short as a whole or not at all.
    """
    short = int(mixer.chunk_size * SEQUENTIAL_SHARE.get(device.type, 0.0))
    if cache is None:
        return seq_len if seq_len <= short else 0
    tail = seq_len % mixer.chunk_size
    return tail if tail <= short else 0


def mixer_forward(mixer: Any, spec: MixerSpec, hidden_states: torch.Tensor, cache: Any = None,
                  attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """Upstream's output `[batch, seq, hidden]` for `hidden_states` `[batch, seq, hidden]`, faster for short tails.

    `kwargs` are the decoder layer's, passed on to upstream, whose torch path ignores them.
    """
    upstream = functools.partial(type(mixer).forward, mixer, cache=cache, **kwargs)
    seq_len = hidden_states.shape[1]
    tail = sequential_tail(mixer, seq_len, cache, hidden_states.device)
    if tail == 0:
        return upstream(hidden_states, attention_mask=attention_mask)
    head = seq_len - tail
    head_mask = tail_mask = None
    if attention_mask is not None:
        head_mask, tail_mask = attention_mask[:, -seq_len:].split([head, tail], dim=1)
    outputs = [upstream(hidden_states[:, :head], attention_mask=head_mask)] if head else []
    outputs.append(sequential_forward(mixer, spec, hidden_states[:, head:], cache, tail_mask))
    return torch.cat(outputs, dim=1)


def install(model: nn.Module) -> int:
    """Make every Mamba2-family mixer of `model` run short forwards sequentially, in scan chunks of at most
    `SCAN_CHUNK` tokens on its device; returns how many were patched."""
    patched = patch_mixers(model, MIXER_SPECS, mixer_forward)
    parameter = next(model.parameters(), None)
    most = SCAN_CHUNK.get(parameter.device.type) if parameter is not None else None
    mixers: list[Any] = [module for module in model.modules() if type(module) in MIXER_SPECS]
    for mixer in mixers:
        if most is not None and mixer.chunk_size > most:
            mixer.chunk_size = most
    return patched
