"""`tenzro bench agent`: a seeded agent workload over chat completions, reused tokens and TTFT per reuse policy.

Every episode re-sends one system prompt with tool definitions (about 1.5k tokens) and a new task, then
loops: the assistant replies, the agent appends that reply and a tool result and asks again. In 30% of the
steps the reply the agent re-sends differs from what was generated (a word inserted mid-reply), which is
where a recurrent model can only resume at a snapshot. Each mode runs the same workload on a fresh local
node; replies are greedy, so every mode must get the same replies. The oracle reuses every prompt token
that agrees with what the caller stored before (the `ours` node counts them per request); its TTFT comes
from a node primed, before each timed request, with a request ending exactly at that point.

With `--callers N`, it measures first turns instead: N callers each open an episode (the one system prompt, a
task of its own), one after another, on a fresh node; with `--group` also on a node where the N callers form a
trust group and share the system prompt in its scope (`Tenzro-Cache-Scope: group`), so that only the first
caller computes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.client import BenchError, Client, Messages, Streamed, add_server_arguments, api_base, open_session
from bench.local_node import LocalNode, model_dir
from bench.prompts import SEED, PromptSource
from bench.report import columns, failed, progress, write_report

MAX_TOKENS = 24
EDIT_FRACTION = 0.3
TOOLS = 6
TOOL_RESULT_WORDS = (70, 150)  # about 100-200 tokens of the node's pseudo-English tokenizer
WARMUP_TOKENS = 128
MIB = 1024**2

CACHED_BYTES = "tenzro_cached_bytes"
SNAPSHOT_BYTES = "tenzro_cached_snapshot_bytes"


class AgentWorkload:
    """Everything the agent says, drawn from one seed before the run, so no mode can shift another's text.

    The text is the pseudo-English the embedded models' tokenizer was trained on; the tool schemas are JSON.
    """

    def __init__(self, seed: int, episodes: int, steps: int) -> None:
        # The one engine module the bench imports (tests/test_layering.py says why): no command prints it.
        from node.engine.synthetic import training_corpus

        rng = random.Random(seed)
        self.episodes, self.steps = episodes, steps
        lines = training_corpus(seed, n_words=24_000)
        words = [word.strip(".,?!:;\"()").lower() for line in lines for word in line.split()]  # Zipf-like

        def sentences(count: int) -> str:
            return " ".join(rng.choice(lines).strip() for _ in range(count))

        def tool() -> dict[str, Any]:
            params = {rng.choice(words): {"type": rng.choice(["string", "integer", "boolean", "array"]),
                                          "description": sentences(1)} for _ in range(rng.randint(2, 3))}
            return {"type": "function", "function": {
                "name": f"{rng.choice(words)}_{rng.choice(words)}", "description": sentences(1),
                "parameters": {"type": "object", "properties": params,
                               "required": sorted(rng.sample(sorted(params), 1))}}}

        self.system = (f"You are an agent. {sentences(2)}\n\n# Tools\nCall a tool by answering with its name "
                       f"and JSON arguments. The tools:\n{json.dumps([tool() for _ in range(TOOLS)])}")
        self.tasks = [f"Task {episode + 1}: {sentences(2)}" for episode in range(episodes)]
        self.results = [[json.dumps({"status": "ok", "output": " ".join(
            rng.choice(words) for _ in range(rng.randint(*TOOL_RESULT_WORDS)))}) for _ in range(steps)]
            for _ in range(episodes)]
        # A reply is re-sent only when a step follows it, so edits are drawn among those steps.
        resent = [(episode, step) for episode in range(episodes) for step in range(steps - 1)]
        edited = rng.sample(resent, round(EDIT_FRACTION * len(resent)))
        self.edits = {key: rng.choice(words) for key in sorted(edited)}

    def opening(self, episode: int) -> Messages:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.tasks[episode]}]

    def after_reply(self, episode: int, step: int, reply: str) -> Messages:
        """The assistant message the agent re-sends (edited in the middle in some steps) and the tool result."""
        word = self.edits.get((episode, step))
        if word is not None:
            middle = len(reply) // 2
            reply = f"{reply[:middle]} {word} {reply[middle:]}"
        return [{"role": "assistant", "content": reply}, {"role": "tool", "content": self.results[episode][step]}]

    def edited(self, episode: int, step: int) -> bool:
        """Whether the request of this step is the first to re-send an edited reply."""
        return (episode, step - 1) in self.edits


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    flags: tuple[str, ...] = ()
    """Extra `tenzro node serve` flags."""
    budget_bytes: int = 0
    """Node and caller cache budget; 0 keeps the config's default."""
    primed: bool = False
    """The oracle: before each request, an untimed request leaves a resume point where the prompt diverges."""


