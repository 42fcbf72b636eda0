"""The router's HTTP front: OpenAI-compatible chat and text completions for the router's own callers, each sent
to the provider node `selection` chooses, with the router's key there and the caller's id.

Per request: authenticate the caller with the router's keys; merge the caller's configured requirements with
the request's requirement headers; read the model and the prompt's prefix forms from the body; choose; forward
(`forward.py`: to the next provider in the choice's order while nothing has reached the client, at most
MAX_ATTEMPTS providers). The response names the provider that answered in `Tenzro-Provider`.

Nothing of a prompt outlives its request: the body is held while the request may still be retried, the prefix
forms are digests dropped with it, and no log line carries content. Apart from the registry's caches of what the
nodes say, the router keeps no state, so any number of routers can serve the same providers file side by side.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from policies.requirements import RequirementHeaderError, merge, requirements_from_headers
from router.callers import CallerKeys, RouterCaller
from router.edge import coding_refusal, read_within
from router.errors import (
    GenerationNotFound,
    InvalidRequest,
    ModelNotFound,
    NoProviderAvailable,
    ProvidersFailed,
    RequestTimeout,
    RequirementNotMet,
    RouterError,
    Unauthenticated,
    UnsupportedMediaType,
)
from router.forward import CALLER_HEADER, PROVIDER_HEADER, Forwarded, ProviderFailed, forward, requirement_headers
from router.generations import Generation, find_generation, record_id
from router.jsonrpc import Params
from router.providers import RouterConfig
from router.registry import Registry
from router.rpc import answer as rpc_answer
from router.rpc import check_body
from router.selection import ROUTINGS, rotate, select
from router.summaries import request_prefix_forms

CONFIG = web.AppKey("config", RouterConfig)
KEYS = web.AppKey("keys", CallerKeys)
ROUTING = web.AppKey("routing", str)
"""One of ROUTINGS."""
TURNS = web.AppKey("turns", itertools.count)
SESSION = web.AppKey("session", aiohttp.ClientSession)
REGISTRY = web.AppKey("registry", Registry)

MAX_ATTEMPTS = 3
"""Providers tried per request: each failure marks its provider down, so later requests skip it anyway."""
OFF_LOOP_BYTES = 256 * 1024
"""A body larger than this is parsed and hashed on a thread, so that a large prompt does not stall the loop."""

STATUS: dict[type[RouterError], int] = {
    InvalidRequest: 400,
    Unauthenticated: 401,
    ModelNotFound: 404,
    GenerationNotFound: 404,
    RequestTimeout: 408,
    RequirementNotMet: 412,
    UnsupportedMediaType: 415,
    ProvidersFailed: 502,
    NoProviderAvailable: 503,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def status_of(error: RouterError) -> int:
    return next(status for kind, status in STATUS.items() if isinstance(error, kind))


def _error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal leaves as an OpenAI-shaped JSON body, aiohttp's own (404, 405, 413) included."""
    try:
        return await handler(request)
    except RouterError as exc:
        response = web.json_response(exc.body(), status=status_of(exc))
        if isinstance(exc, RequestTimeout):
            response.force_close()  # the rest of the body may still come, and would read as the next request
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return _error(exc.status, exc.text or exc.reason, kind)


