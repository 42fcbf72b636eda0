"""OpenAI request bodies parsed into typed records; every invalid field gets a 400 naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node.errors import invalid_request

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class CommonParams:
    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    """An extension (as in vLLM): the response also carries the prompt's and the reply's token ids, so an
    agent can send ids back and never lose reuse to re-tokenisation."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    params: CommonParams
    messages: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    params: CommonParams
    prompt: str | tuple[int, ...]


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise invalid_request(f"'{name}' must be a number between {low} and {high}", param=name)
    return float(value)


def _optional_int(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise invalid_request(f"'{name}' must be an integer of at least {low}", param=name)
    return value


def _common(body: Any) -> CommonParams:
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is required: the id of a model from GET /v1/models", param="model")
    if body.get("n", 1) != 1:
        raise invalid_request("'n' must be 1: this node returns one choice per request", param="n")
    if body.get("logprobs") not in (None, False, 0):
        raise invalid_request("'logprobs' is not supported by this node", param="logprobs")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise invalid_request(f"'stop' must be a string or a list of at most {MAX_STOP} strings", param="stop")
    if any(not s for s in stops):
        raise invalid_request("'stop' strings must not be empty", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid_request("'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise invalid_request("'stream_options' must be an object like {\"include_usage\": true}",
                              param="stream_options")
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool) or (return_ids and stream):
        raise invalid_request("'return_token_ids' must be true or false, and is supported without 'stream' only",
                              param="return_token_ids")
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    return CommonParams(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        seed=_optional_int(body, "seed", -(2**63)),
        stop=stops,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        return_token_ids=return_ids,
    )


def _content(value: Any, index: int, role: str) -> str:
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid_request(f"messages[{index}].content: only text parts are supported by this model",
                                      param=f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid_request(f"messages[{index}].content must be a string or a list of text parts",
                          param=f"messages[{index}].content")


def parse_chat(body: Any) -> ChatRequest:
    params = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty list", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid_request(f"messages[{index}].role must be one of {', '.join(ROLES)}",
                                  param=f"messages[{index}].role")
        parsed.append(Message(message["role"], _content(message.get("content"), index, message["role"])))
    return ChatRequest(params, tuple(parsed))


def parse_completion(body: Any) -> CompletionRequest:
    params = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one, as OpenAI clients send it
    if body.get("echo") or body.get("suffix"):
        raise invalid_request("'echo' and 'suffix' are not supported by this node")
    if isinstance(prompt, str) and prompt:
        return CompletionRequest(params, prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):  # not bool, JSON's true
        return CompletionRequest(params, tuple(prompt))
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid_request("send one prompt per request: batches of prompts are not supported", param="prompt")
    raise invalid_request("'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")
