"""`tenzro bench reuse`: time to first token over HTTP streaming, cold prompts against reused prefixes.

Prompts are token ids, which vLLM, llama.cpp's server and this node all accept, so the same table can be
made for another engine serving the same model directory; timings include HTTP and SSE, as a caller sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

TOKEN_LOW, TOKEN_HIGH = 100, 30000  # clear of special tokens and inside the embedded models' 32000 vocab
SEED = 0
STARTUP_TIMEOUT_S = 600.0  # the first start of `--model default` builds the model
REQUEST_TIMEOUT_S = 900.0


class BenchError(RuntimeError):
    """The benchmark cannot run as asked, or a server answered wrongly; the message says which."""


@dataclass(frozen=True, slots=True)
class Settings:
    url: str
    model: str
    local: bool
    threads: int | None
    """Torch threads of the local node; None when measuring --url."""
    device: str | None
    """Device passed to the local node; None lets it choose (cuda when present) or means --url."""
    lengths: tuple[int, ...]
    new_tokens: int
    runs: int
    seed: int


@dataclass(frozen=True, slots=True)
class Timing:
    ttft_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    """usage.prompt_tokens_details.cached_tokens; None when the server reports no usage."""


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed completion as the client saw it."""

    ttft_s: float
    text: str
    usage: dict[str, Any]

    def timing(self) -> Timing:
        details = self.usage.get("prompt_tokens_details") or {}
        return Timing(self.ttft_s, self.usage.get("prompt_tokens"), details.get("cached_tokens"))


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


class PromptSource:
    """Seeded random token ids. Every prefix starts with a token no earlier prompt started with, so a
    server can reuse nothing of a prompt meant to be cold, and two suffixes of one prefix differ at once."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._first_tokens: set[int] = set()

    def _token(self) -> int:
        return self._rng.randrange(TOKEN_LOW, TOKEN_HIGH)

    def _ids(self, count: int, first_not_in: Collection[int]) -> list[int]:
        first = self._token()
        while first in first_not_in:
            first = self._token()
        return [first] + [self._token() for _ in range(count - 1)]

    def prefix(self, count: int) -> list[int]:
        assert len(self._first_tokens) < TOKEN_HIGH - TOKEN_LOW
        ids = self._ids(count, self._first_tokens)
        self._first_tokens.add(ids[0])
        return ids

    def suffix(self, count: int, unlike: Collection[int] = ()) -> list[int]:
        return self._ids(count, unlike)


def api_base(url: str) -> str:
    """The base that `/completions` and `/models` hang from, whether or not `url` ends in /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def parse_lengths(text: str, new_tokens: int) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise BenchError(f"--lengths must be comma-separated integers, not {text!r}") from exc
    if not lengths or any(length <= new_tokens for length in lengths):
        raise BenchError(f"--lengths must each exceed --new-tokens ({new_tokens}): a prefix must be left")
    return lengths


