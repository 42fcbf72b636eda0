"""`tenzro bench scenarios`: token-exact reuse scenarios, as token ids and as chat messages.

Issue 4's three: (a) a cached history extended by 40 tokens; (b) the same history with one token (chat: one
message) changed 200 tokens before the end; (c) a 1,200-token system prompt shared by three requests with
different tails. Issue 34's two, where hybrids lost what dense models keep: (d) a retry, the identical prompt
sent again, whose last message is a 2,000-token document (it must recompute only its last token); (e) one token
(chat: one word) changed 95% of the way into a 1,000-token system prompt (it must keep at least 80% of the
tokens before the edit).
For each measured request: the tokens the node recomputed (usage: prompt_tokens - cached_tokens), the
ideal, the least any node could recompute (everything after the point of divergence), and TTFT reused
against cold. Every scenario of every run has fresh random content and, on a local node, its own caller,
so nothing of an earlier run can help a later one.

Locally, cold is the same prompt on a second node started with --no-reuse. With --url it is a fresh prompt of
the same length on that server, and `--model` names the model whose tokenizer renders the chat form here.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from bench.chat import ChatMessages, load_tokenizer
from bench.client import BenchError, Client, Messages, Timing, add_server_arguments, open_session
from bench.local_node import LocalNode, model_dir
from bench.prompts import SEED, PromptSource
from bench.report import Target, columns, failed, progress, write_report
from cache.radix_tree import common_prefix_length
from cache.snapshot_policy import SnapshotPolicy

HISTORY = 1460
"""(a): the cached prompt; the extended one is HISTORY + EXTENSION, the history of (b)."""
EXTENSION = 40
EDIT_FROM_END = 200
SYSTEM = 1200
TAIL = 200
DOCUMENT = 2000
"""(d): the last message of the retried prompt."""
LATE_SYSTEM = 1000
LATE_EDIT = 0.95
"""(e): the system prompt, and how far into it the edit lies."""
KEPT_BEFORE_EDIT = 0.8
"""(e): the least share of the tokens before the edit that must be reused."""

Prompt = list[int] | Messages
"""Token ids, sent to /v1/completions, or chat messages, sent to /v1/chat/completions."""


@dataclass(frozen=True, slots=True)
class Sent:
    """A request of this scenario that the node has seen."""

    ids: tuple[int, ...]
    messages: Messages | None
    reply: tuple[int, ...]
    """The generated token ids when known: the node stores them after the prompt."""


def divergence_recompute(ids: Sequence[int], earlier: Sequence[Sent]) -> int:
    """What a node able to resume at any token recomputes: everything after the longest prefix shared with
    what it has seen, and always at least one token, whose logits choose the first output token."""
    shared = max((common_prefix_length(sent.ids + sent.reply, tuple(ids)) for sent in earlier), default=0)
    return len(ids) - min(shared, len(ids) - 1)


def shared_messages(messages: Messages, earlier: Sequence[Sent]) -> int:
    """How many leading messages `messages` has in common with the earlier request sharing the most."""
    best = 0
    for sent in earlier:
        count = 0
        for mine, theirs in zip(messages, sent.messages or [], strict=False):
            if mine != theirs:
                break
            count += 1
        best = max(best, count)
    return best


@dataclass(frozen=True, slots=True)
class Sample:
    form: str
    """"text" (token ids, no message structure) or "chat" (messages)."""
    scenario: str
    run: int
    prompt_tokens: int
    recomputed: int
    """prompt_tokens - usage.prompt_tokens_details.cached_tokens."""
    ideal: int
    """text: everything after the divergence; chat: the new or edited messages and the generation prompt."""
    divergence: int
    """The least any node recomputes: everything after the prefix shared with what it has seen."""
    limit: int | None
    """The most the issue expects to be recomputed; None when it sets no bound (snapshot interval 0)."""
    no_reuse_recomputed: int
    reused_ttft_ms: float
    cold_ttft_ms: float


@dataclass
class ScenarioRun:
    """One scenario of one run: its caller's clients, the requests it sent, and what it measured."""

    form: str
    run: int
    reused: Client
    cold: Client | None
    """The --no-reuse node, sent the very prompt that is measured; None: cold is a fresh prompt of the same
    length sent to `reused` (a server measured by URL)."""
    source: PromptSource
    chat: ChatMessages | None
    interval: int
    samples: list[Sample]
    sent: list[Sent] = field(default_factory=list)

    def _request(self, prompt: Prompt) -> tuple[list[int], Messages | None]:
        """The token ids the node computes for `prompt`, and its messages in the chat form."""
        if self.form == "text":
            return cast(list[int], prompt), None
        assert self.chat is not None
        messages = cast(Messages, prompt)
        return self.chat.ids(messages), messages

    async def prime(self, prompt: Prompt) -> tuple[int, ...]:
        """Send `prompt` untimed, so that the node holds its state; returns the generated token ids."""
        ids, messages = self._request(prompt)
        body: dict[str, Any] = {"model": self.reused.model, "max_tokens": 1, "temperature": 0,
                                "return_token_ids": True}
        body.update({"prompt": ids} if messages is None else {"messages": messages})
        answer = await self.reused.post("/completions" if messages is None else "/chat/completions", body)
        rendered = answer.get("prompt_token_ids")
        if rendered is not None and rendered != ids:
            raise BenchError("the server's prompt tokens differ from the bench's rendering of the same messages: "
                             "--model must name the model the server serves")
        reply = tuple(int(t) for t in answer["choices"][0].get("token_ids") or ())
        self.sent.append(Sent(tuple(ids), messages, reply))
        return reply

    @staticmethod
    async def _timed(client: Client, ids: list[int], messages: Messages | None) -> Timing:
        timing = await client.complete(ids) if messages is None else (await client.chat(messages)).timing()
        if timing.prompt_tokens != len(ids) or timing.cached_tokens is None:
            raise BenchError(f"the server reported prompt_tokens={timing.prompt_tokens} (expected {len(ids)}) and "
                             f"cached_tokens={timing.cached_tokens}: token-exact scenarios need both")
        return timing

    def _ideal(self, ids: list[int], messages: Messages | None) -> int:
        if messages is None:
            return divergence_recompute(ids, self.sent)
        assert self.chat is not None
        kept = self.chat.history_ids(messages[:shared_messages(messages, self.sent)])
        if ids[:len(kept)] != kept:
            raise BenchError("this chat template does not render a conversation's first messages as a prefix "
                             "of the whole: there is no message boundary to measure against")
        return len(ids) - len(kept)

    def grid_gap(self, position: int) -> int | None:
        """Tokens between `position` and the deepest point of the node's resume grid at or before it
        (`SnapshotPolicy.grid`): what a first divergence there may cost over the ideal; None: no grid."""
        if not self.interval:
            return None
        return position - max((0, *SnapshotPolicy.named("ours", self.interval).grid(position)))

    async def measure(self, scenario: str, prompt: Prompt, allowance: int | None,
                      kept: float | None = None) -> None:
        """A timed request; `allowance`: tokens over the ideal the issue allows (None: no bound); `kept`: instead,
        the least share of the tokens before the divergence that must be reused."""
        ids, messages = self._request(prompt)
        ideal, divergence = self._ideal(ids, messages), divergence_recompute(ids, self.sent)
        if kept is not None:
            before = len(ids) - divergence
            ideal, allowance = divergence, before - int(kept * before)
        reused = await self._timed(self.reused, ids, messages)
        if self.cold is not None:
            cold = await self._timed(self.cold, ids, messages)
        else:
            cold = await self._timed(self.reused, self.source.prefix(len(ids)), None)
        assert reused.cached_tokens is not None and cold.cached_tokens is not None
        self.sent.append(Sent(tuple(ids), messages, ()))
        sample = Sample(self.form, scenario, self.run, len(ids), len(ids) - reused.cached_tokens, ideal, divergence,
                        None if allowance is None else ideal + allowance, len(ids) - cold.cached_tokens,
                        reused.ttft_s * 1000.0, cold.ttft_s * 1000.0)
        self.samples.append(sample)
        progress(f"bench: {self.form} {scenario} run {self.run + 1}: recomputed {sample.recomputed} of "
                  f"{sample.prompt_tokens} (ideal {ideal}); TTFT {sample.reused_ttft_ms:.1f} ms reused, "
                  f"{sample.cold_ttft_ms:.1f} ms cold")


