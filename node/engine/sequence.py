"""What the engine runs: a request, its result, `Sequence` (one request while it runs in a lane), and a step's
`StepPlan` (the scheduler's choice) and `StepOutcome` (what the model runner made of it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from cache.adapters import Snapshot
from cache.arena import Scope
from cache.opening import Opening
from cache.scope import SharedPrefix
from cache.ttl import AUTOMATIC, TtlClass, WritePlan
from node.engine.detokenizer import Detokenizer
from node.engine.media import PromptMedia, SequenceMedia
from node.engine.prediction import Prediction
from node.engine.sampling import Sampler, SamplingParams


@dataclass(frozen=True, slots=True)
class PrefixForms:
    """What a routing summary may say of a request (`cache/summary.py`): the forms of its prompt's prefixes that
    end on a message boundary (or its whole text prompt), each at its token position, and how to form the chat
    continued by the reply (None for a text completion). SHA-256 digests of prompt content: memory only."""

    at: tuple[tuple[int, bytes], ...] = ()
    reply: Callable[[str], bytes] | None = None


NO_FORMS = PrefixForms()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    scope: Scope
    prompt: list[int]
    params: SamplingParams
    boundaries: tuple[int, ...] = ()
    """Token positions where messages of the rendered chat template start (snapshot candidates)."""
    retain: bool = True
    """Keep this request's state for reuse; False: nothing of it is stored or left hot after the reply."""
    forms: PrefixForms = NO_FORMS
    """Remembered with the stored state (when it is kept), for the caller's router's summaries."""
    media: PromptMedia | None = None
    """The prompt's attachments (`media.py`); None for a text prompt."""
    write: WritePlan = AUTOMATIC
    """What of it is stored (when it is kept) and for how long: its time-to-live class, or Anthropic's breakpoints
    (only the prompt up to the last is stored; the rest and the reply are not)."""
    shared: SharedPrefix | None = None
    """The prompt's prefix its caller's trust group shares (resumed from and stored in the group's scope); None:
    everything is the caller's own."""
    stamp: int | None = None
    """The node's shred clock when the request was accepted (`cache/shred_clock.py`): nothing of it is stored in a
    scope shredded since, though it was queued or running then. None: stamped when it starts (`ModelRunner.start`)."""

    @property
    def keys(self) -> list[int]:
        """What the prefix index matches the prompt by: its ids, with each attachment's placeholders keyed by the
        attachment (`PromptMedia.keys`)."""
        return self.prompt if self.media is None else self.media.keys

    @property
    def shift(self) -> int:
        """Added to a position after the prompt to give its position id (`PromptMedia.delta`)."""
        return 0 if self.media is None else self.media.delta


@dataclass(frozen=True, slots=True)
class GenerationResult:
    prompt_tokens: int
    cached_read_tokens: int
    """Prompt tokens restored from stored state, or copied from a running request of the same caller, instead
    of computed."""
    cached_write_tokens: int
    """Prompt tokens computed by this request and now held for reuse."""
    output_ids: list[int]
    text: str
    finish_reason: str
    """"stop" (end of sequence or a stop string), "length" (max_tokens) or "cancelled"."""
    queue_wait_s: float
    ttft_s: float
    retained: bool = True
    """The request's state was kept for reuse (False: retention none, nothing stored)."""
    matched_tokens: int = 0
    """Prompt tokens that agreed with this scope's stored tokens (at most all but one): what a node able to
    resume at any token would have reused. `cached_read_tokens` falls short of it only between snapshots."""
    attachments_encoded: int = 0
    """Attachments of the prompt whose encoder ran for this request."""
    attachments_reused: int = 0
    """Attachments of the prompt not encoded: their positions restored with the prefix, or their encoding found in
    the caller's encoding cache."""
    encode_s: float = 0.0
    """Seconds the encoder ran for this request (part of its time to first token)."""
    cached_write_1h_tokens: int = 0
    cached_write_24h_tokens: int = 0
    """Of `cached_write_tokens`, those written under the `1h` and `24h` classes (`cache/ttl.py`), each priced
    apart; the rest are of the default or `5m` class."""
    stop_sequence: str | None = None
    """The stop string that ended the reply (its `finish_reason` "stop"); None when another reason ended it."""