OURS = Mode("ours")
MODES = (OURS, Mode("none", ("--no-reuse",)), Mode("exact", ("--reuse-policy", "exact")),
         Mode("interval-512", ("--reuse-policy", "interval", "--snapshot-interval", "512")),
         Mode("oracle", primed=True))
TABLE_ORDER = ("url", "none", "exact", "interval-512", "ours", "oracle")


def budget_modes(budget_mib: int) -> tuple[Mode, ...]:
    return tuple(Mode(f"ours-{eviction}-{budget_mib}MiB", ("--eviction", eviction), budget_mib * MIB)
                 for eviction in ("value", "lru"))


@dataclass(frozen=True, slots=True)
class Reply:
    text: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    written_tokens: int | None
    """usage.cached_write_tokens (this node's extension): prompt tokens newly stored."""
    completion_tokens: int
    matched_tokens: int | None = None
    """usage.matched_tokens (this node's extension); None from another server."""
    server_ttft_ms: float | None = None
    """usage.server_ttft_ms (this node's extension): TTFT inside the node; None from another server."""


@dataclass(frozen=True, slots=True)
class Sample:
    mode: str
    episode: int
    step: int
    edited: bool
    prompt_tokens: int
    cached_tokens: int
    """Tokens the node reused (usage.prompt_tokens_details.cached_tokens)."""
    ttft_ms: float
    """Client side: request sent to the first streamed content."""
    completion_tokens: int
    reply: str
    server_ttft_ms: float | None = None
    """The node's own TTFT (from /metrics), without HTTP and queueing; None for --url."""
    matched_tokens: int | None = None
    """Prompt tokens agreeing with the caller's stored tokens (from /metrics); None for --url."""
    written_tokens: int | None = None
    """usage.cached_write_tokens, this node's extension: prompt tokens newly stored (as metered)."""
    target_tokens: int | None = None
    """Oracle only: the tokens the oracle reuses, the `ours` node's matched tokens of this request."""

    @property
    def reused_tokens(self) -> int:
        return self.cached_tokens if self.target_tokens is None else self.target_tokens


@dataclass(frozen=True, slots=True)
class ModeRow:
    mode: str
    requests: int
    prompt_tokens: int
    reused_tokens: int
    reused_fraction: float
    of_oracle: float | None
    """Reused tokens over the oracle's; None without an oracle run."""
    prefilled_tokens: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    server_ttft_p50_ms: float | None


@dataclass(frozen=True, slots=True)
class SnapshotMemory:
    """State held at the end of the `ours` run, per token stored (prompts and replies, shared prefixes once)."""

    stored_tokens: int
    cached_bytes: int
    snapshot_bytes: int
    cached_bytes_per_token: float
    snapshot_bytes_per_token: float


@dataclass(frozen=True, slots=True)
class Settings:
    url: str | None
    model: str
    threads: int | None
    device: str | None
    episodes: int
    steps: int
    max_tokens: int
    edit_fraction: float
    seed: int
    budget_mib: int
    modes: tuple[str, ...]


def _reply(streamed: Streamed, base: str) -> Reply:
    usage = streamed.usage
    if "prompt_tokens" not in usage:
        raise BenchError(f"POST {base}/chat/completions streamed no usage "
                         "(the server must honour stream_options.include_usage)")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Reply(streamed.text, streamed.ttft_s, int(usage["prompt_tokens"]), int(cached),
                 usage.get("cached_write_tokens"), int(usage.get("completion_tokens", 0)),
                 usage.get("matched_tokens"), usage.get("server_ttft_ms"))


Primer = Sequence[tuple[Sample, tuple[int, ...]]]
"""The `ours` run's samples, each with its request's prompt ids as that node computed them."""


