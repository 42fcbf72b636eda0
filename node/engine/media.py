"""Attachments in a prompt: where their positions lie, the model inputs they become, and how a prompt chunk that
holds them runs.

A vision-language model reads an image as a run of placeholder tokens whose input embeddings are the image's
encoding (the vision tower's output, projected) instead of the token's embedding; an audio-language model reads
audio the same way (the audio encoder's frames, pooled and projected). The node keeps to that and to nothing
model-specific beyond it, using each family's own processor and tower (`MediaFamily`, of one `MediaKind`):

    expand      the processor turns what the chat template writes for one attachment (`MediaFamily.part`) and the
                attachment into its token ids (the placeholders, with any markup the processor adds around them)
                and the encoder's inputs (pixels and grid sizes; mel features and their mask);
    encode      the model's own `get_image_features` or `get_audio_features` (tower and projection): one row per
                placeholder;
    prefill     a chunk holding placeholder positions runs on input embeddings, the token embeddings with the
                encoding's rows in the placeholders' places (what the model's own forward does with
                `masked_scatter`), so that a chunk may hold part of an attachment and a restored prefix may end
                inside one.

Reuse. In the prefix index a placeholder position is keyed by its attachment, not by the placeholder id that
every image shares (`PromptMedia.keys`): an id of 2^63 or more (no token id is that large) drawn from the
attachment's SHA-256, a different 63-bit word of it at each of four positions in turn, so that the whole digest
is compared. Two prompts with different images at one place diverge at the image's first position; a prompt that
repeats an earlier one's image resumes past it. The keys go through the scope's keyed token digests like any
token id (`cache/token_digest.py`): no digest is kept in the clear.

Family differences, each decided here:

    Qwen2-VL    multimodal rotary positions: an image's positions are its rows and columns, and text after it
                continues from the largest, so a token's rotary position is its index plus a delta. The positions
                of the whole prompt are computed once per request from its ids and images by the model's own
                `get_rope_index` (a pure function; the model's `rope_deltas` attribute is never set, so nothing of
                one request is left on the shared model), and every chunk and decode step passes its position ids.
                The positions are a function of the prompt's prefix, so state stored by one request continues
                under the next request's positions exactly.
    Gemma3      an image's placeholders attend to each other both ways: a chunk never ends inside an image, and
                no resume point (restored prefix, snapshot) falls inside one (`PromptMedia.whole`).
    Llava       neither; nor the audio models (Audio Flamingo 3), whose frames attend causally in the text model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from node.attachments import AUDIO_RATE

MEDIA_KEY = 1 << 63
"""Keys of attachment positions in the prefix index are at least this (`PromptMedia.keys`)."""
KEY_WORDS = 4
"""63-bit words of the 32-byte digest the key of a position takes in turn."""

MROPE_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""Families whose positions are multimodal rotary (`get_rope_index`)."""
BIDIRECTIONAL_TYPES = frozenset({"gemma3"})
"""Families whose image placeholders attend to each other both ways (`token_type_ids`)."""
_NOT_ENCODER_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


class MediaUnsupported(Exception):
    """The model cannot take attachments here; the message says why."""


@dataclass(frozen=True, slots=True)
class MediaKind:
    """What differs between images and audio, as transformers' models and processors name it."""

    name: str
    """The attachment records' `kind` (`node.attachments`): "image" or "audio"."""
    config: str
    """The model config's sub-config of the kind's encoder: a model with it takes the kind."""
    tokens: tuple[str, ...]
    """Config attributes that may name the placeholder token's id, in the order tried."""
    component: str
    """The processor's attribute holding the kind's own processor."""
    argument: str
    """The processor's keyword for the attachments."""
    features: str
    """The model's method from encoder inputs to one row per placeholder."""
    sampling_rate: int | None = None
    """The rate the intake brings audio to (`attachments.AUDIO_RATE`): the processor is told it, and a model whose
    extractor reads another is refused; None for images."""


IMAGE = MediaKind("image", "vision_config", ("image_token_id", "image_token_index"), "image_processor", "images",
                  "get_image_features")
AUDIO = MediaKind("audio", "audio_config", ("audio_token_id", "audio_token_index"), "feature_extractor", "audio",
                  "get_audio_features", AUDIO_RATE)
KINDS = (IMAGE, AUDIO)


def media_kind(config: Any) -> MediaKind | None:
    """The kind of attachment a model of `config` takes, by its encoder's sub-config; None for a text model."""
    return next((kind for kind in KINDS if getattr(config, kind.config, None) is not None), None)


@dataclass(frozen=True, slots=True)
class Expanded:
    """One attachment as the model reads it: its ids (placeholders and the processor's markup around them), where
    the placeholders lie among them, and the encoder's inputs."""

    ids: list[int]
    start: int
    """Index in `ids` of the first placeholder; the placeholders are `ids[start:start + rows]`."""
    rows: int
    inputs: dict[str, torch.Tensor] = field(repr=False)


