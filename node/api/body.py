"""Reading a request's JSON body, and running the steps that grow with a request's size off the event loop."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web

from node.api.keys import CALLER, CONFIG, PREPARE
from node.api.prepare import ANONYMOUS
from node.errors import InvalidRequest, RequestTimeout

T = TypeVar("T")

INLINE_JSON_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop: a thread hop would cost more than the parse."""

ORJSON_MAX_BYTES = 1024 * 1024
"""Bodies over this size are parsed by the standard library's json. With the node's memory locked (hygiene's
mlockall), orjson builds one large string about ten times slower than json does, holding the interpreter lock
all the while: an 8 MB text prompt took 38 ms against json's 3 ms, 145 ms inside a serving node, and /health
waited that long. Below a megabyte orjson is as fast or faster (a 20,000-message chat: 2.8 against 3.7 ms)."""


def _no_constant(name: str) -> object:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def parse_json(raw: bytes) -> object:
    try:
        # orjson: a 2k-token prompt of ids parses in a third of json's time, on every request's TTFT.
        if len(raw) <= ORJSON_MAX_BYTES:
            return orjson.loads(raw)
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)  # orjson's rules: UTF-8, no NaN
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # orjson's error is a json.JSONDecodeError
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg if hasattr(exc, 'msg') else exc}",
                             code="invalid_json") from exc
    except ValueError as exc:  # json's int() past sys.get_int_max_str_digits (orjson reads such a number as a float)
        raise InvalidRequest(f"the request body is not valid JSON: an integer has more than "
                             f"{sys.get_int_max_str_digits()} digits", code="invalid_json") from exc
    except RecursionError as exc:  # json nests by recursion (orjson stops at 1024 levels)
        raise InvalidRequest("the request body is not valid JSON: it nests too deeply", code="invalid_json") from exc


async def off_loop(request: web.Request, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on the PREPARE threads, in the share of the request's caller (`node.api.prepare`): for steps
    that grow with a request's size."""
    caller = request.get(CALLER)
    return await request.app[PREPARE].run(ANONYMOUS if caller is None else caller.name, work, *args)


async def _read_raw(request: web.Request) -> bytes:
    """The body's bytes, within `limits.body_timeout_s`."""
    limit = request.app[CONFIG].limits.body_timeout_s
    try:
        async with asyncio.timeout(limit):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {limit} s") from None


async def read_body(request: web.Request, parse: Callable[[object], T]) -> T:
    """The JSON body, checked by `parse` (a schema parser raising InvalidRequest): on the event loop for a small
    body, on the PREPARE threads for a large one (thousands of messages or token ids to check). A body that takes
    longer than `limits.body_timeout_s` to arrive is refused (RequestTimeout): a client trickling it would hold
    its connection and its buffer for as long as it liked."""
    raw = await _read_raw(request)
    if len(raw) <= INLINE_JSON_BYTES:
        return parse(parse_json(raw))
    return await off_loop(request, lambda: parse(parse_json(raw)))