async def _drive(client: Client, workload: AgentWorkload, mode: Mode, primer: Primer | None = None,
                 prompt_ids: list[tuple[int, ...]] | None = None) -> list[Sample]:
    """Run the workload once; with `primer` (the oracle), prime each request at the `ours` run's matched
    tokens first; with `prompt_ids`, collect each request's prompt ids there (the node's own rendering, with
    its replies as their generated ids: a local rendering cannot know those)."""
    samples: list[Sample] = []
    for episode in range(workload.episodes):
        messages = workload.opening(episode)
        for step in range(workload.steps):
            target = None
            if primer is not None:
                ours, ids = primer[len(samples)]
                target = ours.matched_tokens
                if target is None:
                    raise BenchError("the `ours` node reported no matched tokens: the oracle cannot be primed")
                if target:
                    # Untimed: leaves a resume point at exactly `target`. The node's is one token before a prompt's
                    # end (where an identical prompt resumes), so the primer is one token longer, and that token
                    # differs from the request's: nothing past `target` agrees with it.
                    other = ids[target] - 1 if ids[target] > 0 else 1
                    await client.complete([*ids[:target], other])
            streamed = await client.chat(messages, MAX_TOKENS, token_ids=prompt_ids is not None)
            if prompt_ids is not None:
                if streamed.prompt_ids is None:
                    raise BenchError("the node returned no prompt token ids: the oracle cannot be primed")
                prompt_ids.append(streamed.prompt_ids)
            reply = _reply(streamed, client.base)
            samples.append(Sample(mode.name, episode, step, workload.edited(episode, step), reply.prompt_tokens,
                                  reply.cached_tokens, reply.ttft_s * 1000.0, reply.completion_tokens, reply.text,
                                  reply.server_ttft_ms, reply.matched_tokens, reply.written_tokens, target))
            messages = messages + workload.after_reply(episode, step, reply.text)
        episode_samples = samples[-workload.steps:]
        progress(f"bench agent: {mode.name}, episode {episode + 1}/{workload.episodes}: reused "
                  f"{sum(s.reused_tokens for s in episode_samples)}/{sum(s.prompt_tokens for s in episode_samples)}"
                  f" prompt tokens, median TTFT {statistics.median(s.ttft_ms for s in episode_samples):.0f} ms")
    return samples


def _memory(samples: Sequence[Sample], baseline: dict[str, float], final: dict[str, float]) -> SnapshotMemory:
    """Bytes the workload added (the warm-up's state is the baseline) over the tokens it stored.

    Each request stores its prompt and reply; the tree already held the prompt's first `matched` tokens (no
    prompt of this workload is held whole), so with nothing evicted the stored tokens add up to this sum.
    """
    stored = sum(s.prompt_tokens - (s.matched_tokens or 0) + s.completion_tokens for s in samples)
    cached = round(final[CACHED_BYTES] - baseline[CACHED_BYTES])
    snapshots = round(final[SNAPSHOT_BYTES] - baseline[SNAPSHOT_BYTES])
    return SnapshotMemory(stored, cached, snapshots, cached / max(stored, 1), snapshots / max(stored, 1))


async def _local_mode(session: aiohttp.ClientSession, args: argparse.Namespace, model: Path, workdir: Path,
                      mode: Mode, workload: AgentWorkload, primer: Primer | None = None,
                      prompt_ids: list[tuple[int, ...]] | None = None) -> tuple[str, list[Sample], SnapshotMemory]:
    """One mode on its own fresh node; returns (model id, samples, memory held at the end)."""
    workdir.mkdir()
    node = LocalNode(workdir, str(model), args.threads, args.device, mode.flags)
    if mode.budget_bytes:  # read at start; `keys add` keeps the section
        node.config.write_text(yaml.safe_dump({"cache": {"node_bytes": mode.budget_bytes,
                                                         "caller_bytes": mode.budget_bytes}}))
    progress(f"bench agent: mode {mode.name}: starting a node for '{args.model}' {' '.join(mode.flags)}")
    try:
        with node:
            await node.wait_healthy(session)
            operator_key = node.add_key("bench-operator", "operator")  # for /metrics
            client = await node.client(session)
            await client.complete(PromptSource(SEED).prefix(WARMUP_TOKENS))  # untimed; shares no token with chats
            baseline = await client.metrics(operator_key)
            samples = await _drive(client, workload, mode, primer, prompt_ids)
            memory = _memory(samples, baseline, await client.metrics(operator_key))
    except BenchError as exc:
        raise BenchError(f"mode {mode.name}: {exc}") from exc
    return client.model, samples, memory


@dataclass(frozen=True, slots=True)
class Run:
    settings: Settings
    samples: list[Sample]
    memory: SnapshotMemory | None


async def _run_local(args: argparse.Namespace, workload: AgentWorkload, workdir: Path) -> Run:
    modes = MODES + (budget_modes(args.budget_mib) if args.budget_mib > 0 else ())
    model = model_dir(args.model, workdir / "models")  # every mode's node serves this one directory
    samples: list[Sample] = []
    async with open_session() as session:
        ids: list[tuple[int, ...]] = []
        model_id, ours, memory = await _local_mode(session, args, model, workdir / OURS.name, OURS, workload,
                                                   prompt_ids=ids)
        samples += ours
        for mode in modes[1:]:
            primer = list(zip(ours, ids, strict=True)) if mode.primed else None
            samples += (await _local_mode(session, args, model, workdir / mode.name, mode, workload, primer))[1]
    settings = Settings(None, model_id, args.threads, args.device, args.episodes, args.steps, MAX_TOKENS,
                        EDIT_FRACTION, SEED, args.budget_mib, tuple(m.name for m in modes))
    return Run(settings, samples, memory)


