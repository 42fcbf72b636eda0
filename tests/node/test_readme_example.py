"""The README's three-turn example, pasted as is, prints what the README says it prints (issue 34): every turn reuses
the whole earlier conversation, the reply included, because the node gives a reply it generated its own ids again.
Its replies equal a node's without reuse.

The example is read from the README itself; only its address is changed, to the test node's free port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import openai

from tests.node.conftest import Node, NodeFactory

README = Path(__file__).resolve().parents[2] / "README.md"
ADDRESS = "http://127.0.0.1:8080/v1"


def readme_example() -> tuple[str, str]:
    """(the example's Python, the output the README says it prints)."""
    text = README.read_text()
    found = re.search(r"\.venv/bin/python - <<'PY'\n(.*?)\nPY\n```\n\nIt prints:\n\n```text\n(.*?)```", text, re.S)
    assert found is not None, "the README's three-turn example and its output are not where this test looks"
    return found.group(1), found.group(2)


def the_key(node: Node) -> str:
    """The key `tenzro node serve` minted for the caller `local` and printed once, as `make run` shows it."""
    log = (node.config.parent / "node.log").read_text()
    return next(line.split("=", 1)[1].strip() for line in log.splitlines() if "export TENZRO_API_KEY=" in line)


def three_turns(node: Node, key: str, model: str) -> list[tuple[str, int, int]]:
    """The example's conversation: per turn (reply, prompt tokens, reused tokens)."""
    client = openai.OpenAI(base_url=node.base, api_key=key, max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    turns = []
    for turn in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        content = reply.choices[0].message.content or ""
        turns.append((content, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0))
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"And turn {turn + 1}?"}]
    return turns


def test_the_readme_three_turn_example_prints_what_the_readme_says(node_factory: NodeFactory) -> None:
    code, printed = readme_example()
    assert ADDRESS in code
    node = node_factory(Path("default"))
    env = {**os.environ, "TENZRO_API_KEY": the_key(node)}
    run = subprocess.run([sys.executable, "-"], input=code.replace(ADDRESS, node.base), env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == printed

    # The same conversation for a new caller, and on a node without reuse: the same replies; each turn reuses the
    # previous prompt and its whole reply (16 tokens: the random model writes no end of turn at temperature 0).
    model_dir = Path(node.env["TENZRO_HOME"]) / "models" / "dense-default-v1"
    cold = node_factory(model_dir, "--no-reuse")
    reused = three_turns(node, node.add_key("bob"), "default")
    plain = three_turns(cold, cold.add_key("bob"), model_dir.name)
    assert [reply for reply, _, _ in reused] == [reply for reply, _, _ in plain]
    assert [cached for _, _, cached in plain] == [0, 0, 0]
    assert [cached for _, _, cached in reused] == [0] + [prompt + 16 for _, prompt, _ in reused[:-1]]
    assert [prompt for _, prompt, _ in reused] == [prompt for _, prompt, _ in plain]
