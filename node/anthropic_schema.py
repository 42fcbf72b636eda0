"""Anthropic Messages request bodies parsed into the node's chat records; every invalid field gets a 400 naming it.

A Messages request becomes the `ChatRequest` the equivalent chat completion would: `system` (a string, or text
blocks joined as OpenAI's text parts are) first as a system message, then each message's text blocks joined. The
chat template then renders both dialects to the same ids, so a caller's state serves either.

`cache_control` breakpoints are parsed and carried (`Breakpoint`), at most MAX_BREAKPOINTS, each with a known
`ttl`; a top-level `cache_control` (Anthropic's automatic caching) is one at the end of the last message. What
they store and for how long is the TTL work's (issue 41), not this module's. Fields of features this
node does not implement (tools, thinking, images, documents) are refused naming the field, never ignored; any
other unknown field is refused as the OpenAI dialect refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node.errors import invalid_request
from node.openai_schema import (
    MAX_STOP,
    ChatBounds,
    ChatRequest,
    CommonParams,
    Message,
    _number,
    _optional_int,
    _refuse_unknown,
)

UNSUPPORTED = {
    "tools": "tool use is not supported by this node yet",
    "tool_choice": "tool use is not supported by this node yet",
    "thinking": "extended thinking is not supported by this node's models",
    "mcp_servers": "MCP servers are not supported by this node (it reaches nothing outside itself)",
    "container": "code execution containers are not supported by this node",
    "context_management": "context management is not supported by this node",
    "service_tier": "this node has one service tier: send the request without 'service_tier'",
}
"""Anthropic's fields for features this node does not implement, refused (400) whatever their value."""
FIELDS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k",
                    "metadata", "stream", "cache_control"}) | frozenset(UNSUPPORTED)
MESSAGE_FIELDS = frozenset({"role", "content"})
TEXT_BLOCK_FIELDS = frozenset({"type", "text", "cache_control", "citations"})
CACHE_CONTROL_FIELDS = frozenset({"type", "ttl", "scope"})
METADATA_FIELDS = frozenset({"user_id"})
ROLES = ("user", "assistant")
TTLS = ("5m", "1h")
"""`cache_control.ttl` values, as Anthropic's API takes them; absent means "5m"."""
SCOPES = ("caller", "group")
"""`cache_control.scope`, this node's extension: "group" stores the prefix up to the breakpoint in the caller's
trust group's scope (`node.yaml` `groups`), shared with its members; absent means "caller"."""
MAX_BREAKPOINTS = 4
"""Blocks with `cache_control` in one request at most (Anthropic's limit)."""
BLOCKS = {"image": "images", "document": "documents", "tool_use": "tool use", "tool_result": "tool use",
          "thinking": "extended thinking", "redacted_thinking": "extended thinking", "search_result": "search results",
          "server_tool_use": "server tools", "web_search_tool_result": "server tools"}
"""Content block types of features this node does not implement, and the feature named in the refusal."""


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A `cache_control` breakpoint: the prefix up to the end of its block is to be cached for `ttl`."""

    message: int
    """Index in the parsed chat's messages (the system message, when there is one, is 0)."""
    last_block: bool
    """The block ends its message: only there can the template's rendering be split (a message boundary)."""
    ttl: str
    """One of TTLS."""
    param: str
    """The field it was read from (`system[0].cache_control`, `messages[2].content[1].cache_control`), for the
    refusals of the work that acts on it."""
    group: bool = False
    """`"scope": "group"`: the prefix up to it is the caller's trust group's (SCOPES)."""


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    chat: ChatRequest
    breakpoints: tuple[Breakpoint, ...]


def _cache_control(value: Any, param: str) -> tuple[str, bool]:
    """The breakpoint's ttl, and whether its prefix is the caller's trust group's."""
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise invalid_request(f"'{param}' must be {{\"type\": \"ephemeral\"}}, optionally with a \"ttl\" of "
                              f"{' or '.join(map(repr, TTLS))}", param=param)
    _refuse_unknown(value, CACHE_CONTROL_FIELDS, param)
    ttl = value.get("ttl", TTLS[0])
    if ttl not in TTLS:
        raise invalid_request(f"'{param}.ttl' must be {' or '.join(map(repr, TTLS))}", param=f"{param}.ttl")
    scope = value.get("scope", SCOPES[0])
    if scope not in SCOPES:
        raise invalid_request(f"'{param}.scope' must be {' or '.join(map(repr, SCOPES))}", param=f"{param}.scope")
    return str(ttl), scope == "group"


