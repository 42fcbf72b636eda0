"""`tenzro bench load`: serving capacity under concurrent multi-turn agent callers, the way providers compare engines.

N callers run at once, each in a loop of agent conversations over streamed chat completions: every request
re-sends one system prompt shared by all callers, the conversation so far and a new user turn (a tool's
output, unique per caller and turn), and asks for a greedy reply of `--reply-tokens` tokens; after `--turns`
turns the caller starts a fresh conversation. Each client count of `--clients` runs in turn for `--duration`
seconds with conversations of its own.

The window: no caller starts a request after `--duration`; a request still streaming then finishes (the
server stays loaded to the end) but does not count. The counted requests are those completed without error
within the window, and rates divide by the wall time from the start to the last counted completion, so time
spent on requests that are not counted is not in the denominator either. TTFT and inter-token latency are
the client's: from sending the request to the first streamed content, and between successive content chunks
as they arrive (chunks delivered together show as gaps near zero).

Reuse off: a local node is started with `--no-reuse`. A server measured by `--url` cannot be told to stop
caching, so every request's system prompt then starts with a fresh random tag and shares no prefix with any
earlier request, except the chat template's own header before the system prompt's text. The tag's first
word runs through the tokenizer's one-token words without repeating, so the tags differ at their first token
until every word has begun one.

Prompts are rendered from the served model's tokenizer here (`--model`: a directory, a `models init`
architecture or a Hugging Face id), so the same seed sends the same text to every engine serving the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.chat import ChatMessages, load_tokenizer
from bench.client import BenchError, Client, Messages, add_server_arguments, api_base, open_session
from bench.local_node import LocalNode, model_dir
from bench.report import Target, columns, failed, progress, write_report

USER_TOKENS = (30, 60)
"""Words of a user turn (each one token), drawn per turn: about a short tool result."""
TAG_WORDS = 4
TTFT_LIMIT_MS = 1000.0
"""Capacity counts a client count only while its TTFT p99 stays within this."""
ERROR_PAUSE_S = 0.5
"""A caller whose request failed waits this long, so a failing server is not flooded by a tight loop."""


@dataclass(frozen=True, slots=True)
class Settings(Target):
    label: str
    clients: tuple[int, ...]
    duration_s: float
    turns: int
    system_tokens: int
    reply_tokens: int
    reuse: bool
    reuse_off_by: str | None
    """How reuse was switched off: "node --no-reuse", "random tag per request" (--url); None when on."""
    seed: int
    ttft_limit_ms: float


@dataclass(frozen=True, slots=True)
class Sample:
    """One request of one client count's run."""

    clients: int
    client: int
    conversation: int
    turn: int
    start_s: float
    """Since this client count's run started; so is `end_s`."""
    end_s: float
    counted: bool
    """Completed without error within the window, so it enters the row."""
    ttft_ms: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    """usage.prompt_tokens_details.cached_tokens; None when the server reports none."""
    completion_tokens: int
    """usage.completion_tokens, else the content chunks streamed."""
    error: str | None


@dataclass(frozen=True, slots=True)
class Row:
    """One client count's result, over its counted requests."""

    clients: int
    completed: int
    errors: int
    window_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    """Inter-token latency: gaps between successive content chunks of a request; None when none has two."""


@dataclass(frozen=True, slots=True)
class Capacity:
    requests_per_s: float
    clients: int


@dataclass(frozen=True, slots=True)
class Reply:
    """A streamed chat completion as the caller saw it."""

    text: str
    ttft_s: float
    gaps_s: tuple[float, ...]
    usage: dict[str, Any]
    chunks: int
    """Chunks that carried content."""


class Workload:
    """What the callers say, from the seed: one system prompt of exact length that every caller shares, and
    user turns of the tokenizer's one-token words, drawn per client count and caller."""

    def __init__(self, chat: ChatMessages, seed: int, system_tokens: int, tagged: bool) -> None:
        self.words = chat.words
        self.system = chat.message("system", system_tokens)
        self.seed = seed
        self.tagged = tagged
        """Every request's system prompt starts with a fresh tag (reuse off at a server measured by URL)."""
        self._tag_rng = random.Random(f"{seed}:tags")
        self._tag_starts = self._tag_rng.sample(self.words, len(self.words))
        self._tags_sent = 0

    def caller_rng(self, clients: int, client: int) -> random.Random:
        return random.Random(f"{self.seed}:{clients}:{client}")

    def user(self, rng: random.Random) -> dict[str, str]:
        return {"role": "user", "content": "".join(rng.choice(self.words) for _ in range(rng.randint(*USER_TOKENS)))}

    def request(self, history: Messages) -> Messages:
        """The messages sent for `history` (which starts with the system prompt)."""
        if not self.tagged:
            return history
        first = self._tag_starts[self._tags_sent % len(self._tag_starts)]
        self._tags_sent += 1
        tag = first + "".join(self._tag_rng.choice(self.words) for _ in range(TAG_WORDS - 1))
        return [{"role": "system", "content": tag + history[0]["content"]}, *history[1:]]


