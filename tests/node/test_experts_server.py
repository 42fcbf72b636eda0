"""The expert split end to end: rank 0 (`tenzro node serve --experts-world 3`) and two holders (`tenzro experts
serve`) on loopback, against a single-process node of the same model.

Each MoE family's split answers a three-turn conversation and an edited history with the single process's greedy
output, both for a caller whose prefixes are reused and for fresh callers (nothing to reuse: every token of every
turn reaches the holders). The reference serves with reuse too: a fresh caller's prompt is computed in the same
pieces on both (a `--no-reuse` node computes it in one, which for qwen2-moe and jamba already changes the greedy
output in a single process). On Mixtral: the holders receive exactly the computed tokens times the router's top-k,
never a restored one; a holder killed mid-request fails that request with 503 while `/health` answers and names
it, and a restarted holder brings the node back.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.local_node import TENZRO
from node.engine.synthetic import ARCHITECTURES, SIZES, init_model
from tests.node.conftest import DEVICE_FLAGS, Node, free_port, launch_node, stop_node, wait_healthy

FAMILIES = ["olmoe", "qwen2-moe", "granite-moe-hybrid", "qwen3-next", "jamba", "mixtral"]
"""Mixtral last: the tests after the per-family one use its processes, which are then still running."""
SYSTEM = "You are the planning assistant of a warehouse robot fleet. Answer with short, exact steps."
MAX_TOKENS = 6
HOT = "cache:\n  plaintext_bytes: 268435456\n"
"""Both nodes keep what they store in the clear: a sealed entry is dropped where the load-time probe finds opening
it slower than recomputing, which two nodes measuring on a busy machine need not find alike, and the tests compare
their reused tokens."""


@dataclass
class Split:
    """One family's processes: the single-process reference, rank 0 and its holders."""

    model: Path
    reference: Node
    rank0: Node
    master: str
    holders: dict[int, subprocess.Popen[str]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)

    def start_holder(self, rank: int) -> None:
        log = (self.rank0.config.parent / f"holder{rank}.log").open("a")
        self.holders[rank] = subprocess.Popen(
            [*TENZRO, "experts", "serve", "--model", str(self.model), "--rank", str(rank), "--master", self.master],
            env=self.rank0.env, stdout=log, stderr=subprocess.STDOUT, text=True)

    def key(self, node: Node, name: str, role: str = "caller") -> str:
        if (node.url, name) not in self.keys:
            self.keys[(node.url, name)] = node.add_key(name, role)  # type: ignore[index]
        return self.keys[(node.url, name)]  # type: ignore[index]

    def stop(self) -> None:
        for process in self.holders.values():
            process.kill()
            process.wait(timeout=10)
        stop_node(self.rank0)
        stop_node(self.reference)


class Splits:
    """Each family's processes, started on first use and shared by the file's tests; one family's at a time (four
    processes each: the suite runs beside other test processes, in a bounded memory)."""

    def __init__(self, tmp: Path) -> None:
        self._tmp = tmp
        self._started: dict[str, Split] = {}

    def __call__(self, family: str) -> Split:
        for other in [name for name in self._started if name != family]:
            self._started.pop(other).stop()
        if family not in self._started:
            model = init_model(family, self._tmp / "models" / family, size="small")
            port = free_port()
            master = f"127.0.0.1:{port}"
            reference = launch_node(self._tmp / family / "reference", model, *DEVICE_FLAGS, config_text=HOT)
            rank0 = launch_node(self._tmp / family / "rank0", model, "--experts-world", "3", "--experts-master",
                                master, "--experts-timeout", "10", *DEVICE_FLAGS, config_text=HOT)
            split = Split(model, reference, rank0, master)
            for rank in (1, 2):
                split.start_holder(rank)
            wait_healthy(reference)
            wait_healthy(rank0)
            self._started[family] = split
        return self._started[family]

    def stop(self) -> None:
        for split in self._started.values():
            split.stop()


@pytest.fixture(scope="module")
def splits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Splits]:
    started = Splits(tmp_path_factory.mktemp("experts"))
    yield started
    started.stop()


