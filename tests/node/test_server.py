"""The node as a subprocess on loopback, through the official openai client and aiohttp."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from cache.arena import Scope
from node.engine.chat_template import render_chat
from node.engine.cpu_kernels import load_kernels
from node.engine.loader import load_model
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from tests.node.conftest import Node, start_node, stop_node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, small_model_dir: Path) -> Iterator[Node]:
    """One node (reuse and sealing on, as served by default) for the tests that need no node of their own: each asks
    as callers named for it alone, whose state no other test's requests touch."""
    started = start_node(tmp_path_factory.mktemp("server"), small_model_dir)
    yield started
    stop_node(started)


def client(node: Node, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.base, api_key=key, max_retries=0)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_five_turn_chat_reuses_history_and_matches_no_reuse(node_factory, small_model_dir: Path) -> None:
    reuse, plain = node_factory.all((small_model_dir,), (small_model_dir, "--no-reuse"))
    model = small_model_dir.name
    oracle = ModelRunner(load_model(model, small_model_dir), None)  # in-process, reuse off: the generated ids
    tokenizer = oracle.loaded.tokenizer
    c_reuse, c_plain = client(reuse, reuse.add_key("alice")), client(plain, plain.add_key("alice"))
    messages = [{"role": "system", "content": "You are a terse assistant for the test suite."}]
    stored: list[int] = []
    previous_prompt_len = 0
    replies: dict[str, list[int]] = {}  # the node's replies, which it gives back their generated ids
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question number {turn}: tell me about flowers."})
        got = c_reuse.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        expected = c_plain.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        assert got.choices[0].message.content == expected.choices[0].message.content
        assert expected.usage.prompt_tokens_details.cached_tokens == 0
        prompt = render_chat(tokenizer, messages, replies=replies.get).ids
        assert got.usage.prompt_tokens == len(prompt)
        cached = got.usage.prompt_tokens_details.cached_tokens
        # Reuse covers the previous prompt and the whole reply as generated (issue 34: the re-rendered reply's text
        # re-tokenized to other ids, and reuse stopped at the first); one prompt token is always computed.
        assert cached == min(common_prefix(stored, prompt), len(prompt) - 1)
        if turn:
            assert cached >= len(stored) > previous_prompt_len
        reference = oracle.generate(GenerationRequest(Scope("t", model), prompt, SamplingParams(12, 0.0)),
                                    emit=lambda _: None, cancelled=lambda: False)
        assert reference.text == got.choices[0].message.content
        stored = prompt + reference.output_ids
        previous_prompt_len = len(prompt)
        replies[reference.text] = [t for t in reference.output_ids if t not in oracle.loaded.eos_token_ids]
        messages.append({"role": "assistant", "content": got.choices[0].message.content})
    assert got.usage.prompt_tokens > 100


def test_another_caller_and_another_model_start_from_scratch(node: Node, small_model_dir: Path) -> None:
    alice, bob = client(node, node.add_key("another-alice")), client(node, node.add_key("another-bob"))
    model = small_model_dir.name
    messages = [{"role": "user", "content": "The same long prompt for both callers. " * 10}]
    first = alice.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    again = alice.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    other = bob.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == first.choices[0].message.content


def test_completions_accept_text_and_token_ids_and_stream_usage(node: Node, small_model_dir: Path) -> None:
    c = client(node, node.add_key("completions"))
    model = small_model_dir.name
    ids = list(range(1000, 1100))
    plain = c.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert plain.usage.prompt_tokens == 100 and plain.usage.completion_tokens == 6
    assert plain.choices[0].finish_reason == "length"
    stream = c.completions.create(model=model, prompt=ids + [7, 8], max_tokens=6, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == 102
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 100
    text = c.completions.create(model=model, prompt="Hello there", max_tokens=3, temperature=0)
    assert text.usage.completion_tokens == 3
    chat_stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chat_chunks = list(chat_stream)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chat_chunks if ch.choices)
    whole = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                      temperature=0)
    assert streamed == whole.choices[0].message.content
    assert chat_chunks[-1].usage.completion_tokens == 5
    assert [ch.choices[0].finish_reason for ch in chat_chunks if ch.choices][-1] == "length"


