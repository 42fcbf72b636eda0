"""One served model: its loaded weights, runner and scheduler, and turning API requests into jobs.

The HTTP layer asks the service, never the runner's or the reuse manager's internals: what the node says of its
engine and sealing, its stored state's sizes and a router's warm prefixes, and a removed caller's state dropped.

Rendering and tokenizing grow with a request's size, so the HTTP layer runs them off the event loop; before
either, a prompt whose text alone cannot fit the context is refused: no token of this tokenizer stands for
more than `LoadedModel.max_token_bytes` bytes, so B bytes of text are at least B / max_token_bytes tokens.

For a caller reached through a router the prompt's prefix forms (`cache/summary.py`) are formed in the same
step: a chat's at each message boundary the renderer reports, a text completion's whole prompt at its end; the
runner remembers them with the stored state for the router's summaries. Other callers' requests form none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from attestation.nvml_cc import NvmlLoader, load_pynvml
from cache.arena import Scope, StateArena
from cache.device_copy import HostCopies
from cache.encodings import EncodingCounts
from cache.prefix_cache import NOTHING_HELD, Holdings, Lookups, PrefixCache
from cache.scope import SharedPrefix, group_scope
from cache.snapshot_policy import SnapshotPolicy
from cache.summary import ChatForms, completion_prefix_form
from cache.ttl import AUTOMATIC, WritePlan
from node.config import Limits
from node.engine.chat_template import BOUNDARY_MESSAGES, ChatTemplateError, RenderedChat, image_marker, render_chat
from node.engine.device import DevicePlan, FreeMemory, host_copy_mode, lane_bytes, plan_device, prefill_chunk
from node.engine.loader import LoadedModel
from node.engine.media import MediaUnsupported, PromptMedia
from node.engine.runner import NO_FORMS, GenerationRequest, ModelRunner, PrefixForms
from node.engine.sampling import SamplingParams
from node.engine.scheduler import Scheduler
from node.errors import invalid_request
from node.openai_schema import CommonParams, Message


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the engine takes it: ids and message boundaries, its prefix forms, and its
    attachments."""

    rendered: RenderedChat
    forms: PrefixForms = NO_FORMS
    media: PromptMedia | None = None
    write: WritePlan = AUTOMATIC
    """What its request stores and for how long (Anthropic's breakpoints, `anthropic_schema.write_plan`)."""

    @property
    def ids(self) -> list[int]:
        return self.rendered.ids


def chat_forms(messages: list[dict[str, str]], rendered: RenderedChat) -> PrefixForms:
    """The forms of `messages`' prefixes at the boundaries `render_chat` reports, and of the chat continued by a
    reply. The renderer tries where each of the last BOUNDARY_MESSAGES messages ends, in order; when it reports
    one boundary for each, they are those ends in order. When it reports fewer (an end fell inside a token, or
    the template is not stable under prefixes), which message ends where is unknown: no boundary is claimed."""
    chat = ChatForms()
    forms = [chat.add(message) for message in messages]
    counts = range(max(1, len(messages) - BOUNDARY_MESSAGES + 1), len(messages) + 1)
    at = (tuple((position, forms[count - 1]) for position, count in zip(rendered.boundaries, counts, strict=True))
          if len(rendered.boundaries) == len(counts) else ())
    return PrefixForms(at, chat.reply_form)


@dataclass(frozen=True, slots=True)
class ScopeState:
    """What the node keeps for one scope, as its own caller may see it (`GET /v1/cache`): counts and sizes only."""

    held: Holdings
    replies: int
    """Replies remembered to recognise when the caller sends them back (`cache/replies.py`)."""
    lookups: Lookups
    encodings: EncodingCounts
    """Attachment encodings held (`cache/encodings.py`)."""