async def stream_chat(client: Client, messages: Messages, max_tokens: int) -> Reply:
    """A greedy streamed chat completion, with the gaps between the events carrying text as they arrived."""
    streamed = await client.chat(messages, max_tokens)
    arrivals = streamed.arrivals_s
    gaps = tuple(later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False))
    return Reply(streamed.text, streamed.ttft_s, gaps, streamed.usage, len(arrivals))


@dataclass
class Recorder:
    """What the callers of one client count measured, as they go."""

    clients: int
    started: float
    """time.perf_counter() at the start; the window ends `duration_s` later."""
    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)
    """Inter-token gaps of the counted requests."""

    def open(self) -> bool:
        return time.perf_counter() - self.started < self.duration_s

    def record(self, client: int, conversation: int, turn: int, start: float, reply: Reply | None,
               error: str | None) -> None:
        end_s = time.perf_counter() - self.started
        usage = reply.usage if reply is not None else {}
        counted = reply is not None and end_s <= self.duration_s
        if reply is not None and counted:
            self.gaps_ms += [gap * 1000.0 for gap in reply.gaps_s]
        self.samples.append(Sample(
            self.clients, client, conversation, turn, start - self.started, end_s, counted,
            None if reply is None else reply.ttft_s * 1000.0, usage.get("prompt_tokens"),
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            int(usage.get("completion_tokens") or (reply.chunks if reply is not None else 0)), error))


async def _caller(client: Client, workload: Workload, recorder: Recorder, index: int, turns: int,
                  reply_tokens: int) -> None:
    """One caller's conversations until the window closes; a failed request ends its conversation."""
    rng = workload.caller_rng(recorder.clients, index)
    conversation = 0
    while recorder.open():
        history = [workload.system]
        for turn in range(turns):
            if not recorder.open():
                return
            history.append(workload.user(rng))
            start = time.perf_counter()
            try:
                reply = await stream_chat(client, workload.request(history), reply_tokens)
            except BenchError as exc:
                recorder.record(index, conversation, turn, start, None, str(exc))
                await asyncio.sleep(ERROR_PAUSE_S)
                break
            recorder.record(index, conversation, turn, start, reply, None)
            history.append({"role": "assistant", "content": reply.text})
        conversation += 1


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Nearest rank; None of no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(fraction * len(ordered)), 1) - 1]


def summarise(recorder: Recorder) -> Row:
    counted = [s for s in recorder.samples if s.counted]
    window = max((s.end_s for s in counted), default=recorder.duration_s)
    ttfts = [s.ttft_ms for s in counted if s.ttft_ms is not None]
    output = sum(s.completion_tokens for s in counted)
    cached = [s.cached_tokens for s in counted if s.cached_tokens is not None]
    return Row(recorder.clients, len(counted), sum(s.error is not None for s in recorder.samples), window, output,
               sum(s.prompt_tokens or 0 for s in counted), sum(cached) if cached else None, output / window,
               len(counted) / window, percentile(ttfts, 0.5), percentile(ttfts, 0.99),
               percentile(recorder.gaps_ms, 0.5), percentile(recorder.gaps_ms, 0.99))


def capacity(rows: Sequence[Row], ttft_limit_ms: float = TTFT_LIMIT_MS) -> Capacity | None:
    """The most requests/s among the client counts whose TTFT p99 stayed within the limit."""
    within = [r for r in rows if r.completed and r.ttft_p99_ms is not None and r.ttft_p99_ms <= ttft_limit_ms]
    best = max(within, key=lambda r: r.requests_per_s, default=None)
    return None if best is None else Capacity(best.requests_per_s, best.clients)


