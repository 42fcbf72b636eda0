"""`tenzro bench scenarios`: exact recompute of issue 4's scenarios on a small hybrid model, end to end."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from bench.chat import ChatMessages
from bench.local_node import TENZRO
from bench.scenarios import Sent, divergence_recompute, shared_messages
from node.cli import build_parser

SCENARIOS = ["a", "b", "c2", "c3", "d", "e"]


@pytest.fixture(scope="module")
def hybrid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from node.engine.synthetic import init_model

    return init_model("granite-moe-hybrid", tmp_path_factory.mktemp("models") / "hybrid", size="small")


@pytest.fixture(scope="module")
def chat() -> ChatMessages:
    from node.engine.synthetic import build_tokenizer

    return ChatMessages(build_tokenizer(), random.Random(0))


def test_divergence_counts_the_tokens_after_the_longest_shared_prefix_and_at_least_one() -> None:
    earlier = [Sent((1, 2, 3, 4), None, (9,)), Sent((1, 2, 7), None, ())]
    assert divergence_recompute([1, 2, 3, 5, 6], earlier) == 2
    assert divergence_recompute([1, 2, 3, 4, 9, 8], earlier) == 1  # the stored reply is shared too
    assert divergence_recompute([1, 2, 3, 4], earlier) == 1  # the last token is always computed
    assert divergence_recompute([5, 6], earlier) == 2
    assert divergence_recompute([5, 6], []) == 2


def test_shared_messages_counts_leading_equal_messages_of_the_closest_earlier_request() -> None:
    system, user = {"role": "system", "content": " a"}, {"role": "user", "content": " b"}
    earlier = [Sent((), [system, {"role": "user", "content": " c"}], ()), Sent((), [system, user], ())]
    assert shared_messages([system, user, user], earlier) == 2
    assert shared_messages([user], earlier) == 0


def test_chat_messages_have_exact_token_counts(chat: ChatMessages) -> None:
    tokenizer = chat.tokenizer
    # Rendered and tokenised on their own, without the bench's helpers: "<|im_start|>assistant\n" is 5 tokens.
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert chat.generation_prompt == len(header) == 5
    for role, tokens in (("system", 1200), ("user", 195), ("assistant", 20)):
        message = chat.message(role, tokens)
        text = f"<|im_start|>{role}\n{message['content']}<|im_end|>\n"
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == tokens
    history = [chat.message("system", 100), chat.message("user", 50)]
    assert len(chat.ids(history)) == 155
    assert chat.ids(history)[:150] == chat.history_ids(history)


def test_an_edited_message_differs_in_its_middle_word_only(chat: ChatMessages) -> None:
    message = chat.message("user", 110)
    words, edited = message["content"].split(" "), chat.edited(message)["content"].split(" ")
    assert len(words) == len(edited) == 105  # the leading space, then 110 - 6 words
    assert [i for i, (a, b) in enumerate(zip(words, edited, strict=True)) if a != b] == [53]


def test_bad_arguments_exit_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "scenarios", "--runs", "0"])
    assert args.func(args) == 2
    assert "--runs and --threads must be at least 1" in capsys.readouterr().err


def test_bench_scenarios_recomputes_exactly_what_the_issue_expects(hybrid_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results" / "scenarios.json"
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    result = subprocess.run([*TENZRO, "bench", "scenarios", "--model", str(hybrid_model_dir), "--runs", "1",
                             "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr

    report = json.loads(out.read_text())
    assert report["settings"] == {
        "url": report["settings"]["url"], "model": "hybrid", "local": True, "threads": 1, "device": None,
        "snapshot_interval": 128, "runs": 1, "seed": 0, "cold": "no-reuse node", "chat": True}
    assert report["settings"]["url"].startswith("http://127.0.0.1:")
    rows = {(row["form"], row["scenario"]): row for row in report["rows"]}
    assert list(rows) == [(form, s) for form in ("text", "chat") for s in SCENARIOS]

    def column(form: str, name: str) -> list[int | None]:
        return [rows[form, s][name][0] for s in SCENARIOS]

    # Token ids: (a) resumes one token before the end of the 1,460 cached tokens (the retry point: the extension
    # replaces the stored reply, whose end is the other resume point there); (b) and (c2), first divergences, at the
    # deepest grid snapshot (1280 before the edit at 1300, 1024 before the tails at 1200); (c3) at the branch
    # point c2 stored at 1200; (d), the same 2,100 tokens again, one token before their end; (e), edited at 950
    # of 1,060, at the grid's 896: it keeps 94% of the 950 tokens before the edit, at least 80% are due.
    assert column("text", "prompt_tokens") == [1500, 1500, 1400, 1400, 2100, 1060]
    assert column("text", "recomputed") == [41, 220, 376, 200, 1, 164]
    assert column("text", "ideal") == column("text", "divergence") == [40, 200, 200, 200, 1, 110]
    assert column("text", "limit") == [41, 220, 376, 200, 1, 300]
    assert column("text", "no_reuse_recomputed") == [1500, 1500, 1400, 1400, 2100, 1060]
    # Chat: ideal is the new or edited messages and the generation prompt. (a) reuses 4 tokens more: the
    # cached prompt's generation prompt is the header of the appended assistant message, and it resumes at the
    # retry point one token before the cached prompt's end (its assistant message is not the stored reply).
    # (c3) 4 more: c2 left a branch point after "<|im_start|>user\n", which both tails start with. (b)'s edit is 4 + 52
    # tokens into the edited message, which is where a node resuming anywhere would start. (d) recomputes the
    # last token only; (e)'s edit is 3 + 945 tokens into the system prompt, and it resumes at the grid's 896.
    assert column("chat", "prompt_tokens") == [1495, 1500, 1400, 1400, 2105, 1065]
    assert column("chat", "ideal") == [40, 200, 200, 200, 5, 117]
    assert column("chat", "recomputed") == [36, 200, 200, 196, 1, 169]
    assert column("chat", "divergence") == [35, 144, 196, 196, 1, 117]
    assert column("chat", "limit") == [40, 200, 200, 200, 5, 307]
    assert column("chat", "no_reuse_recomputed") == [1495, 1500, 1400, 1400, 2105, 1065]
    for row in report["rows"]:
        assert row["within"] is True
        assert row["cold_ttft_ms"] > 0 and row["reused_ttft_ms"] > 0
        assert row["ratio"] == row["reused_ttft_ms"] / row["cold_ttft_ms"]
    assert [(s["form"], s["scenario"], s["run"]) for s in report["samples"]] == list(
        (form, s, 0) for form in ("text", "chat") for s in SCENARIOS)

    lines = result.stdout.splitlines()
    assert lines[0].split()[:6] == ["form", "scenario", "prompt", "recomputed", "ideal", "divergence"]
    assert [line.split()[:2] for line in lines[1:]] == [[form, s] for form in ("text", "chat") for s in SCENARIOS]
    assert [line.split()[-9] for line in lines[1:]] == ["41", "220", "376", "200", "1", "164",
                                                        "36", "200", "200", "196", "1", "169"]
