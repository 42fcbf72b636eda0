"""`tenzro bench load` end to end: a local node, a node measured by URL with reuse on and off, a plot beside an
earlier report, and a server that fails some of its requests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.chat import load_tokenizer
from bench.load import Capacity, Row, capacity, percentile
from bench.local_node import TENZRO
from node.cli import build_parser
from tests.node.conftest import free_port, launch_node, stop_node, wait_healthy

SYSTEM_TOKENS, REPLY_TOKENS, TURNS = 64, 4, 2
TINY = ["--system-tokens", str(SYSTEM_TOKENS), "--reply-tokens", str(REPLY_TOKENS), "--turns", str(TURNS)]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(clients: int, requests_per_s: float, ttft_p99_ms: float | None, completed: int = 10) -> Row:
    return Row(clients, completed, 0, 1.0, 40, 100, 0, 4 * requests_per_s, requests_per_s, ttft_p99_ms, ttft_p99_ms,
               1.0, 2.0)


EARLIER = [_row(1, 2.0, 300.0), _row(8, 9.5, 900.0), _row(32, 14.0, 2500.0)]
"""An earlier report's rows (another engine's, say): its capacity is 9.5 requests/s at 8 clients."""


@dataclass(frozen=True)
class BenchRun:
    stdout: str
    report: dict[str, Any]


def _bench(out: Path, home: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*TENZRO, "bench", "load", *TINY, "--json", str(out), *extra],
                            env={**os.environ, "TENZRO_HOME": str(home)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, BenchRun]:
    """Three runs at once (their token counts are asserted, not their speed): the bench's own local node
    sweeping 1 and 2 clients, and one node measured by URL with reuse on and off, each run a caller of its own
    (callers' scopes never share state). The reuse-off run also plots itself beside an earlier report."""
    tmp = tmp_path_factory.mktemp("bench-load")
    earlier = tmp / "earlier.json"
    earlier.write_text(json.dumps({"settings": {"label": "earlier"}, "rows": [asdict(row) for row in EARLIER]}))
    processes = {"local": _bench(tmp / "local.json", tmp / "home-local", "--model", str(small_model_dir),
                                 "--clients", "1,2", "--duration", "3")}
    node = launch_node(tmp / "node", small_model_dir)
    try:
        wait_healthy(node)
        for name, extra in (("reuse", ()), ("no-reuse", ("--no-reuse", "--plot", str(tmp / "load.png"),
                                                         "--compare", str(earlier)))):
            processes[name] = _bench(tmp / f"{name}.json", tmp / f"home-{name}", "--url", node.url, "--api-key",
                                     node.add_key(name), "--model", str(small_model_dir), "--clients", "2",
                                     "--duration", "2", *extra)
        outputs = {name: process.communicate(timeout=240) for name, process in processes.items()}
    finally:
        stop_node(node)
        for process in processes.values():
            if process.poll() is None:
                process.kill()
    for name, process in processes.items():
        assert process.returncode == 0, outputs[name][1]
    runs = {name: BenchRun(outputs[name][0], json.loads((tmp / f"{name}.json").read_text())) for name in processes}
    runs["png"] = BenchRun("", {"head": (tmp / "load.png").read_bytes()[:len(PNG_MAGIC)]})
    return runs


def _prompt_overheads(model: Path) -> tuple[int, int, int]:
    """Tokens of the chat template around the text, rendered on their own: the system message's header
    before its text, a user message's header and end, and the generation prompt."""
    tokenizer = load_tokenizer(model)
    assert tokenizer is not None

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count("<|im_start|>system\n"), count("<|im_start|>user\n<|im_end|>\n"), count("<|im_start|>assistant\n")


def test_percentile_is_the_nearest_rank() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 0.2)) == (3.0, 5.0, 1.0)
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None


def test_capacity_is_the_most_requests_per_s_whose_ttft_p99_is_within_a_second() -> None:
    assert capacity(EARLIER) == Capacity(9.5, 8)
    assert capacity([_row(1, 2.0, 1000.0), _row(2, 3.0, 1000.1)]) == Capacity(2.0, 1)
    assert capacity([_row(4, 5.0, 1500.0), _row(8, 9.0, None, completed=0)]) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--clients", "1,0"], "--clients must list client counts of at least 1, not '1,0'"),
    (["--clients", "1,x"], "--clients must be comma-separated integers, not '1,x'"),
    (["--turns", "0"], "--turns, --reply-tokens and --threads must be at least 1, --duration above 0"),
    (["--duration", "0"], "--turns, --reply-tokens and --threads must be at least 1, --duration above 0"),
])
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "load", *argv])
    assert args.func(args) == 2
    assert capsys.readouterr().err == f"tenzro: error: {message}\n"


