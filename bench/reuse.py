"""`tenzro bench reuse`: time to first token over HTTP streaming, cold prompts against reused prefixes.

Prompts are token ids, which vLLM, llama.cpp's server and this node all accept, so the same table can be
made for another engine serving the same model directory; timings include HTTP and SSE, as a caller sees.

`--tls both` measures what TLS costs: a plain and a `--tls` local node side by side, each run sending the same
prompts to both in turn (which goes first alternating), requests to the TLS node pinned to its certificate.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bench.client import BenchError, Client, add_server_arguments, open_session
from bench.local_node import LocalNode
from bench.prompts import PromptSource
from bench.report import Target, columns, failed, progress, write_report

TRANSPORTS = {"off": ("http",), "on": ("https",), "both": ("http", "https")}
"""The local nodes `--tls` runs: plain HTTP, HTTPS (`tenzro node serve --tls`), or one of each."""


@dataclass(frozen=True, slots=True)
class Settings(Target):
    lengths: tuple[int, ...]
    new_tokens: int
    runs: int
    seed: int
    tls: str = "off"
    """`--tls`: off, on or both (TRANSPORTS)."""


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
    transport: str = "http"
    """http or https: the scheme of the node's URL."""


@dataclass(frozen=True, slots=True)
class Row:
    transport: str
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


async def _measure(clients: dict[str, Client], source: PromptSource, settings: Settings) -> list[Sample]:
    """Cold and reused runs interleaved per length, so drifting noise hits both alike; each run's prompts go to
    every transport's node, the first of them alternating from run to run."""
    for client in clients.values():
        await client.complete(source.prefix(max(settings.lengths)))  # untimed: loads and warms everything
    samples: list[Sample] = []
    for length in settings.lengths:
        for run in range(settings.runs):
            prefix = source.prefix(length - settings.new_tokens)
            warm_suffix = source.suffix(settings.new_tokens)
            cold_prompt = source.prefix(length)
            other_suffix = source.suffix(settings.new_tokens, unlike=(warm_suffix[0],))
            reused_suffix = source.suffix(settings.new_tokens, unlike=(warm_suffix[0], other_suffix[0]))
            order = list(clients.items())
            for transport, client in order if run % 2 == 0 else reversed(order):
                await client.complete(prefix + warm_suffix)  # untimed: leaves the prefix's state on the server
                cold = await client.complete(cold_prompt)  # and another prompt in between
                after_other = await client.complete(prefix + other_suffix)
                reused = await client.complete(prefix + reused_suffix)
                for kind, timing in (("cold", cold), ("after-other", after_other), ("reused", reused)):
                    samples.append(Sample(length, kind, run, timing.ttft_s * 1000.0, timing.prompt_tokens,
                                          timing.cached_tokens, transport))
                progress(f"bench: {length} tokens, run {run + 1}/{settings.runs} over {transport}: cold "
                         f"{cold.ttft_s * 1000:.1f} ms, reused {reused.ttft_s * 1000:.1f} ms (cached "
                         f"{reused.cached_tokens}), after another prompt {after_other.ttft_s * 1000:.1f} ms")
    return samples


def summarise(settings: Settings, samples: list[Sample]) -> list[Row]:
    rows = []
    for transport in dict.fromkeys(sample.transport for sample in samples):
        for length in settings.lengths:
            mine = [sample for sample in samples if sample.length == length and sample.transport == transport]
            ttfts: dict[str, list[float]] = {}
            for sample in mine:
                ttfts.setdefault(sample.kind, []).append(sample.ttft_ms)
            cold_ms, reused_ms = statistics.median(ttfts["cold"]), statistics.median(ttfts["reused"])
            cached = [s.cached_tokens for s in mine if s.kind == "reused"]
            rows.append(Row(transport, length, cold_ms, reused_ms, reused_ms / cold_ms,
                            statistics.median(ttfts["after-other"]), settings.new_tokens / length,
                            None if None in cached else tuple(c for c in cached if c is not None)))
    return rows


