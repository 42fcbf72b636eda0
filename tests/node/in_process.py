"""A node in process over the real HTTP stack (aiohttp's test client), for tests that must hold or watch its worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient

from cache.arena import new_prefix_cache
from cache.budget import CacheBudget
from node.api.app import create_app
from node.config import Limits, load_config
from node.engine.loader import LoadedModel
from node.identity import NodeIdentity
from node.meter import MeteringPaths, ensure_price_file
from node.service import ModelService
from policies.node_policy import load_node_policy


async def serve(aiohttp_client: Any, tmp_path: Path, loaded: LoadedModel) -> TestClient:
    """A node in process with reuse on (plaintext state: no sealing cost to measure) and no callers yet."""
    config_path = tmp_path / "node.yaml"
    service = ModelService.create(loaded, new_prefix_cache(CacheBudget(1 << 30, 1 << 30), sealed=False),
                                  Limits(max_queue=8))
    paths = MeteringPaths(ledger_dir=tmp_path / "ledger", pricing_file=tmp_path / "pricing.yaml")
    ensure_price_file(paths.pricing_file)
    app = create_app(load_config(config_path), config_path, service, paths, NodeIdentity.start(),
                     load_node_policy("standard"))
    return await aiohttp_client(app)
