"""A router's caller reading its own signed generation records: each provider up is asked, as the router acting for
that caller, and the one that served the generation answers.

A node shows a record to the caller it bills, and a router's caller is billed there as `ROUTER/CALLER` (the
router's key name at that node and the `Tenzro-Caller` id), so the read goes out exactly as that caller's
completions did: the router's key at the node and `Tenzro-Caller: CALLER`. Any other caller's read of the
record, and a read of an id no node holds, get the node's one not-found answer, and the router answers both
alike (`GenerationNotFound`, 404): ids cannot be probed through the router either.

The router does not remember which provider served which completion: routers run side by side without sticky
sessions and hold no state of their own, so the read may reach a router that never saw the completion. Every
provider up is asked at once instead (ids are random, so at most one holds it); the first to answer with the
record wins and the other reads are dropped. When no provider that answered holds it but one could not be asked
(down, or failing), the record may be on that one: the caller is told to retry rather than that it does not exist.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.errors import GenerationNotFound, InvalidRequest, NoProviderAvailable
from router.forward import CALLER_HEADER
from router.providers import ProviderSpec
from router.registry import Registry

GENERATION_PATH = "/v1/generation"
MAX_ID_CHARS = 256
"""The longest completion id a node stores (`metering.record.MAX_ID_CHARS`, which the router may not import)."""


@dataclass(frozen=True, slots=True)
class Generation:
    """A provider's answer holding the record: its JSON as the node sent it."""

    provider: str
    body: bytes
    """The record's JSON as the node sent it: passed on byte for byte, as the node signed what it holds."""
    record: dict[str, Any]
    """The same, parsed (JSON-RPC's result)."""


@dataclass(frozen=True, slots=True)
class _Asked:
    """One provider's answer to the read: the record, or that it holds none for this caller (`found` None,
    `problem` None), or why it could not be asked."""

    provider: str
    found: Generation | None = None
    problem: str | None = None


def record_id(value: object) -> str:
    """`value` as a completion id to look up; raises InvalidRequest naming `id` otherwise."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise InvalidRequest(f"'id' must be a completion id (chatcmpl-... or cmpl-...) of 1 to {MAX_ID_CHARS} "
                             f"characters", param="id")
    return value


async def _ask(session: aiohttp.ClientSession, spec: ProviderSpec, caller: str, record: str,
               timeout: aiohttp.ClientTimeout, pin: aiohttp.Fingerprint | bool) -> _Asked:
    headers = {"Authorization": f"Bearer {spec.api_key}", CALLER_HEADER: caller, "Accept-Encoding": "identity"}
    try:
        async with session.get(spec.url + GENERATION_PATH, params={"id": record}, headers=headers,
                               timeout=timeout, ssl=pin) as response:
            if response.status == 404:
                return _Asked(spec.name)
            if response.status != 200:
                return _Asked(spec.name, problem=f"answered {response.status}")
            body = await response.read()
            record = json.loads(body)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            return _Asked(spec.name, Generation(spec.name, body, record))
    except ValueError:  # UnicodeDecodeError is one
        return _Asked(spec.name, problem="answered 200 without a JSON record")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return _Asked(spec.name, problem=f"no answer: {type(exc).__name__}")


async def _first_found(asks: Iterable[asyncio.Task[_Asked]]) -> tuple[Generation | None, list[_Asked]]:
    """The first record any read returns (the rest are cancelled), else None with every read's answer."""
    pending = set(asks)
    answered: list[_Asked] = []
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                asked = task.result()
                if asked.found is not None:
                    return asked.found, answered
                answered.append(asked)
        return None, answered
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def find_generation(registry: Registry, session: aiohttp.ClientSession, timeout_s: float, providers:
                          Iterable[ProviderSpec], caller: str, record: str) -> Generation:
    """The record `record` as the provider that served it shows it to `caller` (this router's caller id). Raises
    GenerationNotFound when every provider holds none for this caller, NoProviderAvailable when one that might
    could not be asked."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    specs = list(providers)
    up = [spec for spec in specs if registry.state(spec.name).up]
    found, answered = await _first_found(asyncio.create_task(_ask(session, spec, caller, record, timeout,
                                                                  registry.pin(spec.name)))
                                         for spec in up)
    if found is not None:
        return found
    unasked = [f"{spec.name}: down" for spec in specs if spec not in up]
    unasked += [f"{asked.provider}: {asked.problem}" for asked in answered if asked.problem is not None]
    if unasked:
        raise NoProviderAvailable(f"no provider that answered holds this generation, and some could not be asked "
                                  f"({'; '.join(sorted(unasked))}); retry in a few seconds",
                                  code="generation_unavailable")
    raise GenerationNotFound("no generation with this id for this API key", param="id")