async def text_extended(s: ScenarioRun) -> None:
    history = s.source.prefix(HISTORY)
    reply = await s.prime(history)
    # The extension replaces the stored reply: it resumes at the prompt's retry point, one token before its end.
    await s.measure("a", history + s.source.suffix(EXTENSION, unlike=reply[:1]), 1)


async def text_edited(s: ScenarioRun) -> None:
    history = s.source.prefix(HISTORY + EXTENSION)
    await s.prime(history)
    at = len(history) - EDIT_FROM_END
    edited = history[:at] + s.source.suffix(1, unlike=(history[at],)) + history[at + 1:]
    await s.measure("b", edited, s.grid_gap(at))


async def text_shared(s: ScenarioRun) -> None:
    system = s.source.prefix(SYSTEM)
    tails = [s.source.suffix(TAIL)]
    await s.prime(system + tails[0])
    for scenario, allowance in (("c2", s.grid_gap(SYSTEM)), ("c3", 0)):
        tail = s.source.suffix(TAIL)
        while tail[0] in {t[0] for t in tails}:  # the tails diverge at their first token
            tail = s.source.suffix(TAIL)
        tails.append(tail)
        await s.measure(scenario, system + tail, allowance)


async def text_retried(s: ScenarioRun) -> None:
    history = s.source.prefix(DOCUMENT + 100)
    await s.prime(history)
    await s.measure("d", history, 0)


