"""Reuse on every architecture class, through the HTTP API: greedy output with reuse on equals reuse off.

Each family's small random model is served twice, with reuse and with `--no-reuse`; three conversations
that real traffic produces run against both: one that appends turns, one that shares only the system
prompt, and one whose history is edited in the middle. Then four callers run their conversations at once
against the node with reuse (their requests run together, batched where the model allows): each gets what
its conversation gets alone on the node without reuse.

The nodes serve on TENZRO_TEST_DEVICE (default cpu; `cuda` runs the matrix on the GPU), in float32 on every device:
the matrix asks for token-for-token equality, which bfloat16's rounding need not keep between two paths.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from node.engine.cpu_decoder import DECODERS
from node.engine.cpu_kernels import native_switched_off
from node.engine.synthetic import ARCHITECTURES, SIZES, init_model
from tests.node.conftest import DEVICE_FLAGS, Node

FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "mixtral", "olmoe", "qwen2-moe", "mamba", "mamba2", "jamba",
            "bamba", "falcon-h1", "granite-moe-hybrid", "lfm2", "qwen3-next"]
SYSTEM = ("You are the planning assistant of a warehouse robot fleet. Answer with short, exact steps. " * 3).strip()


def native_forward(family: str) -> bool:
    """Whether the native CPU decoder takes this family's model (where the kernels load)."""
    model_type = ARCHITECTURES[family](SIZES["small"]).model_type
    return any(kind.config_class.model_type == model_type for kind in DECODERS)


def client(node: Node) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.base, api_key=node.add_key("alice"), max_retries=0)


def ask(c: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    reply = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_identical_with_reuse_on_and_off(family: str, node_factory,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    if native_switched_off() and not native_forward(family):
        pytest.skip("no native forward for this family: the pass with the native kernels ran this same code")
    model_dir = init_model(family, tmp_path_factory.mktemp("zoo") / family, size="small")
    reuse, plain = node_factory.all((model_dir, *DEVICE_FLAGS), (model_dir, "--no-reuse", *DEVICE_FLAGS))
    c_reuse, c_plain = client(reuse), client(plain)
    model = model_dir.name

    def both(messages: list[dict[str, str]]) -> tuple[str, int]:
        got, cached = ask(c_reuse, model, messages)
        expected, _ = ask(c_plain, model, messages)
        assert got == expected, f"{family}: reuse changed the output after {cached} reused tokens"
        return got, cached

    history = [{"role": "system", "content": SYSTEM}]
    cached_per_turn = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Step {turn}: move pallet {turn * 7} to dock {turn + 2}."})
        reply, cached = both(history)
        cached_per_turn.append(cached)
        history.append({"role": "assistant", "content": reply})
    assert cached_per_turn[0] == 0 and all(cached > 0 for cached in cached_per_turn[1:])

    _, shared = both([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count the docks."}])
    assert shared > 0  # at least the system prompt, which ends on a message boundary

    edited = [dict(m) for m in history[:-1]]
    edited[1]["content"] = "Step 0: move pallet 99 to dock 1."
    _, reused_after_edit = both(edited)
    assert 0 < reused_after_edit < cached_per_turn[-1]

    concurrent_callers_get_their_alone_output(family, reuse, plain, model)


def conversation(c: openai.OpenAI, model: str, caller: int, expected: list[str] | None = None) -> list[str]:
    """Caller `caller`'s three turns; each reply is checked against `expected` as it comes (when given)."""
    history = [{"role": "system", "content": SYSTEM}]
    replies: list[str] = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Robot {caller}, step {turn}: lift crate {caller * 5 + turn}."
                                                  + " Then report." * caller})
        reply, _ = ask(c, model, history)
        if expected is not None:
            assert reply == expected[turn], f"caller {caller} turn {turn}: its output differs from its output alone"
        replies.append(reply)
        history.append({"role": "assistant", "content": reply})
    return replies


def concurrent_callers_get_their_alone_output(family: str, reuse: Node, plain: Node, model: str) -> None:
    alone = [conversation(client(plain), model, caller) for caller in range(4)]
    clients = [openai.OpenAI(base_url=reuse.base, api_key=reuse.add_key(f"robot-{caller}"), max_retries=0)
               for caller in range(4)]
    time.sleep(0.6)  # the node reads new keys twice a second
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(conversation, clients[caller], model, caller, alone[caller]) for caller in range(4)]
        for run in runs:
            run.result()
    engine = reuse.state(reuse.add_key("robot-ops", "operator"))["engine"]  # how decode steps ran: the operator's
    if engine["batched_decode"]:
        assert engine["largest_batch"] >= 2, f"{family}: the callers' decode steps never ran together"
