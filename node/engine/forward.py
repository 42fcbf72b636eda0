"""The one forward interface the engine runs a model through, and the one place it is chosen (`choose_forward`).

Two backends, chosen once per model at load; the choice and its reason are logged and reported (`GET /v1/node`,
`/metrics`):

    library      transformers' modules, attention through torch's `scaled_dot_product_attention` (or the model's
                 own eager function where it needs one): any device, every family. Its parts, all installed
                 or decided here: the chunk forward with the last layer for the last position only
                 (`last_row.py`); the batched decode step (`batch_forward.BatchedDecode`), which also runs the
                 last tokens of ended requests without the head (`feed`); the Mamba continuations (`mamba1.py`,
                 `mamba2.py`); and on a CPU the linear layers' transposed and oneDNN-packed weights
                 (`cpu_layout.py`).
    native-cpu   the library backend, with the node's CPU kernels doing what they do better: short chunks and
                 single decode rows (`CpuDecoder.takes`), and the head screened for greedy rows of a batched
                 step. It needs the kernels (built at install, an AVX-512 CPU, not switched off by
                 TENZRO_NATIVE=off), one torch thread, float32, a model class `cpu_decoder.py` implements, room
                 for its packed weights, and a forward that reproduces the library's, checked at load. The
                 linear layers of a batched step (up to `cpu_layout.NATIVE_ROWS` rows) then run on its panels
                 too (`scripts/native_ab.py`).

The batched step's attention over each row's own history is the native decode attention wherever the kernels
run on one thread in float32, whatever the backend (a model class without a CPU decoder still steps its rows
with it); `Forward.decode_attention` names it. Both are decided here and nowhere else: the runner asks its
`Forward` for a batched step's scratch (`batched_decode`) and calls `prefill`, `extend`, `decode` and `feed`; whether
several sequences' steps run as one forward (`batching`, `batches`) is the forward's to say.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from node.engine import mamba1, mamba2
from node.engine.batch_forward import BatchedDecode, Shared, batch_blocker, batchable
from node.engine.cpu_decoder import CpuDecoder, unsupported_reason
from node.engine.cpu_kernels import CpuKernels, KernelsFound, load_kernels
from node.engine.cpu_layout import transpose_linear_weights
from node.engine.last_row import LastRow
from node.engine.media import MediaFamily, SequenceMedia
from node.engine.prediction import Logits, Prediction
from node.log_privacy import Safe

log = logging.getLogger(__name__)

Backend = Literal["library", "native-cpu"]

LAST_ROW_AGREEMENT = 1e-4
"""Largest |difference| from the plain forward's logits, relative to the largest |logit| (float32 sums in
another order differ by about 1e-6)."""


@dataclass(frozen=True, slots=True)
class Forward:
    """A model's forward: `prefill` a chunk, `extend` without logits, `step` many rows at once."""

    backend: Backend
    reason: str
    """Why this backend: what the native kernels needed and found, or what they lacked."""
    model: Any
    device: torch.device
    last_row: LastRow | None = None
    """Hooks that compute the last layer for the last position only (`last_row.py`); None: it runs in full."""
    decoder: CpuDecoder | None = None
    """The kernels' forward for short chunks and decode rows; set exactly for `native-cpu`."""
    decode_kernels: CpuKernels | None = None
    """The kernels the batched step attends each row's own history with; None: the model's attention (SDPA)."""
    batching: str | None = None
    """Why decode steps of several sequences cannot run as one forward on this model (None: they can)."""
    media: MediaFamily | None = None
    """The model's image processor and tower (`media.py`), for a vision-language model that takes images."""
    static: str | None = "decode steps attend each row's own cache"
    """Why decode steps do not run over the lanes' slabs as static, captured steps (`static_decode.py`); None: they
    do, once the runner lays its lanes out so (`ModelRunner.reserve_lanes`)."""

    def batches(self, caches: Sequence[DynamicCache]) -> bool:
        """Whether one step of the sequences holding `caches` runs as one batched forward."""
        return len(caches) > 1 and self.batching is None and all(batchable(cache) for cache in caches)

    @property
    def decode_attention(self) -> str:
        """What attends each row's own history in a batched decode step: "native" or "sdpa"."""
        return "native" if self.decode_kernels is not None else "sdpa"

    def batched_decode(self) -> BatchedDecode:
        """A batched decode step for one runner (its scratch and counters are the runner's own)."""
        return BatchedDecode(self.model, self.decode_kernels)

    def prefill(self, ids: list[int], start: int, cache: DynamicCache, media: SequenceMedia | None = None
                ) -> Prediction:
        """Run `ids` at positions `[start, start + len)` into `cache`; returns the last position's prediction
        (logits `[vocab]` in float32 on demand). `media`: the request's attachments, whose encodings the chunk's
        placeholders read, and its positions where they are not the indices (`SequenceMedia.inputs`)."""
        if media is not None:
            out = self.model(**media.inputs(self.model, ids, start), cache=cache, use_cache=True, logits_to_keep=1)
            return Logits(out.logits[0, -1].float())
        if self.decoder is not None and self.decoder.takes(len(ids), cache):
            return self.decoder.forward(ids, start, cache)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        with self.last_row.active() if self.last_row is not None and len(ids) > 1 else nullcontext():
            out = self.model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True,
                             logits_to_keep=1)
        return Logits(out.logits[0, -1].float())

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One attachment's encoding (`MediaFamily.encode`): what its placeholders' prefill reads."""
        assert self.media is not None, "only a vision-language model takes attachments"
        return self.media.encode(inputs)

    def extend(self, ids: list[int], start: int, cache: DynamicCache) -> None:
        """Run `ids` into `cache` when no logits are wanted (the reply's last token, fed for its state)."""
        if self.decoder is not None and self.decoder.takes(len(ids), cache):
            self.decoder.extend(ids, start, cache)
        else:
            self.prefill(ids, start, cache)

    def decode(self, batched: BatchedDecode, tokens: Sequence[int], positions: Sequence[int],
               caches: Sequence[DynamicCache], shared: Callable[[], Sequence[Shared]], greedy: Sequence[bool]
               ) -> tuple[list[Prediction], bool]:
        """One decode step of each sequence (`tokens[b]` at `positions[b]` into `caches[b]`): one batched forward
        where they `batches` (`shared()` gives its groups of shared rows, which only a CPU step attends once: off the
        CPU they are not asked for, `batch_forward`'s portable step), else one forward each. Returns each row's
        prediction and whether they ran as one forward."""
        logits = batched.static_step(tokens, positions, caches)
        if logits is not None:
            return [Logits(row) for row in logits], len(caches) > 1
        if self.batches(caches):
            return self.step(batched, tokens, positions, caches, self._groups(shared), greedy), True
        return [self.prefill([token], position, cache) for token, position, cache in zip(tokens, positions, caches,
                                                                                          strict=True)], False

    def feed(self, batched: BatchedDecode, tokens: Sequence[int], positions: Sequence[int],
             caches: Sequence[DynamicCache], shared: Callable[[], Sequence[Shared]]) -> bool:
        """Run each sequence's last sampled token into its cache, for its state only (no logits), as one batched
        forward without the head; False, nothing run, where they do not `batches` (each is then `extend`ed
        alone when it is stored)."""
        if not self.batches(caches):
            return False
        if batched.static_step(tokens, positions, caches) is None:
            batched.step(tokens, positions, caches, self.device, self._groups(shared), logits=False)
        return True

    def _groups(self, shared: Callable[[], Sequence[Shared]]) -> Sequence[Shared]:
        return shared() if self.device.type == "cpu" else ()

    def step(self, batched: BatchedDecode, tokens: Sequence[int], positions: Sequence[int],
             caches: Sequence[DynamicCache], shared: Sequence[Shared], greedy: Sequence[bool]) -> list[Prediction]:
        """One batched decode step (`BatchedDecode.step`) and each row's prediction. Where the CPU decoder
        screens the head for so many greedy rows (`greedy[b]`: row b's token is the argmax), it scores them."""
        screened = self.decoder is not None and self.decoder.screens(greedy)
        out = batched.step(tokens, positions, caches, self.device, shared, hidden=screened)
        if screened:
            assert self.decoder is not None
            return self.decoder.score_rows(out, greedy)
        return [Logits(row) for row in out]

    def wipe_scratch(self) -> None:
        """Zero the native decoder's scratch (it held an ended request's activations)."""
        if self.decoder is not None:
            self.decoder.wipe_scratch()


def choose_forward(model: Any, device: torch.device, dtype: torch.dtype, model_id: str,
                   media: MediaFamily | None = None, remote_experts: bool = False) -> Forward:
    """The backend for a loaded model, logged once with its reason; the library backend's parts are installed
    in `model` first (the native backend builds on them). `media`: a vision-language model's image processor and
    tower; its prompt chunks that hold attachments, or whose positions are not their indices, run the library's
    forward on input embeddings (`media.py`). `remote_experts`: its routed experts run on expert holders
    (`experts.py`)."""
    mamba1.install(model)  # multi-token continuation of Mamba-1 scans from the cached state
    mamba2.install(model)  # short continuations of Mamba-2 mixers skip the padded chunk scan
    if device.type == "cpu":
        transpose_linear_weights(model)
    last_row = LastRow.install(model)
    if last_row is not None and not last_row_agrees(model, last_row):
        log.warning("model %s: its last layer does not reduce to the last position; it runs in full", Safe(model_id))
        last_row = None
    found = load_kernels()
    one_thread_f32 = torch.get_num_threads() == 1 and device.type == "cpu" and dtype == torch.float32
    decode_kernels = found.kernels if one_thread_f32 else None
    decoder, reason = _cpu_decoder(model, found) if device.type == "cpu" else (
        None, f"the model runs on {device.type}")
    forward = Forward("native-cpu" if decoder is not None else "library", reason, model, device, last_row=last_row,
                      decoder=decoder, decode_kernels=decode_kernels, batching=batch_blocker(model), media=media,
                      static=static_blocker(model, device, remote_experts))
    log.info("model %s: %s forward (%s); decode attention %s", Safe(model_id), Safe(forward.backend), Safe(reason),
             Safe(forward.decode_attention))
    return forward


def static_blocker(model: Any, device: torch.device, remote_experts: bool = False) -> str | None:
    """Why `model`'s decode steps on `device` do not run as static steps over the lanes' slabs, replayed as CUDA
    graphs (`static_decode.py`), or None where they do: on CUDA, every layer full attention by SDPA or recurrent,
    the experts (if any) in this process, unless TENZRO_CUDA_GRAPHS=off (the A/B of
    `scripts/device_check.sh`). TENZRO_STATIC_DECODE=on takes the static steps on any device, eagerly off CUDA: how
    the whole node's use of them is tested on a CPU."""
    if os.environ.get("TENZRO_CUDA_GRAPHS", "").lower() == "off":
        return "switched off (TENZRO_CUDA_GRAPHS=off)"
    if device.type != "cuda" and os.environ.get("TENZRO_STATIC_DECODE", "").lower() != "on":
        return f"on {device.type} a decode step attends each row's own cache: graphs are for a GPU's launches"
    if remote_experts:
        return "the routed experts run on expert holders: a step's exchange with them cannot be replayed"
    layers = DynamicCache(config=model.config).layers
    kinds = {type(layer) for layer in layers}
    if kinds - {DynamicLayer, LinearAttentionLayer}:
        names = ", ".join(sorted(kind.__name__ for kind in kinds - {DynamicLayer, LinearAttentionLayer}))
        return f"layers of kind {names} keep state a static step does not hold (only full attention and recurrent)"
    attention = {index for index, layer in enumerate(layers) if type(layer) is DynamicLayer}
    implementations = {getattr(m.config, "_attn_implementation", None) for m in model.modules()
                       if getattr(m, "layer_idx", None) in attention and hasattr(m, "config")}
    if implementations - {"sdpa"}:
        return f"attention by {', '.join(sorted(map(str, implementations - {'sdpa'})))}, not SDPA"
    return None


def available_memory() -> int | None:
    """Bytes the kernel could still hand out (MemAvailable), or None where /proc/meminfo is not there."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cpu_decoder(model: Any, found: KernelsFound) -> tuple[CpuDecoder | None, str]:
    """The kernels' forward where it applies, else None; and why. It needs the kernels (built at install,
    an AVX-512 CPU, not switched off), one torch thread (the kernels are single-threaded), room for its
    packed copy of the weights (at most half of the memory still available), a model class it implements,
    and a short forward that reproduces transformers' own (checked here)."""
    if found.kernels is None:
        return None, found.reason
    threads = torch.get_num_threads()
    if threads != 1:
        return None, f"the native kernels are single-threaded and the node runs {threads} torch threads"
    unsupported = unsupported_reason(model)
    if unsupported is not None:
        return None, unsupported
    weights = sum(m.weight.numel() * 4 for m in model.modules() if hasattr(m, "in_features"))
    head = getattr(model, "lm_head", None)
    weights += 2 * head.weight.numel() if head is not None else 0  # the head's two int8 screens (at most)
    available = available_memory()
    if available is not None and weights > available // 2:
        return None, (f"no room for the packed copy of the weights ({weights >> 20} MiB; "
                      f"{available >> 20} MiB of memory available)")
    decoder = CpuDecoder(model, found.kernels)
    if not decoder.agrees_with_model():
        return None, "the native forward failed its check against transformers' forward at load"
    decoder.lend_panels()  # after the check, which compares the native forward with the library's own
    return decoder, f"{found.reason}, checked against transformers' forward at load"


@torch.inference_mode()
def last_row_agrees(model: Any, last_row: LastRow) -> bool:
    """Whether the forward with `last_row` active gives the plain forward's last logits: one pass, and a chunk
    that continues a cache (its attention mask then covers more keys than queries)."""
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = torch.randint(min(100, vocab - 1), vocab, (1, 29), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    plain = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    with last_row.active():
        whole = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :8], cache=cache, use_cache=True)
        chunk = model(input_ids=ids[:, 8:], cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()
    bound = LAST_ROW_AGREEMENT * max(1.0, float(plain.abs().max()))
    return all(float((got - plain).abs().max()) <= bound for got in (whole, chunk))
