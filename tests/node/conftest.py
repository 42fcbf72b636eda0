"""A real node as a subprocess on loopback, driven through the CLI and HTTP only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TENZRO = str(Path(sys.executable).parent / "tenzro")


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
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
    return subprocess.run([TENZRO, *args], env=env, capture_output=True, text=True, timeout=300)


@dataclass
class Node:
    url: str
    process: subprocess.Popen[str]
    config: Path
    env: dict[str, str]

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def add_key(self, name: str) -> str:
        result = tenzro("keys", "add", name, "--config", str(self.config), env=self.env)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]


def start_node(tmp: Path, model: Path, *extra: str, config_text: str | None = None) -> Node:
    env = {**os.environ, "TENZRO_HOME": str(tmp / "home")}
    config = tmp / "node.yaml"
    if config_text is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        config.write_text(config_text)
    port = free_port()
    process = subprocess.Popen(
        [TENZRO, "node", "serve", "--model", str(model), "--port", str(port), "--config", str(config),
         "--threads", "1", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"node exited: {process.stdout.read() if process.stdout else ''}")
        if http_status(url + "/health") == 200:
            return Node(url, process, config, env)
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("node did not become healthy")


def stop_node(node: Node) -> None:
    node.process.terminate()
    try:
        node.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        node.process.kill()


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator:
    started: list[Node] = []

    def make(model: Path, *extra: str, config_text: str | None = None) -> Node:
        node = start_node(tmp_path / f"node{len(started)}", model, *extra, config_text=config_text)
        started.append(node)
        return node

    yield make
    for node in started:
        stop_node(node)