class Client:
    """Streamed text completions with max_tokens=1 over one pooled session."""

    def __init__(self, session: aiohttp.ClientSession, base: str, api_key: str | None) -> None:
        self.session = session
        self.base = base
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = ""

    async def first_model(self) -> str:
        async with self.session.get(self.base + "/models", headers=self.headers) as response:
            if response.status != 200:
                raise BenchError(f"GET {self.base}/models: {response.status} {await response.text()}")
            models = (await response.json()).get("data") or []
        if not models:
            raise BenchError(f"GET {self.base}/models lists no model; pass --model")
        return str(models[0]["id"])

    async def stream(self, path: str, body: dict[str, Any]) -> Streamed:
        """POST a streamed request to `path`. TTFT: to the first event carrying generated text or a finish
        reason (a chat stream opens with a role chunk sent before anything is computed)."""
        ttft: float | None = None
        parts: list[str] = []
        usage: dict[str, Any] = {}
        started = time.perf_counter()
        async with self.session.post(self.base + path, json=body, headers=self.headers) as response:
            if response.status != 200:
                raise BenchError(f"POST {self.base}{path} answered {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip().decode()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError as exc:
                    raise BenchError(f"the server streamed a non-JSON event: {data[:200]!r}") from exc
                if "error" in event:
                    raise BenchError(f"the server failed a request mid-stream: {event['error']}")
                for choice in event.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if ttft is None and (text or choice.get("finish_reason") or "text" in choice):
                        ttft = time.perf_counter() - started
                    parts.append(text)
                usage = event.get("usage") or usage
        if ttft is None:
            raise BenchError(f"POST {self.base}{path} streamed no generated text")
        return Streamed(ttft, "".join(parts), usage)

    async def complete(self, prompt: list[int]) -> Timing:
        """A text completion of one token on token ids: its TTFT and usage."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        return (await self.stream("/completions", body)).timing()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
                     for line in lines)


class LocalNode:
    """`tenzro node serve` as a subprocess on a free loopback port, with its own config, key, ledger and
    prices in `workdir`; TENZRO_HOME is left alone so the generated model cache is shared with the user's."""

    def __init__(self, workdir: Path, model: str, threads: int, device: str | None,
                 extra: tuple[str, ...] = ()) -> None:
        self.tenzro = [sys.executable, "-m", "node"]
        self.extra = extra
        self.model, self.threads, self.device = model, threads, device
        self.workdir = workdir
        self.config = workdir / "node.yaml"
        self.log = workdir / "node.log"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.root = f"http://127.0.0.1:{self.port}"
        self.api_key = ""
        self.process: subprocess.Popen[bytes] | None = None

    def add_key(self, name: str, role: str = "caller") -> str:
        """A new key of `role` in this node's config (also while it runs); returns the key."""
        added = subprocess.run([*self.tenzro, "keys", "add", name, "--role", role, "--config", str(self.config)],
                               capture_output=True, text=True, check=False)
        if added.returncode != 0:
            raise BenchError(f"'tenzro keys add --role {role}' failed: {added.stderr.strip()}")
        return added.stdout.strip().splitlines()[-1]

    def start(self) -> None:
        self.api_key = self.add_key("bench")
        # Its own ledger and prices: a benchmark's usage records are not the user's.
        command = [*self.tenzro, "node", "serve", "--config", str(self.config), "--model", self.model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--threads", str(self.threads),
                   "--ledger", str(self.workdir / "ledger"), "--pricing", str(self.workdir / "pricing.yaml")]
        if self.device:
            command += ["--device", self.device]
        command += list(self.extra)
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    async def wait_healthy(self, session: aiohttp.ClientSession) -> None:
        assert self.process is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(f"the local node exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                async with session.get(self.root + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise BenchError(f"the local node was not healthy in {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def _bench(args: argparse.Namespace, lengths: tuple[int, ...],
                 node: LocalNode | None) -> tuple[Settings, list[Sample]]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if node is None:
            client = Client(session, api_base(args.url), args.api_key)
            client.model = args.model or await client.first_model()
        else:
            progress(f"bench: starting a local node for model '{node.model}' on {node.root}")
            await node.wait_healthy(session)
            client = Client(session, api_base(node.root), node.api_key)
            client.model = await client.first_model()
        local = node is not None
        settings = Settings(url=client.base, model=client.model, local=local,
                            threads=args.threads if local else None, device=args.device if local else None,
                            lengths=lengths, new_tokens=args.new_tokens, runs=args.runs, seed=args.seed)
        progress(f"bench: measuring model '{client.model}' at {client.base}")
        return settings, await _measure(client, PromptSource(settings.seed), settings)


def _run(args: argparse.Namespace, lengths: tuple[int, ...]) -> tuple[Settings, list[Sample]]:
    if args.url:
        return asyncio.run(_bench(args, lengths, None))
    with tempfile.TemporaryDirectory(prefix="tenzro-bench-") as workdir:
        node = LocalNode(Path(workdir), args.model or "default", args.threads, args.device)
        try:
            node.start()
            return asyncio.run(_bench(args, lengths, node))
        finally:
            node.stop()


def write_report(out: Path, report: dict[str, Any]) -> None:
    """A benchmark's JSON, next to the table it printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    progress(f"bench: wrote {out}")


def run_reuse_bench(args: argparse.Namespace) -> int:
    try:
        if args.new_tokens < 1 or args.runs < 1:
            raise BenchError("--new-tokens and --runs must be at least 1")
        settings, samples = _run(args, parse_lengths(args.lengths, args.new_tokens))
    except (BenchError, aiohttp.ClientError, TimeoutError) as exc:
        print(f"tenzro: error: {str(exc) or type(exc).__name__}", file=sys.stderr)
        return 2
    rows = summarise(settings, samples)
    print(format_table(rows))
    write_report(Path(args.out), {"settings": asdict(settings), "rows": [asdict(r) for r in rows],
                                  "samples": [asdict(s) for s in samples]})
    return 0
