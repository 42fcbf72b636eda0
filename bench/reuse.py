"""`tenzro bench reuse`: time to first token over HTTP streaming, cold prompts against reused prefixes.

Prompts are token ids, which vLLM, llama.cpp's server and this node all accept, so the same table can be
made for another engine serving the same model directory; timings include HTTP and SSE, as a caller sees.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.client import BenchError, Client, add_server_arguments, open_session
from bench.local_node import LocalNode
from bench.prompts import PromptSource
from bench.report import Target, columns, failed, progress, write_report


@dataclass(frozen=True, slots=True)
class Settings(Target):
    lengths: tuple[int, ...]
    new_tokens: int
    runs: int
    seed: int


@dataclass(frozen=True, slots=True)
class Sample:
    length: int
    kind: str
    """"cold"; "reused": right after a request on the same prefix; "after-other": after a request on
    another prompt, so a node that keeps the last request's state hot must restore this prefix from store."""
    run: int
    ttft_ms: float
    prompt_tokens: int | None
    cached_tokens: int | None


@dataclass(frozen=True, slots=True)
class Row:
    prompt_tokens: int
    cold_ttft_ms: float
    reused_ttft_ms: float
    ratio: float
    """Median reused TTFT over median cold TTFT."""
    after_other_ttft_ms: float
    """Median TTFT of the same reuse when another prompt ran in between."""
    ideal_ratio: float
    """new_tokens / prompt_tokens: the ratio if TTFT were proportional to the tokens computed."""
    reused_cached_tokens: tuple[int, ...] | None
    """Per reused run, in run order; None when the server does not report cached tokens."""


def parse_lengths(text: str, new_tokens: int) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise BenchError(f"--lengths must be comma-separated integers, not {text!r}") from exc
    if not lengths or any(length <= new_tokens for length in lengths):
        raise BenchError(f"--lengths must each exceed --new-tokens ({new_tokens}): a prefix must be left")
    return lengths


async def _measure(client: Client, source: PromptSource, settings: Settings) -> list[Sample]:
    """Cold and reused runs interleaved per length, so drifting noise hits both alike."""
    await client.complete(source.prefix(max(settings.lengths)))  # untimed: loads and warms everything
    samples: list[Sample] = []
    for length in settings.lengths:
        for run in range(settings.runs):
            prefix = source.prefix(length - settings.new_tokens)
            warm_suffix = source.suffix(settings.new_tokens)
            await client.complete(prefix + warm_suffix)  # untimed: leaves the prefix's state on the server
            cold = await client.complete(source.prefix(length))  # and another prompt in between
            other_suffix = source.suffix(settings.new_tokens, unlike=(warm_suffix[0],))
            after_other = await client.complete(prefix + other_suffix)
            reused = await client.complete(
                prefix + source.suffix(settings.new_tokens, unlike=(warm_suffix[0], other_suffix[0])))
            for kind, timing in (("cold", cold), ("after-other", after_other), ("reused", reused)):
                samples.append(Sample(length, kind, run, timing.ttft_s * 1000.0, timing.prompt_tokens,
                                      timing.cached_tokens))
            progress(f"bench: {length} tokens, run {run + 1}/{settings.runs}: cold {cold.ttft_s * 1000:.1f} ms, "
                     f"reused {reused.ttft_s * 1000:.1f} ms (cached {reused.cached_tokens}), after another "
                     f"prompt {after_other.ttft_s * 1000:.1f} ms")
    return samples


def summarise(settings: Settings, samples: list[Sample]) -> list[Row]:
    rows = []
    for length in settings.lengths:
        ttfts: dict[str, list[float]] = {}
        for sample in samples:
            if sample.length == length:
                ttfts.setdefault(sample.kind, []).append(sample.ttft_ms)
        cold_ms, reused_ms = statistics.median(ttfts["cold"]), statistics.median(ttfts["reused"])
        cached = [s.cached_tokens for s in samples if s.length == length and s.kind == "reused"]
        rows.append(Row(length, cold_ms, reused_ms, reused_ms / cold_ms, statistics.median(ttfts["after-other"]),
                        settings.new_tokens / length,
                        None if None in cached else tuple(c for c in cached if c is not None)))
    return rows


def format_table(rows: list[Row]) -> str:
    def cached(values: tuple[int, ...] | None) -> str:
        if values is None:
            return "n/a"
        return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"

    lines = [("prompt tokens", "cold TTFT ms", "reused TTFT ms", "reused/cold", "ideal", "after other ms",
              "cached (reused)")]
    lines += [(str(r.prompt_tokens), f"{r.cold_ttft_ms:.1f}", f"{r.reused_ttft_ms:.1f}", f"{r.ratio:.3f}",
               f"{r.ideal_ratio:.3f}", f"{r.after_other_ttft_ms:.1f}", cached(r.reused_cached_tokens)) for r in rows]
    return columns(lines)


async def _bench(args: argparse.Namespace, lengths: tuple[int, ...],
                 node: LocalNode | None) -> tuple[Settings, list[Sample]]:
    async with open_session() as session:
        if node is None:
            client = await Client.connect(session, args.url, args.api_key, args.model)
        else:
            progress(f"bench: starting a local node for model '{node.model}' on {node.root}")
            await node.wait_healthy(session)
            client = await node.client(session)
        local = node is not None
        settings = Settings(url=client.base, model=client.model, local=local,
                            threads=args.threads if local else None, device=args.device if local else None,
                            lengths=lengths, new_tokens=args.new_tokens, runs=args.runs, seed=args.seed)
        progress(f"bench: measuring model '{client.model}' at {client.base}")
        return settings, await _measure(client, PromptSource(settings.seed), settings)


def _run(args: argparse.Namespace, lengths: tuple[int, ...]) -> tuple[Settings, list[Sample]]:
    if args.url:
        return asyncio.run(_bench(args, lengths, None))
    with (tempfile.TemporaryDirectory(prefix="tenzro-bench-") as workdir,
          LocalNode(Path(workdir), args.model or "default", args.threads, args.device) as node):
        return asyncio.run(_bench(args, lengths, node))


def run_reuse_bench(args: argparse.Namespace) -> int:
    try:
        if args.new_tokens < 1 or args.runs < 1:
            raise BenchError("--new-tokens and --runs must be at least 1")
        settings, samples = _run(args, parse_lengths(args.lengths, args.new_tokens))
    except BenchError as exc:
        return failed(exc)
    rows = summarise(settings, samples)
    print(format_table(rows))
    write_report(Path(args.out), settings, rows, samples)
    return 0


def add_reuse_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tenzro bench reuse` under the `bench` subcommands."""
    reuse = bench.add_parser("reuse", help="time to first token, cold versus reused prefix")
    add_server_arguments(reuse, None, "model id at --url, or model dir/'default' for the local node")
    reuse.add_argument("--lengths", default="512,1024,2048,4096")
    reuse.add_argument("--new-tokens", type=int, default=32)
    reuse.add_argument("--runs", type=int, default=5)
    reuse.add_argument("--seed", type=int, default=0, help="of the random prompts; vary it between rounds against "
                       "a server that keeps its cache, or its cold prompts are not cold")
    reuse.add_argument("--out", default="bench-results/reuse.json")
    reuse.set_defaults(func=run_reuse_bench)
