"""What a stranger or another caller can read of a real node shows nothing of anyone's traffic (issue 33): the
public `GET /v1/node` and `/health` are fixed for the node's start, counters and byte totals are the operator's
(`GET /v1/node/state`), and only caller and router keys run completions."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.node.conftest import Node, start_node, stop_node

SETTLE_TIMEOUT_S = 10.0
MOVING = {"engine": ("decode_steps", "batched_steps", "largest_batch", "shared_rows", "fed_together", "waiting",
                     "running"),
          "sealing": ("entries", "bytes", "plaintext_bytes", "sealed_bytes", "open_failures", "unsealed_drops",
                      "reserve_free_bytes")}
"""The operator's fields of `GET /v1/node/state` that move with traffic, by section."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, small_model_dir: Path) -> Iterator[Node]:
    """One node (reuse and sealing on, as served by default) for the whole module: each test reads it before and
    after its own requests."""
    started = start_node(tmp_path_factory.mktemp("public-view"), small_model_dir)
    yield started
    stop_node(started)


def call(node: Node, path: str, key: str | None = None, body: dict[str, Any] | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """GET `path` (POST with a JSON `body`) on the node, as `key`; the status and the JSON answer."""
    sent = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    if body is not None:
        sent["Content-Type"] = "application/json"
    request = urllib.request.Request(node.url + path, json.dumps(body).encode() if body is not None else None,
                                     sent, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # loopback only
            return int(response.status), dict(json.load(response))
    except urllib.error.HTTPError as exc:
        return exc.code, dict(json.load(exc))


def settled_state(node: Node, operator: str) -> dict[str, Any]:
    """The operator's view once no request runs or waits and the hot tier is sealed (settle ran)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        state = node.state(operator)
        engine, sealing = state["engine"], state["sealing"]
        if engine["waiting"] == engine["running"] == 0 and sealing["plaintext_bytes"] == 0:
            return state
        assert time.monotonic() < deadline, f"the node did not settle in {SETTLE_TIMEOUT_S} s: {state}"
        time.sleep(0.01)


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 6,
            "temperature": 0}


def text(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": list(range(400, 480)), "max_tokens": 6, "temperature": 0}


def test_another_callers_requests_change_nothing_a_keyless_or_caller_reader_sees(node: Node,
                                                                                 small_model_dir: Path) -> None:
    model = small_model_dir.name
    bob, operator = node.add_key("bob"), node.add_key("ops-view", "operator")
    readers = {"no key": None, "carol": node.add_key("carol")}

    def seen() -> dict[str, dict[str, Any]]:
        views = {}
        for name, key in readers.items():
            for path in ("/v1/node", "/health"):
                status, answer = call(node, path, key)
                assert status == 200, (name, path, answer)
                views[f"{path} as {name}"] = answer
        return views

    before, operators_before = seen(), settled_state(node, operator)
    assert before["/health as carol"] == before["/health as no key"] == {"status": "ok", "model": model}
    assert before["/v1/node as carol"] == before["/v1/node as no key"]
    for section, fields in MOVING.items():
        assert not set(fields) & set(before["/v1/node as no key"][section]), section
    for body, route in ((chat(model), "/v1/chat/completions"), (text(model), "/v1/completions")):
        status, answer = call(node, route, bob, body)
        assert status == 200, answer
    operators_after = settled_state(node, operator)
    assert seen() == before
    # What moved is in the operator's view: the decode steps of bob's replies and the state his turns stored.
    assert operators_after["engine"]["decode_steps"] > operators_before["engine"]["decode_steps"]
    assert operators_after["sealing"]["sealed_bytes"] > operators_before["sealing"]["sealed_bytes"]
    assert operators_after["sealing"]["on"] is True and operators_after["boot_id"] == before["/v1/node as no key"][
        "boot_id"]


def test_node_state_is_for_operator_keys(node: Node) -> None:
    assert call(node, "/v1/node/state")[0] == 401
    for role in ("caller", "auditor", "router"):
        status, answer = call(node, "/v1/node/state", node.add_key(f"state-{role}", role))
        assert (status, answer["error"]["code"]) == (403, "operator_role_required"), answer
        assert f"this key's role is {role}" in answer["error"]["message"]
    status, state = call(node, "/v1/node/state", node.add_key("state-ops", "operator"))
    assert status == 200 and state["object"] == "node.state"
    assert set(MOVING["engine"]) <= set(state["engine"]) and set(MOVING["sealing"]) <= set(state["sealing"])


def test_only_caller_and_router_keys_run_completions(node: Node, small_model_dir: Path) -> None:
    model = small_model_dir.name
    operator = node.add_key("ops-run", "operator")
    steps = settled_state(node, operator)["engine"]["decode_steps"]
    for role in ("auditor", "operator"):
        key = node.add_key(f"run-{role}", role)
        for route, body in (("/v1/chat/completions", chat(model)), ("/v1/completions", text(model))):
            status, answer = call(node, route, key, body)
            error = answer["error"]
            assert (status, error["type"], error["code"]) == (403, "permission_error", "caller_role_required")
            assert error["message"] == (f"POST {route} needs a caller or router key, and this key's role is {role} "
                                        f"('tenzro keys add NAME --role caller' makes one)")
    assert settled_state(node, operator)["engine"]["decode_steps"] == steps  # refused before any compute
    router = node.add_key("run-router", "router")
    for key, headers in ((node.add_key("run-caller"), {}), (router, {}), (router, {"Tenzro-Caller": "alice"})):
        for route, body in (("/v1/chat/completions", chat(model)), ("/v1/completions", text(model))):
            status, answer = call(node, route, key, body, headers)
            assert status == 200, answer