def test_seeded_sampling_repeats_and_stop_strings_cut(node: Node, small_model_dir: Path) -> None:
    c = client(node, node.add_key("seeded"))
    model = small_model_dir.name
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=10, temperature=0.9, top_p=0.9)
    a = c.completions.create(seed=7, **kwargs)
    b = c.completions.create(seed=7, **kwargs)
    assert a.choices[0].text == b.choices[0].text
    full = c.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0).choices[0]
    stop = full.text[3:5]
    cut = c.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].text == full.text[:full.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_unknown_and_unimplemented_fields_are_refused_by_name_and_the_node_keeps_serving(
        node: Node, small_model_dir: Path) -> None:
    """As OpenAI refuses them (issue 34: `modalities: ["audio"]`, `web_search_options`, `store: true` and a
    made-up field were served with 200, as if absent)."""
    c = client(node, node.add_key("refused"))
    model = small_model_dir.name
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as unknown:
        c.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                  extra_body={"made_up": 1, "max_token": 5})
    assert unknown.value.body == {
        "message": "unknown parameters 'made_up', 'max_token': remove them (this node refuses the fields it does "
                   "not know rather than ignore them)",
        "type": "invalid_request_error", "param": "made_up", "code": "unknown_parameter"}
    for field, kwargs in (("web_search_options", {"extra_body": {"web_search_options": {}}}),
                          ("store", {"store": True}), ("modalities", {"modalities": ["audio"]})):
        with pytest.raises(openai.BadRequestError) as unsupported:
            c.chat.completions.create(model=model, messages=messages, max_tokens=2, **kwargs)
        assert (unsupported.value.body["param"], unsupported.value.body["code"]) == (field, "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as text:
        c.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"made_up": 1})
    assert text.value.body["param"] == "made_up"
    served = c.chat.completions.create(model=model, messages=messages, max_tokens=2, store=False, user="u-1")
    assert served.usage.completion_tokens == 2


def test_usage_carries_cache_writes_where_openai_clients_read_them(node: Node, small_model_dir: Path) -> None:
    c = client(node, node.add_key("usage"))
    messages = [{"role": "user", "content": "Write down what the tide does."}]
    first = c.chat.completions.create(model=small_model_dir.name, messages=messages, max_tokens=2)
    again = c.chat.completions.create(model=small_model_dir.name, messages=messages, max_tokens=2)
    details = first.usage.prompt_tokens_details
    assert (details.cached_tokens, details.cache_write_tokens) == (0, first.usage.prompt_tokens)  # all written
    details = again.usage.prompt_tokens_details
    assert (details.cached_tokens, details.cache_write_tokens) == (again.usage.prompt_tokens - 1, 0)
    for usage in (first.usage, again.usage):  # the node's own top-level fields stay
        assert usage.prompt_tokens_details.cache_write_tokens == usage.model_extra["cached_write_tokens"]


