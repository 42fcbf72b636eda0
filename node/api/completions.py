"""OpenAI-compatible routes: chat and text completions (plain and SSE streamed) and models.

A completion is refused before any compute when the node cannot meet its caller's requirements (node.yaml's
`callers.NAME.requirements`, narrowed by the request's `Tenzro-*` headers). Every accepted completion is
metered under its completion id (`node.meter`); the usage a response carries is read from its signed record.
A client that goes away, streamed or not, cancels its handler (the server runs with handler cancellation):
its generation stops within one decode step and is recorded as cancelled with the tokens it produced.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Protocol

from aiohttp import web

from metering.ledger import LedgerError
from metering.record import UsageRecord
from node.api.body import off_loop, read_body
from node.api.keys import CALLER, CONFIG, IDENTITY, METER, METRICS, POLICY, SERVICE
from node.api.trust_groups import GroupAsk, openai_ask, refuse_text_ask
from node.attachments import AttachmentLimits
from node.auth import ROUTER, require_role
from node.config import Caller
from node.engine.scheduler import Event, Failed, Finished, Job, QueueFullError, TextDelta
from node.engine.sequence import GenerationRequest, GenerationResult
from node.errors import (
    InvalidRequest,
    ModelFailure,
    NodeError,
    RequirementNotMet,
    Unavailable,
    model_not_found,
    queue_full,
)
from node.meter import Completion, MeteredJob
from node.openai_schema import ChatBounds, CommonParams, parse_chat, parse_completion
from node.service import ModelService, Prompt
from policies.requirements import (
    NO_REQUIREMENTS,
    TOKEN_CLASSES,
    Offer,
    RequirementHeaderError,
    merge,
    requirements_from_headers,
    unmet,
)

routes = web.RouteTableDef()

RUNS_COMPLETIONS = ("caller", ROUTER)
"""Roles whose keys run the model: callers, and routers as themselves or (as a caller) for their callers. An
auditor's or operator's key reads records or the node's state; it is not billed for completions."""
METERING_RETRY_AFTER_S = 5
"""A ledger that failed to append (a full or failing disk) needs an operator: retry later, not at once."""


def _service(request: web.Request, model: str) -> ModelService:
    service = request.app[SERVICE]
    if model != service.model_id:
        raise model_not_found(model)
    return service


def _usage(record: UsageRecord, result: GenerationResult, retention: str = "in_memory") -> dict[str, Any]:
    """The counts as the signed record bills them, and what only the response tells its caller."""
    counts = record.counts
    return {
        "prompt_tokens": counts.input_tokens,
        "completion_tokens": counts.output_tokens,
        "total_tokens": counts.input_tokens + counts.output_tokens,
        # Where OpenAI's client reads them (`PromptTokensDetails`); the top-level pair below is this node's own.
        "prompt_tokens_details": {"cached_tokens": counts.cached_read_tokens,
                                  "cache_write_tokens": counts.cached_write_tokens},
        "cached_read_tokens": counts.cached_read_tokens,
        "cached_write_tokens": counts.cached_write_tokens,
        # This node's extensions, for the caller's own request only: tokens that agreed with its stored tokens
        # (what resuming at any token would reuse) and the time to first token measured inside the node.
        "matched_tokens": result.matched_tokens,
        "server_ttft_ms": round(result.ttft_s * 1000.0, 3),
        # Whether this request's state was kept for the caller's reuse; "none": nothing stored, no cached writes.
        "prompt_cache_retention": retention if result.retained else "none",
        # The prompt's images: how many ran the model's encoder for this request, and how many did not (their
        # positions restored with the prefix, or their encoding found in the caller's encoding cache).
        **({"attachments": {"encoded": result.attachments_encoded, "reused": result.attachments_reused,
                            "encode_ms": round(result.encode_s * 1000.0, 3)}}
           if result.attachments_encoded or result.attachments_reused else {}),
    }


def _finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


class Dialect(Protocol):
    """What one API's response format writes for one completion, whole or streamed as server-sent events:
    `Shape` (OpenAI's chat and text completions) and `node.api.messages.MessageShape` (Anthropic's Messages).
    `_respond` runs every completion the same way and asks the dialect only what to write."""

    id: str
    """The completion id the client sees, under which the completion is metered."""
    prompt_param: str
    """The request field a prompt too long for the context is blamed on."""

    def opening(self) -> list[dict[str, Any]]:
        """Events a stream starts with, before the job is queued."""
        ...

    def complete(self, record: UsageRecord, result: GenerationResult, params: CommonParams,
                 prompt_ids: list[int]) -> dict[str, Any]: ...

    def delta(self, text: str) -> dict[str, Any]: ...

    def closing(self, record: UsageRecord, result: GenerationResult, params: CommonParams,
                prompt_ids: list[int]) -> list[dict[str, Any] | str]:
        """Events a stream ends with once its job finished."""
        ...

    def failed(self, error: NodeError) -> list[dict[str, Any] | str]:
        """Events a stream ends with when its job failed after the 200 went out."""
        ...

    def frame(self, payload: dict[str, Any] | str) -> bytes:
        """One server-sent event."""
        ...


