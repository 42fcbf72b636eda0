"""JSON-RPC 2.0 at the router's `POST /rpc`: the node's network API names for what the router serves.

    tenzro_getGeneration  {"id": "chatcmpl-..."} or ["chatcmpl-..."]: the caller's own signed record, read from the
                          provider that served it as `GET /v1/generation` reads it (`router.generations`); needs
                          the caller's API key, as for HTTP

The envelope is the node's (`router/jsonrpc.py`), and so are the error codes of each kind of refusal, so that a
client sees one API whether it talks to a node or to a router. A node's `tenzro_getAttestation` is not served: its
evidence is each node's own, read from the node.
"""

from __future__ import annotations

import json

from aiohttp import web

from router.errors import (
    GenerationNotFound,
    InvalidRequest,
    NoProviderAvailable,
    RouterError,
    Unauthenticated,
    UnsupportedMediaType,
)
from router.jsonrpc import INVALID_PARAMS, MAX_BODY_BYTES, PARSE_ERROR, Envelope, Method, error_response

CODES: dict[type[Exception], int] = {
    InvalidRequest: INVALID_PARAMS,
    Unauthenticated: -32001,
    GenerationNotFound: -32004,
    NoProviderAvailable: -32005,
}
"""The node's codes for the same kinds of refusal (node/api/rpc.py `CODES`)."""


def check_body(request: web.Request) -> None:
    """Refuse, before the body is read, what cannot be a JSON-RPC request: not JSON (415), or declared larger than
    MAX_BODY_BYTES (413)."""
    if request.content_type != "application/json":
        raise UnsupportedMediaType("JSON-RPC requests are sent with 'Content-Type: application/json'",
                                   code="unsupported_content_type")
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=request.content_length)


async def answer(body: bytes, methods: dict[str, tuple[Method, tuple[str, ...]]],
                 refused: RouterError | None = None) -> web.Response:
    """The response to a JSON-RPC request body; `refused`: why the request's API key was refused."""
    if len(body) > MAX_BODY_BYTES:  # sent without a length
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=len(body))
    try:
        parsed = json.loads(body)
    except ValueError:  # UnicodeDecodeError is one
        return error_response(PARSE_ERROR, "the body is not JSON")
    return await Envelope(methods, CODES, RouterError).answer(parsed, refused)
