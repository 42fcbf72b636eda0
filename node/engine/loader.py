"""Loading a local Hugging Face causal LM directory (or the embedded default) for serving."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoProcessor,
    AutoTokenizer,
)

from cache.adapters import ModelStateAdapter
from cache.state_spec import UnsupportedLayerKindError, model_state_specs
from node.engine import qwen2_vl_processor  # noqa: F401 - registers Qwen2-VL's image-only processor
from node.engine.chat_template import max_token_bytes, message_tokens
from node.engine.experts import ExpertsError, ExpertSplit, ExpertsTopology
from node.engine.forward import Forward, choose_forward
from node.engine.media import AUDIO, IMAGE, MediaFamily, MediaUnsupported, media_kind
from node.engine.reuse_check import check_reuse
from node.engine.synthetic import ARCHITECTURES, ensure_default_model
from node.log_privacy import Safe

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"

AUTO_CLASSES = {IMAGE.name: AutoModelForImageTextToText, AUDIO.name: AutoModelForSeq2SeqLM}
"""The transformers class that loads a model taking each kind of attachment. Audio's is the one transformers files
its speech-and-text-in, text-out models under, decoder-only ones (Audio Flamingo 3, Qwen2-Audio) included."""


class ModelLoadError(Exception):
    """The model directory cannot be served; the message says what is missing."""


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
    forward: Forward
    """The one forward the engine runs this model through, and why (`forward.py`)."""
    media: MediaFamily | None = None
    """How the model takes image or audio attachments (`media.py`); None for a text model, or where they cannot be taken
    (`media_blocker` says why)."""
    media_blocker: str | None = None
    experts: ExpertSplit | None = None
    """Where the routed experts run on expert holders (`experts.py`); None when they run here."""


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


def load_model(model_id: str, path: Path, device: str | None = None, dtype: str | None = None,
               experts: ExpertsTopology | None = None) -> LoadedModel:
    _check_model_dir(path)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if target.type == "cuda" else torch.float32)
    media: MediaFamily | None = None
    media_blocker: str | None = None
    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        kind = media_kind(config)
        auto = AUTO_CLASSES[kind.name] if kind is not None else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=torch_dtype)
        model = model.to(device=target).eval()  # type: ignore[call-arg]
        if kind is not None:
            try:
                media = MediaFamily(model, AutoProcessor.from_pretrained(path), tokenizer, kind)
            except (MediaUnsupported, OSError, ValueError) as exc:
                media_blocker = str(exc)
                log.warning("model %s takes no %s: %s", Safe(model_id), Safe(kind.name), Safe(media_blocker))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the model in {path}: {exc}") from exc
    try:
        split = None if experts is None else ExpertSplit.start(model, torch_dtype, experts)
    except ExpertsError as exc:
        raise ModelLoadError(str(exc)) from exc
    forward = choose_forward(model, target, torch_dtype, model_id, media, remote_experts=split is not None)
    text_config = config.get_text_config(decoder=True)
    context = int(getattr(text_config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    state: ModelStateAdapter | None = None
    blocker: str | None = None
    try:
        state = ModelStateAdapter(model_state_specs(model.config), model.config)
    except UnsupportedLayerKindError as exc:
        blocker = str(exc)
    if state is not None:
        check = check_reuse(forward.prefill, state, int(text_config.vocab_size), torch_dtype)
        if not check.passed:
            state, blocker = None, (f"resuming from stored state differs from one pass by "
                                    f"{check.relative_difference:.2e} of the largest logit")
    if blocker:
        log.warning("model %s is served without reuse: %s", Safe(model_id), Safe(blocker))
    return LoadedModel(model_id=model_id, path=path, model=model, tokenizer=tokenizer, context_length=context,
                       device=target, dtype=torch_dtype, eos_token_ids=_eos_ids(model, tokenizer),
                       max_token_bytes=max_token_bytes(tokenizer), state=state,
                       message_tokens=message_tokens(tokenizer) if getattr(tokenizer, "chat_template", None) else 0,
                       reuse_blocker=blocker, forward=forward, media=media, media_blocker=media_blocker,
                       experts=split)