def tls_over_plain(rows: list[Row]) -> dict[int, float]:
    """Per prompt length, the median reused TTFT over HTTPS divided by that over plain HTTP (`--tls both`)."""
    plain = {row.prompt_tokens: row.reused_ttft_ms for row in rows if row.transport == "http"}
    return {row.prompt_tokens: row.reused_ttft_ms / plain[row.prompt_tokens] for row in rows
            if row.transport == "https" and row.prompt_tokens in plain}


def format_table(rows: list[Row]) -> str:
    def cached(values: tuple[int, ...] | None) -> str:
        if values is None:
            return "n/a"
        return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"

    both = len({r.transport for r in rows}) > 1  # then a first column says which node each row measured
    lines: list[tuple[str, ...]] = [(*(("transport",) if both else ()), "prompt tokens", "cold TTFT ms",
                                     "reused TTFT ms", "reused/cold", "ideal", "after other ms", "cached (reused)")]
    lines += [(*((r.transport,) if both else ()), str(r.prompt_tokens), f"{r.cold_ttft_ms:.1f}",
               f"{r.reused_ttft_ms:.1f}", f"{r.ratio:.3f}", f"{r.ideal_ratio:.3f}", f"{r.after_other_ttft_ms:.1f}",
               cached(r.reused_cached_tokens)) for r in rows]
    ratios = tls_over_plain(rows)
    ratio_line = ("\nreused TTFT, https over http: "
                  + ", ".join(f"{length} tokens {ratio:.3f}" for length, ratio in ratios.items())) if ratios else ""
    return columns(lines, left=int(both)) + ratio_line


async def _bench(args: argparse.Namespace, lengths: tuple[int, ...],
                 nodes: list[LocalNode]) -> tuple[Settings, list[Sample]]:
    async with open_session() as session:
        clients: dict[str, Client] = {}
        if not nodes:
            clients[urlsplit(args.url).scheme] = await Client.connect(session, args.url, args.api_key, args.model)
        for node in nodes:
            progress(f"bench: starting a local node for model '{node.model}' on {node.root}")
        for node, transport in zip(nodes, TRANSPORTS[args.tls], strict=True):
            await node.wait_healthy(session)
            clients[transport] = await node.client(session)
        client = next(iter(clients.values()))
        local = bool(nodes)
        settings = Settings(url=client.base, model=client.model, local=local,
                            threads=args.threads if local else None, device=args.device if local else None,
                            lengths=lengths, new_tokens=args.new_tokens, runs=args.runs, seed=args.seed, tls=args.tls)
        progress(f"bench: measuring model '{client.model}' at {', '.join(c.base for c in clients.values())}")
        return settings, await _measure(clients, PromptSource(settings.seed), settings)


def _run(args: argparse.Namespace, lengths: tuple[int, ...]) -> tuple[Settings, list[Sample]]:
    if args.url:
        if args.tls != "off":
            raise BenchError("--tls runs local nodes; measure an https server by giving its --url")
        return asyncio.run(_bench(args, lengths, []))
    with tempfile.TemporaryDirectory(prefix="tenzro-bench-") as workdir, ExitStack() as running:
        nodes = [running.enter_context(LocalNode(Path(workdir) / transport, args.model or "default", args.threads,
                                                 args.device, tls=transport == "https"))
                 for transport in TRANSPORTS[args.tls]]
        return asyncio.run(_bench(args, lengths, nodes))


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
    reuse.add_argument("--tls", choices=list(TRANSPORTS), default="off",
                       help="the local node serves plain HTTP (off), HTTPS with `--tls`, its certificate pinned by "
                            "the client (on), or both: one node of each, the same prompts sent to both in turn")
    reuse.add_argument("--out", default="bench-results/reuse.json")
    reuse.set_defaults(func=run_reuse_bench)
