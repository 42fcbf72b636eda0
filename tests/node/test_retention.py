"""Retention over HTTP: per request (`prompt_cache_retention`) and per caller (`retention`, `ttl_s`), and a
removed key's state destroyed by the running node."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.node.conftest import Node, tenzro

PROMPT = list(range(200, 500))


def sealing(node: Node) -> dict[str, Any]:
    with urllib.request.urlopen(node.url + "/v1/node", timeout=5) as response:
        return dict(json.load(response)["sealing"])


def wait_for(node: Node, done: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not done(state := sealing(node)):
        if time.monotonic() > deadline:
            raise AssertionError(f"the node's sealing state did not get there in {timeout_s} s: {state}")
        time.sleep(0.1)
    return state


def complete(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                     extra_body=extra or None).usage


def test_retention_none_per_request_and_per_caller_stores_nothing(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    model = small_model_dir.name
    alice = openai.OpenAI(base_url=node.base, api_key=node.add_key("alice"), max_retries=0)
    usage = complete(alice, model, prompt_cache_retention="none")
    assert usage.cached_write_tokens == 0 and usage.prompt_cache_retention == "none"
    assert sealing(node)["entries"] == 0
    again = complete(alice, model)
    assert again.prompt_tokens_details.cached_tokens == 0 and again.cached_write_tokens == len(PROMPT)
    assert again.prompt_cache_retention == "in_memory"
    assert complete(alice, model).prompt_tokens_details.cached_tokens == len(PROMPT) - 1
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        complete(alice, model, prompt_cache_retention="24h")

    result = tenzro("keys", "add", "carol", "--retention", "none", "--config", str(node.config), env=node.env)
    assert result.returncode == 0, result.stderr
    carol = openai.OpenAI(base_url=node.base, api_key=result.stdout.strip().splitlines()[-1], max_retries=0)
    entries = sealing(node)["entries"]
    assert complete(carol, model).cached_write_tokens == 0
    assert complete(carol, model).prompt_tokens_details.cached_tokens == 0
    assert sealing(node)["entries"] == entries


def test_a_removed_key_and_an_expired_ttl_destroy_the_callers_state(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    model = small_model_dir.name
    alice = openai.OpenAI(base_url=node.base, api_key=node.add_key("alice"), max_retries=0)
    complete(alice, model)
    settled = wait_for(node, lambda s: s["entries"] > 0 and s["plaintext_bytes"] == 0)
    assert settled["sealed_bytes"] > 0 and settled["reserve_bytes"] == 1024**3  # the default `cache.reserve_bytes`
    assert settled["reserve_free_bytes"] < settled["reserve_bytes"]  # the ciphertext lies in the reserve
    removed = tenzro("keys", "remove", "alice", "--config", str(node.config), env=node.env)
    assert removed.returncode == 0, removed.stderr
    gone = wait_for(node, lambda s: s["entries"] == 0 and s["bytes"] == 0, timeout_s=5)
    assert gone["reserve_free_bytes"] == gone["reserve_bytes"]  # given back (zeroed: tests/cache/test_blob_memory.py)
    with pytest.raises(openai.AuthenticationError):
        complete(alice, model)

    result = tenzro("keys", "add", "dave", "--ttl", "1", "--config", str(node.config), env=node.env)
    dave = openai.OpenAI(base_url=node.base, api_key=result.stdout.strip().splitlines()[-1], max_retries=0)
    time.sleep(0.6)  # the node re-reads its config every 0.5 s
    complete(dave, model)
    assert sealing(node)["entries"] > 0
    wait_for(node, lambda s: s["entries"] == 0, timeout_s=5)  # unused for a second: expired within the next tick
    assert complete(dave, model).prompt_tokens_details.cached_tokens == 0
