"""The router over two real nodes: a node killed mid-run loses no request and answers none twice, and it is
routed to again once it is back; an agent's follow-ups, sent as soon as each reply ends, stay on the node holding
its conversation; a caller reads its own signed records through the router, and only its own."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench.local_node import TENZRO, LocalNode, free_port

CALLER_KEY = "tz-test-caller-key"
OTHER_KEY = "tz-test-other-caller-key"
REQUESTS = 24
FOLLOW_UPS, GAP_S = 4, 0.2
UNKNOWN_ID = "chatcmpl-" + "0" * 32
NOT_FOUND = {"error": {"message": "no generation with this id for this API key", "type": "not_found_error",
                       "param": "id", "code": "generation_not_found"}}


def healthy(url: str) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return dict(json.load(response))
    except OSError:
        return None


def wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen in {timeout_s} s")


def start(node: LocalNode) -> None:
    node.start()
    wait(lambda: healthy(node.root) is not None, 120, f"node on port {node.port} answering")


def records(node: LocalNode) -> list[str]:
    """Completion ids in every ledger segment the node wrote."""
    ids = []
    for segment in (node.workdir / "ledger").glob("ledger-*.jsonl"):
        for line in segment.read_text().splitlines()[1:]:
            if line.strip():
                ids.append(json.loads(line)["record_id"])
    return ids


def start_router(workdir: Path, providers: dict[str, Any], routing: str) -> tuple[subprocess.Popen[bytes], str]:
    """`tenzro router serve` over `providers` (a providers file's content) on a free port; its process and URL,
    once it sees every provider up."""
    (workdir / "providers.yaml").write_text(yaml.safe_dump(providers))
    port = free_port()
    with (workdir / "router.log").open("wb") as log:
        router = subprocess.Popen([*TENZRO, "router", "serve", "--providers", str(workdir / "providers.yaml"),
                                   "--port", str(port), "--routing", routing], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    count = len(providers["providers"])
    try:
        wait(lambda: (healthy(base) or {}).get("providers_up") == count, 60, f"the router seeing {count} nodes")
    except AssertionError:
        router.terminate()
        router.wait(timeout=10)
        raise
    return router, base


def test_a_killed_node_loses_no_request_and_comes_back(tmp_path: Path, small_model_dir: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    nodes = [LocalNode(tmp_path / name, str(small_model_dir), 1, None) for name in ("a", "b")]
    router: subprocess.Popen[bytes] | None = None
    try:
        keys = [node.add_key("router", "router") for node in nodes]
        for node in nodes:
            # One request at a time: those sent to `a` queue there, so the kill finds some unanswered (run
            # together, they could all end in the step that answers the first).
            config = yaml.safe_load(node.config.read_text())
            config["limits"] = {**config.get("limits", {}), "max_running": 1}
            node.config.write_text(yaml.safe_dump(config))
            start(node)
        providers = {"settings": {"poll_interval_s": 0.5, "connect_timeout_s": 2},
                     "providers": [{"name": name, "url": node.root, "api_key": key, "models": [small_model_dir.name]}
                                   for name, node, key in zip(("a", "b"), nodes, keys, strict=True)],
                     "callers": {"carol": {"key_sha256": hashlib.sha256(CALLER_KEY.encode()).hexdigest()}}}
        router, base = start_router(tmp_path, providers, "round-robin")

        async def run() -> list[tuple[int, str, str]]:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {CALLER_KEY}"}) as session:
                async def one(index: int) -> tuple[int, str, str]:
                    body = {"model": small_model_dir.name, "prompt": list(range(100 + index, 160 + index)),
                            "max_tokens": 48, "temperature": 0}
                    async with session.post(base + "/v1/completions", json=body) as response:
                        return response.status, response.headers.get("Tenzro-Provider", ""), (await response.json()
                                                                                                 ).get("id", "")

                first = [asyncio.create_task(one(index)) for index in range(REQUESTS // 2)]
                pending: set[asyncio.Task[tuple[int, str, str]]] = set(first)
                while pending:  # mid-run: `a` has answered one, and the others sent to it queue there
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if any(task.result()[1] == "a" for task in done):
                        break
                assert nodes[0].process is not None
                nodes[0].process.send_signal(signal.SIGKILL)
                nodes[0].process.wait()
                later = [asyncio.create_task(one(index)) for index in range(REQUESTS // 2, REQUESTS)]
                return list(await asyncio.gather(*first, *later))

        answers = asyncio.run(run())
        assert [status for status, _, _ in answers] == [200] * REQUESTS  # none lost
        ids = [record_id for _, _, record_id in answers]
        assert len(set(ids)) == REQUESTS
        completed_on_b = records(nodes[1])
        served_by_a = [record_id for _, provider, record_id in answers if provider == "a"]
        assert all(record_id in completed_on_b for _, provider, record_id in answers if provider == "b")
        assert len(completed_on_b) == len(set(completed_on_b))  # no completion recorded twice
        assert not set(served_by_a) & set(completed_on_b)  # none answered by both
        # Round-robin sent half of the first requests to `a`; those it had not answered when killed moved to `b`.
        assert 1 <= len(served_by_a) < REQUESTS // 4, f"a answered {len(served_by_a)}: the kill came too late"

        start(nodes[0])  # back on its port: the router polls it up again and routes to it
        wait(lambda: (healthy(base) or {}).get("providers_up") == 2, 30, "the router seeing the node back")
        providers_seen = set()
        for index in range(4):
            body = json.dumps({"model": small_model_dir.name, "prompt": [7, 8, 9, index], "max_tokens": 2}).encode()
            request = urllib.request.Request(base + "/v1/completions", data=body, headers={
                "Authorization": f"Bearer {CALLER_KEY}", "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                providers_seen.add(response.headers["Tenzro-Provider"])
        assert providers_seen == {"a", "b"}
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=10)
        for node in nodes:
            node.stop()


@dataclass(frozen=True)
class Pair:
    """Two real nodes (`a`, `b`) behind a warm-biased router whose callers are carol (CALLER_KEY) and dave
    (OTHER_KEY)."""

    base: str
    model: str


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, small_model_dir: Path) -> Iterator[Pair]:
    workdir = tmp_path_factory.mktemp("pair")
    for name in ("a", "b"):
        (workdir / name).mkdir()
    nodes = [LocalNode(workdir / name, str(small_model_dir), 1, None) for name in ("a", "b")]
    router: subprocess.Popen[bytes] | None = None
    try:
        keys = [node.add_key("router", "router") for node in nodes]
        for node in nodes:
            start(node)
        # No poll while a test runs: what keeps an agent's next turn warm is the in-flight count alone.
        providers = {"settings": {"poll_interval_s": 600, "connect_timeout_s": 5},
                     "providers": [{"name": name, "url": node.root, "api_key": key, "models": [small_model_dir.name]}
                                   for name, node, key in zip(("a", "b"), nodes, keys, strict=True)],
                     "callers": {name: {"key_sha256": hashlib.sha256(key.encode()).hexdigest()}
                                 for name, key in (("carol", CALLER_KEY), ("dave", OTHER_KEY))}}
        router, base = start_router(workdir, providers, "warm")
        yield Pair(base, small_model_dir.name)
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=10)
        for node in nodes:
            node.stop()


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_back_to_back_follow_ups_stay_on_the_node_holding_the_conversation(pair: Pair) -> None:
    """An agent's first turn, then FOLLOW_UPS more, each sent GAP_S after the reply before it ended: every one
    goes where the first went, and finds its conversation there. Before in-flight counting, the finished first
    turn still counted as that node's load (until a poll), and the first follow-up went to the idle node."""

    async def run() -> list[tuple[str, int]]:
        messages = [{"role": "system", "content": "You are a dispatcher. Answer in one short line."}]
        seen = []
        async with aiohttp.ClientSession(headers=bearer(CALLER_KEY)) as session:
            for turn in range(1 + FOLLOW_UPS):
                if turn:
                    await asyncio.sleep(GAP_S)
                messages.append({"role": "user", "content": f"Step {turn}: route pallet {turn} to berth {turn}."})
                body = {"model": pair.model, "messages": messages, "max_tokens": 4, "temperature": 0}
                async with session.post(pair.base + "/v1/chat/completions", json=body) as response:
                    answer = await response.json()
                    assert response.status == 200, answer
                    seen.append((response.headers["Tenzro-Provider"],
                                 answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        return seen

    seen = asyncio.run(run())
    first = seen[0][0]
    assert [provider for provider, _ in seen[1:]] == [first] * FOLLOW_UPS
    assert all(cached > 0 for _, cached in seen[1:])


def test_a_caller_reads_its_own_records_through_the_router_and_no_one_elses(pair: Pair) -> None:
    """Completions served by both nodes: each record is read through the router from the node that served it
    (`GET /v1/generation` and JSON-RPC's `tenzro_getGeneration`), billed to the router's caller there; another
    caller of the router reading it gets what an unknown id gets, an OpenAI-shaped 404."""

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            async def complete(index: int) -> tuple[str, str]:
                body = {"model": pair.model, "prompt": list(range(200 + index, 240 + index)), "max_tokens": 16,
                        "temperature": 0}
                async with session.post(pair.base + "/v1/completions", json=body, headers=bearer(CALLER_KEY)
                                        ) as response:
                    assert response.status == 200
                    return response.headers["Tenzro-Provider"], (await response.json())["id"]

            async def read(record_id: str | None, key: str | None) -> tuple[int, str | None, Any]:
                params = {"id": record_id} if record_id is not None else {}
                async with session.get(pair.base + "/v1/generation", params=params, headers=bearer(key)) as response:
                    return response.status, response.headers.get("Tenzro-Provider"), await response.json()

            async def rpc(calls: Any, key: str | None) -> Any:
                async with session.post(pair.base + "/rpc", json=calls, headers=bearer(key)) as response:
                    assert response.status == 200
                    return await response.json()

            # Sent at once, the four are spread over both nodes by the requests in flight.
            served = await asyncio.gather(*(complete(index) for index in range(4)))
            assert {provider for provider, _ in served} == {"a", "b"}
            for provider, record_id in served:
                status, read_from, record = await read(record_id, CALLER_KEY)
                assert (status, read_from) == (200, provider), record
                assert (record["record_id"], record["caller_id"]) == (record_id, "router/carol")
                assert (await rpc({"jsonrpc": "2.0", "method": "tenzro_getGeneration", "params": [record_id],
                                   "id": 1}, CALLER_KEY)) == {"jsonrpc": "2.0", "result": record, "id": 1}
                assert await read(record_id, OTHER_KEY) == (404, None, NOT_FOUND)
            assert await read(UNKNOWN_ID, CALLER_KEY) == (404, None, NOT_FOUND)
            status, _, refused = await read(None, CALLER_KEY)
            assert (status, refused["error"]["param"]) == (400, "id")
            status, _, refused = await read(served[0][1], None)
            assert (status, refused["error"]["code"]) == (401, "invalid_api_key")

            calls = [{"jsonrpc": "2.0", "method": "tenzro_getGeneration", "params": {"id": record_id}, "id": index}
                     for index, (_, record_id) in enumerate(served[:1])]
            calls.append({"jsonrpc": "2.0", "method": "tenzro_getGeneration", "params": {"id": UNKNOWN_ID}, "id": 9})
            [mine, unknown] = await rpc(calls, CALLER_KEY)
            assert mine["result"]["record_id"] == served[0][1]
            assert unknown == {"jsonrpc": "2.0", "error": {"code": -32004, "message": NOT_FOUND["error"]["message"],
                                                           "data": NOT_FOUND["error"]}, "id": 9}
            [others] = await rpc(calls[:1], OTHER_KEY)
            assert others["error"]["code"] == -32004
            [no_key] = await rpc(calls[:1], None)
            assert no_key["error"]["code"] == -32001

    asyncio.run(run())