async def text_late_edit(s: ScenarioRun) -> None:
    system, tail = s.source.prefix(LATE_SYSTEM), s.source.suffix(60)
    await s.prime(system + tail)
    at = int(LATE_SYSTEM * LATE_EDIT)
    await s.measure("e", system[:at] + s.source.suffix(1, unlike=(system[at],)) + system[at + 1:] + tail, None,
                    kept=KEPT_BEFORE_EDIT)


async def chat_extended(s: ScenarioRun) -> None:
    """Two messages, 40 tokens with the generation prompt, appended to a conversation of 1,460 tokens."""
    assert s.chat is not None
    m, gen = s.chat.message, s.chat.generation_prompt
    history = [m("system", SYSTEM), m("user", 120), m("assistant", 70), m("user", HISTORY - SYSTEM - 190 - gen)]
    await s.prime(history)
    await s.measure("a", history + [m("assistant", 20), m("user", EXTENSION - 20 - gen)], 0)


async def chat_edited(s: ScenarioRun) -> None:
    """One word edited in the message that starts 200 tokens (with the generation prompt) before the end."""
    assert s.chat is not None
    m, gen = s.chat.message, s.chat.generation_prompt
    history = [m("system", SYSTEM), m("user", 60), m("assistant", 40), m("user", 110), m("assistant", 50),
               m("user", EDIT_FROM_END - 160 - gen)]
    await s.prime(history)
    await s.measure("b", history[:3] + [s.chat.edited(history[3])] + history[4:], 0)


async def chat_shared(s: ScenarioRun) -> None:
    assert s.chat is not None
    m, gen = s.chat.message, s.chat.generation_prompt
    system = m("system", SYSTEM)
    await s.prime([system, m("user", TAIL - gen)])
    for scenario in ("c2", "c3"):
        await s.measure(scenario, [system, m("user", TAIL - gen)], 0)


async def chat_retried(s: ScenarioRun) -> None:
    """The identical conversation sent again: a short system prompt, then a 2,000-token document."""
    assert s.chat is not None
    history = [s.chat.message("system", 100), s.chat.message("user", DOCUMENT)]
    await s.prime(history)
    await s.measure("d", history, 0)


async def chat_late_edit(s: ScenarioRun) -> None:
    """One word changed 95% of the way into a 1,000-token system prompt, the question after it the same."""
    assert s.chat is not None
    history = [s.chat.message("system", LATE_SYSTEM), s.chat.message("user", 60)]
    await s.prime(history)
    await s.measure("e", [s.chat.edited(history[0], at=LATE_EDIT), history[1]], None, kept=KEPT_BEFORE_EDIT)


