"""Metering routes: a caller's own generation record, the node key, signed tree heads, proofs, auditor reads.

A record is visible to the caller it bills and to auditors. For anyone else a record id answers
exactly as an unknown id does, so ids cannot be probed to learn another caller's traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from metering.canonical import wei_to_json
from metering.record import MAX_ID_CHARS, UsageRecord
from node.app import HYGIENE, METER, SERVICE, caller_of
from node.config import Caller
from node.errors import ApiError, invalid_request

AUDITOR = "auditor"
DEFAULT_RECORDS_LIMIT = 1000
MAX_RECORDS_LIMIT = 10_000


def _id_param(request: web.Request) -> str:
    record_id = request.query.get("id", "")
    if not 0 < len(record_id) <= MAX_ID_CHARS:
        raise invalid_request(f"'id' must be a completion id (chatcmpl-... or cmpl-...) of 1 to {MAX_ID_CHARS} "
                              "characters", param="id")
    return record_id


def _int_param(request: web.Request, name: str, default: int, low: int, high: int | None = None) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    value = int(text) if text.isascii() and text.isdigit() else None
    if value is None or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"of at least {low}"
        raise invalid_request(f"'{name}' must be an integer {bound}", param=name)
    return value


def _visible_record(request: web.Request, caller: Caller) -> UsageRecord:
    """The record named by `?id=` if this caller may see it; otherwise the one 404 for every id."""
    record = request.app[METER].ledger.get(_id_param(request))
    if record is None or (record.caller_id != caller.name and caller.role != AUDITOR):
        raise ApiError(404, "no generation with this id for this API key", type="not_found_error",
                       param="id", code="generation_not_found")
    return record


async def generation(request: web.Request) -> web.Response:
    """The signed record of one completion: counts, prices, cost and signature, as in the ledger."""
    caller = caller_of(request)
    return web.json_response(_visible_record(request, caller).to_json())


async def node_identity(request: web.Request) -> web.Response:
    """Which key signs this node start's records, the prices it charges now, which forward its model runs on
    (and why), whether stored state is sealed and the process's hygiene; no key needed."""
    meter = request.app[METER]
    prices = meter.pricing.current()
    forward = request.app[SERVICE].loaded.forward_path
    return web.json_response({
        "object": "node",
        "model": request.app[SERVICE].model_id,
        "boot_id": meter.boot_id,
        "key_id": meter.signer.key_id,
        "public_key": meter.signer.public_key_hex,
        "ledger_segment": meter.ledger.path.name,
        "prices": {name: wei_to_json(value) for name, value in prices.to_mapping().items()},
        "pricing_error": meter.pricing.reload_error,
        "forward": {"path": forward.name, "reason": forward.reason},
        "sealing": request.app[SERVICE].runner.sealing_state(),
        "hygiene": request.app[HYGIENE],
    })


async def checkpoint(request: web.Request) -> web.Response:
    """A signed tree head over every record of this node start so far."""
    caller_of(request)
    return web.json_response(request.app[METER].ledger.tree_head().to_json())


async def proof(request: web.Request) -> web.Response:
    """A record, a signed tree head, and the audit path that puts the one under the other."""
    caller = caller_of(request)
    record = _visible_record(request, caller)
    ledger = request.app[METER].ledger
    head = ledger.tree_head()
    return web.json_response({
        "record": record.to_json(),
        "tree_head": head.to_json(),
        "proof": ledger.inclusion_proof(record.record_id, head.size).to_json(),
    })


async def records(request: web.Request) -> web.Response:
    """Auditors only: the records from seq `since` on, in order, at most `limit` of them."""
    caller = caller_of(request)
    if caller.role != AUDITOR:
        raise ApiError(403, "reading all records needs an API key with the auditor role "
                       "('tenzro keys add NAME --role auditor')", type="permission_error",
                       code="auditor_role_required")
    since = _int_param(request, "since", 0, 0)
    limit = _int_param(request, "limit", DEFAULT_RECORDS_LIMIT, 1, MAX_RECORDS_LIMIT)
    meter = request.app[METER]
    page = meter.ledger.records_since(since)
    return web.json_response({
        "object": "list",
        "boot_id": meter.boot_id,
        "data": [record.to_json() for record in page[:limit]],
        "next_since": since + min(len(page), limit),
        "has_more": len(page) > limit,
    })


ROUTES: list[tuple[str, str, Callable[[web.Request], Any]]] = [
    ("GET", "/v1/generation", generation),
    ("GET", "/v1/node", node_identity),
    ("GET", "/v1/metering/checkpoint", checkpoint),
    ("GET", "/v1/metering/proof", proof),
    ("GET", "/v1/metering/records", records),
]