@dataclass(frozen=True, slots=True)
class ModelService:
    loaded: LoadedModel
    runner: ModelRunner
    scheduler: Scheduler
    device: DevicePlan
    """Where stored state lives and how it is copied to and from the host (`GET /v1/node`'s `device`)."""

    @classmethod
    def create(cls, loaded: LoadedModel, prefix_cache: PrefixCache | None, limits: Limits,
               policy: SnapshotPolicy | None = None, device_bytes: int | None = None,
               free_memory: FreeMemory | None = None, nvml: NvmlLoader = load_pynvml) -> ModelService:
        """The runner, its lanes reserved, then the device planned in what memory is left (`plan_device`:
        `device_bytes` is `cache.device_bytes`; `free_memory`, `nvml` are fakes in tests) and given to the arena:
        its hot tier's budget and how sealing stages the state on the host."""
        chunk = prefill_chunk(loaded.device, limits.prefill_chunk)
        copies = host_copy_mode(loaded.device, nvml)
        if prefix_cache is not None:
            # Before the runner: its load-time seal-cost probe stages state through the host as the node will.
            assert isinstance(prefix_cache.arena, StateArena)
            prefix_cache.arena.host_copies = HostCopies(pinned=copies[0] == "pinned")
        runner = ModelRunner(loaded, prefix_cache, prefill_chunk=chunk, policy=policy)
        runner.reserve_lanes(limits.max_running, lane_bytes(loaded.device, limits.lane_bytes, free_memory))
        arena = runner.reuse.arena  # None with reuse off: no stored state, so no hot tier
        plan = plan_device(loaded.device, device_bytes if arena is not None else 0,
                           arena.plaintext_bytes if arena is not None else 0, free_memory, nvml, copies,
                           prefix_cache.budget.node_bytes if prefix_cache is not None else None)
        if arena is not None:
            arena.plaintext_bytes = plan.hot_bytes
            arena.host_copies = plan.host_copies
        if runner.reuse.encodings is not None:
            runner.reuse.encodings.host_copies = plan.host_copies
        return cls(loaded, runner, Scheduler(runner, limits.max_queue, limits.max_running), plan)

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    @property
    def reuse_enabled(self) -> bool:
        return self.runner.reuse.enabled

    @property
    def arena(self) -> StateArena | None:
        """The stored state's tiers, whose sizes `/metrics` reads (None with reuse off)."""
        return self.runner.reuse.arena

    def engine_config(self) -> dict[str, Any]:
        """`GET /v1/node`'s engine section: fixed at start, so that it says nothing of other callers' traffic."""
        return {**self.runner.engine_config(), "max_queue": self.scheduler.max_queue,
                "max_running": self.scheduler.max_running}

    def engine_state(self) -> dict[str, Any]:
        """`GET /v1/node/state`'s engine section, for operators: with how decode steps ran and the queue now."""
        return {**self.runner.engine_state(), **self.scheduler.describe()}

    def media_config(self) -> dict[str, Any]:
        """`GET /v1/node`'s attachments section: whether the model takes images or audio (and why not), and how
        their encodings are kept per caller; fixed at start."""
        family, cache = self.loaded.media, self.runner.reuse.encodings
        config: dict[str, Any] = {"images": family is not None and family.kind.name == "image",
                                  "audio": family is not None and family.kind.name == "audio"}
        if family is None and self.loaded.media_blocker is not None:
            config["reason"] = self.loaded.media_blocker
        if family is not None:
            config["encoder"] = family.encoder
            config["encoding_cache"] = None if cache is None else {
                "sealed": cache.sealing, "max_bytes": cache.max_bytes, "scope_bytes": cache.scope_bytes,
                "keyed_by": "HMAC-SHA256 of the attachment's SHA-256 and the encoder, under a per-scope key"}
        return config

    def media_state(self) -> dict[str, Any]:
        """`GET /v1/node/state`'s attachments section, for operators: `media_config` and the encoding cache's
        counts over every caller."""
        cache = self.runner.reuse.encodings
        return {**self.media_config(), **({"encodings": cache.describe()} if cache is not None else {})}

    def sealing_config(self) -> dict[str, Any]:
        return self.runner.reuse.sealing_config()

    def sealing_state(self) -> dict[str, Any]:
        return self.runner.reuse.sealing_state()

    def warm_forms(self, select: Callable[[Scope], bool]) -> Future[list[tuple[Scope, bytes]]]:
        """`ReuseManager.warm_forms` of the scopes `select` takes, read on the worker thread, which owns the prefix
        index."""
        return self.scheduler.ask(lambda: self.runner.reuse.warm_forms(select))

    def drop_caller(self, caller: str) -> None:
        """A caller removed from the config loses its state and keys (a router's callers theirs too), on the
        worker thread, which owns them, before its next step."""
        self.scheduler.chore(lambda: self.runner.drop_caller(caller))

    def scope_state(self, scope: Scope) -> Future[ScopeState]:
        """What is held for `scope`, read on the worker thread, which owns the prefix index."""
        return self.scheduler.ask(lambda: self._scope_state(scope))

    def shred(self, scope: Scope) -> Future[ScopeState]:
        """Destroy `scope`'s state now, on the worker thread (`ReuseManager.shred`: its requests accepted before,
        queued or running, keep their working memory until they end, and store nothing); what was held."""
        def run() -> ScopeState:
            held = self._scope_state(scope)
            self.runner.shred(scope)
            return held

        return self.scheduler.ask(run)

    def _scope_state(self, scope: Scope) -> ScopeState:
        reuse = self.runner.reuse
        encodings = reuse.encodings.counts(scope) if reuse.encodings is not None else EncodingCounts(0, 0, 0, 0)
        if reuse.prefix_cache is None:
            return ScopeState(NOTHING_HELD, 0, Lookups(), encodings)
        lookups = reuse.prefix_cache.lookups.get(scope, Lookups())
        return ScopeState(reuse.prefix_cache.holdings(scope), reuse.replies.replies(scope),
                          Lookups(lookups.hits, lookups.misses), encodings)

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.model.config.get_text_config(decoder=True).vocab_size)

    def check_text_fits(self, text_bytes: int, param: str) -> None:
        """Refuse, before rendering or tokenizing, text too long for the context whatever its tokens."""
        per_token = self.loaded.max_token_bytes
        least = -(-text_bytes // per_token)
        if least >= self.loaded.context_length:
            raise invalid_request(f"the prompt's text is {text_bytes} bytes, at least {least} tokens (no token of "
                                  f"this model is more than {per_token} bytes); this model's context length is "
                                  f"{self.loaded.context_length} tokens", param=param, code="context_length_exceeded")

    def chat_prompt(self, messages: tuple[Message, ...], forms: bool = False, caller: str | None = None,
                    split_at: int = 0, ends_of: tuple[int, ...] = ()) -> Prompt:
        """The rendered chat, and its prefix forms when `forms` (a router's caller). Its size was bounded when it was
        parsed (`openai_schema.parse_chat`'s `ChatBounds`, stricter than `check_text_fits`): not counted again.
        `caller`: whose replies an assistant message may be (`cache/replies.py`): those are their generated ids.
        `split_at`: a count of messages whose end is wanted (`RenderedChat.split`: a trust group's prefix); `ends_of`
        more (`RenderedChat.ends`: cache breakpoints)."""
        plain = [{"role": m.role, "content": m.content} for m in messages]
        replies = None
        if caller is not None:
            replies = functools.partial(self.runner.reuse.replies.recall, Scope(caller=caller, model=self.model_id))
        images = [part for m in messages for part in m.parts if not isinstance(part, str)]  # and audio
        family = self.loaded.media
        refused = next((part.kind for part in images if family is None or part.kind != family.kind.name), None)
        if refused is not None:
            raise invalid_request(f"model {self.model_id!r} takes no {refused} attachments", param="messages")
        try:
            if not images:
                rendered = render_chat(self.loaded.tokenizer, plain, fits=self.loaded.context_length - 1,
                                       replies=replies, split_at=split_at, ends_of=ends_of)
                return Prompt(rendered, chat_forms(plain, rendered) if forms else NO_FORMS)
            assert family is not None
            # Each image stands in its message's text as a random marker while the template renders it; the
            # marker's text is then replaced by the image's ids, which the model's processor expands.
            markers = image_marker(plain, len(images))
            pending = iter(markers)
            marked = [{"role": m.role, "content": "".join(part if isinstance(part, str) else next(pending)
                                                          for part in m.parts) if m.parts else m.content}
                      for m in messages]
            expanded = []
            for number, image in enumerate(images, start=1):
                try:
                    expanded.append(family.expand(image.content))
                except MediaUnsupported as exc:
                    raise invalid_request(f"model {self.model_id!r}: attachment {number} of the request ({image.kind})"
                                          f": {exc}", param="messages") from exc
            media_ids = {marker: exp.ids for marker, exp in zip(markers, expanded, strict=True)}
            rendered = render_chat(self.loaded.tokenizer, marked, fits=self.loaded.context_length - 1,
                                   replies=replies, media=media_ids, split_at=split_at, ends_of=ends_of)
        except ChatTemplateError as exc:
            raise invalid_request(f"model {self.model_id!r}: {exc}", param="messages") from exc
        media = family.prompt_media(rendered.ids, [(at, exp, image.digest) for at, exp, image in
                                                   zip(rendered.placed, expanded, images, strict=True)])
        if not forms:
            return Prompt(rendered, NO_FORMS, media)
        # A router's summary forms a message with images by its text and its images' digests (memory only).
        formed = [{"role": m.role, "content": "".join(part if isinstance(part, str) else f"\x00{part.kind}:" +
                                                      part.digest.hex() for part in m.parts) if m.parts else m.content}
                  for m in messages]
        return Prompt(rendered, chat_forms(formed, rendered), media)

    def text_prompt(self, prompt: str | tuple[int, ...], forms: bool = False) -> Prompt:
        """A text completion prompt: no message structure, so no boundaries; its form when `forms` (a router's
        caller). Token ids are checked, and formed, only when they can fit the context (`request` refuses the
        others), so the work is bounded by the context."""
        if isinstance(prompt, str):
            self.check_text_fits(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
            rendered = RenderedChat(list(self.loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]), ())
        else:
            vocab = self.vocab_size
            if prompt and len(prompt) < self.loaded.context_length and (min(prompt) < 0 or max(prompt) >= vocab):
                bad = next(i for i, t in enumerate(prompt) if not 0 <= t < vocab)
                raise invalid_request(f"prompt[{bad}] is not a token id of this model (0 to {vocab - 1})",
                                      param="prompt")
            rendered = RenderedChat(list(prompt), ())
        if not (forms and len(rendered.ids) < self.loaded.context_length):
            return Prompt(rendered)
        return Prompt(rendered, PrefixForms(((len(rendered.ids), completion_prefix_form(prompt)),)))

    def request(self, caller: str, prepared: Prompt, params: CommonParams, limits: Limits,
                prompt_param: str, retain: bool = True, group: str | None = None,
                group_param: str = "") -> GenerationRequest:
        """Check the prompt against the context length and build the engine request. `group`: the caller's trust
        group, whose scope the prompt's prefix up to `prepared.rendered.split` is shared in (a membership the
        caller was checked for); `group_param` names the field that asked for it, blamed when the chat cannot
        be split there."""
        prompt = prepared.ids
        context = self.loaded.context_length
        if not prompt:
            raise invalid_request("the prompt is empty", param=prompt_param)
        if len(prompt) >= context:
            raise invalid_request(f"the prompt is {len(prompt)} tokens; this model's context length is "
                                  f"{context} tokens, which must also fit at least one output token",
                                  param=prompt_param, code="context_length_exceeded")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(limits.default_max_tokens, context - len(prompt))
        elif len(prompt) + max_tokens > context:
            raise invalid_request(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
                                  f"this model's context length of {context} tokens; lower max_tokens",
                                  param="max_tokens", code="context_length_exceeded")
        vocab = self.vocab_size
        if any(token >= vocab for token, _ in params.logit_bias):
            raise invalid_request(f"'logit_bias' keys must be token ids of this model (0 to {vocab - 1})",
                                  param="logit_bias")
        sampling = SamplingParams(max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
                                  seed=params.seed, stop=params.stop, presence_penalty=params.presence_penalty,
                                  frequency_penalty=params.frequency_penalty, logit_bias=params.logit_bias,
                                  top_k=params.top_k)
        boundaries, shared = prepared.rendered.boundaries, None
        if group is not None:
            split = prepared.rendered.split
            if split is None or not 0 < split <= len(prompt):
                raise invalid_request("the chat template cannot split this conversation where the group's prefix "
                                      "ends (that message's end falls inside a token): put the group's "
                                      "breakpoint on another message", param=group_param)
            shared = SharedPrefix(group_scope(group, self.model_id), split)
            boundaries = tuple(sorted({*boundaries, split}))  # a resume point for models that need snapshots
        # OpenAI's `prompt_cache_retention: 24h` holds everything for a day; breakpoints are resume points.
        write = WritePlan("24h") if params.retention == "24h" else prepared.write
        boundaries = tuple(sorted({*boundaries, *(point.end for point in write.breakpoints)}))
        # Accepted now: a shred of its scope from here on leaves it storing nothing there (`cache/shred_clock.py`).
        return GenerationRequest(scope=Scope(caller=caller, model=self.model_id), prompt=prompt, params=sampling,
                                 boundaries=boundaries, retain=retain and params.retain,
                                 forms=prepared.forms, media=prepared.media, shared=shared, write=write,
                                 stamp=self.runner.reuse.shreds.now)