async def _measure(client: Client, workload: Workload, settings: Settings) -> tuple[list[Row], list[Sample]]:
    try:  # untimed: loads and warms everything
        warmup = await stream_chat(client, workload.request([workload.system, workload.user(random.Random(-1))]),
                                   settings.reply_tokens)
    except BenchError as exc:
        raise BenchError(f"the warm-up request failed, so nothing was measured: {exc}") from exc
    progress(f"bench load: warm-up request answered in {warmup.ttft_s * 1000:.0f} ms to the first token")
    rows: list[Row] = []
    samples: list[Sample] = []
    for clients in settings.clients:
        recorder = Recorder(clients, time.perf_counter(), settings.duration_s)
        await asyncio.gather(*(_caller(client, workload, recorder, index, settings.turns, settings.reply_tokens)
                               for index in range(clients)))
        row = summarise(recorder)
        rows.append(row)
        samples += recorder.samples
        progress(f"bench load: {clients} clients: {row.completed} requests, {row.output_tokens_per_s:.1f} output "
                 f"tokens/s, TTFT p99 {_ms(row.ttft_p99_ms)} ms, {row.errors} errors")
    return rows, samples


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_table(rows: Sequence[Row]) -> str:
    lines = [("clients", "completed", "errors", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
              "ITL p99 ms", "cached")]
    lines += [(str(r.clients), str(r.completed), str(r.errors), f"{r.output_tokens_per_s:.1f}",
               f"{r.requests_per_s:.2f}", _ms(r.ttft_p50_ms), _ms(r.ttft_p99_ms), _ms(r.itl_p50_ms),
               _ms(r.itl_p99_ms),
               "n/a" if r.cached_tokens is None or not r.prompt_tokens
               else f"{100 * r.cached_tokens / r.prompt_tokens:.0f}%") for r in rows]
    return columns(lines)


def format_capacity(label: str, found: Capacity | None) -> str:
    if found is None:
        return f"capacity ({label}): none, no client count kept TTFT p99 <= {TTFT_LIMIT_MS:.0f} ms"
    return (f"capacity ({label}): {found.requests_per_s:.2f} requests/s at {found.clients} clients "
            f"with TTFT p99 <= {TTFT_LIMIT_MS:.0f} ms")