ERROR_CASES = [
    # (headers, body, status, code)
    ({}, {"model": "M", "messages": [{"role": "user", "content": "x"}]}, 401, "invalid_api_key"),
    ({"Authorization": "Bearer tz-wrong"}, {"model": "M", "messages": [{"role": "user", "content": "x"}]},
     401, "invalid_api_key"),
    (None, {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
    (None, b"{not json", 400, "invalid_json"),
    (None, {"model": "M", "messages": []}, 400, None),
    (None, {"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, None),
    (None, {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, None),
    (None, {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    (None, {"model": "M", "messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "context_length_exceeded"),
    (None, {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400,
     "context_length_exceeded"),
    (None, b"x" * (9 * 1024 * 1024), 413, "request_too_large"),
]


async def _post(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: object):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as resp:
        return resp.status, await resp.json()


def test_errors_are_openai_shaped_and_the_node_keeps_serving(node: Node, small_model_dir: Path) -> None:
    key = node.add_key("errors")
    model = small_model_dir.name
    good = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            url = node.base + "/chat/completions"
            for headers, body, status, code in ERROR_CASES:
                if isinstance(body, dict) and body.get("model") == "M":
                    body = {**body, "model": model}
                got_status, payload = await _post(session, url, {"Authorization": f"Bearer {key}"}
                                                  if headers is None else headers, body)
                assert got_status == status, payload
                assert set(payload["error"]) == {"message", "type", "param", "code"}
                assert payload["error"]["message"]
                if code is not None:
                    assert payload["error"]["code"] == code
                ok_status, ok = await _post(session, url, {"Authorization": f"Bearer {key}"}, good)
                assert ok_status == 200 and ok["usage"]["completion_tokens"] == 2

    asyncio.run(run())


def test_full_queue_answers_503_and_health_answers_during_prefill(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir, config_text="limits:\n  max_queue: 1\n  max_running: 1\n")
    key, operator = node.add_key("alice"), node.add_key("ops", "operator")
    long = {"model": small_model_dir.name, "prompt": list(range(100, 2100)), "max_tokens": 300}

    async def run() -> None:
        headers = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession() as session:
            async def until_waiting(count: int) -> None:  # the queue's depth, as an operator sees it
                while True:
                    async with session.get(node.url + "/health",
                                           headers={"Authorization": f"Bearer {operator}"}) as health:
                        assert health.status == 200
                        if (await health.json())["waiting"] == count:
                            return
                    await asyncio.sleep(0.02)

            url = node.base + "/completions"
            busy = [asyncio.create_task(_post(session, url, headers, long))]
            await asyncio.sleep(0.1)
            await until_waiting(0)  # the worker took the first off the queue before the second arrives
            busy.append(asyncio.create_task(_post(session, url, headers, long)))
            await until_waiting(1)
            status, payload = await _post(session, url, headers, long)
            assert status == 503 and payload["error"]["code"] == "queue_full"
            assert [s for s, _ in await asyncio.gather(*busy)] == [200, 200]
            status, _ = await _post(session, url, headers, {**long, "max_tokens": 1})
            assert status == 200

    asyncio.run(run())


def test_models_and_metrics(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    c = client(node, node.add_key("alice"))
    operator = node.add_key("ops", "operator")
    assert [m.id for m in c.models.list().data] == [small_model_dir.name]
    prompt = list(range(2000, 2050))
    c.completions.create(model=small_model_dir.name, prompt=prompt, max_tokens=2, temperature=0)
    c.completions.create(model=small_model_dir.name, prompt=prompt + [5], max_tokens=2, temperature=0)

    async def scrape() -> str:
        async with aiohttp.ClientSession() as session, session.get(
                node.url + "/metrics", headers={"Authorization": f"Bearer {operator}"}) as resp:
            return await resp.text()

    text = asyncio.run(scrape())
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    # Per-request quantities only as coarse histograms: 50 and 51 prompt tokens, the second one mostly reused.
    assert values['tenzro_prompt_tokens_bucket{le="64.0"}'] == 2
    assert values['tenzro_prompt_reused_share_bucket{le="0.0"}'] == 1
    assert values['tenzro_prompt_reused_share_bucket{le="0.9"}'] == 1
    assert values['tenzro_prompt_reused_share_bucket{le="+Inf"}'] == 2
    assert values["tenzro_time_to_first_token_seconds_count"] == 2
    # Stored: 50 prompt + 2 reply tokens, then 1 more prompt + 2 reply tokens, in 2 layers of K and V
    # (2 kv heads of 32 dims, float32).
    per_token = 2 * 2 * 2 * 32 * 4
    assert values["tenzro_cached_bytes"] == (52 + 1 + 2) * per_token
    assert "alice" not in text


def test_the_node_says_which_forward_its_model_runs_and_why(node: Node, small_model_dir: Path) -> None:
    """The same choice as an in-process load on this machine, in the start log, `GET /v1/node` and `/metrics`:
    `native-cpu` where the kernels load, `library` under TENZRO_NATIVE=off or where they do not (the engine tests
    check both choices on every machine: `test_cpu_decoder.py`, `test_cpu_kernels.py`)."""
    expected = load_model(small_model_dir.name, small_model_dir).forward
    if os.environ.get("TENZRO_NATIVE") == "off":
        assert (expected.backend, expected.reason) == ("library", "switched off by TENZRO_NATIVE=off")
    else:
        assert expected.backend == ("native-cpu" if load_kernels().kernels is not None else "library")
    operator = node.add_key("forward-ops", "operator")

    async def read() -> tuple[dict[str, object], str]:
        async with aiohttp.ClientSession() as session:
            async with session.get(node.url + "/v1/node") as resp:
                identity = await resp.json()
            async with session.get(node.url + "/metrics", headers={"Authorization": f"Bearer {operator}"}) as resp:
                return identity, await resp.text()

    identity, metrics = asyncio.run(read())
    assert identity["forward"] == {"backend": expected.backend, "reason": expected.reason}
    reason = expected.reason.replace("\\", "\\\\").replace('"', '\\"')
    assert (f'tenzro_forward_backend{{backend="{expected.backend}",model="{small_model_dir.name}",reason="{reason}"}} '
            '1.0' in metrics.splitlines())
    log = (node.config.parent / "node.log").read_text()
    assert f"model {small_model_dir.name}: {expected.backend} forward ({expected.reason})" in log
    assert f"Forward: {expected.backend} ({expected.reason})" in log


@pytest.mark.parametrize("bad", ["/nonexistent"])
def test_refuses_to_start_on_a_directory_that_is_not_a_model(tmp_path: Path, bad: str) -> None:
    from tests.node.conftest import tenzro

    result = tenzro("node", "serve", "--model", str(tmp_path), "--config", str(tmp_path / "c.yaml"),
                    env={"TENZRO_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "is not a Hugging Face model directory: it has no config.json" in result.stderr


def test_a_stream_returns_its_prompt_and_reply_ids_with_its_finish_reason(node: Node, small_model_dir: Path) -> None:
    c, model = client(node, node.add_key("stream")), small_model_dir.name
    messages = [{"role": "user", "content": "Count the tides."}]
    plain = c.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0,
                                      extra_body={"return_token_ids": True})
    chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}))
    last = next(chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason)
    assert (last.model_extra or {})["prompt_token_ids"] == (plain.model_extra or {})["prompt_token_ids"]
    assert (last.choices[0].model_extra or {})["token_ids"] == (plain.choices[0].model_extra or {})["token_ids"]
    assert all("token_ids" not in (chunk.choices[0].model_extra or {}) for chunk in chunks
               if chunk.choices and chunk is not last)


def test_the_node_says_where_its_stored_state_lives_and_its_prefill_chunk(node_factory, small_model_dir: Path) -> None:
    """On a CPU the hot tier is `cache.plaintext_bytes` in host memory and nothing is copied to a device
    (`cache.device_bytes` is a GPU's); an unset `limits.prefill_chunk` is the CPU's 256."""
    node = node_factory(small_model_dir, config_text="cache: {plaintext_bytes: 1048576, device_bytes: 4096}\n")

    async def read() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.get(node.url + "/v1/node") as resp:
                return dict(await resp.json())

    identity = asyncio.run(read())
    assert identity["device"] == {"type": "cpu", "hot_bytes": 1048576, "host_copies": "none",
                                  "reason": "state is in host memory"}
    assert identity["engine"]["prefill_chunk"] == 256
    assert "Device:" not in (node.config.parent / "node.log").read_text()