Scenario = Callable[[ScenarioRun], Awaitable[None]]
SCENARIOS: tuple[tuple[str, str, Scenario], ...] = (
    ("text", "a", text_extended), ("text", "b", text_edited), ("text", "c", text_shared),
    ("text", "d", text_retried), ("text", "e", text_late_edit),
    ("chat", "a", chat_extended), ("chat", "b", chat_edited), ("chat", "c", chat_shared),
    ("chat", "d", chat_retried), ("chat", "e", chat_late_edit),
)
DESCRIPTIONS = {
    "a": f"{HISTORY} cached, +{EXTENSION}",
    "b": f"edit {EDIT_FROM_END} before end",
    "c2": f"shared {SYSTEM}, 2nd tail",
    "c3": f"shared {SYSTEM}, 3rd tail",
    "d": f"retry, {DOCUMENT}-token last message",
    "e": f"edit {LATE_EDIT:.0%} into {LATE_SYSTEM}",
}


@dataclass(frozen=True, slots=True)
class Settings(Target):
    snapshot_interval: int | None
    """The local node's --snapshot-interval; None when measuring --url."""
    runs: int
    seed: int
    cold: str
    """Where cold TTFT comes from: "no-reuse node" (the same prompt) or "fresh prompt" (same length)."""
    chat: bool
    """Whether the chat form ran (it needs the model's tokenizer here)."""


@dataclass(frozen=True, slots=True)
class Row:
    form: str
    scenario: str
    description: str
    prompt_tokens: tuple[int, ...]
    """Per run, in run order; so are the counts below."""
    recomputed: tuple[int, ...]
    ideal: tuple[int, ...]
    divergence: tuple[int, ...]
    limit: tuple[int | None, ...]
    within: bool | None
    """Every run recomputed at most its limit; None when no run has one."""
    no_reuse_recomputed: tuple[int, ...]
    cold_ttft_ms: float
    reused_ttft_ms: float
    ratio: float
    """Median reused TTFT over median cold TTFT."""


def summarise(samples: list[Sample]) -> list[Row]:
    keys = list(dict.fromkeys((s.form, s.scenario) for s in samples))
    rows = []
    for form, scenario in keys:
        runs = [s for s in samples if (s.form, s.scenario) == (form, scenario)]
        limited = [s for s in runs if s.limit is not None]
        cold = statistics.median(s.cold_ttft_ms for s in runs)
        reused = statistics.median(s.reused_ttft_ms for s in runs)
        rows.append(Row(form, scenario, DESCRIPTIONS[scenario], tuple(s.prompt_tokens for s in runs),
                        tuple(s.recomputed for s in runs), tuple(s.ideal for s in runs),
                        tuple(s.divergence for s in runs), tuple(s.limit for s in runs),
                        all(s.limit is not None and s.recomputed <= s.limit for s in limited) if limited else None,
                        tuple(s.no_reuse_recomputed for s in runs), cold, reused, reused / cold))
    return rows