@dataclass(frozen=True, slots=True)
class Curve:
    """One measured server in the plot: a report's label and its rows."""

    label: str
    rows: tuple[Row, ...]

    @classmethod
    def read(cls, path: Path) -> Curve:
        """The curve of a JSON report this command wrote."""
        try:
            report = json.loads(path.read_text())
            return cls(str(report["settings"]["label"]), tuple(Row(**row) for row in report["rows"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BenchError(f"--compare {path}: not a `tenzro bench load` JSON report ({exc})") from exc


def plot(out: Path, curves: Sequence[Curve]) -> None:
    """Two panels against clients: aggregate output tokens/s, and TTFT p50 (solid) and p99 (dashed)."""
    from matplotlib.figure import Figure  # a figure of its own, no pyplot state: the Agg canvas draws the PNG

    figure = Figure(figsize=(12, 4.8), layout="constrained")
    throughput, ttft = figure.subplots(1, 2)
    for curve in curves:
        rows = [r for r in curve.rows if r.completed]
        clients = [r.clients for r in rows]
        (line,) = throughput.plot(clients, [r.output_tokens_per_s for r in rows], marker="o", label=curve.label)
        ttft.plot(clients, [r.ttft_p50_ms for r in rows], marker="o", color=line.get_color(),
                  label=f"{curve.label} p50")
        ttft.plot(clients, [r.ttft_p99_ms for r in rows], marker="s", linestyle="--", color=line.get_color(),
                  label=f"{curve.label} p99")
    throughput.set(title="aggregate output tokens/s", xlabel="concurrent clients", ylabel="tokens/s")
    ttft.set(title="time to first token", xlabel="concurrent clients", ylabel="ms")
    ttft.set_yscale("log")
    throughput.set_ylim(bottom=0)
    ttft.axhline(TTFT_LIMIT_MS, color="grey", linewidth=0.8, linestyle=":", label="capacity's TTFT p99 limit")
    ticks = sorted({r.clients for curve in curves for r in curve.rows})
    for axes in (throughput, ttft):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [str(tick) for tick in ticks])
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=120)
    progress(f"bench: wrote {out}")


def parse_clients(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise BenchError(f"--clients must be comma-separated integers, not {text!r}") from exc
    if not counts or min(counts) < 1:
        raise BenchError(f"--clients must list client counts of at least 1, not {text!r}")
    return counts


def _default_label(url: str | None, reuse: bool) -> str:
    name = "tenzro" if url is None else urlsplit(url).netloc or url
    return name if reuse else f"{name} no-reuse"


async def _bench(args: argparse.Namespace, clients: tuple[int, ...], workdir: Path,
                 node: LocalNode | None) -> tuple[Settings, list[Row], list[Sample]]:
    async with open_session() as session:
        if node is None:
            client = Client(session, api_base(args.url), args.api_key)
            listed = await client.models()  # raises when the server cannot be reached
            client.model = args.model if args.model in listed else listed[0]
            tokenizer_of = args.model or client.model
        else:
            progress(f"bench load: starting a local node for {' '.join((node.model, *node.extra))}")
            await node.wait_healthy(session)
            client = await node.client(session)
            tokenizer_of = node.model
        local, reuse = node is not None, not args.no_reuse
        tagged = not reuse and not local
        workload = Workload(ChatMessages(_tokenizer(tokenizer_of, workdir), random.Random(args.seed)), args.seed,
                            args.system_tokens, tagged)
        settings = Settings(url=client.base, model=client.model, local=local, threads=args.threads if local else None,
                            device=args.device if local else None,
                            label=args.label or _default_label(args.url, reuse), clients=clients,
                            duration_s=args.duration, turns=args.turns, system_tokens=args.system_tokens,
                            reply_tokens=args.reply_tokens, reuse=reuse,
                            reuse_off_by=None if reuse else "node --no-reuse" if local else "random tag per request",
                            seed=args.seed, ttft_limit_ms=TTFT_LIMIT_MS)
        progress(f"bench load: model '{client.model}' at {client.base}, {settings.label}")
        if tagged:
            progress("bench load: --no-reuse at a URL: every request's system prompt starts with a fresh random tag")
        rows, samples = await _measure(client, workload, settings)
        return settings, rows, samples


def _tokenizer(spec: str, workdir: Path) -> Any:
    """The tokenizer that renders the prompts: of a model directory or `models init` architecture (built into
    `workdir`), or of a Hugging Face id (an `owner/name` that is not a directory here)."""
    if Path(spec).expanduser().is_dir() or "/" not in spec:
        tokenizer = load_tokenizer(model_dir(spec, workdir))
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as exc:
            raise BenchError(f"--model {spec!r}: no tokenizer loads here ({exc})") from exc
    if tokenizer is None:
        raise BenchError(f"--model {spec!r} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    return tokenizer


def _run(args: argparse.Namespace, clients: tuple[int, ...]) -> tuple[Settings, list[Row], list[Sample]]:
    with tempfile.TemporaryDirectory(prefix="tenzro-bench-load-") as workdir:
        if args.url:
            return asyncio.run(_bench(args, clients, Path(workdir), None))
        # Built once: the node serves this directory and the bench reads its tokenizer.
        model = model_dir(args.model or "default", Path(workdir))
        (Path(workdir) / "node").mkdir()
        with LocalNode(Path(workdir) / "node", str(model), args.threads, args.device,
                       ("--no-reuse",) if args.no_reuse else ()) as node:
            return asyncio.run(_bench(args, clients, Path(workdir), node))


def run_load_bench(args: argparse.Namespace) -> int:
    try:
        if min(args.turns, args.reply_tokens, args.threads) < 1 or args.duration <= 0:
            raise BenchError("--turns, --reply-tokens and --threads must be at least 1, --duration above 0")
        clients = parse_clients(args.clients)
        compared = [Curve.read(Path(path)) for path in args.compare]
        settings, rows, samples = _run(args, clients)
    except BenchError as exc:
        return failed(exc)
    found = capacity(rows)
    print(format_table(rows))
    for line in [format_capacity(settings.label, found)] + [format_capacity(c.label, capacity(c.rows))
                                                            for c in compared]:
        print(line)
    if settings.reuse_off_by == "random tag per request":
        print("reuse off: every request's system prompt started with a fresh random tag (a server measured by "
              "URL keeps its cache); only the chat template's header before it can be shared")
    write_report(Path(args.json), settings, rows, samples, capacity=None if found is None else asdict(found))
    if args.plot:
        plot(Path(args.plot), [Curve(settings.label, tuple(rows)), *compared])
    return 0


def add_load_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tenzro bench load` under the `bench` subcommands."""
    load = bench.add_parser("load", help="capacity: output tokens/s and TTFT of concurrent multi-turn agent callers")
    add_server_arguments(load, None, "local: a model directory or `models init` architecture (default: 'default'); "
                         "with --url, the model whose tokenizer renders the prompts here (a directory, an "
                         "architecture or a Hugging Face id), served under that id when listed, else the first")
    load.add_argument("--clients", default="1,8,32", help="concurrent callers; a comma-separated list sweeps them")
    load.add_argument("--duration", type=float, default=60.0, help="seconds each client count runs")
    load.add_argument("--no-reuse", action="store_true", help="reuse off: the local node runs with --no-reuse; at "
                      "--url, every request's system prompt starts with a fresh random tag")
    load.add_argument("--turns", type=int, default=4, help="requests per conversation")
    load.add_argument("--system-tokens", type=int, default=1000, help="of the system prompt all callers share")
    load.add_argument("--reply-tokens", type=int, default=64, help="max_tokens of every request")
    load.add_argument("--label", help="this run's name in the report and plot (default: tenzro, or the URL's host)")
    load.add_argument("--seed", type=int, default=0, help="of the prompts' text")
    load.add_argument("--json", default="bench-results/load.json", help="the JSON report")
    load.add_argument("--plot", help="a PNG of tokens/s and TTFT against clients, this run and every --compare")
    load.add_argument("--compare", nargs="+", default=[], metavar="JSON",
                      help="earlier reports of this command (another engine's, say) to plot and size beside this run")
    load.set_defaults(func=run_load_bench)