async def _run_url(args: argparse.Namespace, workload: AgentWorkload) -> Run:
    async with open_session() as session:
        client = Client(session, api_base(args.url), args.api_key)
        listed = await client.models()
        client.model = args.model if args.model in listed else listed[0]
        progress(f"bench agent: mode url: model '{client.model}' at {client.base}")
        samples = await _drive(client, workload, Mode("url"))
    settings = Settings(client.base, client.model, None, None, args.episodes, args.steps, MAX_TOKENS,
                        EDIT_FRACTION, SEED, 0, ("url",))
    return Run(settings, samples, None)


GROUP = "agents"
SCOPE_HEADER = "Tenzro-Cache-Scope"


async def _first_turns(session: aiohttp.ClientSession, args: argparse.Namespace, model: Path, workdir: Path,
                       workload: AgentWorkload, group: bool) -> tuple[str, list[Sample]]:
    """The first turn of each of `args.callers` callers, in order, on a fresh node; with `group`, the callers form
    a trust group and share the system prompt in its scope."""
    name = f"callers-{args.callers}" + ("-group" if group else "")
    workdir.mkdir()
    node = LocalNode(workdir, str(model), args.threads, args.device)
    progress(f"bench agent: mode {name}: starting a node for '{args.model}'")
    samples = []
    try:
        with node:
            await node.wait_healthy(session)
            keys = [node.add_key(f"agent-{index}") for index in range(args.callers)]
            if group:  # read by the running node on the next request
                config = yaml.safe_load(node.config.read_text())
                config["groups"] = {GROUP: {"members": [f"agent-{index}" for index in range(args.callers)]}}
                node.config.write_text(yaml.safe_dump(config))
            warm = await node.client(session)
            await warm.complete(PromptSource(SEED).prefix(WARMUP_TOKENS))  # untimed; shares no token with chats
            for index, key in enumerate(keys):
                client = await node.client(session, key, warm.model)
                body: dict[str, Any] = {**client._greedy(MAX_TOKENS), "messages": workload.opening(index)}
                if group:
                    client.headers = {**client.headers, SCOPE_HEADER: "group"}
                    body["prompt_cache_key"] = GROUP
                reply = _reply(await client.stream("/chat/completions", body), client.base)
                samples.append(Sample(name, index, 0, False, reply.prompt_tokens, reply.cached_tokens,
                                      reply.ttft_s * 1000.0, reply.completion_tokens, reply.text,
                                      reply.server_ttft_ms, reply.matched_tokens, reply.written_tokens))
    except BenchError as exc:
        raise BenchError(f"mode {name}: {exc}") from exc
    progress(f"bench agent: {name}: reused {sum(s.cached_tokens for s in samples)}/"
             f"{sum(s.prompt_tokens for s in samples)} prompt tokens, median TTFT "
             f"{statistics.median(s.ttft_ms for s in samples):.0f} ms")
    return warm.model, samples


async def _run_callers(args: argparse.Namespace, workdir: Path) -> Run:
    workload = AgentWorkload(SEED, args.callers, args.steps)
    model = model_dir(args.model, workdir / "models")
    samples: list[Sample] = []
    model_id = ""
    async with open_session() as session:
        for group in (False, True) if args.group else (False,):
            model_id, turns = await _first_turns(session, args, model, workdir / f"group-{group}", workload, group)
            samples += turns
    settings = Settings(None, model_id, args.threads, args.device, args.callers, 1, MAX_TOKENS, 0.0, SEED, 0,
                        tuple(dict.fromkeys(s.mode for s in samples)))
    return Run(settings, samples, None)


def _p90(values: Sequence[float]) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


def summarise(samples: Sequence[Sample]) -> list[ModeRow]:
    names = list(dict.fromkeys(s.mode for s in samples))
    names.sort(key=lambda name: TABLE_ORDER.index(name) if name in TABLE_ORDER else len(TABLE_ORDER))
    oracle = sum(s.reused_tokens for s in samples if s.mode == "oracle") or None
    rows = []
    for name in names:
        mode = [s for s in samples if s.mode == name]
        prompt, reused = sum(s.prompt_tokens for s in mode), sum(s.reused_tokens for s in mode)
        server = [s.server_ttft_ms for s in mode if s.server_ttft_ms is not None]
        rows.append(ModeRow(name, len(mode), prompt, reused, reused / prompt,
                            None if oracle is None else reused / oracle, prompt - reused,
                            statistics.median(s.ttft_ms for s in mode), _p90([s.ttft_ms for s in mode]),
                            statistics.median(server) if server else None))
    return rows


