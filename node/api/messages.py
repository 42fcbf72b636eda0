"""Anthropic's Messages API (`POST /v1/messages`): its responses, its stream's events and its error bodies.

A Messages request is run as the equivalent chat completion (`anthropic_schema`, then `completions._respond`):
the same rendering, the same caller's state, the same metering under the message's id. Only what is written
differs, which `MessageShape` says. Usage splits the prompt as Anthropic bills it: `input_tokens` computed and not
stored, `cache_creation_input_tokens` computed and stored, `cache_read_input_tokens` resumed from stored state.
With `cache_control` breakpoints only the prompt up to the last one is written (`node/breakpoints.py`), and writes
are reported by their time to live: `cache_creation.ephemeral_1h_input_tokens` those of `1h` breakpoints,
`ephemeral_5m_input_tokens` the rest (the node's default time to live, without breakpoints).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from aiohttp import web

from metering.record import UsageRecord
from node.anthropic_schema import parse_messages
from node.api.anthropic_errors import error_body
from node.api.body import off_loop, read_body
from node.api.completions import RUNS_COMPLETIONS, _respond, _service, chat_bounds, check_requirements
from node.api.keys import CALLER
from node.api.middleware import status_of
from node.api.trust_groups import anthropic_ask
from node.auth import require_role
from node.breakpoints import message_counts, write_plan
from node.engine.sequence import GenerationResult
from node.errors import NodeError
from node.openai_schema import CommonParams

routes = web.RouteTableDef()


def _stop_reason(result: GenerationResult) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_sequence is not None else "end_turn"


def _usage(record: UsageRecord) -> dict[str, Any]:
    """The signed record's counts as Anthropic reports them: the three input classes are disjoint."""
    counts = record.counts
    written, read = counts.cached_write_tokens, counts.cached_read_tokens
    return {"input_tokens": counts.input_tokens - written - read, "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read,
            "cache_creation": {"ephemeral_5m_input_tokens": written - counts.cached_write_1h_tokens,
                               "ephemeral_1h_input_tokens": counts.cached_write_1h_tokens},
            "output_tokens": counts.output_tokens}


class MessageShape:
    """Anthropic's message and its stream's events (`completions.Dialect`)."""

    def __init__(self, model: str) -> None:
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.prompt_param = "messages"

    def _message(self, text: str, stop_reason: str | None, usage: dict[str, Any],
                 stop_sequence: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": text}] if stop_reason is not None else [],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def complete(self, record: UsageRecord, result: GenerationResult, params: CommonParams,
                 prompt_ids: list[int]) -> dict[str, Any]:
        return self._message(result.text, _stop_reason(result), _usage(record), result.stop_sequence)

    def opening(self) -> list[dict[str, Any]]:
        """`message_start` (its usage is known only at the end: `message_delta` carries it whole), the text block's
        start and a ping."""
        usage = {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}
        return [{"type": "message_start", "message": self._message("", None, usage)},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                {"type": "ping"}]

    def delta(self, text: str) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}

    def closing(self, record: UsageRecord, result: GenerationResult, params: CommonParams,
                prompt_ids: list[int]) -> list[dict[str, Any] | str]:
        return [{"type": "content_block_stop", "index": 0},
                {"type": "message_delta", "delta": {"stop_reason": _stop_reason(result),
                                                    "stop_sequence": result.stop_sequence},
                 "usage": _usage(record)},
                {"type": "message_stop"}]

    def failed(self, error: NodeError) -> list[dict[str, Any] | str]:
        return [error_body(status_of(error), error.body())]

    def frame(self, payload: dict[str, Any] | str) -> bytes:
        assert isinstance(payload, dict)  # this dialect has no `[DONE]`
        return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    caller = require_role(request[CALLER], "POST /v1/messages", *RUNS_COMPLETIONS)
    check_requirements(request, caller)
    bounds = chat_bounds(request, attachments=False)
    parsed = await read_body(request, lambda body: parse_messages(body, bounds))
    service = _service(request, parsed.chat.params.model)
    ask = anthropic_ask(request, caller, parsed.breakpoints)
    # Rendered as the equivalent chat completion is, replies recognised alike: one caller's state serves both.
    prompt = await off_loop(request, service.chat_prompt, parsed.chat.messages, caller.router is not None,
                            caller.name if caller.retention == "keep" else None, ask.messages if ask else 0,
                            message_counts(parsed.breakpoints))
    prompt = dataclasses.replace(prompt, write=write_plan(parsed.breakpoints, prompt.rendered.ends))
    return await _respond(request, service, caller, prompt, parsed.chat.params, MessageShape(service.model_id),
                          ask)
