"""Router keys in process: `Tenzro-Caller` names the caller a router acts for, a scope of its own per (router,
caller) with the router's retention, requirements and time to live; any other key sending it is refused; routers
read the queue's depth; a removed router takes its callers' state with it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient

from cache.arena import Scope
from node.api.keys import KEYRING, SERVICE
from node.config import add_key, remove_key
from node.engine.loader import LoadedModel, load_model
from tests.node.in_process import serve

PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def small_loaded(small_model_dir: Path) -> LoadedModel:
    return load_model(small_model_dir.name, small_model_dir)


def bearer(key: str, caller: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **({"Tenzro-Caller": caller} if caller is not None else {})}


async def complete(client: TestClient, headers: dict[str, str], prompt: list[int] = PROMPT) -> dict[str, Any]:
    response = await client.post("/v1/completions", headers=headers, json={
        "model": client.server.app[SERVICE].model_id, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    body = await response.json()
    assert response.status == 200, body
    return dict(body)


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_router_acts_for_the_caller_it_names_in_a_scope_of_their_own(aiohttp_client: Any, tmp_path: Path,
                                                                          small_loaded: LoadedModel) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    r1, r2 = add_key(tmp_path / "node.yaml", "r1", role="router"), add_key(tmp_path / "node.yaml", "r2", role="router")
    first = await complete(client, bearer(r1, "alice"))
    assert cached(first) == 0 and first["usage"]["cached_write_tokens"] == len(PROMPT)
    assert cached(await complete(client, bearer(r1, "alice"))) == len(PROMPT) - 1
    # Another caller of the same router, the router itself, and another router's `alice` share nothing with her.
    assert [cached(await complete(client, headers)) for headers in
            (bearer(r1, "bob"), bearer(r1), bearer(r2, "alice"))] == [0, 0, 0]
    record = await client.get("/v1/generation", params={"id": first["id"]}, headers=bearer(r1, "alice"))
    assert (await record.json())["caller_id"] == "r1/alice"
    for other in (bearer(r1), bearer(r1, "bob"), bearer(r2, "alice")):  # only the caller it bills sees it
        assert (await client.get("/v1/generation", params={"id": first["id"]}, headers=other)).status == 404
    cache = client.server.app[SERVICE].runner.reuse.prefix_cache
    assert cache is not None
    model = small_loaded.model_id
    assert sorted(scope.caller for scope in cache._trees if scope.model == model) == [
        "r1", "r1/alice", "r1/bob", "r2/alice"]


@pytest.mark.parametrize(("role", "caller", "status", "param", "code"), [
    ("caller", "alice", 403, None, "router_role_required"),
    ("operator", "alice", 403, None, "router_role_required"),
    ("router", "", 400, "Tenzro-Caller", "invalid_caller"),
    ("router", "al/ice", 400, "Tenzro-Caller", "invalid_caller"),
    ("router", "x" * 65, 400, "Tenzro-Caller", "invalid_caller"),
    ("router", "alice bob", 400, "Tenzro-Caller", "invalid_caller"),
])
async def test_tenzro_caller_is_refused_unless_a_router_names_a_well_formed_caller(
        aiohttp_client: Any, tmp_path: Path, small_loaded: LoadedModel, role: str, caller: str, status: int,
        param: str | None, code: str) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    key = add_key(tmp_path / "node.yaml", "k", role=role)
    response = await client.post("/v1/completions", headers=bearer(key, caller),
                                 json={"model": small_loaded.model_id, "prompt": PROMPT, "max_tokens": 1})
    error = (await response.json())["error"]
    assert (response.status, error["param"], error["code"]) == (status, param, code)
    assert client.server.app[SERVICE].runner.reuse.prefix_cache.cached_tokens(Scope("k", small_loaded.model_id)) == 0


async def test_the_header_twice_or_without_a_key_is_refused(aiohttp_client: Any, tmp_path: Path,
                                                              small_loaded: LoadedModel) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    router = add_key(tmp_path / "node.yaml", "r1", role="router")
    twice = await client.get("/v1/models", headers=[("Authorization", f"Bearer {router}"),
                                                    ("Tenzro-Caller", "alice"), ("Tenzro-Caller", "bob")])
    assert twice.status == 400 and (await twice.json())["error"]["param"] == "Tenzro-Caller"
    unkeyed = await client.get("/health", headers={"Tenzro-Caller": "alice"})  # a public route, but not for this
    assert unkeyed.status == 401


async def test_routers_and_operators_read_the_queue_in_health(aiohttp_client: Any, tmp_path: Path,
                                                              small_loaded: LoadedModel) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    path = tmp_path / "node.yaml"
    keys = {role: add_key(path, role, role=role) for role in ("router", "operator", "caller", "auditor")}
    for role in ("router", "operator"):
        response = await client.get("/health", headers=bearer(keys[role]))
        assert await response.json() == {"status": "ok", "model": small_loaded.model_id, "waiting": 0,
                                         "max_queue": 8, "running": 0, "max_running": 32}
    # Any other key, a router's caller included, reads what no key reads: never refused, never the queue.
    public = await (await client.get("/health")).json()
    assert public == {"status": "ok", "model": small_loaded.model_id}
    for headers in (bearer(keys["caller"]), bearer(keys["auditor"]), bearer(keys["router"], "alice")):
        response = await client.get("/health", headers=headers)
        assert response.status == 200 and await response.json() == public
    assert (await client.get("/metrics", headers=bearer(keys["router"]))).status == 403


async def test_a_routers_callers_have_its_retention_requirements_and_time_to_live(
        aiohttp_client: Any, tmp_path: Path, small_loaded: LoadedModel) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    path = tmp_path / "node.yaml"
    router = add_key(path, "r1", role="router", retention="none", ttl_s=30)
    body = await complete(client, bearer(router, "alice"))
    assert body["usage"]["prompt_cache_retention"] == "none" and body["usage"]["cached_write_tokens"] == 0
    assert client.server.app[KEYRING].ttl_of("r1/alice") == 30 and client.server.app[KEYRING].ttl_of("r9/x") is None
    config = yaml.safe_load(path.read_text())
    config["callers"]["r1"]["requirements"] = {"jurisdictions": ["FR"]}  # this node's jurisdiction is unset
    path.write_text(yaml.safe_dump(config))
    refused = await client.post("/v1/completions", headers=bearer(router, "alice"),
                                json={"model": small_loaded.model_id, "prompt": PROMPT, "max_tokens": 1})
    assert refused.status == 412 and (await refused.json())["error"]["param"] == "jurisdiction"


async def test_a_removed_router_takes_its_callers_state_with_it(aiohttp_client: Any, tmp_path: Path,
                                                               small_loaded: LoadedModel) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    path = tmp_path / "node.yaml"
    router, carol = add_key(path, "r1", role="router"), add_key(path, "carol")
    for headers in (bearer(router, "alice"), bearer(router, "bob"), bearer(router), bearer(carol)):
        await complete(client, headers)
    remove_key(path, "r1")
    app = client.server.app
    app[KEYRING].refresh()
    await asyncio.wrap_future(app[SERVICE].scheduler.ask(lambda: None))  # after the drop, which was queued first
    cache = app[SERVICE].runner.reuse.prefix_cache
    assert cache is not None
    model = small_loaded.model_id
    assert {scope.caller: cache.cached_tokens(scope) for scope in cache._trees if scope.model == model} == {
        "carol": len(PROMPT) + 2}  # the prompt and the 2-token reply