def reply_mismatches(samples: Sequence[Sample]) -> list[str]:
    """Modes whose greedy replies differ from `ours` (or from the first mode), first differing step each."""
    by_mode: dict[str, dict[tuple[int, int], str]] = {}
    for s in samples:
        by_mode.setdefault(s.mode, {})[(s.episode, s.step)] = s.reply
    reference_name = OURS.name if OURS.name in by_mode else next(iter(by_mode), "")
    reference = by_mode.get(reference_name, {})
    found = []
    for name, replies in by_mode.items():
        differing = sorted(key for key in reference if replies.get(key) != reference[key])
        if differing:
            found.append(f"{name} (episode {differing[0][0] + 1}, step {differing[0][1] + 1}: "
                         f"{replies.get(differing[0])!r} vs {reference[differing[0]]!r})")
    return found


def format_table(rows: Sequence[ModeRow], memory: SnapshotMemory | None) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    lines = [("mode", "reused", "of oracle", "prefilled tokens", "TTFT p50 ms", "TTFT p90 ms", "node TTFT p50 ms")]
    lines += [(r.mode, f"{100 * r.reused_fraction:.1f}%",
               "n/a" if r.of_oracle is None else f"{100 * r.of_oracle:.1f}%", str(r.prefilled_tokens),
               ms(r.ttft_p50_ms), ms(r.ttft_p90_ms), ms(r.server_ttft_p50_ms)) for r in rows]
    text = columns(lines)
    if memory is not None:
        text += (f"\nstate held at the end of 'ours': {memory.stored_tokens} tokens stored, "
                 f"{memory.cached_bytes_per_token:.0f} bytes/token in all, "
                 f"{memory.snapshot_bytes_per_token:.0f} bytes/token in snapshots")
    return text


def run_agent_bench(args: argparse.Namespace) -> int:
    try:
        if args.episodes < 1 or args.steps < 2 or args.budget_mib < 0 or args.threads < 1 or args.callers < 0:
            raise BenchError("--episodes and --threads must be at least 1, --steps at least 2 (a reply must be "
                             "re-sent), --budget-mib 0 (off) or more")
        if args.group and not args.callers:
            raise BenchError("--group compares first turns of several callers: give --callers too")
        if args.callers and args.url:
            raise BenchError("--callers runs local nodes of its own; it does not take --url")
        workload = AgentWorkload(SEED, args.episodes, args.steps)
        if args.callers:
            with tempfile.TemporaryDirectory(prefix="tenzro-bench-agent-") as workdir:
                run = asyncio.run(_run_callers(args, Path(workdir)))
        elif args.url:
            run = asyncio.run(_run_url(args, workload))
        else:
            with tempfile.TemporaryDirectory(prefix="tenzro-bench-agent-") as workdir:
                run = asyncio.run(_run_local(args, workload, Path(workdir)))
    except BenchError as exc:
        return failed(exc)
    rows = summarise(run.samples)
    mismatches = reply_mismatches(run.samples)
    print(format_table(rows, run.memory))
    write_report(Path(args.out), run.settings, rows, run.samples,
                 snapshot_memory=None if run.memory is None else asdict(run.memory),
                 replies_identical=not mismatches)
    if mismatches:
        print("tenzro: error: greedy replies differ between modes, so reuse changed the output: "
              + "; ".join(mismatches), file=sys.stderr)
        return 1
    return 0


def add_agent_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tenzro bench agent` under the `bench` subcommands."""
    agent = bench.add_parser("agent", help="an agent workload: reused tokens and TTFT per reuse policy")
    add_server_arguments(agent, "hybrid", "local: a model directory or a `models init --arch` name (built at default "
                         "size); with --url, measured as the one mode")
    agent.add_argument("--episodes", type=int, default=3)
    agent.add_argument("--steps", type=int, default=10)
    agent.add_argument("--budget-mib", type=int, default=0,
                       help="also compare eviction policies (value vs lru) under this node budget; 48 shows "
                            "the difference on the default hybrid models")
    agent.add_argument("--callers", type=int, default=0,
                       help="measure the first turns of this many callers sharing one system prompt instead")
    agent.add_argument("--group", action="store_true",
                       help="with --callers: also with the callers in one trust group sharing the system prompt")
    agent.add_argument("--out", default="bench-results/agent.json")
    agent.set_defaults(func=run_agent_bench)
