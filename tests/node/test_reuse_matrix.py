"""Reuse on every architecture class, through the HTTP API: greedy output with reuse on equals reuse off.

Each family's small random model is served twice, with reuse and with `--no-reuse`; three conversations
that real traffic produces run against both: one that appends turns, one that shares only the system
prompt, and one whose history is edited in the middle.
"""

from __future__ import annotations

import openai
import pytest

from node.engine.synthetic import init_model
from tests.node.conftest import Node

FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "mixtral", "olmoe", "qwen2-moe", "mamba", "mamba2", "jamba",
            "bamba", "falcon-h1", "granite-moe-hybrid", "lfm2", "qwen3-next"]
SYSTEM = ("You are the planning assistant of a warehouse robot fleet. Answer with short, exact steps. " * 3).strip()


def client(node: Node) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.base, api_key=node.add_key("alice"), max_retries=0)


def ask(c: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    reply = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_identical_with_reuse_on_and_off(family: str, node_factory,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = init_model(family, tmp_path_factory.mktemp("zoo") / family, size="small")
    reuse, plain = node_factory.all((model_dir,), (model_dir, "--no-reuse"))
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
