"""The few-token forward of a Llama-shaped decoder on the CPU kernels: resumed prompt tails and decode steps.

After a reused prefix only the new tokens run, tens of them against a history of thousands; on one CPU
thread that forward is bound by streaming every weight from memory once and by attention over the whole
history, not by transformers' Python. This module runs it as one native call (`tz_decoder_forward`) over
the same working cache, so stored spans and pooled buffers behave as with transformers' forward: Python
only reserves each layer's new rows in the working layers, which the kernels write in place, and a
restored prefix that a layer holds by reference (`GrowableKVLayer.defer`) is attended where it is stored.
A chunk runs as consecutive pieces of at most `PIECE_TOKENS`. Longer chunks used to stay on transformers'
forward (oneDNN GEMMs and SDPA), but the pieces are ahead at every history length (`scripts/prefill_ab.py`;
RESULTS.md, 2026-12-01): SDPA's attention over a history is what the pieces save.

Only the last position's logits are wanted, so the last layer runs attention, output projection and MLP
for that one row; earlier rows of the last layer feed nothing but their K/V, which it still writes. The
output head itself runs only when the caller asks: the greedy token comes from an int8 screen of the head
and a float32 recomputation of the rows the screen cannot rule out, which reads a quarter of the head's
bytes and picks exactly the token the full float32 logits would (see `tz_head_argmax`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache, LlamaForCausalLM

from cache.working_cache import GrowableKVLayer
from node.engine.cpu_kernels import CpuKernels
from node.engine.cpu_layout import NativeLinear, TransposedLinear
from node.engine.kernel_operands import LayerWeights, NativeDecoder, PackedHead
from node.engine.prediction import Prediction

PIECE_TOKENS = 64
"""Most tokens one native call runs (its scratch's size); a longer chunk runs as consecutive pieces. Pieces of
32 were no faster (RESULTS.md, 2026-12-01)."""
HEAD_DIMS = (32, 64, 128)
AGREEMENT = 1e-4
"""Largest |difference| from transformers' logits, relative to the largest |logit|: float32 sums in
another order differ by about 1e-6."""


SCREENED_ROWS = 16
"""Most greedy rows of a batched decode step whose tokens one pass of the head's hand-written int8 screen finds
(`CpuDecoder.score_rows`), where the CPU has no exact library int8 product. That screen reads a quarter of the
head's bytes but does as much arithmetic per row as the float32 head; from a few tens of rows the arithmetic
costs what the bytes save, and the head runs as one GEMM. With the library's int8 product (`Int8Head`) every
greedy row is screened: its arithmetic is int8 too (node/engine/BATCHING.md, "The head of a batched step")."""


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
            [index] = self._kernels.head_argmax(self._hidden.unsqueeze(0), self._head)
            if index is not None:
                return index
        return int(torch.argmax(self.logits()))


class RowPrediction(Prediction):
    """One row of a batched step: its greedy token where a screen of the head found it (else None), and its
    logits from `logits` when asked for."""

    def __init__(self, index: int | None, logits: Callable[[], torch.Tensor]) -> None:
        self.index, self._logits = index, logits

    def logits(self) -> torch.Tensor:
        return self._logits()

    def greedy(self) -> int:
        return self.index if self.index is not None else super().greedy()


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot run on this forward, or None."""
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

    The packed weights are a copy next to the model's own; once the forward is chosen, the model's linear layers
    run their short inputs (a batched decode step's rows) on views of them too (`lend_panels`).
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
        self._embed = body.embed_tokens.weight.detach().contiguous()
        self._final_norm = body.norm.weight.detach().contiguous()
        self._head = kernels.pack_head(model.lm_head.weight, getattr(model.lm_head, "bias", None))
        self._layers = [self._pack_layer(layer) for layer in body.layers]
        self._native = NativeDecoder(self._embed, self._layers, self.heads,
                                     self.kv_heads, self.head_dim, self.eps, self.scale, self._final_norm,
                                     self.final_eps, self._head)
        # One forward runs at a time per model (its worker thread): scratch is allocated once.
        self._work = torch.empty(self._native.work_floats(PIECE_TOKENS))
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        kind = str(getattr(body.rotary_emb, "rope_type", "default"))
        self._rope_by_position = "dynamic" not in kind and kind != "longrope"
        """Whether cos/sin depend on the position alone (dynamic rope types rescale with the length)."""
        self._like = torch.empty(1, self.kv_heads, PIECE_TOKENS, self.head_dim)
        """The shape, dtype and device of new K/V rows, for reserving them in the working cache."""

    @classmethod
    def build(cls, model: Any, kernels: CpuKernels | None) -> CpuDecoder | None:
        """The decoder of `model`, or None where there are no kernels or the model is not one it runs."""
        if kernels is None or unsupported_reason(model) is not None:
            return None
        return cls(model, kernels)

    def _pack_layer(self, layer: Any) -> LayerWeights:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        qkv_bias = (torch.cat([p.bias for p in projections]) if attention.q_proj.bias is not None else None)
        gate_up_bias = (torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]) if mlp.gate_proj.bias is not None
                        else None)
        pack = self._kernels.pack
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach().contiguous(),
            qkv=pack(torch.cat([p.weight for p in projections]), qkv_bias),
            output=pack(attention.o_proj.weight, attention.o_proj.bias),
            post_norm=layer.post_attention_layernorm.weight.detach().contiguous(),
            gate_up=pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gate_up_bias),
            down=pack(mlp.down_proj.weight, mlp.down_proj.bias),
        )

    def lend_panels(self) -> int:
        """Give each linear layer of the model's decoder layers (`TransposedLinear`) a view of its columns of these
        panels (`cpu_layout.NativeLinear`), so that its inputs of up to `NATIVE_ROWS` rows run on the native
        GEMM without another copy of the weights; returns how many layers took one (a part that does not begin a
        panel keeps the library's product)."""
        lent = 0
        for layer, packed in zip(self._model.model.layers, self._layers, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            parts = [(attention.q_proj, packed.qkv, 0), (attention.k_proj, packed.qkv, attention.q_proj.out_features),
                     (attention.v_proj, packed.qkv, attention.q_proj.out_features + attention.k_proj.out_features),
                     (attention.o_proj, packed.output, 0), (mlp.gate_proj, packed.gate_up, 0),
                     (mlp.up_proj, packed.gate_up, mlp.gate_proj.out_features), (mlp.down_proj, packed.down, 0)]
            for module, weight, start in parts:
                view = weight.columns(start, module.out_features)
                if isinstance(module, TransposedLinear) and view is not None:
                    module.native = NativeLinear(self._kernels, view)
                    lent += 1
        return lent

    def _rotary(self, start: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[tokens, head_dim]` of positions `start..`, from the model's own rotary module. Where they
        depend on the position alone (every rope type but the dynamic ones, which rescale with the length),
        they come from a table of the positions so far, which grows by doubling."""
        rotary = self._model.model.rotary_emb
        if not self._rope_by_position:
            cos, sin = rotary(self._final_norm, torch.arange(start, start + tokens).unsqueeze(0))
            return cos[0].contiguous(), sin[0].contiguous()
        end = start + tokens
        if self._rope_table is None or self._rope_table[0].shape[0] < end:
            length = max(end, 2 * self._rope_table[0].shape[0] if self._rope_table is not None else 1024)
            cos, sin = rotary(self._final_norm, torch.arange(length).unsqueeze(0))  # x: only its dtype and device
            self._rope_table = (cos[0].contiguous(), sin[0].contiguous())
        return self._rope_table[0][start:end], self._rope_table[1][start:end]

    @torch.inference_mode()
    def wipe_scratch(self) -> None:
        """Zero the forward's scratch: it holds the last chunk's activations and new keys and values."""
        self._work.zero_()

    def takes(self, tokens: int, cache: DynamicCache) -> bool:
        """Whether this forward runs `tokens` new tokens into `cache`: into working-cache layers it can write in
        place."""
        return tokens > 0 and all(isinstance(layer, GrowableKVLayer) for layer in cache.layers)

    @torch.inference_mode()
    def agrees_with_model(self) -> bool:
        """Whether this forward, continuing transformers' prefill by a kernel-attention chunk and a decode
        step, gives transformers' own logits (within AGREEMENT of the largest)."""
        model, vocab = self._model, self._head.out_features
        generator = torch.Generator().manual_seed(0)
        # A prefill of 8 by transformers, a chunk of 20 and a decode step by this forward.
        ids = torch.randint(min(100, vocab - 1), vocab, (8 + 20 + 1,), generator=generator).tolist()
        cache = DynamicCache(config=model.config)
        cache.layers = [GrowableKVLayer(len(ids)) for _ in cache.layers]
        model(input_ids=torch.tensor([ids[:8]]), cache=cache, use_cache=True)
        chunk = self.forward(ids[8:-1], 8, cache).logits()
        step = self.forward(ids[-1:], len(ids) - 1, cache).logits()
        for got, length in ((chunk, len(ids) - 1), (step, len(ids))):
            expected = model(input_ids=torch.tensor([ids[:length]]), logits_to_keep=1).logits[0, -1]
            if float((got - expected).abs().max()) > AGREEMENT * max(1.0, float(expected.abs().max())):
                return False
        return True

    def forward(self, ids: list[int], start: int, cache: DynamicCache) -> HeadPrediction:
        """Run `ids` at positions `[start, start + len)`, writing their K/V into `cache`; returns the last
        position's prediction (its logits are computed when asked for)."""
        hidden = self._run(ids, start, cache, want_logits=True)
        assert hidden is not None
        return HeadPrediction(self._kernels, self._head, hidden)

    @property
    def screens_every_row(self) -> bool:
        """Whether `score_rows` screens any number of greedy rows (the library's int8 product runs here)."""
        return self._head.rows is not None

    def screens(self, greedy: Sequence[bool]) -> bool:
        """Whether `score_rows` screens a batched step whose rows are greedy where `greedy` says so."""
        rows = sum(greedy)
        return 0 < rows and (rows <= SCREENED_ROWS or self.screens_every_row)

    @torch.inference_mode()
    def score_rows(self, hidden: torch.Tensor, greedy: Sequence[bool]) -> list[Prediction]:
        """Predictions of a batched decode step's rows from their final normed hidden states `[B, hidden]`: the
        greedy rows' tokens from one pass of the head's int8 screen over all of them (each exactly the argmax of
        its float32 logits, as for one row); the other rows' logits, and those of a greedy row the screen cannot
        decide, from one run of the model's own head over those rows, when first asked for."""
        rows = [row for row, wanted in enumerate(greedy) if wanted]
        picked = dict(zip(rows, self._kernels.head_argmax(hidden[rows].contiguous(), self._head), strict=True))
        unpicked = [row for row in range(hidden.shape[0]) if picked.get(row) is None]
        logits: dict[int, torch.Tensor] = {}

        def row_logits(row: int) -> torch.Tensor:
            if row not in logits:  # the rows that need logits at once; a picked row's alone
                wanted = unpicked if row in unpicked else [row]
                logits.update(zip(wanted, self._model.lm_head(hidden[wanted]).float(), strict=True))
            return logits[row]

        return [RowPrediction(picked.get(row), partial(row_logits, row)) for row in range(hidden.shape[0])]

    def extend(self, ids: list[int], start: int, cache: DynamicCache) -> None:
        """Write the K/V of `ids` into `cache` and nothing else: the last layer's attention, MLP and the
        output head feed only logits, so they are skipped (the head alone reads 65 MB on the default model)."""
        self._run(ids, start, cache, want_logits=False)

    @torch.inference_mode()
    def _run(self, ids: list[int], start: int, cache: DynamicCache, want_logits: bool) -> torch.Tensor | None:
        """The last position's final normed hidden state `[hidden]` (None when not `want_logits`), in pieces of
        at most PIECE_TOKENS: only the last one wants logits."""
        last = None
        for first in range(0, len(ids), PIECE_TOKENS):
            piece = ids[first:first + PIECE_TOKENS]
            last = self._run_piece(piece, start + first, cache, want_logits and first + len(piece) == len(ids))
        return last

    def _run_piece(self, ids: list[int], start: int, cache: DynamicCache, want_logits: bool) -> torch.Tensor | None:
        tokens = len(ids)
        cos, sin = self._rotary(start, tokens)
        like = self._like[:, :, :tokens]
        layer_caches = []
        for layer, layer_cache in zip(self._native.layers, cache.layers, strict=True):
            # The kernels write the new rows in place and read restored pieces where they lie.
            assert isinstance(layer_cache, GrowableKVLayer)  # see takes()
            new_keys, new_values, segments = layer_cache.reserve(like)
            layer.set_cache(new_keys, new_values, segments)
            layer_caches.append(layer_cache)
        last = torch.empty(self.hidden)
        # A sealed hit's rows may still be opening: each layer waits for its own, between the layers' compute.
        opening = any(layer_cache.opening is not None for layer_cache in layer_caches)
        ready = (lambda index: layer_caches[index].wait_rows()) if opening else None
        self._kernels.decoder_forward(self._native, ids, start, cos, sin, self._work, want_logits, last, ready)
        return last if want_logits else None


DECODERS: dict[type, type[CpuDecoder]] = {LlamaForCausalLM: CpuDecoder}
"""Model classes whose decoder layers are exactly what `CpuDecoder` computes."""