def _text_blocks(value: Any, param: str, message: int, breakpoints: list[Breakpoint]) -> str:
    """The text of a string or a list of text blocks; each block's breakpoint appended to `breakpoints`."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid_request(f"'{param}' must be a string or a list of text blocks", param=param)
    texts = []
    for index, block in enumerate(value):
        where = f"{param}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in BLOCKS:
            raise invalid_request(f"{BLOCKS[kind]} ({kind!r} blocks) are not supported by this node; send text "
                                  f"blocks only", param=f"{where}.type", code="unsupported_parameter")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise invalid_request(f"'{where}' must be a text block: {{\"type\": \"text\", \"text\": \"...\"}}",
                                  param=where)
        _refuse_unknown(block, TEXT_BLOCK_FIELDS, where)
        if block.get("citations") not in (None, []):
            raise invalid_request("citations are not supported by this node", param=f"{where}.citations",
                                  code="unsupported_parameter")
        if block.get("cache_control") is not None:
            ttl, group = _cache_control(block["cache_control"], f"{where}.cache_control")
            breakpoints.append(Breakpoint(message, index == len(value) - 1, ttl, f"{where}.cache_control", group))
        texts.append(block["text"])
    return "".join(texts)


def _refuse_features(body: dict[str, Any]) -> None:
    for name, why in UNSUPPORTED.items():
        if name in body:
            raise invalid_request(f"{why}; remove '{name}' from the request", param=name,
                                  code="unsupported_parameter")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise invalid_request("'metadata' must be an object like {\"user_id\": \"...\"}", param="metadata")
        _refuse_unknown(metadata, METADATA_FIELDS, "metadata")
        if not isinstance(metadata.get("user_id"), str | None):
            raise invalid_request("'metadata.user_id' must be a string", param="metadata.user_id")


def _params(body: dict[str, Any]) -> CommonParams:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is required: the id of a model from GET /v1/models", param="model")
    max_tokens = _optional_int(body, "max_tokens", 1)
    if max_tokens is None:
        raise invalid_request("'max_tokens' is required: the most tokens to generate", param="max_tokens")
    stops = body.get("stop_sequences")
    stops = [] if stops is None else stops
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP and all(isinstance(s, str) and s for s in stops)):
        raise invalid_request(f"'stop_sequences' must be a list of at most {MAX_STOP} non-empty strings",
                              param="stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid_request("'stream' must be true or false", param="stream")
    # Anthropic's temperature runs from 0 to 1; its message_delta always carries the usage.
    return CommonParams(model=model, max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 1.0),
                        top_p=_number(body, "top_p", 1.0, 0.0, 1.0), seed=None, stop=tuple(stops), stream=stream,
                        include_usage=True, top_k=_optional_int(body, "top_k", 1) or 0)


def parse_messages(body: Any, bounds: ChatBounds) -> MessagesRequest:
    """The request as the node's chat, refused before any message is looked at when its count alone cannot fit
    `bounds`, as `openai_schema.parse_chat` refuses it."""
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    _refuse_unknown(body, FIELDS)
    _refuse_features(body)
    params = _params(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty list", param="messages")
    system = body.get("system")
    count = len(messages) + (system is not None)
    bounds.check(count, 0)
    if count > bounds.max_messages:
        raise invalid_request(f"the request holds {count} messages (with 'system'); this node takes at most "
                              f"{bounds.max_messages} in one request", param="messages")
    breakpoints: list[Breakpoint] = []
    parsed = []
    if system is not None:
        parsed.append(Message("system", _text_blocks(system, "system", 0, breakpoints)))
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid_request(f"messages[{index}].role must be one of {', '.join(ROLES)}",
                                  param=f"messages[{index}].role")
        _refuse_unknown(message, MESSAGE_FIELDS, f"messages[{index}]")
        parsed.append(Message(message["role"], _text_blocks(message.get("content"), f"messages[{index}].content",
                                                            len(parsed), breakpoints)))
    if parsed[-1].role != "user":
        raise invalid_request(f"the last message must be the user's: continuing a partial assistant message "
                              f"(prefill) is not supported by this node; remove messages[{len(messages) - 1}]",
                              param=f"messages[{len(messages) - 1}].role", code="unsupported_parameter")
    if body.get("cache_control") is not None:
        ttl, group = _cache_control(body["cache_control"], "cache_control")
        breakpoints.append(Breakpoint(len(parsed) - 1, True, ttl, "cache_control", group))
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise invalid_request(f"{len(breakpoints)} blocks carry 'cache_control'; at most {MAX_BREAKPOINTS} may",
                              param=breakpoints[MAX_BREAKPOINTS].param)
    bounds.check(len(parsed), sum(len(m.content.encode("utf-8", "surrogatepass")) for m in parsed))
    return MessagesRequest(ChatRequest(params, tuple(parsed)), tuple(breakpoints))
