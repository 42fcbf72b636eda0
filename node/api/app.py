"""The aiohttp application: shared objects under typed keys, the middleware, and every route table.

Every step of a request whose cost grows with its size (parsing a large body, rendering, tokenizing) runs
on the `PREPARE` threads, never on the event loop, so `/health` and every other route keep answering while
a large request is prepared.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from cache.summary import SummaryFilters
from node.api import caller_cache, completions, identity, media_refusals, messages, operations, records, rpc, summary
from node.api.keys import CONFIG, HYGIENE, IDENTITY, KEYRING, METER, METRICS, POLICY, PREPARE, SERVICE, SUMMARIES, TLS
from node.api.middleware import auth_middleware, coding_middleware, error_middleware
from node.api.prepare import FairPreparation
from node.auth import KeyRing
from node.config import NodeConfig
from node.identity import NodeIdentity
from node.meter import Meter, MeteringPaths
from node.metrics import NodeMetrics
from node.service import ModelService
from node.tls import NodeCertificate, tls_json
from policies.node_policy import NodePolicy

PREPARE_THREADS = 4
"""Preparation threads in all. Each caller runs on one at most (`node.api.prepare`): callers flooding expensive
bodies hold one each, and a caller arriving finds a free thread unless four others are all preparing."""
METER_CLOSE_TIMEOUT_S = 30.0
KEY_REFRESH_S = 0.5
"""How often the config is re-read: a removed key's state is destroyed within this much (plus the job running)."""

ROUTE_TABLES = (completions.routes, messages.routes, caller_cache.routes, records.routes, identity.routes,
                operations.routes, rpc.routes, summary.routes, media_refusals.text_node_routes)


def create_app(config: NodeConfig, config_path: Path, service: ModelService, metering: MeteringPaths,
               node_identity: NodeIdentity, policy: NodePolicy, hygiene: dict[str, Any] | None = None,
               tls: NodeCertificate | None = None) -> web.Application:
    """`tls`: the certificate the node serves HTTPS with (`node.tls`); None when it serves plain HTTP."""
    scheduler = service.scheduler
    arena = service.arena
    metrics = NodeMetrics(
        cached_bytes=lambda: float(arena.bytes_total) if arena is not None else 0.0,
        queue_waiting=lambda: float(scheduler.waiting),
        snapshot_bytes=lambda: float(arena.snapshot_bytes) if arena is not None else 0.0,
        forward_backend=(service.model_id, service.loaded.forward.backend, service.loaded.forward.reason),
        plaintext_bytes=lambda: float(arena.hot_bytes) if arena is not None else 0.0,
        sealed_open_failures=lambda: float(arena.open_failures) if arena is not None else 0.0)
    if service.loaded.experts is not None:
        metrics.registry.register(service.loaded.experts.collector())

    def removed(name: str) -> None:
        # A caller removed from the config loses its state and keys on the worker thread, which owns them; a
        # router, its callers' too, and its summary filters.
        service.drop_caller(name)
        app[SUMMARIES].forget(name)

    app = node_app(config, config_path, metering, node_identity, policy, hygiene, tls,
                   NodeEngine(metrics, removed, scheduler.start, scheduler.stop), ROUTE_TABLES)
    app[SUMMARIES] = SummaryFilters()
    scheduler.ttl_of = app[KEYRING].ttl_of
    app[SERVICE] = service
    return app


@dataclass(frozen=True, slots=True)
class NodeEngine:
    """What the application needs of the engine it serves, a text model's scheduler or an image model's worker."""

    metrics: NodeMetrics
    removed: Callable[[str], None]
    """A caller removed from the config: its state and keys go."""
    start: Callable[[], None]
    stop: Callable[[], None]


def node_app(config: NodeConfig, config_path: Path, metering: MeteringPaths, node_identity: NodeIdentity,
             policy: NodePolicy, hygiene: dict[str, Any] | None, tls: NodeCertificate | None, engine: NodeEngine,
             tables: Iterable[web.RouteTableDef]) -> web.Application:
    """The parts every node has whatever it serves: the middleware, keys, identity, metering and `tables`."""
    # Errors outermost: an authentication failure leaves as JSON too. A compressed body is refused before any key
    # is checked.
    app = web.Application(client_max_size=config.limits.max_body_bytes,
                          middlewares=[error_middleware, coding_middleware, auth_middleware])
    app[CONFIG] = config
    app[KEYRING] = KeyRing(config_path, on_removed=engine.removed)
    app[HYGIENE] = hygiene or {}
    app[IDENTITY] = node_identity
    app[POLICY] = policy
    app[TLS] = tls_json(tls)
    app[METRICS] = engine.metrics

    async def watch_keys(app: web.Application) -> None:
        while True:
            await asyncio.sleep(KEY_REFRESH_S)
            app[KEYRING].refresh()

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        app[PREPARE] = FairPreparation(PREPARE_THREADS)
        engine.start()
        watcher = asyncio.create_task(watch_keys(app))
        yield
        watcher.cancel()
        engine.stop()
        app[PREPARE].shutdown()

    async def meter_ctx(app: web.Application) -> AsyncIterator[None]:
        # The boot's evidence beside its segment: an auditor checks the segment's key against it offline.
        node_identity.write_evidence(metering.ledger_dir)
        served = node_identity.served
        app[METER] = Meter.open(metering, node_identity.signer, node_identity.evidence_digest, node_identity.boot_id,
                                code_digest=None if served is None else served.code.digest,
                                model_digests=None if served is None else served.model_digests())
        yield
        await app[METER].close(METER_CLOSE_TIMEOUT_S)

    # Cleanup runs in reverse: the meter closes while the engine still runs, so that the cancelled jobs
    # it still has to record can end.
    app.cleanup_ctx.append(engine_ctx)
    app.cleanup_ctx.append(meter_ctx)
    for table in tables:
        app.router.add_routes(table)
    return app
