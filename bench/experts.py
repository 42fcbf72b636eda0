"""`tenzro bench experts`: what the expert split sends its holders with reuse and without, and what it costs the
time to first token, on a multi-turn conversation.

Three local nodes in turn serve the same MoE model: one process (reuse on), rank 0 with `--experts-world 3` and
two holders (reuse on), and the same split with `--no-reuse`. One caller runs the same conversation against each;
per turn the bench reads the bytes and (token, expert) pairs sent to the holders from rank 0's `/metrics` and the
streamed TTFT. With reuse, a turn sends only its new tokens' rows; without, the whole history's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.client import BenchError
from bench.local_node import TENZRO, LocalNode, free_port, model_dir
from bench.report import columns, failed, progress, write_report

SYSTEM = "You are the planning assistant of a warehouse robot fleet. Answer with short, exact steps. " * 4
SETUPS = ("single", "split", "split-no-reuse")


@dataclass(frozen=True, slots=True)
class ExpertsSettings:
    model: str
    turns: int
    max_tokens: int
    threads: int


@dataclass(frozen=True, slots=True)
class TurnSample:
    setup: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    sent_bytes: int
    """To all holders during this turn (0 for the single process)."""
    sent_pairs: int


@dataclass(frozen=True, slots=True)
class ExpertsRow:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    bytes_reuse: int
    bytes_no_reuse: int
    ttft_single_ms: float
    ttft_split_ms: float


def _sent(metrics: dict[str, float], name: str) -> int:
    return int(sum(value for series, value in metrics.items() if series.startswith(name + "{")))


async def _conversation(node: LocalNode, setup: str, settings: ExpertsSettings) -> list[TurnSample]:
    operator = node.add_key("bench-operator", "operator")
    samples = []
    async with aiohttp.ClientSession() as session:
        await node.wait_healthy(session)
        client = await node.client(session)
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(settings.turns):
            messages.append({"role": "user", "content": f"Step {turn}: move pallet {turn * 7} to dock {turn + 2}."})
            before = await client.metrics(operator)
            reply = await client.chat(messages, max_tokens=settings.max_tokens)
            after = await client.metrics(operator)
            timing = reply.timing()
            samples.append(TurnSample(setup, turn, timing.prompt_tokens or 0, timing.cached_tokens or 0,
                                      timing.ttft_s,
                                      _sent(after, "tenzro_experts_sent_bytes_total")
                                      - _sent(before, "tenzro_experts_sent_bytes_total"),
                                      _sent(after, "tenzro_experts_sent_tokens_total")
                                      - _sent(before, "tenzro_experts_sent_tokens_total")))
            messages.append({"role": "assistant", "content": reply.text})
    return samples


def _run_setup(setup: str, model: Path, settings: ExpertsSettings, workdir: Path) -> list[TurnSample]:
    progress(f"bench experts: {setup}")
    master = f"127.0.0.1:{free_port()}"
    extra: tuple[str, ...] = ()
    if setup != "single":
        extra = ("--experts-world", "3", "--experts-master", master)
    if setup == "split-no-reuse":
        extra += ("--no-reuse",)
    (workdir / setup).mkdir(parents=True, exist_ok=True)
    holders: list[subprocess.Popen[bytes]] = []
    with LocalNode(workdir / setup, str(model), settings.threads, "cpu", extra) as node:
        try:
            if setup != "single":
                for rank in (1, 2):
                    with (workdir / setup / f"holder{rank}.log").open("wb") as log:
                        holders.append(subprocess.Popen(
                            [*TENZRO, "experts", "serve", "--model", str(model), "--rank", str(rank), "--master",
                             master, "--threads", str(settings.threads)], stdout=log, stderr=subprocess.STDOUT))
            return asyncio.run(_conversation(node, setup, settings))
        finally:
            for holder in holders:
                holder.kill()
                holder.wait()


def run_experts_bench(args: argparse.Namespace) -> int:
    settings = ExpertsSettings(args.model, args.turns, args.max_tokens, args.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="tenzro-bench-experts-") as tmp:
            workdir = Path(tmp)
            model = model_dir(args.model, workdir)
            samples = {setup: _run_setup(setup, model, settings, workdir) for setup in SETUPS}
    except BenchError as exc:
        return failed(exc)
    rows = [ExpertsRow(turn, split.prompt_tokens, split.cached_tokens, split.sent_bytes, plain.sent_bytes,
                       single.ttft_s * 1000, split.ttft_s * 1000)
            for turn, (single, split, plain) in enumerate(zip(*(samples[s] for s in SETUPS), strict=True))]
    table = [["turn", "prompt", "reused", "bytes to holders (reuse)", "(no reuse)", "TTFT 1 process ms",
              "TTFT split ms"]]
    table += [[str(r.turn), str(r.prompt_tokens), str(r.cached_tokens), str(r.bytes_reuse), str(r.bytes_no_reuse),
               f"{r.ttft_single_ms:.1f}", f"{r.ttft_split_ms:.1f}"] for r in rows]
    print(columns(table))
    reuse_mean = statistics.mean(r.bytes_reuse for r in rows)
    plain_mean = statistics.mean(r.bytes_no_reuse for r in rows)
    print(f"bytes per request to holders: {reuse_mean:.0f} with reuse, {plain_mean:.0f} without "
          f"({plain_mean / max(reuse_mean, 1):.2f}x); median TTFT "
          f"{statistics.median(r.ttft_single_ms for r in rows):.1f} ms in one process, "
          f"{statistics.median(r.ttft_split_ms for r in rows):.1f} ms split")
    write_report(Path(args.out), settings, rows, [s for setup in SETUPS for s in samples[setup]],
                 bytes_per_request={"reuse": reuse_mean, "no_reuse": plain_mean})
    return 0


def add_experts_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tenzro bench experts` under the `bench` subcommands."""
    experts = bench.add_parser("experts", help="bytes sent to expert holders with and without reuse; TTFT of one "
                               "process versus the expert split")
    experts.add_argument("--model", default="mixtral", help="an MoE model dir or architecture name")
    experts.add_argument("--turns", type=int, default=6)
    experts.add_argument("--max-tokens", type=int, default=16)
    experts.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    experts.add_argument("--out", default="bench-results/experts.json")
    experts.set_defaults(func=run_experts_bench)
