"""`tenzro bench hostile`: how a node serves everyone else while it is attacked. For each of issue 33's hostile
inputs, `/health`'s and a normal chat's latency (p50 and max) while the attack runs, and what the node answered
the attackers (counts per status).

A baseline with no hostile traffic runs first, then each case for `--seconds`: its hostile clients
(`bench.hostile_load`) loop their requests, or hold their connections, while one prober polls `GET /health` (a
connection of its own each time, `PROBE_INTERVAL_S` after the last answer) and one normal caller, with a key of
its own, sends short streamed chats (max_tokens 4) one after another. A latency runs from sending the request to
the end of its answer; a request that failed counts too, to its failure, and in `failed`. A probe or chat started
within the window counts whole. After each case the node settles: one untimed chat, so that work a case left
queued (a body still inflating or tokenizing) lands in no other case's numbers.

The hostile clients run in a process of their own (multiprocessing, spawned afresh per case), the prober and the
caller in this one: with hundreds of connections and 8 MiB bodies written on the prober's event loop, a probe
would wait for the bench's own loop and the table would show the bench, not the node. The hostile process
reports when its load starts, and the window opens then.

Hostile traffic goes only to a loopback address: the local node started here (the default, with two hostile
caller keys beside the normal caller's), or `--url` when its host is a loopback address or `localhost`; any
other host is refused before anything is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import multiprocessing
import multiprocessing.process
import multiprocessing.queues
import queue
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from bench.client import BenchError, Client, add_server_arguments, api_base
from bench.hostile_load import CASES, Plan, Tally, gzip_bomb, hostile_process
from bench.load import percentile
from bench.local_node import LocalNode
from bench.report import Target, columns, failed, progress, write_report

BASELINE = "baseline"
PROBE_INTERVAL_S = 0.05
PROBE_TIMEOUT_S = 30.0
CHAT_TIMEOUT_S = 120.0
CHAT_TOKENS = 4
ERROR_PAUSE_S = 0.5
"""A chat that failed is followed by this pause, so a failing node is not flooded by the normal caller."""
HOSTILE_CALLERS = 2
"""Caller keys made for a local node's hostile clients (the issue's two callers); a keyed case's clients
alternate between them."""
READY_TIMEOUT_S = 60.0
"""For the hostile process to start: the interpreter, its imports and the case's bodies."""
REPORT_TIMEOUT_S = 30.0
"""For its tally after the case's seconds: its exchanges all end at the deadline."""


@dataclass(frozen=True, slots=True)
class Settings(Target):
    seconds: float
    cases: tuple[str, ...]
    """In the order run; the baseline first."""
    probe_interval_s: float
    chat_max_tokens: int
    hostile_callers: int
    """Distinct caller keys the keyed cases' clients use."""


@dataclass(frozen=True, slots=True)
class Sample:
    case: str
    kind: str
    """"health" or "chat"."""
    start_s: float
    """Since the case's window opened."""
    latency_ms: float
    error: str | None


@dataclass(frozen=True, slots=True)
class Row:
    case: str
    hostile_clients: int
    health_probes: int
    health_p50_ms: float | None
    health_max_ms: float | None
    chats: int
    chat_p50_ms: float | None
    chat_max_ms: float | None
    failed: int
    """Probes and chats that failed."""
    hostile_requests: int
    hostile_answer_p50_ms: float | None
    """Of the hostile exchanges the node answered with a status: from connecting to the status line."""
    hostile_answer_max_ms: float | None
    outcomes: dict[str, int]
    """Hostile exchanges by what they got, most frequent first: a status ("400"), or "open" (unanswered when the
    case ended: every connection the node held through it, and a looping client's request then in flight),
    "closed", "reset", "refused" or "garbled" (`bench.hostile_load.Exchange`)."""


@dataclass
class Window:
    case: str
    seconds: float
    started: float = field(default_factory=time.perf_counter)
    samples: list[Sample] = field(default_factory=list)

    def open(self) -> bool:
        return time.perf_counter() - self.started < self.seconds

    def record(self, kind: str, start: float, error: str | None) -> None:
        self.samples.append(Sample(self.case, kind, start - self.started, (time.perf_counter() - start) * 1000.0,
                                   error))


def loopback_address(url: str) -> tuple[str, int]:
    """The host and port of `url`, which must be plain HTTP to a loopback address; else BenchError."""
    parts = urlsplit(url)
    host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme != "http" or not loopback:
        raise BenchError(f"--url {url}: the hostile bench sends only to http:// at a loopback address "
                         "(127.0.0.1, ::1 or localhost)")
    return host, parts.port or 80


