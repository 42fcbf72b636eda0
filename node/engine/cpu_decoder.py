"""The few-token forward of a Llama-shaped decoder on the CPU kernels: resumed prompt tails and decode steps.

After a reused prefix only the new tokens run, tens of them against a history of thousands; on one CPU
thread that forward is bound by streaming every weight from memory once and by attention over the whole
history, not by transformers' Python. This module runs it with the kernels of `cpu_kernels` over the same
working cache, so stored spans and pooled buffers behave as with transformers' forward; a restored prefix
that the working layer holds by reference (`GrowableKVLayer.defer`) is attended where it is stored.
Chunks longer than `MAX_TOKENS` (cold prefill) stay on transformers' forward, whose library GEMMs are at
their best on long inputs.

Only the last position's logits are wanted, so the last layer runs attention, output projection and MLP
for that one row; earlier rows of the last layer feed nothing but their K/V, which it still writes. The
output head itself runs only when the caller asks: the greedy token comes from an int8 screen of the head
and a float32 recomputation of the rows the screen cannot rule out, which reads a quarter of the head's
bytes and picks exactly the token the full float32 logits would (see `tz_head_argmax`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaForCausalLM

from cache.working_cache import GrowableKVLayer
from node.engine.cpu_kernels import CpuKernels, PackedHead, PackedWeight
from node.engine.prediction import Prediction

log = logging.getLogger(__name__)

MAX_TOKENS = 64
"""Longest chunk this forward takes; longer chunks are cold prefill, run by transformers."""
KERNEL_ATTENTION_MIN_QUERIES = 16
"""Below this many queries a lane-per-query kernel wastes most lanes; torch's SDPA is faster (measured:
1 query over 2k keys 0.37 versus 0.64 ms, 17 queries over 70 keys 0.036 versus 0.014 ms) once the
history is one tensor. Over restored pieces the kernel still runs: joining them first costs more."""
HEAD_DIMS = (32, 64, 128)
AGREEMENT = 1e-4
"""Largest |difference| from transformers' logits, relative to the largest |logit|: float32 sums in
another order differ by about 1e-6."""


class HeadPrediction(Prediction):
    """The final normed hidden state of the last position, with the packed head to score it on demand."""

    def __init__(self, kernels: CpuKernels, head: PackedHead, hidden: torch.Tensor) -> None:
        self._kernels, self._head, self._hidden = kernels, head, hidden
        self._logits: torch.Tensor | None = None

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            logits = torch.empty(1, self._head.out_features)
            self._kernels.gemm(self._hidden.unsqueeze(0), self._head.weight, logits)
            self._logits = logits[0]
        return self._logits

    def greedy(self) -> int:
        if self._logits is None:
            index = self._kernels.head_argmax(self._hidden, self._head)
            if index is not None:
                return index
        return int(torch.argmax(self.logits()))


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: PackedWeight
    """q, k and v projections as one `[(heads + 2 * kv_heads) * head_dim, hidden]` weight."""
    output: PackedWeight
    post_norm: torch.Tensor
    gate_up: PackedWeight
    """Gate and up projections as one `[2 * intermediate, hidden]` weight."""
    down: PackedWeight


def _supports(model: Any) -> str | None:
    """Why `model` cannot run here, or None."""
    config = model.config
    if type(model) not in DECODERS:
        return f"{type(model).__name__} has no CPU decoder"
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return "the CPU kernels are float32 on the CPU"
    if config.hidden_act != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return "only the SiLU-gated MLP without tensor-parallel slicing"
    if model.model.layers[0].self_attn.head_dim not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS}"
    return None


class CpuDecoder:
    """Packed copies of a Llama-shaped model's weights and the forward that runs on them.

    The packed weights are a second copy next to the model's own, which cold prefill still reads.
    """

    def __init__(self, model: Any, kernels: CpuKernels) -> None:
        self._kernels = kernels
        self._model = model
        body = model.model
        attention = body.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.scale = float(attention.scaling)
        self.hidden = model.config.hidden_size
        self.intermediate = body.layers[0].mlp.intermediate_size
        self.eps = float(body.layers[0].input_layernorm.variance_epsilon)
        self.final_eps = float(body.norm.variance_epsilon)
        self._embed = body.embed_tokens.weight
        self._final_norm = body.norm.weight.detach().contiguous()
        self._layers = [self._pack_layer(layer) for layer in body.layers]
        self._head = kernels.pack_head(model.lm_head.weight, getattr(model.lm_head, "bias", None))

    @classmethod
    def build(cls, model: Any, kernels: CpuKernels | None) -> CpuDecoder | None:
        if kernels is None:
            return None
        reason = _supports(model)
        if reason is not None:
            log.debug("no CPU decoder: %s", reason)
            return None
        return cls(model, kernels)

    def _pack_layer(self, layer: Any) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        qkv_bias = (torch.cat([p.bias for p in projections]) if attention.q_proj.bias is not None else None)
        gate_up_bias = (torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]) if mlp.gate_proj.bias is not None
                        else None)
        pack = self._kernels.pack
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach().contiguous(),
            qkv=pack(torch.cat([p.weight for p in projections]), qkv_bias),
            output=pack(attention.o_proj.weight, attention.o_proj.bias),
            post_norm=layer.post_attention_layernorm.weight.detach().contiguous(),
            gate_up=pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gate_up_bias),
            down=pack(mlp.down_proj.weight, mlp.down_proj.bias),
        )

    def takes(self, tokens: int) -> bool:
        return 0 < tokens <= MAX_TOKENS

    @torch.inference_mode()
    def agrees_with_model(self) -> bool:
        """Whether this forward, continuing transformers' prefill by a kernel-attention chunk and a decode
        step, gives transformers' own logits (within AGREEMENT of the largest)."""
        model, vocab = self._model, self._head.out_features
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(min(100, vocab - 1), vocab, (8 + KERNEL_ATTENTION_MIN_QUERIES + 1,),
                            generator=generator).tolist()
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:8]]), cache=cache, use_cache=True)
        chunk = self.forward(ids[8:-1], 8, cache).logits()
        step = self.forward(ids[-1:], len(ids) - 1, cache).logits()
        for got, length in ((chunk, len(ids) - 1), (step, len(ids))):
            expected = model(input_ids=torch.tensor([ids[:length]]), logits_to_keep=1).logits[0, -1]
            if float((got - expected).abs().max()) > AGREEMENT * max(1.0, float(expected.abs().max())):
                return False
        return True

    def _attention(self, q: torch.Tensor, layer: Any, segments: list[tuple[torch.Tensor, torch.Tensor]], start: int,
                   out: torch.Tensor, then: PackedWeight | PackedHead) -> None:
        """q `[T, heads, head_dim]` at positions `start..` over the layer's K/V `segments` (pieces
        `[1, kv_heads, n, head_dim]` in position order) -> out `[T, heads * head_dim]`."""
        tokens = q.shape[0]
        if ((tokens >= KERNEL_ATTENTION_MIN_QUERIES or len(segments) > 1)
                and self._kernels.attention(q, segments, start, self.scale, out, then)):
            return
        if len(segments) > 1:  # torch needs the history as one tensor: copy the restored pieces in now
            layer.materialize()
            segments = layer.segments()
        keys, values = segments[0]
        mask = None if tokens == 1 else torch.ones(tokens, start + tokens, dtype=torch.bool).tril(start)
        result = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                                scale=self.scale, enable_gqa=self.heads != self.kv_heads)
        out.copy_(result[0].transpose(0, 1).reshape(tokens, -1))

    def forward(self, ids: list[int], start: int, cache: DynamicCache) -> HeadPrediction:
        """Run `ids` at positions `[start, start + len)`, writing their K/V into `cache`; returns the last
        position's prediction (its logits are computed when asked for)."""
        hidden = self._run(ids, start, cache, want_logits=True)
        assert hidden is not None
        return HeadPrediction(self._kernels, self._head, hidden)

    def extend(self, ids: list[int], start: int, cache: DynamicCache) -> None:
        """Write the K/V of `ids` into `cache` and nothing else: the last layer's attention, MLP and the
        output head feed only logits, so they are skipped (the head alone reads 65 MB on the default model)."""
        self._run(ids, start, cache, want_logits=False)

    @torch.inference_mode()
    def _run(self, ids: list[int], start: int, cache: DynamicCache, want_logits: bool) -> torch.Tensor | None:
        """The last position's final normed hidden state `[hidden]` (None when not `want_logits`)."""
        kernels, tokens = self._kernels, len(ids)
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        hidden = self._embed[torch.tensor(ids)]
        positions = torch.arange(start, start + tokens).unsqueeze(0)
        cos, sin = self._model.model.rotary_emb(hidden, positions)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        normed = torch.empty(tokens, self.hidden)
        qkv = torch.empty(tokens, q_width + 2 * kv_width)
        attended = torch.empty(tokens, q_width)
        gate_up = torch.empty(tokens, 2 * self.intermediate)
        activated = torch.empty(tokens, self.intermediate)
        # Each kernel prefetches the start of the weight that follows it (`then`).
        following = [layer.qkv for layer in self._layers[1:]] + [self._head]
        for index, layer in enumerate(self._layers):
            kernels.rmsnorm(hidden, layer.input_norm, self.eps, normed)
            kernels.gemm(normed, layer.qkv, qkv)
            kernels.rope(qkv, heads + kv_heads, head_dim, cos, sin)
            new_keys = qkv[:, q_width:q_width + kv_width].view(tokens, kv_heads, head_dim).transpose(0, 1)
            new_values = qkv[:, q_width + kv_width:].view(tokens, kv_heads, head_dim).transpose(0, 1)
            layer_cache = cache.layers[index]
            if isinstance(layer_cache, GrowableKVLayer):  # restored pieces are read where they lie
                segments = layer_cache.append(new_keys.unsqueeze(0), new_values.unsqueeze(0))
            else:
                segments = [cache.update(new_keys.unsqueeze(0), new_values.unsqueeze(0), index)]
            queries = qkv[:, :q_width].view(tokens, heads, head_dim)
            if index == len(self._layers) - 1 and not want_logits:
                return None
            if index == len(self._layers) - 1 and tokens > 1:
                # Only the last row reaches the logits.
                hidden, queries, attended, normed = hidden[-1:], queries[-1:], attended[-1:], normed[-1:]
                gate_up, activated = gate_up[-1:], activated[-1:]
                self._attention(queries, layer_cache, segments, start + tokens - 1, attended, layer.output)
            else:
                self._attention(queries, layer_cache, segments, start, attended, layer.output)
            kernels.gemm(attended, layer.output, hidden, accumulate=True, then=layer.gate_up)
            kernels.rmsnorm(hidden, layer.post_norm, self.eps, normed)
            kernels.gemm(normed, layer.gate_up, gate_up, then=layer.down)
            kernels.silu_mul(gate_up, activated)
            kernels.gemm(activated, layer.down, hidden, accumulate=True, then=following[index])
        last = torch.empty(1, self.hidden)
        kernels.rmsnorm(hidden[-1:], self._final_norm, self.final_eps, last)
        return last[0]


DECODERS: dict[type, type[CpuDecoder]] = {LlamaForCausalLM: CpuDecoder}
"""Model classes whose decoder layers are exactly what `CpuDecoder` computes."""
