"""The router verifies its providers itself under its trust policy (issue 35 item 6): a `--tls` node serving weights
the policy does not accept is never sent a request, every connection goes over the verified certificate, and a node
that restarts with a new key is dropped until it verifies again.

No TEE here: the nodes present `none` evidence, which the router accepts only with `trust.allow_none`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from bench.local_node import TENZRO
from tests.node.conftest import Node, NodeFactory, free_port, launch_node, node_view, stop_node, wait_healthy
from tests.router.test_real_nodes import wait

CALLER_KEY = "tz-test-verified-router-caller"


def router_health(base: str) -> dict[str, object]:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as response:
            return dict(json.load(response))
    except OSError:
        return {}


def chat(base: str) -> tuple[int, str | None]:
    request = urllib.request.Request(base + "/v1/chat/completions", method="POST", data=json.dumps({
        "model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode(),
        headers={"Authorization": f"Bearer {CALLER_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("Tenzro-Provider")
    except urllib.error.HTTPError as exc:
        return exc.code, None


def start_router(tmp_path: Path, nodes: list[tuple[str, Node]], policy: dict[str, object], allow_none: bool
                 ) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`tenzro router serve` over `nodes` under `policy`; its process, URL and log."""
    (tmp_path / "trust.yaml").write_text(yaml.safe_dump(policy))
    providers = {
        "settings": {"poll_interval_s": 0.5},
        "providers": [{"name": name, "url": node.url, "api_key": node.add_key("router", "router"), "models": ["small"]}
                      for name, node in nodes],
        "callers": {"alice": {"key_sha256": hashlib.sha256(CALLER_KEY.encode()).hexdigest()}},
        "trust": {"policy": "trust.yaml", "allow_none": allow_none}}
    (tmp_path / "providers.yaml").write_text(yaml.safe_dump(providers))
    port = free_port()
    log = tmp_path / "router.log"
    with log.open("wb") as output:
        router = subprocess.Popen([*TENZRO, "router", "serve", "--providers", str(tmp_path / "providers.yaml"),
                                   "--port", str(port)], stdout=output, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait(lambda: router_health(base).get("providers") == len(nodes), 60, "the router serving")
    return router, base, log


@pytest.fixture
def other_weights(small_model_dir: Path, tmp_path: Path) -> Path:
    """The same model id (`small`) with other bytes: another weight digest."""
    copy = tmp_path / "other" / "small"
    shutil.copytree(small_model_dir, copy)
    (copy / "NOTICE").write_text("one more file is other weights to the digest\n")
    return copy


def test_the_router_sends_only_to_providers_that_verify_and_drops_a_restarted_one_until_it_verifies_again(
        node_factory: NodeFactory, small_model_dir: Path, other_weights: Path, tmp_path: Path) -> None:
    genuine, other = node_factory.all((small_model_dir, "--tls"), (other_weights, "--tls"))
    accepted = node_view(genuine)["models"][0]["digest"]
    assert accepted != node_view(other)["models"][0]["digest"]
    router, base, log = start_router(tmp_path, [("genuine", genuine), ("other", other)],
                                     policy(model_digests={"small": [accepted]}), allow_none=True)
    try:
        wait(lambda: router_health(base).get("providers_up") == 1, 60, "the router verifying the genuine node")
        assert [chat(base) for _ in range(4)] == [(200, "genuine")] * 4
        text = log.read_text()  # names and reasons are withheld by the log's privacy filter; indices are not
        assert "(providers[0]) verified" in text and "(providers[1]) verified" not in text
        assert "(providers[1]) is down" in text
        refused = subprocess.run([*TENZRO, "client", "verify", other.url, "--trust-policy",
                                  str(tmp_path / "trust.yaml"), "--allow-none"], capture_output=True, text=True,
                                 timeout=60)
        assert refused.stdout.splitlines()[1].startswith("  model-not-accepted: the node serves small with weights ")

        # The genuine node restarts on its address with a new TLS key (its keys file kept): dropped, then verified.
        address = int(genuine.url.rsplit(":", 1)[1])
        stop_node(genuine)
        wait(lambda: router_health(base).get("providers_up") == 0, 30, "the router dropping the stopped node")
        restarted = wait_healthy(launch_node(genuine.config.parent, small_model_dir, "--tls", port=address))
        node_factory.started.append(restarted)
        wait(lambda: router_health(base).get("providers_up") == 1, 60, "the router verifying the restarted node")
        assert chat(base) == (200, "genuine")
        assert log.read_text().count("(providers[0]) verified") == 2
    finally:
        router.terminate()
        router.wait(timeout=10)


def policy(**changes: object) -> dict[str, object]:
    return {"tee_types": ["none"], "allow_none": True, "roots": None, "measurements": "any", "rtmrs": "any",
            "min_tcb": "any", "code_digests": "any", "model_digests": "any", "gpu": "optional", **changes}


def test_without_allow_none_the_router_never_verifies_a_node_without_a_tee(
        node_factory: NodeFactory, small_model_dir: Path, tmp_path: Path) -> None:
    node = node_factory(small_model_dir, "--tls")
    router, base, log = start_router(tmp_path, [("plain", node)], policy(), allow_none=False)
    try:
        wait(lambda: "(providers[0]) is down" in log.read_text(), 30, "the router refusing the node")
        time.sleep(1.5)  # three more polls: still refused
        assert router_health(base).get("providers_up") == 0
        assert chat(base)[0] == 503
        assert "(providers[0]) verified" not in log.read_text()
    finally:
        router.terminate()
        router.wait(timeout=10)