@dataclass(frozen=True, slots=True)
class Attachment:
    """One attachment placed in a prompt: its placeholder positions `[start, end)`, the encoder's inputs, and the
    SHA-256 of its bytes (memory only: it keys the scope's encoding cache and the prefix index's positions)."""

    kind: str
    """"image" or "audio" (`MediaKind.name`)."""
    start: int
    end: int
    inputs: dict[str, torch.Tensor] = field(repr=False)
    digest: bytes = field(repr=False)

    def key(self, offset: int) -> int:
        """The prefix index's id for the placeholder `offset` positions into the attachment."""
        word = offset % KEY_WORDS
        return MEDIA_KEY | (int.from_bytes(self.digest[8 * word:8 * word + 8], "big") >> 1)


@dataclass(frozen=True, slots=True)
class PromptMedia:
    """The attachments of one prompt, in order, and what the whole prompt needs of them."""

    items: tuple[Attachment, ...]
    keys: list[int] = field(repr=False)
    """The prompt's ids with each placeholder replaced by its attachment's key: what the prefix index matches."""
    positions: torch.Tensor | None = field(default=None, repr=False)
    """`[3, len(prompt)]` multimodal rotary position ids (Qwen2-VL), else None (a position is its index)."""
    delta: int = 0
    """Added to a position after the prompt to give its rotary position (Qwen2-VL: the prompt's images take fewer
    positions than tokens); 0 elsewhere."""
    whole: bool = False
    """No chunk ends and no resume point falls inside an attachment (its placeholders attend both ways)."""

    def touches(self, start: int, end: int) -> list[Attachment]:
        """The attachments with placeholders in `[start, end)`."""
        return [item for item in self.items if item.start < end and start < item.end]

    def inside(self, position: int) -> Attachment | None:
        """The attachment that `position` falls strictly inside, when attachments are `whole`; else None."""
        if not self.whole:
            return None
        return next((item for item in self.items if item.start < position < item.end), None)

    def resume_limit(self, position: int) -> int:
        """`position`, or the start of the attachment it would fall inside."""
        inside = self.inside(position)
        return position if inside is None else inside.start

    def chunk_stops(self, stops: Iterable[int]) -> list[int]:
        """Chunk ends and snapshot positions with those inside a `whole` attachment moved to its end."""
        moved = set()
        for stop in stops:
            inside = self.inside(stop)
            moved.add(stop if inside is None else inside.end)
        return sorted(moved)


def _ids(output: Any) -> list[int]:
    return [int(i) for i in output["input_ids"][0].tolist()]


class MediaFamily:
    """How one loaded vision- or audio-language model takes its kind of attachment: its processor, its tower, its
    positions and masks."""

    def __init__(self, model: Any, processor: Any, tokenizer: Any, kind: MediaKind = IMAGE) -> None:
        config = model.config
        self.model = model
        self.processor = processor
        self.kind = kind
        self.model_type = str(config.model_type)
        token = next((getattr(config, name) for name in kind.tokens if getattr(config, name, None) is not None), None)
        component = getattr(processor, kind.component, None)
        if token is None or component is None or not hasattr(model, kind.features):
            raise MediaUnsupported(f"{type(model).__name__} names no {kind.name} token, has no {kind.features}, or "
                                   f"its processor no {kind.component}")
        self.options: dict[str, Any] = {}
        """The processor's keywords beside the attachment: audio's sampling rate."""
        if kind.sampling_rate is not None:
            if int(component.sampling_rate) != kind.sampling_rate:
                raise MediaUnsupported(f"{type(component).__name__} reads audio at {component.sampling_rate} Hz; the "
                                       f"node brings audio to {kind.sampling_rate} Hz and resamples nothing else")
            self.options["sampling_rate"] = kind.sampling_rate
        self.placeholder = int(token)
        self.part = template_part(tokenizer, kind)
        self.hidden = int(config.get_text_config(decoder=True).hidden_size)
        self.mrope = self.model_type in MROPE_TYPES
        self.whole = self.model_type in BIDIRECTIONAL_TYPES
        self.encoder = f"{self.model_type}:{kind.name}:{type(component).__name__}"
        """The encoder's identity, part of an encoding's cache key (the model id is the scope's already); the kind is
        in it so that one model's image and audio encodings never share a key."""

    def expand(self, content: Any) -> Expanded:
        """The ids and encoder inputs of an attachment of this family's kind where the template wrote `part`;
        `content`: what the processor reads of it (`MediaAttachment.content`)."""
        out = self.processor(text=[self.part], **{self.kind.argument: [content]}, **self.options, return_tensors="pt",
                             add_special_tokens=False)
        ids = _ids(out)
        rows = [index for index, token in enumerate(ids) if token == self.placeholder]
        if not rows:
            raise MediaUnsupported(f"the model's processor makes no {self.kind.name} tokens of it (too short?)")
        if rows != list(range(rows[0], rows[0] + len(rows))):
            raise MediaUnsupported(f"{type(self.processor).__name__} does not write {self.kind.name} as one run of "
                                   "placeholders")
        inputs = {name: value for name, value in out.items()
                  if name not in _NOT_ENCODER_INPUTS and isinstance(value, torch.Tensor)}
        return Expanded(ids, rows[0], len(rows), inputs)

    @torch.inference_mode()
    def encode(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model's own features for one attachment's `inputs`: `[placeholders, hidden]`."""
        device, dtype = self.model.device, self.model.dtype
        moved = {name: value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
                 for name, value in inputs.items()}
        out = getattr(self.model, self.kind.features)(**moved, return_dict=True)
        features = getattr(out, "pooler_output", out)
        if isinstance(features, list | tuple):
            features = torch.cat([f.reshape(-1, self.hidden) for f in features])
        return features.reshape(-1, self.hidden)

    def prompt_media(self, ids: list[int], placed: Sequence[tuple[int, Expanded, bytes]]) -> PromptMedia:
        """The media of a prompt `ids` holding each `(offset, expanded, digest)`'s ids at `offset`."""
        items = tuple(Attachment(self.kind.name, offset + exp.start, offset + exp.start + exp.rows, exp.inputs, digest)
                      for offset, exp, digest in placed)
        keys = list(ids)
        for item in items:
            for position in range(item.start, item.end):
                keys[position] = item.key(position - item.start)
        positions, delta = None, 0
        if self.mrope and items:
            positions, delta = self._rope(ids, items)
        return PromptMedia(items, keys, positions, delta, self.whole)

    def _rope(self, ids: list[int], items: Sequence[Attachment]) -> tuple[torch.Tensor, int]:
        """Qwen2-VL's position ids of the whole prompt and the delta after it, from the model's `get_rope_index`
        (which reads the model's config only)."""
        input_ids = torch.tensor([ids], dtype=torch.long)
        types = torch.zeros_like(input_ids, dtype=torch.int)
        for item in items:
            types[0, item.start:item.end] = 1
        grids = torch.cat([item.inputs["image_grid_thw"] for item in items])
        positions, deltas = self.model.model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grids)
        return positions[:, 0].clone(), int(deltas.reshape(-1)[0])


