"""OpenAI request bodies parsed into typed records; every invalid field gets a 400 naming it.

Each field a body may hold is of one of three kinds. Honoured: read into the records below. Unsupported
(`UNSUPPORTED`): OpenAI's field for a feature this node does not implement, refused unless its value asks for
nothing (`store: false`, `modalities: ["text"]`, `tools: []`). Ignored (`IGNORED`: `user`, `safety_identifier`,
`prompt_cache_key`): accepted because neither the reply nor what the node keeps depends on them. Any other field
is unknown and refused, every unknown name in one message, as OpenAI refuses it: a misspelt `max_token` or a
field newer than this node would otherwise be served as if it were absent. Chat messages are held to the same
rule (`MESSAGE_FIELDS`), and so is `stream_options`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node.attachments import AttachmentLimits, MediaAttachment, collect_attachments
from node.errors import invalid_request

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
MAX_LOGIT_BIAS = 300
"""Entries of `logit_bias` at most (OpenAI's limit)."""
SEED_RANGE = (-(2**63), 2**63 - 1)
"""A signed 64-bit integer, as OpenAI's API documents it."""

TOOLS = "tool calling is not supported by this node yet"


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A field OpenAI defines for a feature this node does not implement."""

    why: str
    no_ops: tuple[object, ...] = (None,)
    """The values that ask for nothing the node lacks, accepted (compared with their JSON type: `0` is not
    `false`); any other value is refused, never served without the feature."""


UNSUPPORTED: dict[str, Unsupported] = {
    "tools": Unsupported(TOOLS, (None, [])),
    "tool_choice": Unsupported(TOOLS, (None, "none")),
    "parallel_tool_calls": Unsupported(TOOLS, (None, False, True)),  # means nothing without tools
    "functions": Unsupported("function calling is not supported by this node", (None, [])),
    "function_call": Unsupported("function calling is not supported by this node", (None, "none")),
    "top_logprobs": Unsupported("log probabilities are not supported by this node", (None, 0)),
    "prediction": Unsupported("predicted outputs are not supported by this node"),
    "audio": Unsupported("audio output is not supported by this node"),
    "modalities": Unsupported("this node answers in text only: 'modalities' may only be [\"text\"]",
                              (None, ["text"])),
    "web_search_options": Unsupported("web search is not supported by this node"),
    "store": Unsupported("this node stores no completions: 'store' may only be false", (None, False)),
    "metadata": Unsupported("metadata tags stored completions, and this node stores none", (None, {})),
    "reasoning_effort": Unsupported("reasoning effort is not supported by this node's models"),
    "verbosity": Unsupported("'verbosity' is not supported by this node's models"),
    "service_tier": Unsupported("this node has one service tier: 'service_tier' may only be \"auto\" or "
                                "\"default\"", (None, "auto", "default")),
    "moderation": Unsupported("moderation is not supported by this node"),
    "prompt_cache_options": Unsupported("prompt cache options are not supported by this node: it reuses every "
                                        "caller's prefixes without them (see 'prompt_cache_retention')", (None, {})),
    "echo": Unsupported("'echo' is not supported by this node", (None, False)),
    "suffix": Unsupported("'suffix' is not supported by this node", (None, "")),
    "tool_calls": Unsupported(TOOLS, (None, [])),
    "tool_call_id": Unsupported(TOOLS),
    "refusal": Unsupported("an assistant message's 'refusal' is not supported by this node: send the text as "
                           "its content"),
    "name": Unsupported("participant names are not supported by this node: its chat template does not show them "
                        "to the model (write the name into the content)"),
}
"""Fields of requests (and of chat messages: `tool_calls`, `tool_call_id`, `refusal`, `name`, `audio`) that ask
for what this node does not do: a request that sets one to anything but a no-op value is refused (400,
`unsupported_parameter`), never silently served without it."""

IGNORED = {
    "user": "OpenAI's end-user label for abuse monitoring: the node knows its callers by their keys and keeps "
            "no per-user records, and the reply does not depend on it",
    "safety_identifier": "`user`'s successor, ignored for the same reason",
    "prompt_cache_key": "a hint OpenAI routes by to raise cache hits: this node reuses each caller's stored "
                        "prefixes whatever the key, and the reply does not depend on it",
}
"""Fields accepted (a string or null) and ignored, and why: none changes the reply or what is kept."""

SHARED_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
    "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "n", "logprobs", "return_token_ids",
    "prompt_cache_retention", "user"})
"""The fields both completion routes take (`n` and `logprobs` at their single supported value)."""
CHAT_FIELDS = SHARED_FIELDS | frozenset(IGNORED) | {"messages", "response_format"} | {
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "top_logprobs", "prediction",
    "audio", "modalities", "web_search_options", "store", "metadata", "reasoning_effort", "verbosity",
    "service_tier", "moderation", "prompt_cache_options"}
COMPLETION_FIELDS = SHARED_FIELDS | {"prompt", "best_of", "echo", "suffix"}
"""Any other top-level field is refused as unknown (400, `unknown_parameter`), as OpenAI refuses it."""
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio",
                            "function_call"})
PLAIN_MESSAGE = frozenset({"role", "content"})
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
"""`stream_options` keys; the node pads no stream event, so `include_obfuscation` is taken only as false."""


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    """The message's text (its text parts joined, where it has parts)."""
    parts: tuple[str | MediaAttachment, ...] = ()
    """Its text, image and audio parts in order, for a message that holds an attachment; empty otherwise."""


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias added to its logit) pairs; ids are checked against the vocabulary by the service."""
    return_token_ids: bool = False
    """An extension (as in vLLM): the response also carries the prompt's and the reply's token ids, so an
    agent can send ids back and never lose reuse to re-tokenisation."""
    retain: bool = True
    """`prompt_cache_retention` (OpenAI's field): "in_memory", the default, keeps this request's state for
    the caller's reuse; "none", this node's value, keeps nothing of it after the reply."""
    retention: str = "in_memory"
    """`prompt_cache_retention` as sent (RETENTION_VALUES): "24h" keeps the state as "in_memory" does, with the
    longer time to live the TTL work (issue 41) gives it."""
    top_k: int = 0
    """Sample among the k most likely tokens (Anthropic's `top_k`); 0: no limit."""


@dataclass(frozen=True, slots=True)
class ChatBounds:
    """What a chat may hold, checked as its body is parsed, before it is rendered: rendering and tokenizing grow
    with the rendered conversation, which each message lengthens by the template's markup even when empty (an 8 MB
    body of 289,255 empty messages rendered to 1.7 M tokens)."""

    max_messages: int
    """`limits.max_messages`."""
    context_length: int
    token_bytes: int
    """The most bytes of text one token of the model stands for (`LoadedModel.max_token_bytes`)."""
    message_tokens: int
    """The fewest tokens the model's chat template writes for each message after the first
    (`chat_template.message_tokens`)."""
    attachments: AttachmentLimits | None = None
    """What image and audio parts a request may hold (`node/attachments.py`); None: the model takes text parts
    only."""

    def least_tokens(self, messages: int, content_bytes: int) -> int:
        """Tokens a conversation of `messages` messages holding `content_bytes` bytes of content renders to at
        least: its content's and its markup's are distinct tokens."""
        return -(-content_bytes // self.token_bytes) + self.message_tokens * max(0, messages - 1)

    def check(self, messages: int, content_bytes: int) -> None:
        least = self.least_tokens(messages, content_bytes)
        if least >= self.context_length:
            raise invalid_request(
                f"the conversation is at least {least} tokens ({messages} messages, each after the first at least "
                f"{self.message_tokens} tokens of this model's chat template, and {content_bytes} bytes of content, "
                f"no token more than {self.token_bytes} bytes); this model's context length is "
                f"{self.context_length} tokens", param="messages", code="context_length_exceeded")


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


def _refuse_unknown(fields: dict[str, Any], known: frozenset[str], where: str = "") -> None:
    """Every field of `fields` outside `known` named in one 400: a misspelt or newer field is never ignored."""
    unknown = [f"{where}.{name}" if where else name for name in fields if name not in known]
    if unknown:
        plural = len(unknown) > 1
        raise invalid_request(
            f"unknown parameter{'s' if plural else ''} {', '.join(map(repr, unknown))}: remove "
            f"{'them' if plural else 'it'} (this node refuses the fields it does not know rather than ignore them)",
            param=unknown[0], code="unknown_parameter")


def _is_no_op(value: Any, no_ops: tuple[object, ...]) -> bool:
    return any(type(value) is type(no_op) and value == no_op for no_op in no_ops)


def _refuse_unsupported_fields(fields: dict[str, Any], where: str = "") -> None:
    for name, value in fields.items():
        unsupported = UNSUPPORTED.get(name)
        if unsupported is not None and not _is_no_op(value, unsupported.no_ops):
            param = f"{where}.{name}" if where else name
            raise invalid_request(f"{unsupported.why}; remove '{param}' from the request", param=param,
                                  code="unsupported_parameter")


def _refuse_unsupported(body: dict[str, Any]) -> None:
    _refuse_unsupported_fields(body)
    for name in IGNORED:
        if not isinstance(body.get(name, ""), str | None):
            raise invalid_request(f"'{name}' must be a string", param=name)
    n = body.get("n", 1)
    if n is not None and (type(n) is not int or n != 1):
        raise invalid_request("'n' must be 1: this node returns one choice per request", param="n")
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != 1):
        raise invalid_request("'best_of' must be 1: this node returns one choice per request", param="best_of")
    if body.get("logprobs") not in (None, False):
        raise invalid_request("'logprobs' is not supported by this node", param="logprobs",
                              code="unsupported_parameter")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise invalid_request("structured output ('response_format' other than {\"type\": \"text\"}) is not "
                              "supported by this node yet", param="response_format", code="unsupported_parameter")


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid_request(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids to biases",
                              param="logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid_request("'logit_bias' keys must be token ids written as decimal strings",
                                  param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise invalid_request("'logit_bias' values must be numbers between -100 and 100", param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _seed(body: dict[str, Any]) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    low, high = SEED_RANGE
    if type(value) is not int or not low <= value <= high:
        raise invalid_request(f"'seed' must be an integer between {low} and {high}", param="seed")
    return value


RETENTION_VALUES = ("in_memory", "24h", "none")


def _retention(body: dict[str, Any]) -> str:
    value = body.get("prompt_cache_retention")
    if value is None:
        return "in_memory"
    if value not in RETENTION_VALUES:
        raise invalid_request("'prompt_cache_retention' must be \"in_memory\" (keep this request's state for "
                              "your reuse, in memory only), \"24h\" (the same, kept up to 24 hours) or \"none\" "
                              "(keep nothing after the reply)", param="prompt_cache_retention")
    return str(value)


def _common(body: Any, known: frozenset[str]) -> CommonParams:
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    _refuse_unknown(body, known)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is required: the id of a model from GET /v1/models", param="model")
    _refuse_unsupported(body)
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
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise invalid_request("'stream_options' must be an object like {\"include_usage\": true}",
                              param="stream_options")
    _refuse_unknown(options, STREAM_OPTIONS, "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise invalid_request("'stream_options.include_usage' must be true or false",
                              param="stream_options.include_usage")
    if not _is_no_op(options.get("include_obfuscation"), (None, False)):
        raise invalid_request("this node adds no obfuscation to its stream events: "
                              "'stream_options.include_obfuscation' may only be false",
                              param="stream_options.include_obfuscation", code="unsupported_parameter")
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool):
        raise invalid_request("'return_token_ids' must be true or false", param="return_token_ids")
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    return CommonParams(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=_seed(body),
        stop=stops,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body),
        return_token_ids=return_ids,
        retain=_retention(body) != "none",
        retention=_retention(body),
    )


def _content(value: Any, index: int, role: str, attachments: dict[tuple[int, int], MediaAttachment] | None
             ) -> tuple[str, tuple[str | MediaAttachment, ...]]:
    """The message's text, and its parts where it holds an attachment (`attachments`: the request's, by message and
    part; None where the model takes text parts only)."""
    if isinstance(value, str):
        return value, ()
    if value is None and role == "assistant":
        return "", ()
    if isinstance(value, list):
        parts: list[str | MediaAttachment] = []
        for at, part in enumerate(value):
            attachment = attachments.get((index, at)) if attachments is not None else None
            if attachment is not None:
                parts.append(attachment)
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                what = "text" if attachments is None else "text, image_url and input_audio"
                raise invalid_request(f"messages[{index}].content[{at}]: only {what} parts are supported by this "
                                      "model", param=f"messages[{index}].content[{at}]")
            parts.append(part["text"])
        text = "".join(part for part in parts if isinstance(part, str))
        return text, tuple(parts) if any(not isinstance(part, str) for part in parts) else ()
    raise invalid_request(f"messages[{index}].content must be a string or a list of text parts",
                          param=f"messages[{index}].content")


def parse_chat(body: Any, bounds: ChatBounds) -> ChatRequest:
    """The chat, refused before any message is looked at when its count alone cannot fit `bounds` (a body of
    hundreds of thousands of empty messages is answered in the time it takes to parse)."""
    params = _common(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty list", param="messages")
    bounds.check(len(messages), 0)
    if len(messages) > bounds.max_messages:
        raise invalid_request(f"'messages' holds {len(messages)} messages; this node takes at most "
                              f"{bounds.max_messages} in one request", param="messages",
                              code="array_above_max_length")
    parsed = []
    content_bytes = 0
    attachments: dict[tuple[int, int], MediaAttachment] | None = None
    if bounds.attachments is not None:
        attachments = {(placed.index.message, placed.index.part): placed.attachment
                       for placed in collect_attachments(messages, bounds.attachments)}
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid_request(f"messages[{index}].role must be one of {', '.join(ROLES)}",
                                  param=f"messages[{index}].role")
        if not message.keys() <= PLAIN_MESSAGE:  # checked only where there is more to check (a long chat's cost)
            _refuse_unknown(message, MESSAGE_FIELDS, f"messages[{index}]")
            _refuse_unsupported_fields(message, f"messages[{index}]")
        content, parts = _content(message.get("content"), index, message["role"], attachments)
        content_bytes += len(content.encode("utf-8", "surrogatepass"))
        parsed.append(Message(message["role"], content, parts))
    bounds.check(len(parsed), content_bytes)
    return ChatRequest(params, tuple(parsed))


def parse_completion(body: Any) -> CompletionRequest:
    params = _common(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one, as OpenAI clients send it
    if isinstance(prompt, str) and prompt:
        return CompletionRequest(params, prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):  # not bool, JSON's true
        return CompletionRequest(params, tuple(prompt))
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid_request("send one prompt per request: batches of prompts are not supported", param="prompt")
    raise invalid_request("'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")
