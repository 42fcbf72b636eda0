"""Reading a request's JSON body, and running the steps that grow with a request's size off the event loop."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web

from node.api.keys import CALLER, CONFIG, PREPARE
from node.api.prepare import ANONYMOUS
from node.errors import BodyTooLarge, InvalidRequest, RequestTimeout
from router.edge import read_within

T = TypeVar("T")

INLINE_JSON_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop: a thread hop would cost more than the parse."""

ORJSON_MAX_BYTES = 1024 * 1024
"""Bodies over this size are parsed by the standard library's json. With the node's memory locked (hygiene's
mlockall), orjson builds one large string far slower than json does, holding the interpreter lock all the
while, and /health waits that long. Below a megabyte orjson is as fast or faster (RESULTS.md, 2026-12-01)."""


MAX_JSON_OBJECTS = 32_768
"""Objects a body over ORJSON_MAX_BYTES may hold: the parse stops at the next one. A dict built per object is
what makes a large body slow to parse (289,255 empty messages fit in 8 MB), while the largest chat the limits
accept (`limits.max_messages` messages, each an object with a few content parts) holds far fewer, and a text
prompt or a list of ids holds none. A body up to ORJSON_MAX_BYTES is parsed whole: it holds few enough."""


class _TooManyObjects(Exception):
    pass


def _no_constant(name: str) -> object:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def _object_budget(limit: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An `object_hook` that counts the objects json builds and stops the parse past `limit`."""
    left = limit

    def counted(obj: dict[str, Any]) -> dict[str, Any]:
        nonlocal left
        left -= 1
        if left < 0:
            raise _TooManyObjects
        return obj

    return counted


def parse_json(raw: bytes) -> object:
    try:
        # orjson: a 2k-token prompt of ids parses in a third of json's time, on every request's TTFT.
        if len(raw) <= ORJSON_MAX_BYTES:
            return orjson.loads(raw)
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant,  # orjson's rules: UTF-8, no NaN
                          object_hook=_object_budget(MAX_JSON_OBJECTS))
    except _TooManyObjects:
        raise InvalidRequest(f"the request body holds more than {MAX_JSON_OBJECTS} JSON objects",
                             code="too_many_objects") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # orjson's error is a json.JSONDecodeError
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg if hasattr(exc, 'msg') else exc}",
                             code="invalid_json") from exc
    except ValueError as exc:  # json's int() past sys.get_int_max_str_digits (orjson reads such a number as a float)
        raise InvalidRequest(f"the request body is not valid JSON: an integer has more than "
                             f"{sys.get_int_max_str_digits()} digits", code="invalid_json") from exc
    except RecursionError as exc:  # json nests by recursion (orjson stops at 1024 levels)
        raise InvalidRequest("the request body is not valid JSON: it nests too deeply", code="invalid_json") from exc


def _share(request: web.Request) -> str | None:
    caller = request.get(CALLER)
    return ANONYMOUS if caller is None else caller.name


async def off_loop(request: web.Request, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on the PREPARE threads, in the share of the request's caller (`node.api.prepare`): for steps
    that grow with a request's size."""
    return await request.app[PREPARE].run(_share(request), work, *args)


async def _read_raw(request: web.Request, max_bytes: int | None) -> bytes:
    """The body's bytes, within `limits.body_timeout_s`; a body its `Content-Length` says is over `max_bytes` is
    refused before a byte of it is read."""
    if max_bytes is not None and (request.content_length or 0) > max_bytes:
        raise BodyTooLarge(f"the request body is larger than the limit of {max_bytes} bytes of this route")
    limit = request.app[CONFIG].limits.body_timeout_s
    try:
        raw = await read_within(request, limit)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {limit} s") from None
    if max_bytes is not None and len(raw) > max_bytes:  # sent in chunks, with no length said up front
        raise BodyTooLarge(f"the request body is larger than the limit of {max_bytes} bytes of this route")
    return raw


async def read_body(request: web.Request, parse: Callable[[object], T], max_bytes: int | None = None) -> T:
    """The JSON body, checked by `parse` (a schema parser raising InvalidRequest): on the event loop for a small
    body, on the PREPARE threads for a large one (thousands of messages or token ids to check). A body that takes
    longer than `limits.body_timeout_s` to arrive is refused (RequestTimeout): a client trickling it would hold
    its connection and its buffer for as long as it liked. `max_bytes`: the route's own limit, below the node's
    `limits.max_body_bytes`. A large body refused once read sets its caller's back-off, which the caller's next
    large body waits out before it is read (`FairPreparation.refused`)."""
    if request.content_length is None or request.content_length > INLINE_JSON_BYTES:  # large, or sent in chunks
        await request.app[PREPARE].backoff(_share(request))
    started = time.perf_counter()
    raw = await _read_raw(request, max_bytes)
    if len(raw) <= INLINE_JSON_BYTES:
        return parse(parse_json(raw))
    try:
        return await off_loop(request, lambda: parse(parse_json(raw)))
    except InvalidRequest:
        request.app[PREPARE].refused(_share(request), time.perf_counter() - started)
        raise