@web.middleware
async def refuse_compressed(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a compressed body (415) or an unknown `Content-Encoding` (400) before the body is read or a key is
    checked (`router.edge`; the server inflates nothing either way)."""
    refusal = coding_refusal(request.headers)
    if refusal is not None:
        raise (UnsupportedMediaType if refusal.compressed else InvalidRequest)(refusal.message, code=refusal.code)
    return await handler(request)


def _caller(request: web.Request) -> RouterCaller:
    authorization = request.headers.getall("Authorization", [])
    if len(authorization) > 1:  # which one would count is a guess: refused rather than guessed
        raise Unauthenticated(f"the request has {len(authorization)} Authorization headers: send one, "
                              f"'Authorization: Bearer <key>'", code="duplicate_authorization")
    return request.app[KEYS].caller_for(authorization[0] if authorization else None)


async def _body(request: web.Request) -> bytes:
    limit = request.app[CONFIG].settings.body_timeout_s
    try:
        return await read_within(request, limit)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {limit:g} s") from None


def _model_and_forms(body: bytes, chat: bool) -> tuple[str, list[bytes]]:
    try:
        parsed: Any = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError is one
        raise InvalidRequest("the body must be a JSON object", code="invalid_json") from exc
    if not isinstance(parsed, dict):
        raise InvalidRequest("the body must be a JSON object", code="invalid_json")
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must name a model; GET /v1/models lists them", param="model")
    return model, request_prefix_forms(parsed, chat)


async def _complete(request: web.Request, path: str, chat: bool) -> web.StreamResponse:
    caller = _caller(request)
    try:
        requested = requirements_from_headers(request.headers)
    except RequirementHeaderError as exc:
        raise InvalidRequest(str(exc), param=exc.header, code="invalid_requirement_header") from exc
    requirements = merge(caller.requirements, requested)
    body = await _body(request)
    if len(body) > OFF_LOOP_BYTES:
        model, forms = await asyncio.to_thread(_model_and_forms, body, chat)
    else:
        model, forms = _model_and_forms(body, chat)
    registry = request.app[REGISTRY]
    candidates, routing = registry.candidates(model, caller.name), request.app[ROUTING]
    if routing == "round-robin":
        turns: itertools.count[int] = request.app[TURNS]
        choice = rotate(candidates, requirements, caller.min_trust_tier, next(turns))
    else:
        choice = select(candidates, requirements, caller.min_trust_tier, forms, warm_bias=routing == "warm")
    forwarded = Forwarded(path, body, {"Content-Type": "application/json", CALLER_HEADER: caller.name,
                                       **requirement_headers(requirements)}, model)
    failures: list[ProviderFailed] = []
    for name in choice.order[:MAX_ATTEMPTS]:
        try:
            return await forward(registry, request.app[SESSION], registry.state(name).spec, forwarded,
                                 request.app[CONFIG].settings, request)
        except ProviderFailed as failure:
            failures.append(failure)
    answered = [failure.answer for failure in failures if failure.answer is not None]
    if answered:  # the provider's own refusal says more than ours would
        return web.Response(status=answered[-1].status, body=answered[-1].body, headers=answered[-1].headers)
    raise ProvidersFailed("no provider answered: " + "; ".join(str(failure) for failure in failures))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "/v1/chat/completions", chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "/v1/completions", chat=False)


async def models(request: web.Request) -> web.Response:
    _caller(request)
    return web.json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "tenzro"}
        for model in request.app[REGISTRY].models()]})


async def _generation(request: web.Request, caller: RouterCaller, value: object) -> Generation:
    return await find_generation(request.app[REGISTRY], request.app[SESSION],
                                 request.app[CONFIG].settings.connect_timeout_s, request.app[CONFIG].providers,
                                 caller.name, record_id(value))


async def generation(request: web.Request) -> web.Response:
    """The caller's own signed record of one completion, as the provider that served it keeps it."""
    found = await _generation(request, _caller(request), request.query.get("id"))
    return web.Response(body=found.body, content_type="application/json", headers={PROVIDER_HEADER: found.provider})


async def rpc(request: web.Request) -> web.Response:
    """JSON-RPC (`router.rpc`): a refused key refuses each call, as at a node, rather than the request."""
    check_body(request)
    caller: RouterCaller | None = None
    refused: Unauthenticated | None = None
    try:
        caller = _caller(request)
    except Unauthenticated as exc:
        refused = exc

    async def get_generation(params: Params) -> Any:
        assert caller is not None  # a refused key refuses every call first
        return (await _generation(request, caller, params.get("id"))).record

    return await rpc_answer(await _body(request), {"tenzro_getGeneration": (get_generation, ("id",))}, refused)


async def health(request: web.Request) -> web.Response:
    """That the router serves, and how many of its providers are up; no key needed."""
    states = [request.app[REGISTRY].state(spec.name) for spec in request.app[CONFIG].providers]
    return web.json_response({"status": "ok", "providers": len(states),
                              "providers_up": sum(state.up for state in states)})


async def _providers(app: web.Application) -> AsyncIterator[None]:
    """The session to the nodes and the registry: a first poll before serving, then one every interval."""
    # No connection limit: each forwarded request holds one connection for as long as its answer streams,
    # and the nodes' queues, not the router, bound the work.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar())
    registry = Registry(app[CONFIG].providers, session, app[CONFIG].settings, app[CONFIG].trust)
    app[SESSION], app[REGISTRY] = session, registry
    await registry.poll()
    polling = asyncio.create_task(registry.run())
    yield
    polling.cancel()
    await asyncio.gather(polling, return_exceptions=True)
    await registry.close()
    await session.close()


def create_app(config: RouterConfig, routing: str = "warm") -> web.Application:
    assert routing in ROUTINGS
    app = web.Application(middlewares=[openai_errors, refuse_compressed],
                          client_max_size=config.settings.max_body_bytes)
    app[CONFIG], app[KEYS], app[ROUTING], app[TURNS] = config, CallerKeys(config.callers), routing, itertools.count()
    app.cleanup_ctx.append(_providers)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/generation", generation)
    app.router.add_post("/rpc", rpc)
    app.router.add_get("/health", health)
    return app
