"""Error bodies in Anthropic's form, for the routes of its dialect (`node.api.messages`); the middleware writes
them there instead of OpenAI's."""

from __future__ import annotations

from typing import Any

ANTHROPIC_ROUTES = frozenset({"/v1/messages"})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error `type` by status; other statuses are `invalid_request_error` below 500, `api_error` above."""


def error_body(status: int, openai_body: dict[str, Any]) -> dict[str, Any]:
    """An error body (`NodeError.body`'s, OpenAI's) in Anthropic's form. Anthropic's has no `param`: the field at
    fault leads the message unless the message names it already."""
    error = openai_body.get("error", {})
    message, param = str(error.get("message", "request failed")), error.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
