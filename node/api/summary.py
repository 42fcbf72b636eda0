"""`GET /v1/cache/summary?model=ID`: for a router key, a signed Bloom filter of the prefixes its callers can
resume on this node, readable only with that router's key (`cache/summary.py`: construction, threat model).

The prefix index belongs to the engine's worker thread, so the warm forms are read there, as a chore between
jobs, without touching anything (a summary changes no eviction order). Keying them (one HMAC per entry) and
signing run on the preparation threads; the filter each router last read is kept and grows with the new entries.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from cache.prefix_cache import ROUTED
from cache.scope import GROUP
from cache.summary import EPOCH_S, SummaryFilters, epoch_of, summary_entries
from metering.signer import SIGNATURE_FIELD, signed_payload
from node.api.body import off_loop
from node.api.keys import CALLER, IDENTITY, KEYRING, SERVICE, SUMMARIES
from node.auth import ROUTER, presented_key
from node.errors import PermissionDenied, invalid_request, model_not_found
from node.identity import NodeIdentity
from node.service import ModelService

routes = web.RouteTableDef()


async def warm_forms(service: ModelService, router: str, model: str, groups: frozenset[str] = frozenset()
                     ) -> list[tuple[str, bytes]]:
    """(caller id, form) for each prefix of `router`'s callers on `model` that the node can still resume, and
    (`group:NAME`, form) for each of the trust groups `groups` (those with a member it routes); read on the worker
    thread."""
    own, shared = router + ROUTED, {GROUP + group for group in groups}
    warm = await asyncio.wrap_future(service.warm_forms(
        lambda scope: scope.model == model and (scope.caller.startswith(own) or scope.caller in shared)))
    return [(scope.caller if scope.caller in shared else scope.caller.removeprefix(own), form)
            for scope, form in warm]


def _document(identity: NodeIdentity, filters: SummaryFilters, router: str, model: str, router_key: str, epoch: int,
              warm: list[tuple[str, bytes]]) -> dict[str, Any]:
    entries = summary_entries(router_key, epoch, warm)
    document: dict[str, Any] = {
        "object": "cache.summary",
        "model": model,
        "epoch": epoch,
        "epoch_s": EPOCH_S,
        "bloom": filters.refresh(router, model, entries),
        "entries": len(entries),
        "boot_id": identity.boot_id,
        "key_id": identity.signer.key_id,
    }
    document[SIGNATURE_FIELD] = identity.signer.sign(signed_payload(document)).hex()
    return document


@routes.get("/v1/cache/summary")
async def cache_summary(request: web.Request) -> web.Response:
    """The summary for the router whose key this is, of every scope it acts for on `model`, in the current
    epoch, signed by the node's key (the canonical JSON of every other member, as records are)."""
    router = request[CALLER]
    if router.role != ROUTER:
        raise PermissionDenied("a cache summary is read with a router key ('tenzro keys add NAME --role router'), "
                               "as the router itself (without 'Tenzro-Caller')", code="router_role_required")
    model = request.query.get("model")
    if model is None:
        raise invalid_request("'model' is required: GET /v1/cache/summary?model=ID", param="model")
    service = request.app[SERVICE]
    if model != service.model_id:
        raise model_not_found(model)
    router_key = presented_key(request.headers.get("Authorization"))
    epoch = epoch_of(time.time())
    warm = await warm_forms(service, router.name, model, request.app[KEYRING].groups_routed_by(router.name))
    return web.json_response(await off_loop(request, _document, request.app[IDENTITY], request.app[SUMMARIES],
                                            router.name, model, router_key, epoch, warm))
