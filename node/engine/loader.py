"""Loading a local Hugging Face causal LM directory (or the embedded default) for serving."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from cache.adapters import ModelStateAdapter
from cache.state_spec import UnsupportedLayerKindError, model_state_specs
from node.engine import mamba1, mamba2
from node.engine.chat_template import max_token_bytes, message_tokens
from node.engine.cpu_decoder import CpuDecoder, unsupported_reason
from node.engine.cpu_kernels import load_kernels
from node.engine.cpu_layout import transpose_linear_weights
from node.engine.last_row import LastRow
from node.engine.prediction import Logits, Prediction
from node.engine.reuse_check import check_reuse
from node.engine.synthetic import ARCHITECTURES, ensure_default_model
from node.log_privacy import Safe

if TYPE_CHECKING:
    from node.engine.batch_forward import BatchedDecode, Shared

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"


class ModelLoadError(Exception):
    """The model directory cannot be served; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class ForwardPath:
    """Which forward runs a model's short chunks and decode steps, and why: logged at start and reported by
    `GET /v1/node` and `/metrics`."""

    name: str
    """"native" (the CPU kernels, `cpu_decoder.py`) or "transformers"."""
    reason: str


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model_id: str
    path: Path
    model: Any
    tokenizer: Any
    context_length: int
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    max_token_bytes: int
    """The most bytes of text one token stands for (`chat_template.max_token_bytes`)."""
    message_tokens: int
    """The fewest tokens the chat template writes for each message after the first (`chat_template.message_tokens`;
    0 without a template)."""
    state: ModelStateAdapter | None
    """How to cut and restore this model's state; None when some layer kind is not supported yet."""
    reuse_blocker: str | None
    decoder: CpuDecoder | None = None
    """The CPU kernels' forward for short chunks, where the model has one and the node runs on one thread."""
    last_row: LastRow | None = None
    """Hooks that compute transformers' last layer for the last position only (`last_row.py`)."""
    forward_path: ForwardPath = ForwardPath("transformers", "not loaded by load_model")

    def forward(self, ids: list[int], start: int, cache: DynamicCache) -> Prediction:
        """Run `ids` at positions `[start, start + len)` into `cache`; returns the last position's prediction
        (logits `[vocab]` in float32 on demand)."""
        if self.decoder is not None and self.decoder.takes(len(ids), cache):
            return self.decoder.forward(ids, start, cache)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        with self.last_row.active() if self.last_row is not None and len(ids) > 1 else nullcontext():
            out = self.model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True,
                             logits_to_keep=1)
        return Logits(out.logits[0, -1].float())

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

    def extend(self, ids: list[int], start: int, cache: DynamicCache) -> None:
        """Run `ids` into `cache` when no logits are wanted (the reply's last token, fed for its state)."""
        if self.decoder is not None and self.decoder.takes(len(ids), cache):
            self.decoder.extend(ids, start, cache)
        else:
            self.forward(ids, start, cache)


def resolve_model_dir(spec: str, home: Path) -> tuple[str, Path]:
    """(model id, directory) for `--model default|ARCH|DIR`.

    `default` is the embedded dense model; an architecture name of `tenzro models init` that is not an
    existing path is that architecture's generated model at default size. Both are built on first use.
    """
    if spec == DEFAULT_MODEL:
        return DEFAULT_MODEL, ensure_default_model(home / "models")
    path = Path(spec).expanduser()
    if spec in ARCHITECTURES and not path.exists():
        return spec, ensure_default_model(home / "models", arch=spec)
    path = path.resolve()
    return path.name, path


def _check_model_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory; pass --model default or a local model directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory: it has no config.json")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelLoadError(f"{path} has no weights (*.safetensors or *.bin)")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json)")


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _available_memory() -> int | None:
    """Bytes the kernel could still hand out (MemAvailable), or None where /proc/meminfo is not there."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cpu_decoder(model: Any) -> tuple[CpuDecoder | None, str]:
    """The kernels' forward where it applies, else None; and why. It needs the kernels (built at install,
    an AVX-512 CPU, not switched off), one torch thread (the kernels are single-threaded), room for its
    packed copy of the weights (at most half of the memory still available), a model class it implements,
    and a short forward that reproduces transformers' own (checked here)."""
    found = load_kernels()
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
    available = _available_memory()
    if available is not None and weights > available // 2:
        return None, (f"no room for the packed copy of the weights ({weights >> 20} MiB; "
                      f"{available >> 20} MiB of memory available)")
    decoder = CpuDecoder(model, found.kernels)
    if not decoder.agrees_with_model():
        return None, "the native forward failed its check against transformers' forward at load"
    return decoder, f"{found.reason}, checked against transformers' forward at load"


LAST_ROW_AGREEMENT = 1e-4
"""Largest |difference| from the plain forward's logits, relative to the largest |logit| (float32 sums in
another order differ by about 1e-6)."""


@torch.inference_mode()
def _last_row_agrees(model: Any, last_row: LastRow) -> bool:
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


def load_model(model_id: str, path: Path, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    _check_model_dir(path)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if target.type == "cuda" else torch.float32)
    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        model = model.to(device=target).eval()  # type: ignore[call-arg]
        mamba1.install(model)  # multi-token continuation of Mamba-1 scans from the cached state
        mamba2.install(model)  # short continuations of Mamba-2 mixers skip the padded chunk scan
        if target.type == "cpu":
            transpose_linear_weights(model)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the model in {path}: {exc}") from exc
    last_row = LastRow.install(model)
    if last_row is not None and not _last_row_agrees(model, last_row):
        log.warning("model %s: its last layer does not reduce to the last position; it runs in full", Safe(model_id))
        last_row = None
    decoder, why = _cpu_decoder(model) if target.type == "cpu" else (None, f"the model runs on {target.type}")
    path_taken = ForwardPath("native" if decoder is not None else "transformers", why)
    log.info("model %s: %s forward (%s)", Safe(model_id), Safe(path_taken.name), Safe(why))
    text_config = config.get_text_config(decoder=True)
    context = int(getattr(text_config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    state: ModelStateAdapter | None = None
    blocker: str | None = None
    try:
        state = ModelStateAdapter(model_state_specs(model.config), model.config)
    except UnsupportedLayerKindError as exc:
        blocker = str(exc)
    loaded = LoadedModel(model_id=model_id, path=path, model=model, tokenizer=tokenizer, context_length=context,
                         device=target, dtype=torch_dtype, eos_token_ids=_eos_ids(model, tokenizer),
                         max_token_bytes=max_token_bytes(tokenizer), state=state,
                         message_tokens=message_tokens(tokenizer) if getattr(tokenizer, "chat_template", None) else 0,
                         reuse_blocker=blocker, decoder=decoder, forward_path=path_taken, last_row=last_row)
    if state is not None:
        check = check_reuse(loaded.forward, state, int(text_config.vocab_size), torch_dtype)
        if not check.passed:
            state, blocker = None, (f"resuming from stored state differs from one pass by "
                                    f"{check.relative_difference:.2e} of the largest logit")
    if blocker:
        log.warning("model %s is served without reuse: %s", Safe(model_id), Safe(blocker))
    return dataclasses.replace(loaded, state=state, reuse_blocker=blocker)