def post(node: Node, key: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(node.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:  # loopback only
            return int(response.status), dict(json.load(response))
    except urllib.error.HTTPError as exc:
        return exc.code, dict(json.load(exc))


def ask(node: Node, key: str, model: str, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
    status, body = post(node, key, "/v1/chat/completions", {"model": model, "messages": messages,
                                                              "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"]), dict(body["usage"])


def get(node: Node, path: str, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(node.url + path, headers=headers), timeout=10) as response:
        return str(response.read().decode())


def health(node: Node) -> dict[str, Any]:
    return dict(json.loads(get(node, "/health")))


def sent_tokens(split: Split) -> int:
    """`tenzro_experts_sent_tokens_total` summed over the holders."""
    text = get(split.rank0, "/metrics", split.key(split.rank0, "ops", "operator"))
    return sum(int(float(value)) for value in re.findall(r'^tenzro_experts_sent_tokens_total\{holder="\d+"\} (\S+)$',
                                                        text, flags=re.MULTILINE))


def turns() -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Step {turn}: move pallet {turn * 7} to dock {turn + 2}."}
            for turn in range(3)]


@pytest.mark.parametrize("family", FAMILIES)
def test_split_output_equals_the_single_process(family: str, splits: Splits) -> None:
    split = splits(family)
    model = split.model.name
    reference_key = split.key(split.reference, "alice")
    reused_key = split.key(split.rank0, "alice")
    fresh = iter(range(100))

    def both(messages: list[dict[str, str]]) -> tuple[str, int]:
        """Each node's reply to a caller that reuses its earlier turns and to a new caller, which computes every
        token; the tokens the reusing caller restored on the split."""
        expected, expected_usage = ask(split.reference, reference_key, model, messages)
        reused, usage = ask(split.rank0, reused_key, model, messages)
        assert usage["prompt_tokens_details"] == expected_usage["prompt_tokens_details"]
        fresh_key = f"fresh-{next(fresh)}"
        expected_plain, _ = ask(split.reference, split.key(split.reference, fresh_key), model, messages)
        plain, plain_usage = ask(split.rank0, split.key(split.rank0, fresh_key), model, messages)
        assert plain_usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert (reused, plain) == (expected, expected_plain), f"{family}: the split changed the output"
        return expected, int(usage["prompt_tokens_details"]["cached_tokens"])

    history = [{"role": "system", "content": SYSTEM}]
    cached = []
    for message in turns():
        history.append(message)
        reply, reused = both(history)
        cached.append(reused)
        history.append({"role": "assistant", "content": reply})
    assert cached[0] == 0 and all(tokens > 0 for tokens in cached[1:])
    edited = [dict(m) for m in history[:-1]]
    edited[1]["content"] = "Step 0: move pallet 99 to dock 1."
    assert 0 < both(edited)[1] < cached[-1]


def test_holders_receive_computed_tokens_times_top_k_only(splits: Splits) -> None:
    """Every MoE layer but the last gets each computed token (prompt tokens not restored, and one per generated
    token: the last is fed so that the stored state ends with the reply); the last layer runs on each forward's
    last row only (`node/engine/last_row.py`): one row per prefill and per generated token. A restored token
    reaching a holder would add top-k pairs per layer."""
    split = splits("mixtral")
    config = ARCHITECTURES["mixtral"](SIZES["small"])
    key = split.key(split.rank0, "counted")
    history = [{"role": "system", "content": SYSTEM}, turns()[0]]
    before = sent_tokens(split)
    reply, first = ask(split.rank0, key, split.model.name, history)
    fresh_pairs = sent_tokens(split) - before
    history += [{"role": "assistant", "content": reply}, turns()[1]]
    before = sent_tokens(split)
    _, resumed = ask(split.rank0, key, split.model.name, history)
    resumed_pairs = sent_tokens(split) - before
    assert resumed["prompt_tokens_details"]["cached_tokens"] > 0
    for usage, pairs in ((first, fresh_pairs), (resumed, resumed_pairs)):
        new_prompt = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        computed = new_prompt + usage["completion_tokens"]
        last_layer_rows = 1 + usage["completion_tokens"]
        assert pairs == config.num_experts_per_tok * (computed * (config.num_hidden_layers - 1) + last_layer_rows)


def test_a_killed_holder_fails_the_request_and_a_restarted_one_brings_the_node_back(splits: Splits) -> None:
    split = splits("mixtral")
    key = split.key(split.rank0, "faults")
    messages = [{"role": "system", "content": SYSTEM}, turns()[2]]
    expected, _ = ask(split.reference, split.key(split.reference, "alice"), split.model.name, messages)
    holder = split.holders[2]
    os.kill(holder.pid, signal.SIGSTOP)  # it stops answering: the request waits on it
    answer: list[tuple[int, dict[str, Any]]] = []
    request = threading.Thread(target=lambda: answer.append(post(split.rank0, key, "/v1/chat/completions", {
        "model": split.model.name, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})))
    request.start()
    time.sleep(1.0)
    assert request.is_alive() and health(split.rank0)["status"] == "ok"  # /health answers while it waits
    holder.kill()  # killed mid-request
    holder.wait(timeout=10)
    request.join(timeout=30)
    status, body = answer[0]
    assert status == 503 and body["error"]["code"] == "experts_unavailable", body
    down = health(split.rank0)
    assert down["status"] == "degraded" and down["experts"]["holders"]["2"] == "down"
    status, body = post(split.rank0, key, "/v1/chat/completions", {"model": split.model.name, "messages": messages,
                                                                  "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 503 and body["error"]["code"] == "experts_unavailable"

    split.start_holder(2)
    deadline = time.monotonic() + 60
    while health(split.rank0)["status"] != "ok":
        assert time.monotonic() < deadline, "the restarted holder did not bring the node back"
        time.sleep(0.2)
    assert health(split.rank0)["experts"]["holders"] == {"1": "up", "2": "up"}
    assert ask(split.rank0, key, split.model.name, messages)[0] == expected