def _span(values: tuple[int | None, ...]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    return str(known[0]) if min(known) == max(known) else f"{min(known)}-{max(known)}"


def format_table(rows: list[Row]) -> str:
    lines = [("form", "scenario", "", "prompt", "recomputed", "ideal", "divergence", "at most", "within",
              "no-reuse", "cold TTFT ms", "reused TTFT ms", "reused/cold")]
    lines += [(r.form, r.scenario, r.description, _span(r.prompt_tokens), _span(r.recomputed), _span(r.ideal),
               _span(r.divergence), _span(r.limit), {True: "yes", False: "NO", None: "-"}[r.within],
               _span(r.no_reuse_recomputed), f"{r.cold_ttft_ms:.1f}", f"{r.reused_ttft_ms:.1f}", f"{r.ratio:.3f}")
              for r in rows]
    return columns(lines, left=3)


async def _bench(args: argparse.Namespace, tokenizer: Any | None,
                 nodes: tuple[LocalNode, LocalNode] | None) -> tuple[Settings, list[Sample]]:
    async with open_session() as session:
        if nodes is None:
            main = await Client.connect(session, args.url, args.api_key)
            cold = None
        else:
            progress(f"bench: starting a reusing and a --no-reuse node for model '{args.model}'")
            await asyncio.gather(*(node.wait_healthy(session) for node in nodes))
            main = await nodes[0].client(session)
            cold = await nodes[1].client(session, model=main.model)
        source = PromptSource(SEED)
        chat = ChatMessages(tokenizer, random.Random(SEED)) if tokenizer is not None else None
        if chat is None:
            progress(f"bench: no tokenizer for '{args.model}' here: the chat form is left out")
        local = nodes is not None
        settings = Settings(url=main.base, model=main.model, local=local, threads=args.threads if local else None,
                            device=args.device if local else None,
                            snapshot_interval=args.snapshot_interval if local else None, runs=args.runs, seed=SEED,
                            cold="no-reuse node" if local else "fresh prompt", chat=chat is not None)
        warm = source.prefix(HISTORY + EXTENSION)
        for client in (main, cold) if cold is not None else (main,):
            await client.complete(warm)  # untimed: loads and warms everything
        samples: list[Sample] = []
        for run in range(args.runs):
            for form, name, scenario in SCENARIOS:
                if form == "chat" and chat is None:
                    continue
                reused = main
                if nodes is not None:  # a caller of its own: a scope no earlier scenario or run touched
                    reused = Client(session, main.base, nodes[0].add_key(f"run{run}-{form}-{name}"), main.model)
                await scenario(ScenarioRun(form, run, reused, cold, source, chat, args.snapshot_interval, samples))
        return settings, samples


def _url_tokenizer(model: str, workdir: Path) -> Any | None:
    """The tokenizer that renders the chat form for a server measured by URL, when `--model` names a model
    here (a directory or an architecture, built into `workdir`); else None."""
    try:
        return load_tokenizer(model_dir(model, workdir))
    except BenchError:
        return None


def _run(args: argparse.Namespace) -> tuple[Settings, list[Sample]]:
    with tempfile.TemporaryDirectory(prefix="tenzro-scenarios-") as workdir:
        if args.url:
            return asyncio.run(_bench(args, _url_tokenizer(args.model, Path(workdir)), None))
        model = model_dir(args.model, Path(workdir))  # built once, before the nodes look for it
        tokenizer = load_tokenizer(model)
        if tokenizer is None:
            raise BenchError(f"{model} has no tokenizer (tokenizer.json or tokenizer_config.json)")
        nodes = []
        for name, extra in (("reuse", ("--snapshot-interval", str(args.snapshot_interval))), ("cold", ("--no-reuse",))):
            directory = Path(workdir) / name
            directory.mkdir()
            nodes.append(LocalNode(directory, str(model), args.threads, args.device, extra=extra))
        with ExitStack() as running:
            for node in nodes:
                running.enter_context(node)
            return asyncio.run(_bench(args, tokenizer, (nodes[0], nodes[1])))


def run_scenarios_bench(args: argparse.Namespace) -> int:
    try:
        if args.runs < 1 or args.threads < 1 or args.snapshot_interval < 0:
            raise BenchError("--runs and --threads must be at least 1, --snapshot-interval at least 0")
        settings, samples = _run(args)
    except BenchError as exc:
        return failed(exc)
    rows = summarise(samples)
    print(format_table(rows))
    write_report(Path(args.out), settings, rows, samples)
    return 0


def add_scenarios_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tenzro bench scenarios` under the `bench` subcommands."""
    scenarios = bench.add_parser("scenarios", help="token-exact recompute scenarios on a hybrid model")
    add_server_arguments(scenarios, "granite-moe-hybrid", "local: a model directory or a `models init --arch` name "
                         "(built at default size); with --url, the model whose tokenizer renders the chat form here")
    scenarios.add_argument("--snapshot-interval", type=int, default=128)
    scenarios.add_argument("--runs", type=int, default=3)
    scenarios.add_argument("--out", default="bench-results/scenarios.json")
    scenarios.set_defaults(func=run_scenarios_bench)
