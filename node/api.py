"""OpenAI-compatible routes: chat and text completions (plain and SSE streamed), models, health, metrics.

Every accepted completion is metered under its completion id (`node.meter`); the usage a response
carries is the usage its signed record holds. A client that goes away, streamed or not, cancels its
handler (the server runs with handler cancellation): its generation stops within one decode step and is
recorded as cancelled with the tokens it produced.

`/health` tells anyone that the node serves; the queue's depth and `/metrics` are for operator keys only,
so that no caller learns the shape of other callers' traffic.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from metering.ledger import LedgerError
from node.app import CONFIG, KEYRING, METER, METRICS, SERVICE, caller_of, off_loop, read_body
from node.config import Caller
from node.engine.chat_template import RenderedChat
from node.engine.runner import GenerationRequest, GenerationResult
from node.engine.scheduler import Event, Failed, Finished, Job, QueueFullError, TextDelta
from node.errors import ApiError, model_not_found, queue_full
from node.meter import Completion, MeteredJob
from node.openai_schema import CommonParams, parse_chat, parse_completion
from node.service import ModelService

METERING_RETRY_AFTER_S = 5
"""A ledger that failed to append (a full or failing disk) needs an operator: retry later, not at once."""


def _service(request: web.Request, model: str) -> ModelService:
    service = request.app[SERVICE]
    if model != service.model_id:
        raise model_not_found(model)
    return service


def _usage(result: GenerationResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "total_tokens": result.prompt_tokens + len(result.output_ids),
        "prompt_tokens_details": {"cached_tokens": result.cached_read_tokens},
        "cached_read_tokens": result.cached_read_tokens,
        "cached_write_tokens": result.cached_write_tokens,
        # This node's extensions, for the caller's own request only: tokens that agreed with its stored tokens
        # (what resuming at any token would reuse) and the time to first token measured inside the node.
        "matched_tokens": result.matched_tokens,
        "server_ttft_ms": round(result.ttft_s * 1000.0, 3),
        # Whether this request's state was kept for the caller's reuse; "none": nothing stored, no cached writes.
        "prompt_cache_retention": "in_memory" if result.retained else "none",
    }


def _finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


class Shape:
    """The differences between chat and text completion bodies, in one place."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def complete(self, result: GenerationResult) -> dict[str, Any]:
        reason = _finish_reason(result)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": reason}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = _usage(result)
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

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = _usage(result)
        return body


def _submit(request: web.Request, service: ModelService, caller: Caller, generation: GenerationRequest,
            streamed: bool) -> Job:
    try:
        return service.scheduler.submit(caller.name, generation, streamed=streamed, reserved=streamed)
    except QueueFullError as exc:
        raise queue_full(str(exc)) from exc


def _observe(request: web.Request, result: GenerationResult) -> None:
    request.app[METRICS].observe_generation(result.prompt_tokens, result.cached_read_tokens, len(result.output_ids),
                                            result.ttft_s, result.queue_wait_s)


def _raise_failure(event: Failed) -> None:
    if isinstance(event.error, ApiError):
        raise event.error
    raise ApiError(500, "the model failed on this request; the node keeps serving", type="server_error") \
        from event.error


async def _next_event(job: MeteredJob) -> Event:
    try:
        return await job.next_event()
    except LedgerError as exc:
        raise ApiError(503, "the node could not record the usage of this completion, so it is not delivered; "
                       "retry later", type="server_error", code="metering_unavailable",
                       retry_after_s=METERING_RETRY_AFTER_S) from exc