async def _probe(session: aiohttp.ClientSession, root: str, window: Window) -> None:
    while window.open():
        start, error = time.perf_counter(), None
        try:
            async with session.get(root + "/health") as response:
                await response.read()
                if response.status != 200:
                    error = f"GET /health answered {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = f"GET /health: {str(exc) or type(exc).__name__}"
        window.record("health", start, error)
        await asyncio.sleep(PROBE_INTERVAL_S)


async def _chat(client: Client, window: Window) -> None:
    sent = 0
    while window.open():
        start, error = time.perf_counter(), None
        try:
            await client.chat([{"role": "user", "content": f"Say hello to number {sent}."}], CHAT_TOKENS)
        except BenchError as exc:
            error = str(exc)
        window.record("chat", start, error)
        sent += 1
        if error is not None:
            await asyncio.sleep(ERROR_PAUSE_S)


async def _receive(results: multiprocessing.queues.Queue[tuple[str, Tally | None]],
                   process: multiprocessing.process.BaseProcess, expected: str, timeout_s: float) -> Tally | None:
    """The hostile process's next message, which must be `expected`; it going away or staying silent raises."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            kind, tally = await asyncio.to_thread(results.get, True, 0.5)
        except queue.Empty:
            if process.exitcode is not None:
                raise BenchError(f"the hostile process exited ({process.exitcode}) before its {expected} "
                                 "message") from None
            continue
        if kind != expected:
            raise BenchError(f"the hostile process sent {kind!r} where {expected!r} was due")
        return tally
    raise BenchError(f"the hostile process sent no {expected} message in {timeout_s:.0f} s")


async def _run_case(plan: Plan | None, case: str, seconds: float, probes: aiohttp.ClientSession, root: str,
                    client: Client) -> tuple[Row, list[Sample]]:
    """One case's window (no hostile process for the baseline), then the node settles."""
    tally = Tally()
    process = None
    try:
        if plan is not None:
            context = multiprocessing.get_context("spawn")
            results: multiprocessing.queues.Queue[tuple[str, Tally | None]] = context.Queue()
            process = context.Process(target=hostile_process, args=(plan, results), daemon=True)
            process.start()
            await _receive(results, process, "ready", READY_TIMEOUT_S)
        window = Window(case, seconds)
        await asyncio.gather(_probe(probes, root, window), _chat(client, window))
        if plan is not None and process is not None:
            tally = await _receive(results, process, "done", seconds + REPORT_TIMEOUT_S) or tally
    finally:
        if process is not None:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    try:
        await client.chat([{"role": "user", "content": "Settle."}], 1)
    except BenchError as exc:
        progress(f"bench hostile: after {case}, the settling chat failed: {exc}")
    return summarise(case, 0 if plan is None else plan.clients, window.samples, tally), window.samples


def summarise(case: str, clients: int, samples: list[Sample], tally: Tally) -> Row:
    health = [s.latency_ms for s in samples if s.kind == "health"]
    chats = [s.latency_ms for s in samples if s.kind == "chat"]
    return Row(case, clients, len(health), percentile(health, 0.5), max(health, default=None), len(chats),
               percentile(chats, 0.5), max(chats, default=None), sum(s.error is not None for s in samples),
               sum(tally.outcomes.values()), percentile(tally.answer_ms, 0.5), max(tally.answer_ms, default=None),
               dict(tally.outcomes.most_common()))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(rows: list[Row]) -> str:
    """One line per case; the hostile exchanges' outcomes last, most frequent first ("400 x 812")."""
    cells = [("case", "clients", "/health p50 ms", "max ms", "chat p50 ms", "max ms", "chats", "failed",
              "answer p50 ms", "max ms")]
    cells += [(r.case, str(r.hostile_clients), _ms(r.health_p50_ms), _ms(r.health_max_ms), _ms(r.chat_p50_ms),
               _ms(r.chat_max_ms), str(r.chats), str(r.failed), _ms(r.hostile_answer_p50_ms),
               _ms(r.hostile_answer_max_ms)) for r in rows]
    outcomes = ["hostile requests got"] + [", ".join(f"{outcome} x {count}" for outcome, count in r.outcomes.items())
                                           or "-" for r in rows]
    return "\n".join(f"{line}  {last}" for line, last in zip(columns(cells, left=1).splitlines(), outcomes,
                                                              strict=True))


def _clients(args: argparse.Namespace, case: str) -> int:
    spec = CASES[case]
    given = args.connections if spec.stalls else args.clients
    return spec.clients if given is None else int(given)


