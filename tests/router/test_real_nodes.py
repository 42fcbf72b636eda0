"""The router over two real nodes: a node killed mid-run loses no request and answers none twice, and it is
routed to again once it is back."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp
import yaml

from bench.local_node import LocalNode, free_port

TENZRO = str(Path(sys.executable).parent / "tenzro")
CALLER_KEY = "tz-test-caller-key"
REQUESTS = 24


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


def test_a_killed_node_loses_no_request_and_comes_back(tmp_path: Path, small_model_dir: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    nodes = [LocalNode(tmp_path / name, str(small_model_dir), 1, None) for name in ("a", "b")]
    router_port = free_port()
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
        (tmp_path / "providers.yaml").write_text(yaml.safe_dump(providers))
        with (tmp_path / "router.log").open("wb") as log:
            router = subprocess.Popen([TENZRO, "router", "serve", "--providers", str(tmp_path / "providers.yaml"),
                                       "--port", str(router_port), "--routing", "round-robin"],
                                      stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{router_port}"
        wait(lambda: (healthy(base) or {}).get("providers_up") == 2, 60, "the router seeing both nodes")

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