def test_a_server_that_cannot_be_reached_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    args = build_parser().parse_args(["bench", "load", "--url", url, "--json", str(tmp_path / "load.json")])
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith(f"tenzro: error: GET {url}/v1/models: Cannot connect to host")
    assert not (tmp_path / "load.json").exists()


def test_an_earlier_report_that_is_not_one_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"settings": {"lengths": [512]}, "rows": []}))
    args = build_parser().parse_args(["bench", "load", "--compare", str(other)])
    assert args.func(args) == 2
    assert capsys.readouterr().err == (f"tenzro: error: --compare {other}: not a `tenzro bench load` JSON report "
                                       "('label')\n")


def _check_rows(report: dict[str, Any], clients: list[int]) -> None:
    """Every row is its counted samples' sum, and a run on a healthy server counts every request it finished."""
    assert [row["clients"] for row in report["rows"]] == clients
    for row in report["rows"]:
        samples = [s for s in report["samples"] if s["clients"] == row["clients"]]
        counted = [s for s in samples if s["counted"]]
        assert row["errors"] == 0 and all(s["error"] is None for s in samples)
        assert row["completed"] == len(counted) > 0
        assert row["window_s"] == max(s["end_s"] for s in counted) <= report["settings"]["duration_s"]
        assert row["output_tokens"] == sum(s["completion_tokens"] for s in counted) > 0
        assert all(1 <= s["completion_tokens"] <= REPLY_TOKENS for s in samples)
        assert row["output_tokens_per_s"] == row["output_tokens"] / row["window_s"] > 0
        assert row["requests_per_s"] == row["completed"] / row["window_s"]
        assert row["prompt_tokens"] == sum(s["prompt_tokens"] for s in counted)
        assert row["cached_tokens"] == sum(s["cached_tokens"] for s in counted)
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 <= row["itl_p50_ms"] <= row["itl_p99_ms"]
        assert {s["client"] for s in samples} == set(range(row["clients"]))
        assert all(s["turn"] < TURNS for s in samples)


def test_a_local_sweep_reports_every_client_count(runs: dict[str, BenchRun], small_model_dir: Path) -> None:
    report = runs["local"].report
    settings = report["settings"]
    assert (settings["local"], settings["label"], settings["reuse"], settings["reuse_off_by"]) == (
        True, "tenzro", True, None)
    assert settings["url"].startswith("http://127.0.0.1:") and settings["model"] == small_model_dir.name
    assert (settings["clients"], settings["duration_s"], settings["turns"], settings["threads"]) == ([1, 2], 3.0,
                                                                                                     TURNS, 1)
    assert (settings["system_tokens"], settings["reply_tokens"]) == (SYSTEM_TOKENS, REPLY_TOKENS)
    _check_rows(report, [1, 2])
    # The system message is SYSTEM_TOKENS tokens; a user turn is 30 to 60 words of one token each.
    _, user, generation = _prompt_overheads(small_model_dir)
    first_turns = [s["prompt_tokens"] for s in report["samples"] if s["turn"] == 0]
    assert SYSTEM_TOKENS + user + 30 + generation <= min(first_turns)
    assert max(first_turns) <= SYSTEM_TOKENS + user + 60 + generation

    best = max((r for r in report["rows"] if r["ttft_p99_ms"] <= 1000.0), key=lambda r: r["requests_per_s"])
    assert report["capacity"] == {"requests_per_s": best["requests_per_s"], "clients": best["clients"]}
    lines = runs["local"].stdout.splitlines()
    assert lines[0].split() == ["clients", "completed", "errors", "out", "tok/s", "req/s", "TTFT", "p50", "ms", "TTFT",
                                "p99", "ms", "ITL", "p50", "ms", "ITL", "p99", "ms", "cached"]
    assert [line.split()[0] for line in lines[1:3]] == ["1", "2"]
    assert lines[3] == (f"capacity (tenzro): {best['requests_per_s']:.2f} requests/s at {best['clients']} clients "
                        "with TTFT p99 <= 1000 ms")


