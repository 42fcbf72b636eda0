"""JSON-RPC 2.0's envelope, one for the node's and the router's `POST /rpc`, so that a client sees one API whether
it talks to a node or to a router.

Answers are HTTP 200 with a JSON-RPC response (a batch answers with an array); a refusal, a refused API key
included, is a JSON-RPC error object with a server error code for that kind of refusal (JSON-RPC's reserved range
-32000 to -32099) and, as `data`, the OpenAI-shaped error the HTTP route would give. A notification (a call without
"id") is never answered, not even when it fails; a request or batch of nothing but notifications answers 204. A call
that is not a call object at all is answered with a null id, as JSON-RPC 2.0 says. What stops the body from being
read as JSON-RPC at all is an HTTP error, as on every route, since there is no call to answer yet: not
`application/json` (415), compressed (415), too large (413) or too slow (408); each server refuses those before
it hands the parsed body here.

It lives with the router because the node imports the router's shared edge (`router/edge.py`) and the router never
imports the node.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from aiohttp import web

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = -32700, -32600, -32601, -32602, -32603
MAX_BATCH = 100
MAX_BODY_BYTES = 256 * 1024
"""A call names a method and a completion id or a nonce: a full batch of MAX_BATCH such calls is about ten
kilobytes. A larger body is refused before it is read (413): this route answers strangers, and parsing megabytes
of JSON holds the interpreter lock that every other route's answer needs, on whichever thread it runs."""

Params = dict[str, Any]
Method = Callable[[Params], Awaitable[Any]]
"""A method with its request bound: its named params to its JSON result; raises a refusal to refuse."""


class Refusal(Protocol):
    """What the node's and the router's errors have: a message and the OpenAI-shaped body of the HTTP error."""

    message: str

    def body(self) -> dict[str, Any]: ...


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def error(self) -> dict[str, Any]:
        error = {"code": self.code, "message": self.message}
        return error if self.data is None else {**error, "data": self.data}


def error_response(code: int, message: str) -> web.Response:
    """An error that belongs to no call (the body is not JSON, a batch too large or empty): a null id."""
    return web.json_response({"jsonrpc": "2.0", "error": RpcError(code, message).error(), "id": None})


class Envelope:
    """The server's methods, by name with their params' names, and how its refusals map to error codes."""

    def __init__(self, methods: Mapping[str, tuple[Method, tuple[str, ...]]], codes: Mapping[type[Exception], int],
                 refusals: type[Exception]) -> None:
        self.methods = methods
        self.codes = codes
        """A kind of refusal to its server error code; other refusals are INTERNAL_ERROR."""
        self.refusals = refusals
        """The base class of the server's refusals (each a `Refusal`)."""

    def _refusal(self, error: Exception) -> RpcError:
        code = next((code for kind, code in self.codes.items() if isinstance(error, kind)), INTERNAL_ERROR)
        refusal: Refusal = error  # type: ignore[assignment]  # every `refusals` instance is one
        return RpcError(code, refusal.message, refusal.body()["error"])

    async def answer(self, parsed: Any, refused: Exception | None = None) -> web.Response:
        """The response to a parsed JSON-RPC body. `refused`: why the request's API key was refused, which refuses
        every call."""
        if isinstance(parsed, list):
            if not parsed or len(parsed) > MAX_BATCH:
                return error_response(INVALID_REQUEST, f"a batch holds 1 to {MAX_BATCH} calls")
            answers = [reply for call in parsed if (reply := await self._call(call, refused)) is not None]
            return web.json_response(answers) if answers else web.Response(status=204)
        reply = await self._call(parsed, refused)
        return web.json_response(reply) if reply is not None else web.Response(status=204)

    async def _call(self, call: Any, refused: Exception | None) -> dict[str, Any] | None:
        """One call's response; None for a notification (a call without an id), whatever its outcome."""
        if not _is_call(call):
            error = RpcError(INVALID_REQUEST, "a call is an object with \"jsonrpc\": \"2.0\", a string \"method\", "
                             "optional \"params\" and an optional string or integer \"id\"")
            return {"jsonrpc": "2.0", "error": error.error(), "id": _id_of(call)}
        try:
            if refused is not None:
                raise self._refusal(refused)
            if call["method"] not in self.methods:
                raise RpcError(METHOD_NOT_FOUND, f"no method {call['method']!r}; methods: {', '.join(self.methods)}")
            method, names = self.methods[call["method"]]
            try:
                answer = {"result": await method(_named(call.get("params"), names))}
            except self.refusals as exc:
                raise self._refusal(exc) from exc
        except RpcError as exc:
            answer = {"error": exc.error()}
        return {"jsonrpc": "2.0", **answer, "id": call["id"]} if "id" in call else None


def _named(params: Any, names: tuple[str, ...]) -> Params:
    """By-name or by-position params as a mapping of `names`; anything else is invalid params."""
    if params is None:
        return {}
    if isinstance(params, list) and len(params) <= len(names):
        return dict(zip(names, params, strict=False))
    if isinstance(params, dict) and set(params) <= set(names):
        return params
    raise RpcError(INVALID_PARAMS, f"params must be an object with at most the keys {', '.join(names)} or an "
                   f"array of them in that order")


def _id_of(call: Any) -> str | int | None:
    """The call's id where it has one of a valid type (a string or an integer), else None."""
    ident = call.get("id") if isinstance(call, dict) else None
    return ident if isinstance(ident, str | int) and not isinstance(ident, bool) else None


def _is_call(call: Any) -> bool:
    return (isinstance(call, dict) and call.get("jsonrpc") == "2.0" and isinstance(call.get("method"), str)
            and (call.get("id") is None or _id_of(call) is not None))