async def _bench(args: argparse.Namespace, cases: tuple[str, ...], url: str, api_key: str,
                 hostile_keys: tuple[str, ...], node: LocalNode | None) -> tuple[Settings, list[Row], list[Sample]]:
    host, port = loopback_address(url)
    root = api_base(url).removesuffix("/v1")
    chat_timeout = aiohttp.ClientTimeout(total=CHAT_TIMEOUT_S)
    async with (aiohttp.ClientSession(timeout=chat_timeout) as chats,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
                                      connector=aiohttp.TCPConnector(force_close=True)) as probes):
        building = asyncio.to_thread(gzip_bomb) if "gzip-bomb" in cases else asyncio.sleep(0, b"")
        if node is not None:
            progress(f"bench hostile: starting a local node for {node.model}")
            bomb, _ = await asyncio.gather(building, node.wait_healthy(chats))
        else:
            bomb = await building
        client = await Client.connect(chats, url, api_key, args.model if node is None else None)
        await client.chat([{"role": "user", "content": "Warm up."}], CHAT_TOKENS)  # untimed: loads everything
        settings = Settings(url=client.base, model=client.model, local=node is not None,
                            threads=args.threads if node is not None else None,
                            device=args.device if node is not None else None, seconds=args.seconds,
                            cases=(BASELINE, *cases), probe_interval_s=PROBE_INTERVAL_S, chat_max_tokens=CHAT_TOKENS,
                            hostile_callers=len(set(hostile_keys)))
        rows: list[Row] = []
        samples: list[Sample] = []
        for case in settings.cases:
            plan = None if case == BASELINE else Plan(case, host, port, _clients(args, case), args.seconds,
                                                      hostile_keys, client.model,
                                                      bomb if case == "gzip-bomb" else b"")
            progress(f"bench hostile: {case}" + ("" if plan is None else f", {plan.clients} hostile clients"))
            row, found = await _run_case(plan, case, args.seconds, probes, root, client)
            rows.append(row)
            samples += found
        return settings, rows, samples


def _run(args: argparse.Namespace, cases: tuple[str, ...]) -> tuple[Settings, list[Row], list[Sample]]:
    if args.url:
        loopback_address(args.url)
        if not args.api_key:
            raise BenchError("--url needs --api-key (the normal caller's key)")
        hostile_keys = tuple(args.hostile_key) or (args.api_key,)
        return asyncio.run(_bench(args, cases, args.url, args.api_key, hostile_keys, None))
    with tempfile.TemporaryDirectory(prefix="tenzro-bench-hostile-") as workdir:
        node = LocalNode(Path(workdir), args.model or "default", args.threads, args.device)
        hostile_keys = tuple(node.add_key(f"hostile-{i}") for i in range(HOSTILE_CALLERS))
        with node:
            return asyncio.run(_bench(args, cases, node.root, node.api_key, hostile_keys, node))


def parse_cases(text: str) -> tuple[str, ...]:
    cases = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [case for case in cases if case not in CASES]
    if unknown or not cases:
        raise BenchError(f"--cases must name cases among {', '.join(CASES)}, not {text!r}")
    return cases


def run_hostile_bench(args: argparse.Namespace) -> int:
    try:
        counts = (args.threads, *(given for given in (args.clients, args.connections) if given is not None))
        if args.seconds <= 0 or min(counts) < 1:
            raise BenchError("--seconds must be above 0, --clients, --connections and --threads at least 1")
        settings, rows, samples = _run(args, parse_cases(args.cases))
    except BenchError as exc:
        return failed(exc)
    print(format_table(rows))
    write_report(Path(args.json), settings, rows, samples)
    return 0


def add_hostile_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tenzro bench hostile` under the `bench` subcommands."""
    hostile = bench.add_parser("hostile", help="/health and a normal chat's latency while a node gets hostile "
                               "inputs, and what it answers them")
    add_server_arguments(hostile, None, "local: a model directory or `models init` architecture (default: "
                         "'default'); with --url, the model the normal caller chats with (default: the first listed)")
    hostile.add_argument("--hostile-key", action="append", default=[], metavar="KEY",
                         help="at --url, a caller key of the hostile callers; repeat for more callers "
                              "(default: --api-key)")
    hostile.add_argument("--cases", default=",".join(CASES), help="comma-separated, run in this order after the "
                         "baseline: " + "; ".join(f"{case.name}: {case.what}" for case in CASES.values()))
    hostile.add_argument("--seconds", type=float, default=10.0, help="each case's window")
    hostile.add_argument("--clients", type=int, help="hostile clients looping requests, in every case but "
                         "slowloris and slow-body (default: the issue's: "
                         + ", ".join(f"{c.name} {c.clients}" for c in CASES.values() if not c.stalls) + ")")
    hostile.add_argument("--connections", type=int, help="connections slowloris and slow-body hold (default: 200)")
    hostile.add_argument("--json", default="bench-results/hostile.json", help="the JSON report")
    hostile.set_defaults(func=run_hostile_bench)