@dataclass(slots=True)
class SequenceMedia:
    """A running request's media: its prompt's, and the encodings of those attachments its prefill computes (keyed
    by index in `media.items`); the encodings are the caller's plaintext, zeroed when the request leaves."""

    media: PromptMedia
    encodings: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def inputs(self, model: Any, ids: list[int], start: int) -> dict[str, Any]:
        """The model's keyword inputs for the chunk `ids` at `start` (instead of `input_ids` and `position_ids`):
        embeddings with the encodings' rows in the placeholders' places, positions, and the image blocks' token
        types where they attend both ways."""
        end = start + len(ids)
        device = model.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        touched = [index for index, item in enumerate(self.media.items) if item.start < end and start < item.end]
        kwargs: dict[str, Any] = {}
        if touched:
            embeds = model.get_input_embeddings()(input_ids)
            for index in touched:
                item = self.media.items[index]
                first, last = max(start, item.start), min(end, item.end)
                rows = self.encodings[index][first - item.start:last - item.start]
                embeds[0, first - start:last - start] = rows.to(device=device, dtype=embeds.dtype)
            kwargs["inputs_embeds"] = embeds
            if self.media.whole:
                # The model's block mask reads token types by position from the sequence's start.
                types = torch.zeros((1, end), dtype=torch.long, device=device)
                for item in self.media.items:
                    types[0, item.start:min(item.end, end)] = 1
                kwargs["token_type_ids"] = types
        else:
            kwargs["input_ids"] = input_ids
        if self.media.positions is not None:
            kwargs["position_ids"] = self.media.positions[:, start:end].unsqueeze(1).to(device)
        else:
            kwargs["position_ids"] = torch.arange(start, end, device=device).unsqueeze(0)
        return kwargs

    def wipe(self) -> None:
        for tensor in self.encodings.values():
            tensor.zero_()
        self.encodings.clear()


def template_part(tokenizer: Any, kind: MediaKind) -> str:
    """What the chat template writes for one part of `kind` in a message (`{"type": "image"}` or `"audio"`, as
    transformers' templates take them): rendered between two random text parts."""
    before, after = "tz" + "a" * 8, "tz" + "b" * 8
    messages = [{"role": "user", "content": [{"type": "text", "text": before}, {"type": kind.name},
                                             {"type": "text", "text": after}]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001 - templates raise whatever jinja raises
        raise MediaUnsupported(f"the chat template takes no {kind.name} parts ({type(exc).__name__})") from exc
    head, found, tail = text.partition(before)
    part, found_after, _ = tail.partition(after)
    if not found or not found_after or not part:
        raise MediaUnsupported(f"the chat template writes nothing for an {kind.name} part")
    return part

