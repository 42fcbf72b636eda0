"""Cache time-to-live classes on a real node (issue 41): an Anthropic `1h` breakpoint writes only the prefix up to
it, billed at the 1-hour write price in the signed record; OpenAI's `prompt_cache_retention: 24h` at the 24-hour
price; a breakpoint the template cannot split at is a 400 naming the field, and nothing is stored."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import openai

from metering.pricing import PriceSchedule, save_pricing
from tests.node.conftest import NodeFactory

PRICES = PriceSchedule(input_price_wei=10, output_price_wei=40, cached_read_price_wei=1, cached_write_price_wei=12,
                       cached_write_1h_price_wei=20, cached_write_24h_price_wei=30)
SYSTEM = "You are a careful assistant who answers questions about the sea in a few words. " * 4


def get(url: str, key: str) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # loopback only
            return int(response.status), json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def post(url: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      "x-api-key": key}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # loopback only
            return int(response.status), json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_write_classes_are_stored_billed_and_refused_as_asked(node_factory: NodeFactory, small_model_dir: Path,
                                                               tmp_path: Path) -> None:
    pricing = tmp_path / "prices.yaml"
    save_pricing(pricing, PRICES)
    node = node_factory(small_model_dir, "--pricing", str(pricing))
    model = small_model_dir.name
    key = node.add_key("ttl")
    claude = anthropic.Anthropic(base_url=node.url, api_key=key, max_retries=0)

    # A 1-hour breakpoint at the end of the system prompt: only that prefix is written, at the 1-hour price.
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = claude.messages.create(model=model, max_tokens=4, system=system,  # type: ignore[arg-type]
                                   messages=[{"role": "user", "content": "Tell me about tides."}])
    usage = first.usage
    written = usage.cache_creation_input_tokens
    assert written and usage.cache_creation is not None
    assert (usage.cache_creation.ephemeral_1h_input_tokens, usage.cache_creation.ephemeral_5m_input_tokens) == (
        written, 0)
    assert usage.input_tokens > 0 and usage.cache_read_input_tokens == 0  # the user's turn is not stored
    status, record = get(f"{node.base}/generation?id={first.id}", key)
    assert status == 200
    assert (record["cached_write_tokens"], record["cached_write_1h_tokens"]) == (written, written)
    assert record["cached_write_1h_price_wei"] == "20" and "cached_write_24h_tokens" not in record
    uncached = record["input_tokens"] - written
    assert int(record["cost_wei"]) == uncached * 10 + written * 20 + record["output_tokens"] * 40
    status, held = get(f"{node.base}/cache?model={model}", key)
    assert held["tokens"] == written  # the prefix alone: not the rest of the prompt, not the reply

    # The next request with the same system prompt reads the prefix and writes nothing new.
    second = claude.messages.create(model=model, max_tokens=4, system=system,  # type: ignore[arg-type]
                                    messages=[{"role": "user", "content": "And about waves?"}])
    assert (second.usage.cache_read_input_tokens, second.usage.cache_creation_input_tokens) == (written, 0)

    # A breakpoint inside a message (not on its last block): refused naming the field, nothing stored.
    other = node.add_key("ttl-bad")
    status, body = post(f"{node.url}/v1/messages", other, {
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Tell me ", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "about tides."}]}]})
    assert status == 400 and body["type"] == "error"
    assert "messages[0].content[0].cache_control" in body["error"]["message"]
    assert get(f"{node.base}/cache?model={model}", other)[1]["tokens"] == 0

    # OpenAI's 24-hour retention: the whole prompt is written under the 24-hour class, at its price.
    gpt = openai.OpenAI(base_url=node.base, api_key=node.add_key("ttl-24h"), max_retries=0)
    chat = gpt.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "Why is the sea salty?"}],
                                       extra_body={"prompt_cache_retention": "24h"})
    assert chat.usage is not None and chat.usage.model_dump()["prompt_cache_retention"] == "24h"  # echoed as asked
    status, record = get(f"{node.base}/generation?id={chat.id}", gpt.api_key)
    assert (record["cached_write_tokens"], record["cached_write_24h_tokens"]) == (chat.usage.prompt_tokens,) * 2
    assert record["cached_write_24h_price_wei"] == "30" and "cached_write_1h_tokens" not in record