async def _respond(request: web.Request, service: ModelService, caller: Caller, prompt: RenderedChat,
                   params: CommonParams, shape: Shape) -> web.StreamResponse:
    generation = service.request(caller.name, prompt, params, request.app[CONFIG].limits,
                                 prompt_param="messages" if shape.chat else "prompt",
                                 retain=caller.retention == "keep")
    response = None
    if params.stream:
        # Headers (and a chat stream's role chunk) go out before the job is queued: once it is, the event loop
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
            if shape.chat:
                await _send(response, shape.chunk(None, first=True))
        except BaseException:  # the client went away before the job was queued: it computed nothing
            service.scheduler.release()
            request.app[METER].record_unstarted(Completion(shape.id, caller.name, service.model_id))
            raise
    job = request.app[METER].track(_submit(request, service, caller, generation, params.stream),
                                   Completion(shape.id, caller.name, service.model_id))
    try:
        if response is not None:
            return await _stream(request, response, job, params, shape)
        while True:
            event = await _next_event(job)
            if isinstance(event, Finished):
                _observe(request, event.result)
                body = shape.complete(event.result)
                if params.return_token_ids:
                    body["prompt_token_ids"] = prompt.ids
                    body["choices"][0]["token_ids"] = event.result.output_ids
                return web.json_response(body)
            if isinstance(event, Failed):
                _raise_failure(event)
    finally:
        job.close()  # a no-op once finished; stops decoding when the client went away


async def _send(response: web.StreamResponse, payload: dict[str, Any] | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    await response.write(f"data: {data}\n\n".encode())


async def _stream(request: web.Request, response: web.StreamResponse, job: MeteredJob, params: CommonParams,
                  shape: Shape) -> web.StreamResponse:
    """The job's events as server-sent events on the prepared `response`."""
    while True:
        try:
            event = await _next_event(job)
        except ApiError as unrecorded:
            await _send(response, unrecorded.body())
            break
        if isinstance(event, TextDelta):
            await _send(response, shape.chunk(event.text))
            job.job.first_written.set()
        elif isinstance(event, Finished):
            _observe(request, event.result)
            await _send(response, shape.chunk(None if shape.chat else "", _finish_reason(event.result)))
            if params.include_usage:
                await _send(response, shape.usage_chunk(event.result))
            break
        else:
            error = event.error if isinstance(event.error, ApiError) else ApiError(
                500, "the model failed on this request; the node keeps serving", type="server_error")
            await _send(response, error.body())
            break
    await _send(response, "[DONE]")
    await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    caller = caller_of(request)
    chat = await read_body(request, parse_chat)
    service = _service(request, chat.params.model)
    prompt = await off_loop(request, service.chat_prompt, chat.messages)
    return await _respond(request, service, caller, prompt, chat.params, Shape(True, service.model_id))


async def completions(request: web.Request) -> web.StreamResponse:
    caller = caller_of(request)
    completion = await read_body(request, parse_completion)
    service = _service(request, completion.params.model)
    # Text is tokenized off the loop; token ids are checked on it (bounded by the context, no thread hop on
    # the time to first token).
    text = isinstance(completion.prompt, str)
    prompt = await off_loop(request, service.text_prompt, completion.prompt) if text else service.text_prompt(
        completion.prompt)
    return await _respond(request, service, caller, prompt, completion.params, Shape(False, service.model_id))


async def models(request: web.Request) -> web.Response:
    caller_of(request)
    service = request.app[SERVICE]
    return web.json_response({"object": "list", "data": [{
        "id": service.model_id, "object": "model", "created": 0, "owned_by": "tenzro",
        "context_length": service.loaded.context_length, "reuse": service.runner.reuse_enabled,
    }]})


async def health(request: web.Request) -> web.Response:
    """That the node serves, to anyone; the queue's depth too, to an operator key."""
    service = request.app[SERVICE]
    body: dict[str, Any] = {"status": "ok", "model": service.model_id}
    authorization = request.headers.get("Authorization")
    if authorization:
        request.app[KEYRING].operator_for(authorization, "the queue's depth in /health")
        body.update(service.scheduler.describe())
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    request.app[KEYRING].operator_for(request.headers.get("Authorization"), "GET /metrics")
    return web.Response(body=request.app[METRICS].render(), content_type="text/plain", charset="utf-8")


ROUTES: list[tuple[str, str, Callable[[web.Request], Any]]] = [
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("GET", "/v1/models", models),
    ("GET", "/health", health),
    ("GET", "/metrics", metrics),
]
