"""`DELETE /v1/cache` against requests its caller sent before it, in process: a request still queued when the
caller shreds (the worker held, so the order is fixed: the shred runs, then the queued requests are admitted)
replies in full and stores nothing, billed no cached write; another caller's queued request stores as usual; the
caller's next request finds nothing and stores as usual."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from node.api.keys import SERVICE
from node.config import add_key
from node.engine.loader import LoadedModel, load_model
from node.service import ModelService
from tests.node.in_process import serve

PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def small_loaded(small_model_dir: Path) -> LoadedModel:
    return load_model(small_model_dir.name, small_model_dir)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def complete(client: TestClient, key: str) -> dict[str, Any]:
    response = await client.post("/v1/completions", headers=bearer(key), json={
        "model": client.app[SERVICE].model_id, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    body = await response.json()
    assert response.status == 200, body
    return dict(body)


async def shred(client: TestClient, key: str) -> dict[str, Any]:
    response = await client.delete("/v1/cache", headers=bearer(key))
    assert response.status == 200
    return dict(await response.json())


async def view(client: TestClient, key: str) -> dict[str, Any]:
    response = await client.get("/v1/cache", headers=bearer(key))
    assert response.status == 200
    return dict(await response.json())


def written(body: dict[str, Any]) -> tuple[int, int, str]:
    """(cached reads, cached writes, retention) as the signed record bills them and the reply says."""
    usage = body["usage"]
    return usage["cached_read_tokens"], usage["cached_write_tokens"], usage["prompt_cache_retention"]


async def test_a_request_queued_when_its_caller_shreds_stores_nothing_and_anothers_stores(
        aiohttp_client: Any, tmp_path: Path, small_loaded: LoadedModel) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    path = tmp_path / "node.yaml"
    alice, bob = add_key(path, "alice"), add_key(path, "bob")
    before = await complete(client, alice)
    assert written(before)[1] == len(PROMPT) and (await view(client, alice))["entries"] > 0
    service: ModelService = client.app[SERVICE]
    scheduler = service.scheduler
    held, free = threading.Event(), threading.Event()

    def hold() -> None:  # the worker waits here: requests sent meanwhile queue behind it
        held.set()
        free.wait(30)

    loop = asyncio.get_running_loop()
    scheduler.chore(hold)
    try:
        assert await loop.run_in_executor(None, held.wait, 30)
        queued = [asyncio.ensure_future(complete(client, key)) for key in (alice, bob)]
        while scheduler.waiting < 2 and not any(task.done() for task in queued):  # both handlers queued their job
            await asyncio.sleep(0.01)
        shredding = asyncio.ensure_future(shred(client, alice))
        while not scheduler._chores and not shredding.done():  # the shred waits for the worker, behind `hold`
            await asyncio.sleep(0.01)
        assert scheduler.waiting == 2 and not shredding.done()
    finally:
        free.set()
    deleted = await shredding
    mine, theirs = await asyncio.gather(*queued)
    stored = len(PROMPT) + before["usage"]["completion_tokens"]  # what a request stores: its prompt and its reply
    assert deleted["deleted"]["tokens"] == stored
    assert mine["choices"][0]["text"] == before["choices"][0]["text"]  # it replies in full, as it would have
    # Admitted after the shred, it read nothing and stored nothing: no cached write is billed.
    assert written(mine) == (0, 0, "none")
    assert written(theirs) == (0, len(PROMPT), "in_memory")  # another caller's queued request stores as usual
    after = await view(client, alice)
    assert (after["entries"], after["tokens"], after["bytes"]["total"], after["replies"]) == (0, 0, 0, 0)
    assert (await view(client, bob))["tokens"] == stored
    again = await complete(client, alice)  # sent after the shred: nothing to read, and it stores as usual
    assert written(again) == (0, len(PROMPT), "in_memory")
    assert (await view(client, alice))["tokens"] == stored