def test_with_reuse_every_turn_reuses_the_whole_earlier_prompt(runs: dict[str, BenchRun]) -> None:
    report = runs["reuse"].report
    assert (report["settings"]["local"], report["settings"]["reuse"], report["settings"]["threads"]) == (
        False, True, None)
    assert report["settings"]["label"] == report["settings"]["url"].removeprefix("http://").removesuffix("/v1")
    _check_rows(report, [2])
    conversations: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for sample in report["samples"]:
        conversations.setdefault((sample["client"], sample["conversation"]), {})[sample["turn"]] = sample
    assert all(turns[0]["cached_tokens"] >= SYSTEM_TOKENS for turns in conversations.values())
    later = [turns for turns in conversations.values() if 1 in turns]
    assert later and all(turns[1]["cached_tokens"] >= turns[0]["prompt_tokens"] for turns in later)


def test_no_reuse_at_a_url_shares_nothing_past_the_template_header(runs: dict[str, BenchRun],
                                                                   small_model_dir: Path) -> None:
    """A server's cache cannot be switched off by URL: every request's system prompt starts with a fresh tag, so
    only the chat template's header before the system prompt's text is ever found cached."""
    run = runs["no-reuse"]
    settings = run.report["settings"]
    assert (settings["reuse"], settings["reuse_off_by"]) == (False, "random tag per request")
    assert settings["label"].endswith(" no-reuse")
    _check_rows(run.report, [2])
    header, _, _ = _prompt_overheads(small_model_dir)
    assert all(s["cached_tokens"] <= header for s in run.report["samples"])
    assert "reuse off: every request's system prompt started with a fresh random tag" in run.stdout


def test_the_plot_is_a_png_beside_an_earlier_report(runs: dict[str, BenchRun]) -> None:
    assert runs["png"].report["head"] == PNG_MAGIC
    assert "capacity (earlier): 9.50 requests/s at 8 clients with TTFT p99 <= 1000 ms" in runs["no-reuse"].stdout


class FailingServer:
    """An OpenAI-compatible server whose requests, in turn, succeed (without usage), answer 500, fail mid-stream,
    drop the connection mid-stream and end the stream before [DONE]."""

    CONTENT = b'data: {"choices": [{"index": 0, "delta": {"content": " word"}}]}\n\n'

    def __init__(self) -> None:
        self.requests = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "failing"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        number, self.requests = self.requests, self.requests + 1
        if number % 5 == 1:
            return web.json_response({"error": {"message": "overloaded"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(self.CONTENT)
        if number % 5 == 2:
            await response.write(b'data: {"error": {"message": "the model failed"}}\n\n')
        elif number % 5 == 3:
            assert request.transport is not None
            request.transport.close()
        elif number % 5 == 0:
            await response.write(self.CONTENT)
            await response.write(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n')
            await response.write(b"data: [DONE]\n\n")
        return response


async def test_failed_requests_are_counted_and_the_run_goes_on(
        aiohttp_server: Callable[[web.Application], Awaitable[TestServer]], small_model_dir: Path,
        tmp_path: Path) -> None:
    failing = FailingServer()
    app = web.Application()
    app.router.add_get("/v1/models", failing.models)
    app.router.add_post("/v1/chat/completions", failing.chat)
    server = await aiohttp_server(app)
    args = build_parser().parse_args(["bench", "load", "--url", str(server.make_url("")), "--model",
                                      str(small_model_dir), "--clients", "2", "--duration", "1.5", *TINY,
                                      "--json", str(tmp_path / "load.json")])
    assert await asyncio.to_thread(args.func, args) == 0
    report = json.loads((tmp_path / "load.json").read_text())
    (row,) = report["rows"]
    samples = report["samples"]
    failed = [s for s in samples if s["error"] is not None]
    assert len(samples) == failing.requests - 1  # all but the warm-up
    assert row["errors"] == len(failed) >= 4
    endings = ("answered 500: ", "failed a request mid-stream: ", "Response payload is not completed", "before [DONE]")
    assert sorted({next(i for i, ending in enumerate(endings) if ending in s["error"]) for s in failed}) == [0, 1, 2, 3]
    assert row["completed"] == sum(s["counted"] for s in samples) > 0
    assert row["output_tokens"] == 2 * row["completed"]  # no usage: the content chunks are counted
    assert (row["prompt_tokens"], row["cached_tokens"]) == (0, None)
    by_client = sorted(samples, key=lambda s: (s["client"], s["start_s"]))
    for before, after in zip(by_client, by_client[1:], strict=False):
        if before["client"] == after["client"] and before["error"] is not None:
            assert (after["conversation"], after["turn"]) == (before["conversation"] + 1, 0)
