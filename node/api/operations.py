"""Operators' routes: `/health` (that the node serves, to anyone; the queue's depth to operator and router keys,
a router weighing the node's load) and `/metrics`, for operator keys only, so that no caller learns the shape of
other callers' traffic. Any other key reads `/health` as no key does: a client that sends its key everywhere is
told the node serves, never refused."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from node.api.keys import CALLER, METRICS, SERVICE
from node.auth import ROUTER, require_role

routes = web.RouteTableDef()

QUEUE_READERS = ("operator", ROUTER)
"""Roles that read the queue's depth in `/health`; a router acting for a caller is that caller, and does not."""


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body: dict[str, Any] = {"status": "ok", "model": service.model_id}
    split = service.loaded.experts
    if split is not None:  # a node whose expert holders are missing answers, but cannot serve: routers skip it
        body["experts"] = split.describe()
        body["status"] = "ok" if split.serving else "degraded"
    caller = request.get(CALLER)
    if caller is not None and caller.role in QUEUE_READERS:
        body.update(service.scheduler.describe())
    return web.json_response(body)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    require_role(request[CALLER], "GET /metrics", "operator")
    return web.Response(body=request.app[METRICS].render(), content_type="text/plain", charset="utf-8")
