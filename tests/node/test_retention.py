"""Retention over HTTP: per request (`prompt_cache_retention`) and per caller (`retention`, `ttl_s`), and a
removed key's state destroyed by the running node."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.node.conftest import Node, tenzro

PROMPT = list(range(200, 500))


def sealing(node: Node, operator: str) -> dict[str, Any]:
    """What the stored state's tiers hold: the operator's to read (`GET /v1/node/state`)."""
    return dict(node.state(operator)["sealing"])


def wait_for(node: Node, operator: str, done: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not done(state := sealing(node, operator)):
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
    operator = node.add_key("ops", "operator")
    usage = complete(alice, model, prompt_cache_retention="none")
    assert usage.cached_write_tokens == 0 and usage.prompt_cache_retention == "none"
    assert sealing(node, operator)["entries"] == 0
    again = complete(alice, model)
    assert again.prompt_tokens_details.cached_tokens == 0 and again.cached_write_tokens == len(PROMPT)
    assert again.prompt_cache_retention == "in_memory"
    assert complete(alice, model).prompt_tokens_details.cached_tokens == len(PROMPT) - 1
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        complete(alice, model, prompt_cache_retention="1h")

    result = tenzro("keys", "add", "carol", "--retention", "none", "--config", str(node.config), env=node.env)
    assert result.returncode == 0, result.stderr
    carol = openai.OpenAI(base_url=node.base, api_key=result.stdout.strip().splitlines()[-1], max_retries=0)
    entries = sealing(node, operator)["entries"]
    assert complete(carol, model).cached_write_tokens == 0
    assert complete(carol, model).prompt_tokens_details.cached_tokens == 0
    assert sealing(node, operator)["entries"] == entries


def test_a_removed_key_and_an_expired_ttl_destroy_the_callers_state(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    model = small_model_dir.name
    alice = openai.OpenAI(base_url=node.base, api_key=node.add_key("alice"), max_retries=0)
    operator = node.add_key("ops", "operator")
    complete(alice, model)
    settled = wait_for(node, operator, lambda s: s["entries"] > 0 and s["plaintext_bytes"] == 0)
    assert settled["sealed_bytes"] > 0 and settled["reserve_bytes"] == 1024**3  # the default `cache.reserve_bytes`
    assert settled["reserve_free_bytes"] < settled["reserve_bytes"]  # the ciphertext lies in the reserve
    removed = tenzro("keys", "remove", "alice", "--config", str(node.config), env=node.env)
    assert removed.returncode == 0, removed.stderr
    gone = wait_for(node, operator, lambda s: s["entries"] == 0 and s["bytes"] == 0, timeout_s=5)
    assert gone["reserve_free_bytes"] == gone["reserve_bytes"]  # given back (zeroed: tests/cache/test_blob_memory.py)
    with pytest.raises(openai.AuthenticationError):
        complete(alice, model)

    result = tenzro("keys", "add", "dave", "--ttl", "1", "--config", str(node.config), env=node.env)
    dave = openai.OpenAI(base_url=node.base, api_key=result.stdout.strip().splitlines()[-1], max_retries=0)
    time.sleep(0.6)  # the node re-reads its config every 0.5 s
    complete(dave, model)
    assert sealing(node, operator)["entries"] > 0
    # Unused for a second: expired within the next tick.
    wait_for(node, operator, lambda s: s["entries"] == 0, timeout_s=5)
    assert complete(dave, model).prompt_tokens_details.cached_tokens == 0
