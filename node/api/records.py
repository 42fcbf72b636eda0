"""Metering routes: a caller's own generation record, signed tree heads, proofs, auditor reads.

A record is visible to the caller it bills and to auditors. For anyone else a record id answers
exactly as an unknown id does, so ids cannot be probed to learn another caller's traffic.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from metering.ledger import Ledger
from metering.record import MAX_ID_CHARS, UsageRecord
from node.api.keys import CALLER, METER
from node.config import Caller
from node.errors import NotFound, PermissionDenied, invalid_request

AUDITOR = "auditor"
DEFAULT_RECORDS_LIMIT = 1000
MAX_RECORDS_LIMIT = 10_000

routes = web.RouteTableDef()


def _id_param(query: Mapping[str, str]) -> str:
    record_id = query.get("id", "")
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


def visible_record(ledger: Ledger, query: Mapping[str, str], caller: Caller) -> UsageRecord:
    """The record named by `id` if this caller may see it; otherwise the one NotFound for every id (also
    JSON-RPC's `tenzro_getGeneration`: one access rule)."""
    record = ledger.get(_id_param(query))
    if record is None or (record.caller_id != caller.name and caller.role != AUDITOR):
        raise NotFound("no generation with this id for this API key", param="id", code="generation_not_found")
    return record


@routes.get("/v1/generation")
async def generation(request: web.Request) -> web.Response:
    """The signed record of one completion: counts, prices, cost, service times and signature, as in the
    ledger."""
    return web.json_response(visible_record(request.app[METER].ledger, request.query, request[CALLER]).to_json())


@routes.get("/v1/metering/checkpoint")
async def checkpoint(request: web.Request) -> web.Response:
    """A signed tree head over every record of this node start so far."""
    return web.json_response(request.app[METER].ledger.tree_head().to_json())


@routes.get("/v1/metering/proof")
async def proof(request: web.Request) -> web.Response:
    """A record, a signed tree head, and the audit path that puts the one under the other."""
    ledger = request.app[METER].ledger
    record = visible_record(ledger, request.query, request[CALLER])
    head = ledger.tree_head()
    return web.json_response({
        "record": record.to_json(),
        "tree_head": head.to_json(),
        "proof": ledger.inclusion_proof(record.record_id, head.size).to_json(),
    })


@routes.get("/v1/metering/records")
async def records(request: web.Request) -> web.Response:
    """Auditors only: the records from seq `since` on, in order, at most `limit` of them."""
    if request[CALLER].role != AUDITOR:
        raise PermissionDenied("reading all records needs an API key with the auditor role "
                               "('tenzro keys add NAME --role auditor')", code="auditor_role_required")
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