class Shape:
    """The differences between chat and text completion bodies, in one place."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.prompt_param = "messages" if chat else "prompt"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def complete(self, record: UsageRecord, result: GenerationResult, params: CommonParams,
                 prompt_ids: list[int]) -> dict[str, Any]:
        reason = _finish_reason(result)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": reason}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = _usage(record, result, params.retention)
        if params.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = result.output_ids
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion",
                              [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}])

    def usage_chunk(self, record: UsageRecord, result: GenerationResult, retention: str = "in_memory"
                    ) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = _usage(record, result, retention)
        return body

    def opening(self) -> list[dict[str, Any]]:
        return [self.chunk(None, first=True)] if self.chat else []

    def delta(self, text: str) -> dict[str, Any]:
        return self.chunk(text)

    def closing(self, record: UsageRecord, result: GenerationResult, params: CommonParams,
                prompt_ids: list[int]) -> list[dict[str, Any] | str]:
        """The chunk with the finish reason (with `return_token_ids`, also the prompt's and the reply's token ids,
        whole), the usage chunk when asked for, and `[DONE]`."""
        last = self.chunk(None if self.chat else "", _finish_reason(result))
        if params.return_token_ids:
            last["prompt_token_ids"] = prompt_ids
            last["choices"][0]["token_ids"] = result.output_ids
        events: list[dict[str, Any] | str] = [last]
        if params.include_usage:
            events.append(self.usage_chunk(record, result, params.retention))
        return [*events, "[DONE]"]

    def failed(self, error: NodeError) -> list[dict[str, Any] | str]:
        return [error.body(), "[DONE]"]

    def frame(self, payload: dict[str, Any] | str) -> bytes:
        data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        return f"data: {data}\n\n".encode()


def _submit(request: web.Request, service: ModelService, caller: Caller, generation: GenerationRequest,
            streamed: bool) -> Job:
    try:
        return service.scheduler.submit(caller.name, generation, streamed=streamed, reserved=streamed)
    except QueueFullError as exc:
        raise queue_full(str(exc)) from exc


def _observe(request: web.Request, result: GenerationResult) -> None:
    request.app[METRICS].observe_generation(result.prompt_tokens, result.cached_read_tokens, len(result.output_ids),
                                            result.ttft_s, result.queue_wait_s)


def _failure(event: Failed) -> NodeError:
    if isinstance(event.error, NodeError):
        return event.error
    return ModelFailure("the model failed on this request; the node keeps serving")


async def _next_event(job: MeteredJob) -> Event:
    try:
        return await job.next_event()
    except LedgerError as exc:
        raise Unavailable("the node could not record the usage of this completion, so it is not delivered; "
                          "retry later", code="metering_unavailable", retry_after_s=METERING_RETRY_AFTER_S) from exc


def check_requirements(request: web.Request, caller: Caller) -> None:
    """Refuse, before anything is computed, a request whose requirements this node does not meet."""
    try:
        requested = requirements_from_headers(request.headers)
    except RequirementHeaderError as exc:
        raise InvalidRequest(str(exc), param=exc.header, code="invalid_requirement") from exc
    requirements = merge(caller.requirements, requested)
    if requirements == NO_REQUIREMENTS:
        return
    evidence, prices = request.app[IDENTITY].evidence, request.app[METER].pricing.current()
    offer = Offer(evidence.evidence_type, evidence.trusted, request.app[POLICY].jurisdiction,
                  {name: getattr(prices, f"{name}_price_wei") for name in TOKEN_CLASSES})
    missing = unmet(requirements, offer)
    if missing:
        raise RequirementNotMet("this node does not meet the request's requirements: "
                                + "; ".join(item.message for item in missing), param=missing[0].requirement)


async def _respond(request: web.Request, service: ModelService, caller: Caller, prompt: Prompt,
                   params: CommonParams, shape: Dialect, ask: GroupAsk | None = None) -> web.StreamResponse:
    """`ask`: the request's prefix is shared in its caller's trust group's scope (`trust_groups.py`)."""
    generation = service.request(caller.name, prompt, params, request.app[CONFIG].limits,
                                 prompt_param=shape.prompt_param, retain=caller.retention == "keep",
                                 group=ask.group if ask is not None else None,
                                 group_param=ask.param if ask is not None else "")
    response = None
    if params.stream:
        # Headers (and a stream's opening events) go out before the job is queued: once it is, the event loop
        # has nothing to do but wait, and the worker thread it would hold off by the GIL starts at once. The
        # job's place in the queue is held first, so a stream that got its 200 never meets a full queue.
        try:
            service.scheduler.reserve()
        except QueueFullError as exc:
            raise queue_full(str(exc)) from exc
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            await response.prepare(request)
            for payload in shape.opening():
                await response.write(shape.frame(payload))
        except BaseException:  # the client went away before the job was queued: it computed nothing
            service.scheduler.release()
            request.app[METER].record_unstarted(Completion(shape.id, caller.name, service.model_id))
            raise
    job = request.app[METER].track(_submit(request, service, caller, generation, params.stream),
                                   Completion(shape.id, caller.name, service.model_id))
    try:
        if response is not None:
            return await _stream(request, response, job, params, shape, prompt.ids)
        while True:
            event = await _next_event(job)
            if isinstance(event, Finished):
                _observe(request, event.result)
                assert job.record is not None  # recorded before the outcome is handed out
                return web.json_response(shape.complete(job.record, event.result, params, prompt.ids))
            if isinstance(event, Failed):
                raise _failure(event)
    finally:
        job.close()  # a no-op once finished; stops decoding when the client went away


