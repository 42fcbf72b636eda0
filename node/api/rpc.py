"""JSON-RPC 2.0 at `POST /rpc`: the network API's names for what the HTTP routes serve.

    tenzro_getGeneration  {"id": "chatcmpl-..."} or ["chatcmpl-..."]: a caller's own signed record, under
                          `GET /v1/generation`'s access rule (its caller or an auditor; anyone else gets the
                          one not-found answer every unknown id gets); needs the API key as for HTTP
    tenzro_getAttestation {"nonce": HEX} or [HEX] or none: `GET /v1/attestation`'s evidence document

Answers are HTTP 200 with a JSON-RPC response (a batch answers with an array); a refusal, a refused API key
included, is a JSON-RPC error object whose `data` holds the OpenAI-shaped error the HTTP route would give. A
notification (a call without "id") is never answered, not even when it fails; a request or batch of nothing but
notifications answers 204. A call that is not a call object at all is answered with a null id, as JSON-RPC 2.0
says. What stops the body from being read as JSON-RPC at all is an HTTP error, as on every route, since there is no
call to answer yet: a body not sent as `application/json` (415), compressed (415), too large (413) or too slow
(408).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from node.api.body import read_body
from node.api.identity import evidence_document, parse_nonce
from node.api.keys import CALLER, METER
from node.api.middleware import authenticate
from node.api.records import visible_record
from node.errors import (
    InvalidRequest,
    NodeError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    UnsupportedMediaType,
)

routes = web.RouteTableDef()

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = -32700, -32600, -32601, -32602, -32603
CODES: dict[type[NodeError], int] = {
    InvalidRequest: INVALID_PARAMS,
    Unauthenticated: -32001,
    PermissionDenied: -32003,
    NotFound: -32004,
    Unavailable: -32005,
}
"""Server errors in JSON-RPC's reserved range -32000 to -32099, one per kind of refusal."""
MAX_BATCH = 100
MAX_BODY_BYTES = 256 * 1024
"""A call names a method and a completion id or a nonce: a full batch of MAX_BATCH such calls is about ten
kilobytes. A larger body is refused before it is read (413): this route answers strangers, and parsing megabytes
of JSON holds the interpreter lock that every other route's answer needs, on whichever thread it runs."""

Method = Callable[[web.Request, dict[str, Any]], Awaitable[Any]]


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def error(self) -> dict[str, Any]:
        error = {"code": self.code, "message": self.message}
        return error if self.data is None else {**error, "data": self.data}


def _named(params: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """By-name or by-position params as a mapping of `names`; anything else is invalid params."""
    if params is None:
        return {}
    if isinstance(params, list) and len(params) <= len(names):
        return dict(zip(names, params, strict=False))
    if isinstance(params, dict) and set(params) <= set(names):
        return params
    raise RpcError(INVALID_PARAMS, f"params must be an object with at most the keys {', '.join(names)} or an "
                   f"array of them in that order")


async def get_generation(request: web.Request, params: dict[str, Any]) -> Any:
    caller = request.get(CALLER)
    if caller is None:
        raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
    record_id = params.get("id")
    if not isinstance(record_id, str):
        raise InvalidRequest("'id' must be a completion id (chatcmpl-... or cmpl-...)", param="id")
    return visible_record(request.app[METER].ledger, {"id": record_id}, caller).to_json()


async def get_attestation(request: web.Request, params: dict[str, Any]) -> Any:
    nonce = params.get("nonce")
    if nonce is not None and not isinstance(nonce, str):
        raise InvalidRequest("'nonce' must be a string of hex characters", param="nonce")
    return await evidence_document(request, parse_nonce(nonce))


METHODS: dict[str, tuple[Method, tuple[str, ...]]] = {
    "tenzro_getGeneration": (get_generation, ("id",)),
    "tenzro_getAttestation": (get_attestation, ("nonce",)),
}


def _refusal(error: NodeError) -> RpcError:
    code = next((code for kind, code in CODES.items() if isinstance(error, kind)), INTERNAL_ERROR)
    return RpcError(code, error.message, error.body()["error"])


def _id_of(call: Any) -> str | int | None:
    """The call's id where it has one of a valid type (a string or an integer), else None."""
    ident = call.get("id") if isinstance(call, dict) else None
    return ident if isinstance(ident, str | int) and not isinstance(ident, bool) else None


def _is_call(call: Any) -> bool:
    return (isinstance(call, dict) and call.get("jsonrpc") == "2.0" and isinstance(call.get("method"), str)
            and (call.get("id") is None or _id_of(call) is not None))


async def _call(request: web.Request, call: Any, refused: NodeError | None) -> dict[str, Any] | None:
    """One call's response; None for a notification (a call without an id), whatever its outcome. `refused`: why
    the request's API key was refused, which refuses every call."""
    if not _is_call(call):
        error = RpcError(INVALID_REQUEST, "a call is an object with \"jsonrpc\": \"2.0\", a string \"method\", "
                         "optional \"params\" and an optional string or integer \"id\"")
        return {"jsonrpc": "2.0", "error": error.error(), "id": _id_of(call)}
    try:
        if refused is not None:
            raise _refusal(refused)
        if call["method"] not in METHODS:
            raise RpcError(METHOD_NOT_FOUND, f"no method {call['method']!r}; methods: {', '.join(METHODS)}")
        method, names = METHODS[call["method"]]
        try:
            answer = {"result": await method(request, _named(call.get("params"), names))}
        except NodeError as exc:
            raise _refusal(exc) from exc
    except RpcError as exc:
        answer = {"error": exc.error()}
    return {"jsonrpc": "2.0", **answer, "id": call["id"]} if "id" in call else None


@routes.post("/rpc")
async def rpc(request: web.Request) -> web.Response:
    if request.content_type != "application/json":
        raise UnsupportedMediaType("JSON-RPC requests are sent with 'Content-Type: application/json'",
                                   code="unsupported_content_type")
    try:
        authenticate(request, required=False)  # first: a large body is parsed in its caller's share
        refused = None
    except NodeError as exc:
        refused = exc
    try:
        body = await read_body(request, lambda parsed: parsed, MAX_BODY_BYTES)
    except InvalidRequest as exc:
        return web.json_response({"jsonrpc": "2.0", "error": RpcError(PARSE_ERROR, exc.message).error(), "id": None})
    if isinstance(body, list):
        if not body or len(body) > MAX_BATCH:
            error = RpcError(INVALID_REQUEST, f"a batch holds 1 to {MAX_BATCH} calls")
            return web.json_response({"jsonrpc": "2.0", "error": error.error(), "id": None})
        answers = [answer for call in body if (answer := await _call(request, call, refused)) is not None]
        return web.json_response(answers) if answers else web.Response(status=204)
    answer = await _call(request, body, refused)
    return web.json_response(answer) if answer is not None else web.Response(status=204)
