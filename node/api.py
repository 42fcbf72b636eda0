"""OpenAI-compatible routes: chat and text completions (plain and SSE streamed), models, health, metrics."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from node.app import CONFIG, KEYRING, METRICS, SERVICE, read_json
from node.config import Caller
from node.engine.runner import GenerationRequest, GenerationResult
from node.engine.scheduler import Failed, Finished, Job, QueueFullError, TextDelta
from node.errors import ApiError, model_not_found, queue_full
from node.openai_schema import CommonParams, parse_chat, parse_completion
from node.service import ModelService


def _caller(request: web.Request) -> Caller:
    return request.app[KEYRING].caller_for(request.headers.get("Authorization"))


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


def _submit(request: web.Request, service: ModelService, caller: Caller, generation: GenerationRequest) -> Job:
    try:
        return service.scheduler.submit(caller.name, generation)
    except QueueFullError as exc:
        raise queue_full(str(exc)) from exc


def _record(request: web.Request, result: GenerationResult) -> None:
    request.app[METRICS].observe_generation(result.prompt_tokens, result.cached_read_tokens,
                                            len(result.output_ids), result.ttft_s, result.queue_wait_s)


def _raise_failure(event: Failed) -> None:
    if isinstance(event.error, ApiError):
        raise event.error
    raise ApiError(500, "the model failed on this request; the node keeps serving", type="server_error") \
        from event.error


async def _respond(request: web.Request, service: ModelService, caller: Caller, prompt: list[int],
                   params: CommonParams, shape: Shape) -> web.StreamResponse:
    generation = service.request(caller.name, prompt, params, request.app[CONFIG].limits,
                                 prompt_param="messages" if shape.chat else "prompt")
    job = _submit(request, service, caller, generation)
    if not params.stream:
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, Finished):
                    _record(request, event.result)
                    return web.json_response(shape.complete(event.result))
                if isinstance(event, Failed):
                    _raise_failure(event)
        finally:
            job.cancel()
    return await _stream(request, job, params, shape)


async def _stream(request: web.Request, job: Job, params: CommonParams, shape: Shape) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        await response.write(f"data: {data}\n\n".encode())

    try:
        if shape.chat:
            await send(shape.chunk(None, first=True))
        while True:
            event = await job.events.get()
            if isinstance(event, TextDelta):
                await send(shape.chunk(event.text))
            elif isinstance(event, Finished):
                _record(request, event.result)
                await send(shape.chunk(None if shape.chat else "", _finish_reason(event.result)))
                if params.include_usage:
                    await send(shape.usage_chunk(event.result))
                break
            else:
                error = event.error if isinstance(event.error, ApiError) else ApiError(
                    500, "the model failed on this request; the node keeps serving", type="server_error")
                await send(error.body())
                break
        await send("[DONE]")
        await response.write_eof()
    finally:
        job.cancel()  # a no-op once finished; stops decoding when the client went away
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    caller = _caller(request)
    chat = parse_chat(await read_json(request))
    service = _service(request, chat.params.model)
    prompt = service.chat_prompt(chat.messages)
    return await _respond(request, service, caller, prompt, chat.params, Shape(True, service.model_id))


async def completions(request: web.Request) -> web.StreamResponse:
    caller = _caller(request)
    completion = parse_completion(await read_json(request))
    service = _service(request, completion.params.model)
    prompt = service.text_prompt(completion.prompt)
    return await _respond(request, service, caller, prompt, completion.params, Shape(False, service.model_id))


async def models(request: web.Request) -> web.Response:
    _caller(request)
    service = request.app[SERVICE]
    return web.json_response({"object": "list", "data": [{
        "id": service.model_id, "object": "model", "created": 0, "owned_by": "tenzro",
        "context_length": service.loaded.context_length, "reuse": service.runner.reuse_enabled,
    }]})


async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.json_response({"status": "ok", "model": service.model_id, **service.scheduler.describe()})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), content_type="text/plain", charset="utf-8")


ROUTES: list[tuple[str, str, Callable[[web.Request], Any]]] = [
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("GET", "/v1/models", models),
    ("GET", "/health", health),
    ("GET", "/metrics", metrics),
]


def add_routes(app: web.Application) -> None:
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
