"""A real node as a subprocess on loopback, driven through the CLI and HTTP only.

`tenzro` runs as `python -m node` of the interpreter running the tests, so the suite runs wherever the project is
importable (an editable install, or PYTHONPATH on a machine without the project's scripts), as bench/local_node.py
starts its nodes. TENZRO_TEST_DEVICE (default cpu) names the device the tests that pass `DEVICE_FLAGS` or
`TEST_DEVICE` serve on (the reuse matrix, the batching tests): `cuda` runs them on the GPU, in float32 there so
that their exact comparisons hold as on CPU.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.local_node import TENZRO

TEST_DEVICE = os.environ.get("TENZRO_TEST_DEVICE", "cpu")
TEST_DTYPE = "float32"
"""Also on CUDA, where the node's default is bfloat16: the tests compare outputs token for token."""
DEVICE_FLAGS = ("--device", TEST_DEVICE, "--dtype", TEST_DTYPE)
"""`tenzro node serve` flags of a test that runs on TENZRO_TEST_DEVICE."""


def unverified_context() -> ssl.SSLContext:
    """For polling a `--tls` node's health before a test holds its certificate: the test pins it afterwards."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def http_status(url: str) -> int:
    context = unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tenzro(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TENZRO, *args], env=env, capture_output=True, text=True, timeout=300)


@dataclass
class Node:
    url: str
    process: subprocess.Popen[str]
    config: Path
    env: dict[str, str]

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def add_key(self, name: str, role: str = "caller") -> str:
        result = tenzro("keys", "add", name, "--role", role, "--config", str(self.config), env=self.env)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    def state(self, operator_key: str) -> dict[str, Any]:
        """The operator's view of how the node runs (`GET /v1/node/state`): engine counters, the queue and what
        the stored state's tiers hold, which the public `GET /v1/node` does not show."""
        request = urllib.request.Request(self.url + "/v1/node/state",
                                         headers={"Authorization": f"Bearer {operator_key}"})
        with urllib.request.urlopen(request, timeout=5) as response:  # loopback only
            return dict(json.load(response))


def node_view(node: Node) -> dict[str, Any]:
    """The node's public `GET /v1/node`, over an unverified TLS connection for a `--tls` node (tests that verify
    the node pin its certificate themselves)."""
    context = unverified_context() if node.url.startswith("https:") else None
    with urllib.request.urlopen(node.url + "/v1/node", timeout=5, context=context) as response:
        return dict(json.load(response))


def launch_node(tmp: Path, model: Path, *extra: str, config_text: str | None = None, port: int | None = None) -> Node:
    """Start `tenzro node serve` without waiting; its output goes to `tmp/node.log`. Its URL is https when `extra`
    holds `--tls`."""
    env = {**os.environ, "TENZRO_HOME": str(tmp / "home")}
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "node.yaml"
    if config_text is not None:
        config.write_text(config_text)
    port = port or free_port()
    with (tmp / "node.log").open("w") as log:
        process = subprocess.Popen(
            [*TENZRO, "node", "serve", "--model", str(model), "--port", str(port), "--config", str(config),
             "--threads", "1", *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return Node(f"{'https' if '--tls' in extra else 'http'}://127.0.0.1:{port}", process, config, env)


def wait_healthy(node: Node, timeout_s: float = 120) -> Node:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.process.poll() is not None:
            raise RuntimeError(f"node exited: {(node.config.parent / 'node.log').read_text()}")
        if http_status(node.url + "/health") == 200:
            return node
        time.sleep(0.2)
    node.process.kill()
    raise RuntimeError("node did not become healthy")


def start_node(tmp: Path, model: Path, *extra: str, config_text: str | None = None) -> Node:
    return wait_healthy(launch_node(tmp, model, *extra, config_text=config_text))


def stop_node(node: Node) -> None:
    node.process.terminate()
    try:
        node.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        node.process.kill()


class NodeFactory:
    """Nodes for one test, stopped at its end; `all` starts several at once to overlap their start-up."""

    def __init__(self, tmp: Path) -> None:
        self._tmp = tmp
        self.started: list[Node] = []

    def _launch(self, model: Path, *extra: str, config_text: str | None = None) -> Node:
        node = launch_node(self._tmp / f"node{len(self.started)}", model, *extra, config_text=config_text)
        self.started.append(node)
        return node

    def __call__(self, model: Path, *extra: str, config_text: str | None = None) -> Node:
        return wait_healthy(self._launch(model, *extra, config_text=config_text))

    def all(self, *specs: tuple[Any, ...]) -> list[Node]:
        nodes = [self._launch(*spec) for spec in specs]
        return [wait_healthy(node) for node in nodes]


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[NodeFactory]:
    factory = NodeFactory(tmp_path)
    yield factory
    for node in factory.started:
        stop_node(node)
