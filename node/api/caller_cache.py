"""A caller's own cache (`/v1/cache`): what the node holds for it, and shredding it now.

`GET /v1/cache[?model=ID]` shows the calling scope's entries, tokens, bytes held in plaintext (hot) and sealed,
remembered replies, attachment encodings, and its lookups since the node started (a hit resumed stored state, a
miss none).
`DELETE /v1/cache[?model=ID]` destroys that state at once, as a removed key's is (zeroed, its keys destroyed), and
answers what it held. A request of the caller accepted before it, still queued or running, replies in full from
its own working memory, and stores nothing in the scope after it: no state or snapshot, no remembered reply, no
attachment encoding, no cached write billed (`cache/shred_clock.py`); its requests sent after store as usual.
Both see only the scope of the key that asks (for a router's caller, `router/id`'s): counts and sizes, never
content.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from cache.scope import Scope
from node.api.completions import RUNS_COMPLETIONS, _service
from node.api.keys import CALLER, SERVICE
from node.auth import require_role
from node.service import ModelService, ScopeState

routes = web.RouteTableDef()


def _scope(request: web.Request, what: str) -> tuple[ModelService, Scope]:
    """The served model (`model`, when given, must be it: a node serves one) and the calling key's scope of it."""
    caller = require_role(request[CALLER], what, *RUNS_COMPLETIONS)
    service = request.app[SERVICE]
    model = request.query.get("model")
    if model is not None:
        service = _service(request, model)
    return service, Scope(caller=caller.name, model=service.model_id)


def _held(state: ScopeState) -> dict[str, Any]:
    held = state.held
    return {"entries": held.entries, "tokens": held.tokens,
            "bytes": {"hot": held.hot_bytes, "sealed": held.sealed_bytes, "total": held.hot_bytes + held.sealed_bytes},
            "replies": state.replies,
            "encodings": {"entries": state.encodings.entries, "bytes": state.encodings.bytes}}


@routes.get("/v1/cache")
async def show(request: web.Request) -> web.Response:
    service, scope = _scope(request, "GET /v1/cache")
    state = await asyncio.wrap_future(service.scope_state(scope))
    return web.json_response({"object": "cache", "model": scope.model, **_held(state),
                              "hits": state.lookups.hits, "misses": state.lookups.misses})


@routes.delete("/v1/cache")
async def shred(request: web.Request) -> web.Response:
    service, scope = _scope(request, "DELETE /v1/cache")
    state = await asyncio.wrap_future(service.shred(scope))
    return web.json_response({"object": "cache.deleted", "model": scope.model, "deleted": _held(state)})