async def _stream(request: web.Request, response: web.StreamResponse, job: MeteredJob, params: CommonParams,
                  shape: Dialect, prompt_ids: list[int]) -> web.StreamResponse:
    """The job's events as server-sent events on the prepared `response`, written as `shape` writes them."""
    while True:
        try:
            event = await _next_event(job)
        except NodeError as unrecorded:
            ending = shape.failed(unrecorded)
            break
        if isinstance(event, TextDelta):
            await response.write(shape.frame(shape.delta(event.text)))
            job.job.first_written.set()
        elif isinstance(event, Finished):
            _observe(request, event.result)
            assert job.record is not None
            ending = shape.closing(job.record, event.result, params, prompt_ids)
            break
        else:
            ending = shape.failed(_failure(event))
            break
    for payload in ending:
        await response.write(shape.frame(payload))
    await response.write_eof()
    return response


def chat_bounds(request: web.Request, attachments: bool) -> ChatBounds:
    """What a chat body is checked against before it is rendered: the node's `limits.max_messages`, the served
    model's context, and attachments where the API carries them (`attachments`) and the model takes them."""
    loaded = request.app[SERVICE].loaded
    return ChatBounds(request.app[CONFIG].limits.max_messages, loaded.context_length, loaded.max_token_bytes,
                      loaded.message_tokens, AttachmentLimits() if attachments and loaded.media is not None else None)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    caller = require_role(request[CALLER], "POST /v1/chat/completions", *RUNS_COMPLETIONS)
    check_requirements(request, caller)
    bounds = chat_bounds(request, attachments=True)
    chat, cache_key = await read_body(request, lambda body: (parse_chat(body, bounds), _has_cache_key(body)))
    service = _service(request, chat.params.model)
    ask = openai_ask(request, caller, chat.messages, cache_key)
    # A caller whose state is kept has its replies recognised when it sends them back (`cache/replies.py`).
    prompt = await off_loop(request, service.chat_prompt, chat.messages, caller.router is not None,
                            caller.name if caller.retention == "keep" else None, ask.messages if ask else 0)
    return await _respond(request, service, caller, prompt, chat.params, Shape(True, service.model_id), ask)


def _has_cache_key(body: Any) -> bool:
    """The body (a parsed chat's) sent a non-empty `prompt_cache_key`."""
    return bool(body.get("prompt_cache_key"))


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    caller = require_role(request[CALLER], "POST /v1/completions", *RUNS_COMPLETIONS)
    check_requirements(request, caller)
    refuse_text_ask(request)
    completion = await read_body(request, parse_completion)
    service = _service(request, completion.params.model)
    # Text is tokenized off the loop; token ids are checked on it (bounded by the context, no thread hop on
    # the time to first token), unless they are also formed for a router's summary.
    forms = caller.router is not None
    prompt = (await off_loop(request, service.text_prompt, completion.prompt, forms)
              if forms or isinstance(completion.prompt, str) else service.text_prompt(completion.prompt))
    return await _respond(request, service, caller, prompt, completion.params, Shape(False, service.model_id))


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.json_response({"object": "list", "data": [{
        "id": service.model_id, "object": "model", "created": 0, "owned_by": "tenzro",
        "context_length": service.loaded.context_length, "reuse": service.reuse_enabled,
    }]})
