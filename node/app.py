"""The aiohttp application: shared objects under typed keys, error middleware, routes.

Every step of a request whose cost grows with its size (parsing a large body, rendering, tokenizing) runs
on the `PREPARE` threads, never on the event loop, so `/health` and every other route keep answering while
a large request is prepared.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson
from aiohttp import web, web_protocol

from node.auth import KeyRing
from node.config import Caller, NodeConfig
from node.errors import ApiError
from node.log_privacy import Safe
from node.meter import Meter, MeteringPaths
from node.metrics import NodeMetrics
from node.service import ModelService

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", NodeConfig)
KEYRING = web.AppKey("keyring", KeyRing)
SERVICE = web.AppKey("service", ModelService)
METRICS = web.AppKey("metrics", NodeMetrics)
METER = web.AppKey("meter", Meter)
PREPARE = web.AppKey("prepare", ThreadPoolExecutor)
HYGIENE = web.AppKey("hygiene", dict)

PREPARE_THREADS = 2
INLINE_JSON_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop (tens of microseconds); larger ones on PREPARE."""
CLIENT_GONE = "499"
"""The status counted for a request whose client went away before its answer (nginx's convention)."""

T = TypeVar("T")

METER_CLOSE_TIMEOUT_S = 30.0
KEY_REFRESH_S = 0.5
"""How often the config is re-read: a removed key's state is destroyed within this much (plus the job running)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers())


def _parser_error(self: web_protocol.RequestHandler, request: web.BaseRequest, status: int = 500,
                  exc: BaseException | None = None, message: str | None = None) -> web.StreamResponse:
    """aiohttp answers what its HTTP parser rejects (an oversized header line, a malformed request) itself,
    outside every middleware, in plain text, and logs the exception, whose message quotes the first 100
    bytes of the offending line. This replacement answers OpenAI-shaped JSON and logs the error's type only."""
    log.warning("rejected a malformed HTTP request (%s, status %d)", Safe(type(exc).__name__), status)
    if request.writer.output_size > 0:
        raise ConnectionError("the response was already started")
    reason = "the request is not valid HTTP or one of its lines is too long" if status < 500 else "internal error"
    error = ApiError(status, reason, type="invalid_request_error" if status < 500 else "server_error",
                     code="bad_http_request" if status < 500 else None)
    response = _error_response(error)
    response.force_close()
    return response


web_protocol.RequestHandler.handle_error = _parser_error  # type: ignore[method-assign, assignment]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI-shaped JSON body; request counts by route and status."""
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    metrics = request.app[METRICS]
    try:
        response = await handler(request)
    except (asyncio.CancelledError, ConnectionResetError):  # the client went away: nothing to answer
        metrics.requests.labels(endpoint=endpoint, status=CLIENT_GONE).inc()
        raise
    except ApiError as exc:
        response = _error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].limits.max_body_bytes
        response = _error_response(ApiError(413, f"the request body is larger than the limit of {limit} bytes",
                                            code="request_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error_response(ApiError(exc.status, exc.reason or "request failed",
                                            type=HTTP_ERROR_TYPES.get(exc.status, "invalid_request_error")))
    except Exception as exc:  # noqa: BLE001 - the node keeps serving; the type is logged, never the content
        log.error("internal error in %s: %s", Safe(endpoint), Safe(type(exc).__name__))
        response = _error_response(ApiError(500, "internal error; the request was not completed",
                                            type="server_error"))
    metrics.requests.labels(endpoint=endpoint, status=str(response.status)).inc()
    return response


def parse_json(raw: bytes) -> object:
    try:
        # orjson: a 2k-token prompt of ids parses in a third of json's time, on every request's TTFT.
        return orjson.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # orjson's error is a json.JSONDecodeError
        raise ApiError(400, f"the request body is not valid JSON: {exc.msg if hasattr(exc, 'msg') else exc}",
                       code="invalid_json") from exc


async def off_loop(request: web.Request, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on the PREPARE threads: for steps that grow with a request's size."""
    return await asyncio.get_running_loop().run_in_executor(request.app[PREPARE], work, *args)


async def read_body(request: web.Request, parse: Callable[[object], T]) -> T:
    """The JSON body, checked by `parse` (a schema parser raising ApiError): on the event loop for a small
    body, on the PREPARE threads for a large one (thousands of messages or token ids to check)."""
    raw = await request.read()
    if len(raw) <= INLINE_JSON_BYTES:
        return parse(parse_json(raw))
    return await off_loop(request, lambda: parse(parse_json(raw)))


def caller_of(request: web.Request) -> Caller:
    """The caller whose API key the request carries; raises a 401 ApiError otherwise."""
    return request.app[KEYRING].caller_for(request.headers.get("Authorization"))


def create_app(config: NodeConfig, config_path: Path, service: ModelService, metering: MeteringPaths,
               hygiene: dict[str, Any] | None = None) -> web.Application:
    from node import api, metering_routes  # the routes import the keys above

    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=[error_middleware])
    app[CONFIG] = config
    scheduler, runner = service.scheduler, service.runner
    # A caller removed from the config loses its state and keys on the worker thread, which owns them.
    app[KEYRING] = KeyRing(config_path, on_removed=lambda name: scheduler.chore(lambda: runner.drop_caller(name)))
    scheduler.ttl_of = app[KEYRING].ttl_of
    app[SERVICE] = service
    app[HYGIENE] = hygiene or {}
    arena = runner.arena
    app[METRICS] = NodeMetrics(
        cached_bytes=lambda: float(arena.bytes_total) if arena is not None else 0.0,
        queue_waiting=lambda: float(scheduler.waiting),
        snapshot_bytes=lambda: float(arena.snapshot_bytes) if arena is not None else 0.0,
        forward_path=(service.model_id, service.loaded.forward_path.name, service.loaded.forward_path.reason),
        plaintext_bytes=lambda: float(arena.hot_bytes) if arena is not None else 0.0,
        sealed_open_failures=lambda: float(arena.open_failures) if arena is not None else 0.0)

    async def watch_keys(app: web.Application) -> None:
        while True:
            await asyncio.sleep(KEY_REFRESH_S)
            app[KEYRING].refresh()

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        app[PREPARE] = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        scheduler.start()
        watcher = asyncio.create_task(watch_keys(app))
        yield
        watcher.cancel()
        scheduler.stop()
        app[PREPARE].shutdown(wait=False, cancel_futures=True)

    async def meter_ctx(app: web.Application) -> AsyncIterator[None]:
        app[METER] = Meter.open(metering)
        yield
        await app[METER].close(METER_CLOSE_TIMEOUT_S)

    # Cleanup runs in reverse: the meter closes while the engine still runs, so that the cancelled jobs
    # it still has to record can end.
    app.cleanup_ctx.append(engine_ctx)
    app.cleanup_ctx.append(meter_ctx)
    for method, path, handler in api.ROUTES + metering_routes.ROUTES:
        app.router.add_route(method, path, handler)
    return app
