"""Middleware: every failure leaves as an OpenAI-shaped JSON body, and every request past the public routes
carries an authenticated caller.

Handlers and the service raise the node's domain errors (`node.errors`); `STATUS` is the one place that says
which HTTP status each kind of refusal gets.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web, web_protocol

from node.api.anthropic_errors import ANTHROPIC_ROUTES, error_body
from node.api.keys import CALLER, CONFIG, KEYRING, METRICS
from node.auth import CALLER_HEADER, acting_for
from node.errors import (
    BodyTooLarge,
    InvalidRequest,
    ModelFailure,
    NodeError,
    NotFound,
    Overloaded,
    PermissionDenied,
    RequestTimeout,
    RequirementNotMet,
    Unauthenticated,
    Unavailable,
    UnsupportedMediaType,
)
from node.log_privacy import Safe
from router.edge import coding_refusal

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

STATUS: dict[type[NodeError], int] = {
    InvalidRequest: 400,
    Unauthenticated: 401,
    PermissionDenied: 403,
    NotFound: 404,
    RequestTimeout: 408,
    RequirementNotMet: 412,  # the conditions the request states (its headers, its caller's config) are not met
    BodyTooLarge: 413,
    UnsupportedMediaType: 415,
    ModelFailure: 500,
    Overloaded: 503,
    Unavailable: 503,
}
HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
CLIENT_GONE = "499"
"""The status counted for a request whose client went away before an answer."""

API_KEY_HEADER = "x-api-key"
PUBLIC_ROUTES = frozenset({"/health", "/v1/node", "/v1/attestation", "/rpc"})
"""Routes that answer without a key. A key sent to them is still checked, and what they show beyond the public
part depends on it (`/health`'s queue depth for operators; JSON-RPC methods that read a caller's records)."""
SELF_AUTHENTICATED = frozenset({"/rpc"})
"""Public routes that call `authenticate` themselves, to answer a refused key in their own protocol (JSON-RPC's
error objects, one per call)."""


def status_of(error: NodeError) -> int:
    return next(status for kind, status in STATUS.items() if isinstance(error, kind))


def error_response(status: int, body: dict[str, Any], retry_after_s: int | None = None) -> web.Response:
    headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return web.json_response(body, status=status, headers=headers)


def node_error_response(error: NodeError) -> web.Response:
    return error_response(status_of(error), error.body(), error.retry_after_s)


def _http_error(status: int, message: str, code: str | None = None) -> web.Response:
    kind = HTTP_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return error_response(status, {"error": {"message": message, "type": kind, "param": None, "code": code}})


def _parser_error(self: web_protocol.RequestHandler, request: web.BaseRequest, status: int = 500,
                  exc: BaseException | None = None, message: str | None = None) -> web.StreamResponse:
    """aiohttp answers what its HTTP parser rejects (an oversized header line, a malformed request) itself,
    outside every middleware, in plain text, and logs the exception, whose message quotes the first 100
    bytes of the offending line. This replacement answers OpenAI-shaped JSON and logs the error's type only."""
    log.warning("rejected a malformed HTTP request (%s, status %d)", Safe(type(exc).__name__), status)
    if request.writer.output_size > 0:
        raise ConnectionError("the response was already started")
    if status < 500:
        response = _http_error(status, "the request is not valid HTTP or one of its lines is too long",
                               "bad_http_request")
    else:
        response = _http_error(status, "internal error")
    response.force_close()
    return response


web_protocol.RequestHandler.handle_error = _parser_error  # type: ignore[method-assign, assignment]


def _route(request: web.Request) -> str | None:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else None


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI-shaped JSON body (Anthropic's on its dialect's routes); request counts by
    route and status."""
    endpoint = _route(request) or "unmatched"
    metrics = request.app[METRICS]
    try:
        response = await handler(request)
    except (asyncio.CancelledError, ConnectionResetError):  # the client went away: nothing to answer
        metrics.requests.labels(endpoint=endpoint, status=CLIENT_GONE).inc()
        raise
    except NodeError as exc:
        response = node_error_response(exc)
        if isinstance(exc, RequestTimeout | BodyTooLarge):
            response.force_close()  # the rest of the body may still come, and would read as the next request
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].limits.max_body_bytes
        response = _http_error(413, f"the request body is larger than the limit of {limit} bytes",
                               "request_too_large")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _http_error(exc.status, exc.reason or "request failed")
    except Exception as exc:  # noqa: BLE001 - the node keeps serving; the type is logged, never the content
        log.error("internal error in %s: %s", Safe(endpoint), Safe(type(exc).__name__))
        response = _http_error(500, "internal error; the request was not completed")
    if (endpoint in ANTHROPIC_ROUTES and response.status >= 400 and isinstance(response, web.Response)
            and response.text is not None):  # Anthropic's dialect answers in its own error body
        response.text = json.dumps(error_body(response.status, json.loads(response.text)))
    metrics.requests.labels(endpoint=endpoint, status=str(response.status)).inc()
    return response


@web.middleware
async def coding_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a compressed body (415) or an unknown `Content-Encoding` (400) before the body is read or a key is
    checked: no route takes a compressed body, and inflating is work a stranger could make the node do
    (`router.edge`; the server inflates nothing either way)."""
    refusal = coding_refusal(request.headers)
    if refusal is not None:
        raise (UnsupportedMediaType if refusal.compressed else InvalidRequest)(refusal.message, code=refusal.code)
    return await handler(request)


def authenticate(request: web.Request, required: bool) -> None:
    """Put the effective caller of the request on it (`CALLER`): the caller of its API key or, for a router key
    sending `Tenzro-Caller`, the caller the router acts for (`node.auth.acting_for`). Without a key nor
    `Tenzro-Caller`, raises Unauthenticated if `required`, else leaves the request without a caller."""
    authorization = request.headers.getall("Authorization", [])
    # Anthropic's clients send their key as `x-api-key`: the same key, in another header.
    api_keys = [f"Bearer {key}" for key in request.headers.getall(API_KEY_HEADER, [])]
    asserted = request.headers.getall(CALLER_HEADER, [])
    if not (required or authorization or api_keys or asserted):
        return
    if len(authorization) + len(api_keys) > 1:  # which one would count is a guess: refused rather than guessed
        headers = f"{len(authorization)} Authorization" + (f" and {len(api_keys)} {API_KEY_HEADER}" if api_keys else "")
        raise Unauthenticated(f"the request has {headers} headers: send one, 'Authorization: Bearer <key>'"
                              + (f" or '{API_KEY_HEADER}: <key>'" if api_keys else ""), code="duplicate_authorization")
    authorization += api_keys
    caller = request.app[KEYRING].caller_for(authorization[0] if authorization else None)
    # The header sent twice reads as its values joined by ", " (RFC 9110), which no caller id matches.
    request[CALLER] = acting_for(caller, ", ".join(asserted)) if asserted else caller


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`authenticate` every matched route: required on all but the public ones, checked on those too when a key
    or `Tenzro-Caller` is sent; the routes in SELF_AUTHENTICATED call it themselves. Unmatched paths go on to
    their 404 or 405."""
    route = _route(request)
    if route is not None and route not in SELF_AUTHENTICATED:
        authenticate(request, required=route not in PUBLIC_ROUTES)
    return await handler(request)
