"""A router whose callers are members of a trust group sees the group's prefixes in its summary, under the group's
id; a router with no member in the group does not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from cache.summary import BloomFilter, chat_prefix_forms, prefix_entry, summary_key
from node.config import Group, add_key, load_config, save_config
from node.engine.loader import LoadedModel
from tests.node.test_router_callers import bearer, serve, small_loaded  # noqa: F401 - a fixture

SYSTEM = {"role": "system", "content": "You answer questions about the harbour's tides, in a few words."}
QUESTION = {"role": "user", "content": "When does the tide turn at pier 7?"}


async def test_a_routers_summary_holds_its_members_group_prefix_under_the_groups_id(
        aiohttp_client: Any, tmp_path: Path, small_loaded: LoadedModel) -> None:  # noqa: F811
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    path = tmp_path / "node.yaml"
    r1, r2 = add_key(path, "r1", role="router"), add_key(path, "r2", role="router")
    save_config(path, replace(load_config(path), groups=(Group("team", ("r1/alice",)),)))
    response = await client.post("/v1/chat/completions", headers={**bearer(r1, "alice"), "Tenzro-Cache-Scope": "group"},
                                 json={"model": small_loaded.model_id, "messages": [SYSTEM, QUESTION],
                                       "max_tokens": 2, "temperature": 0, "prompt_cache_key": "tides"})
    assert response.status == 200, await response.json()
    system_form, conversation_form = chat_prefix_forms([SYSTEM, QUESTION])
    for router, sees in ((r1, True), (r2, False)):
        summary = await client.get("/v1/cache/summary", headers=bearer(router),
                                   params={"model": small_loaded.model_id})
        doc = await summary.json()
        bloom = BloomFilter.from_json(doc["bloom"])
        group_key = summary_key(router, "group:team", doc["epoch"])
        # The group holds the system message only; alice's own scope holds the rest, under alice's id.
        assert (prefix_entry(group_key, system_form) in bloom,
                prefix_entry(group_key, conversation_form) in bloom) == (sees, False)
        assert (prefix_entry(summary_key(router, "alice", doc["epoch"]), conversation_form) in bloom) == sees