@dataclass(eq=False)
class Sequence:
    """One request while it runs: its ids (prompt and reply so far), how far its prompt is computed, its lane, and
    handles of its state (the lane's working cache, snapshots, state opened elsewhere); the model itself is the
    runner's `Forward`, and what outlives the request is the `ReuseManager`'s."""

    request: GenerationRequest
    emit: Callable[[str], Any]
    cancelled: Callable[[], bool]
    queue_wait_s: float
    lane: int
    started: float
    cache: DynamicCache
    restored: int
    """Prompt tokens restored from stored state, or copied from `donor`, instead of computed."""
    matched: int
    stops: list[int]
    """Where the prefill's chunks end, in order: every snapshot position and every `prefill_chunk` tokens."""
    wanted: frozenset[int]
    """Positions to snapshot the state at."""
    sampler: Sampler
    detok: Detokenizer
    scratch: list[torch.Tensor] = field(default_factory=list)
    """State opened for this sequence outside its lane's buffers; zeroed when it ends."""
    position: int = 0
    """Prompt tokens in the cache."""
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    prediction: Prediction | None = None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """None while it runs; then "stop", "length" or "cancelled"."""
    ttft: float = 0.0
    discard: bool = False
    """Its state may be part written, or did not open: nothing of it is stored (nor, by another rule, in a scope
    shredded since it was accepted: `ReuseManager.shredded`)."""
    fed: bool = False
    """Its last sampled token has run (`ModelRunner.feed_last`): `finish` stores the state as it is."""
    opening: Opening | None = None
    """Sealed rows of its restore still opening (`cache/opening.py`): its first chunk's forward reads them as
    they open, and `ModelRunner.prefill` finishes them after it."""
    donor: tuple[Sequence, int] | None = None
    """(request, n): a running request of the same caller whose prompt agrees with this one's for n tokens, and
    which computes them ahead of this one; this one copies its rows instead of computing them
    (`ReuseManager.follow`)."""
    media: SequenceMedia | None = None
    """Its prompt's attachments and the encodings its prefill reads (None for a text prompt)."""
    encoded: int = 0
    """Attachments encoded for it (the rest were restored with the prefix, or found encoded)."""
    encode_s: float = 0.0
    """Seconds its attachments' encoding took, before its first chunk."""
    written: dict[TtlClass, int] = field(default_factory=dict)
    """Prompt tokens it newly stored, by time-to-live class (`ReuseManager.end`)."""

    @property
    def prefilling(self) -> bool:
        return self.position < len(self.request.prompt)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step of the running sequences, as the scheduler planned it; `ModelRunner.run` executes it in this
    order."""

    follow: tuple[Sequence, ...] = ()
    """Sequences whose prompt a running request of their caller computes: they copy its rows first
    (`ReuseManager.follow`), and run no chunk this step."""
    prefill: tuple[Sequence, ...] = ()
    """One prompt chunk per entry, in this order; a sequence appears once for each chunk it runs."""
    decode: tuple[Sequence, ...] = ()
    """One decode step each, batched where the model allows; a sequence whose prompt this step's chunks complete
    is listed too, and decodes in the same step."""
    retire: tuple[Sequence, ...] = ()
    """Sequences that ended before the step (cancelled while waiting for their prompt). They leave after it, with
    every planned sequence that ended in it."""


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a step did: each ended sequence with its result, each failed one with its error (it left its lane,
    nothing of it stored); `trouble`, an error of the step's housekeeping that failed no request."""

    finished: tuple[tuple[Sequence, GenerationResult], ...] = ()
    failed: tuple[tuple[Sequence, Exception], ...] = ()
    trouble: Exception | None = None
