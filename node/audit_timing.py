"""`tenzro audit timing`: whether one caller can tell, from time to first token, what another caller sent.

The node keeps prompt state per caller (per API key). Caller B must get no reuse from caller A's state, and
B's time to first token must not depend on whether A just sent the same prompt. Each trial runs four
conditions in a random order, each on fresh prompts, timed as a client sees them (HTTP and SSE):

- cross-caller "cached": A sends P (untimed), then B sends P (timed);
- cross-caller "not-cached": A sends another prompt Q (untimed, so A's activity is the same), then B sends P;
- own-caller "hit": A sends P (untimed), then A sends P again (timed);
- own-caller "miss": A sends P once (timed).

A two-sample Kolmogorov-Smirnov test compares each pair. The own-caller pair is the positive control: the
same harness must tell A's own reuse apart, or its silence about B says nothing.

With `--group`, A is a member of a trust group and B is not: every prompt is sent as a chat's system message,
A's shared in the group's scope (`Tenzro-Cache-Scope: group`), B's kept nowhere (retention none, so that B's own
earlier requests give it no hit on the template's opening tokens). The cross-caller pair then asks whether a
non-member can tell that a member just wrote a prompt into the group's scope.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.report import Target, columns

if TYPE_CHECKING:
    from bench.client import Client, Timing
    from bench.prompts import PromptSource

    Probe = Callable[[Client, Client, PromptSource, int], Awaitable[Timing]]
    """Runs one condition on fresh prompts of a length: (caller A, caller B, prompts, length) -> timing."""

ALPHA = 0.01
MIN_SAMPLES = 5
"""With 4 samples a side, even fully separated samples (D = 1) give p = 0.011 > ALPHA: no test could reject."""
WARMUP_TRIALS = 1
KOLMOGOROV_TERMS = 100
KOLMOGOROV_SERIES_SWITCH = 1.0
"""Below this lambda the alternating series cancels over many terms; the theta form converges in a few."""


def kolmogorov_q(lam: float) -> float:
    """Q_KS(lambda) = P(K > lambda) for Kolmogorov's K: 2 sum_{j>=1} (-1)^(j-1) exp(-2 j^2 lambda^2).

    For small lambda the same function is computed through Jacobi's theta identity,
    1 - sqrt(2 pi) / lambda * sum_{j>=1} exp(-(2j-1)^2 pi^2 / (8 lambda^2)), whose terms fall fast there.
    """
    if lam <= 0.0:
        return 1.0
    if lam < KOLMOGOROV_SERIES_SWITCH:
        total = 0.0
        for j in range(1, KOLMOGOROV_TERMS + 1):
            x = (2 * j - 1) * math.pi / lam  # x * x, not x ** 2: a float power overflows with an error
            total += math.exp(-x * x / 8.0)
        q = 1.0 - math.sqrt(2.0 * math.pi) / lam * total
    else:
        q = 2.0 * sum((-1) ** (j - 1) * math.exp(-2.0 * j * j * lam * lam)
                      for j in range(1, KOLMOGOROV_TERMS + 1))
    return min(1.0, max(0.0, q))


def ks_two_sample(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(D, p): the exact two-sample Kolmogorov-Smirnov statistic and its asymptotic p-value.

    D = max_t |F_x(t) - F_y(t)| over the empirical distribution functions, evaluated after all values tied
    at t on both sides. p = Q_KS((sqrt(ne) + 0.12 + 0.11 / sqrt(ne)) * D) with ne = n m / (n + m), Stephens'
    small-sample correction as in Numerical Recipes.
    """
    if not x or not y:
        raise ValueError("both samples must be non-empty")
    xs, ys = sorted(x), sorted(y)
    n, m = len(xs), len(ys)
    i = j = 0
    widest = 0  # max |i m - j n|: D times n m, in integers so that equal fractions compare exactly
    while i < n and j < m:
        value = min(xs[i], ys[j])
        while i < n and xs[i] == value:
            i += 1
        while j < m and ys[j] == value:
            j += 1
        widest = max(widest, abs(i * m - j * n))
    d = widest / (n * m)
    root_ne = math.sqrt(n * m / (n + m))
    return d, kolmogorov_q((root_ne + 0.12 + 0.11 / root_ne) * d)


async def _b_after_a_same(a: Client, b: Client, source: PromptSource, length: int) -> Timing:
    prompt = source.prefix(length)
    await a.complete(prompt)
    return await b.complete(prompt)


async def _b_after_a_other(a: Client, b: Client, source: PromptSource, length: int) -> Timing:
    await a.complete(source.prefix(length))
    return await b.complete(source.prefix(length))


async def _a_repeat(a: Client, b: Client, source: PromptSource, length: int) -> Timing:
    prompt = source.prefix(length)
    await a.complete(prompt)
    return await a.complete(prompt)


async def _a_first(a: Client, b: Client, source: PromptSource, length: int) -> Timing:
    return await a.complete(source.prefix(length))


@dataclass(frozen=True, slots=True)
class Condition:
    name: str
    caller: str
    """The caller whose request is timed: "A" or "B"."""
    probe: Probe


CONDITIONS = (Condition("cached", "B", _b_after_a_same), Condition("not-cached", "B", _b_after_a_other),
              Condition("hit", "A", _a_repeat), Condition("miss", "A", _a_first))


@dataclass(frozen=True, slots=True)
class Comparison:
    test: str
    with_state: str
    """The condition in which the timed prompt's state was just stored (by A)."""
    without_state: str
    must_differ: bool
    """True for the positive control, which must reject; False for the leak test, which must not."""


COMPARISONS = (Comparison("cross-caller", "cached", "not-cached", must_differ=False),
               Comparison("own-caller", "hit", "miss", must_differ=True))


@dataclass(frozen=True, slots=True)
class Settings(Target):
    samples: int
    length: int
    seed: int
    alpha: float
    group: bool = False
    """A a member of a trust group writing into its scope, B a non-member (`--group`)."""


AUDIT_GROUP = "audit"
QUESTION = "Go on."
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def prompt_text(prompt: list[int]) -> str:
    """Words standing for `prompt`'s ids one to one (each id written in base 26): prompts that share no first id
    share no first word, and the same ids are always the same text."""
    words = []
    for token in prompt:
        word = ""
        while True:
            token, digit = divmod(token, len(LETTERS))
            word += LETTERS[digit]
            if not token:
                break
        words.append(word)
    return " ".join(words)


def system_prompt_client(client: Client, member: bool) -> Client:
    """`client` sending each prompt as a chat's system message (`prompt_text`): shared in its caller's trust group
    when `member`, else kept nowhere."""
    from bench.client import Client

    class SystemPromptClient(Client):
        async def complete(self, prompt: list[int]) -> Timing:
            body: dict[str, Any] = {**self._greedy(1), "messages": [{"role": "system", "content": prompt_text(prompt)},
                                                                    {"role": "user", "content": QUESTION}]}
            if member:
                body["prompt_cache_key"] = AUDIT_GROUP
            else:
                body["prompt_cache_retention"] = "none"
            return (await self.stream("/chat/completions", body)).timing()

    shaped = SystemPromptClient(client.session, client.base, None, client.model)
    shaped.headers = {**client.headers, **({"Tenzro-Cache-Scope": "group"} if member else {})}
    shaped.ssl = client.ssl
    return shaped


@dataclass(frozen=True, slots=True)
class Sample:
    trial: int
    order: int
    """Position of this condition within its trial, from 0."""
    condition: str
    caller: str
    ttft_ms: float
    prompt_tokens: int | None
    cached_tokens: int | None
    """usage.prompt_tokens_details.cached_tokens of the timed request; None when the server reports none."""


@dataclass(frozen=True, slots=True)
class Row:
    test: str
    with_state: str
    without_state: str
    samples: int
    with_state_median_ms: float
    without_state_median_ms: float
    d: float
    p: float
    rejects: bool
    """p < alpha: the two TTFT distributions differ."""
    passed: bool
    """rejects == must_differ."""


@dataclass(frozen=True, slots=True)
class Verdict:
    rows: tuple[Row, ...]
    b_requests: int
    b_cached_requests: int
    """B's timed requests whose cached_tokens was not 0 (including unreported): each one is a failure."""
    failures: tuple[str, ...]


async def run_trials(a: Client, b: Client, source: PromptSource, samples: int, length: int,
                     seed: int) -> list[Sample]:
    """`samples` trials of every condition, each trial's conditions in a random order seeded by `seed`,
    after WARMUP_TRIALS untimed ones that load and warm what the first trial would otherwise pay for."""
    from bench.report import progress

    order_rng = random.Random(f"audit-timing-order-{seed}")  # a stream of its own, apart from the prompts'
    results: list[Sample] = []
    for trial in range(-WARMUP_TRIALS, samples):
        conditions = list(CONDITIONS)
        order_rng.shuffle(conditions)
        for order, condition in enumerate(conditions):
            timing = await condition.probe(a, b, source, length)
            if trial >= 0:
                results.append(Sample(trial, order, condition.name, condition.caller, timing.ttft_s * 1000.0,
                                      timing.prompt_tokens, timing.cached_tokens))
        if trial >= 0:
            progress(f"audit: trial {trial + 1}/{samples}: " + ", ".join(
                f"{s.condition} {s.ttft_ms:.1f} ms" for s in results if s.trial == trial))
    return results


def judge(samples: Sequence[Sample], alpha: float = ALPHA) -> Verdict:
    ttfts: dict[str, list[float]] = {}
    for sample in samples:
        ttfts.setdefault(sample.condition, []).append(sample.ttft_ms)
    rows = []
    failures = []
    for comparison in COMPARISONS:
        with_state, without_state = ttfts[comparison.with_state], ttfts[comparison.without_state]
        d, p = ks_two_sample(with_state, without_state)
        rejects = p < alpha
        row = Row(comparison.test, comparison.with_state, comparison.without_state, len(with_state),
                  statistics.median(with_state), statistics.median(without_state), d, p, rejects,
                  rejects == comparison.must_differ)
        rows.append(row)
        if not row.passed and comparison.must_differ:
            failures.append(f"{row.test}: the audit cannot tell A's own cache hits from misses (p = {p:.3g} >= "
                            f"{alpha}), so it could not see a leak either; use a longer --length or more --samples")
        elif not row.passed:
            failures.append(f"{row.test}: B's time to first token depends on whether A sent the same prompt "
                            f"(p = {p:.3g} < {alpha}): a timing side channel between callers")
    b_samples = [s for s in samples if s.caller == "B"]
    b_cached = sum(1 for s in b_samples if s.cached_tokens != 0)
    if b_cached:
        failures.append(f"caller B was reported cached tokens (or none reported) in {b_cached} of "
                        f"{len(b_samples)} requests: B must reuse nothing of A's prompt state")
    return Verdict(tuple(rows), len(b_samples), b_cached, tuple(failures))


def format_table(verdict: Verdict) -> str:
    lines = [("test", "compared", "samples", "median ms", "median ms", "D", "p", "verdict")]
    for r in verdict.rows:
        outcome = "differ" if r.rejects else "same"
        lines.append((r.test, f"{r.with_state} vs {r.without_state}", str(r.samples),
                      f"{r.with_state_median_ms:.1f}", f"{r.without_state_median_ms:.1f}", f"{r.d:.3f}",
                      f"{r.p:.3g}", f"{outcome}: {'pass' if r.passed else 'FAIL'}"))
    return (columns(lines, left=2) + f"\ncaller B: cached tokens not 0 in {verdict.b_cached_requests} of "
            f"{verdict.b_requests} requests: {'FAIL' if verdict.b_cached_requests else 'pass'}")


async def _audit(args: argparse.Namespace, seed: int) -> tuple[Settings, list[Sample]]:
    from bench.client import Client, open_session
    from bench.local_node import LocalNode
    from bench.prompts import PromptSource
    from bench.report import progress

    async def trials(a: Client, b: Client, settings: Settings) -> list[Sample]:
        progress(f"audit: model '{a.model}' at {a.base}: {settings.samples} trials of {settings.length}-token "
                 f"prompts, seed {settings.seed}" + (", A a member of a trust group, B not" if args.group else ""))
        if args.group:
            a, b = system_prompt_client(a, member=True), system_prompt_client(b, member=False)
        return await run_trials(a, b, PromptSource(seed), settings.samples, settings.length, seed)

    async with open_session() as session:
        if args.url:
            a = await Client.connect(session, args.url, args.key_a, args.model)
            b = Client(session, a.base, args.key_b, a.model)
            settings = Settings(a.base, a.model, False, None, None, args.samples, args.length, seed, ALPHA,
                                args.group)
            return settings, await trials(a, b, settings)
        with (tempfile.TemporaryDirectory(prefix="tenzro-audit-") as workdir,
              LocalNode(Path(workdir), args.model or "default", args.threads, args.device) as node):
            progress(f"audit: starting a local node for model '{node.model}' on {node.root}")
            await node.wait_healthy(session)
            a = await node.client(session, node.add_key("audit-a"))
            b = await node.client(session, node.add_key("audit-b"), a.model)
            if args.group:
                from node.config import Group, load_config, save_config

                config = load_config(node.config)
                save_config(node.config, replace(config, groups=(Group(AUDIT_GROUP, ("audit-a",)),)))
            settings = Settings(a.base, a.model, True, args.threads, args.device, args.samples, args.length,
                                seed, ALPHA, args.group)
            return settings, await trials(a, b, settings)


def run_timing_audit(args: argparse.Namespace) -> int:
    """0 when B's TTFT is indistinguishable, A's own reuse is detected and B reused nothing; 1 when a check
    fails; 2 when the audit cannot run."""
    # Imported here, not at the top: every `tenzro` command builds this module's parser, and the light ones
    # (`keys add`, `metering verify`) should not pay for loading aiohttp.
    from bench.client import BenchError
    from bench.report import failed, write_report

    try:
        if args.samples < MIN_SAMPLES:
            raise BenchError(f"--samples must be at least {MIN_SAMPLES}: with fewer, even fully separated "
                             f"samples do not reach p < {ALPHA}")
        if args.length < 2:
            raise BenchError("--length must be at least 2: a one-token prompt leaves nothing to reuse")
        if args.url and not (args.key_a and args.key_b):
            raise BenchError("--url needs --key-a and --key-b: API keys of two different callers")
        if not args.url and (args.key_a or args.key_b):
            raise BenchError("--key-a and --key-b are for --url; a local node makes its own caller keys")
        # Fresh by default: a server that kept its cache from an earlier run with the same seed would
        # have B's own prompts cached.
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
        settings, samples = asyncio.run(_audit(args, seed))
    except BenchError as exc:
        return failed(exc)
    verdict = judge(samples, settings.alpha)
    print(format_table(verdict))
    write_report(Path(args.out), settings, verdict.rows, samples, b_requests=verdict.b_requests,
                 b_cached_requests=verdict.b_cached_requests, failures=list(verdict.failures),
                 passed=not verdict.failures)
    for failure in verdict.failures:
        print(f"tenzro: audit failed: {failure}", file=sys.stderr)
    return 1 if verdict.failures else 0


def add_audit_commands(groups: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `audit timing` to a CLI's subcommands; its parser sets `func`, which returns the exit code."""
    audit = groups.add_parser("audit", help="security audits of a node").add_subparsers(dest="command",
                                                                                        required=True)
    timing = audit.add_parser("timing", help="cross-caller timing side channel of the prefix cache")
    timing.add_argument("--url", help="an OpenAI-compatible base URL to audit (default: start a local node)")
    timing.add_argument("--key-a", help="with --url: API key of caller A, who caches prompts")
    timing.add_argument("--key-b", help="with --url: API key of caller B, a different caller, who probes")
    timing.add_argument("--model", help="model id at --url, or model dir/'default' for the local node")
    timing.add_argument("--samples", type=int, default=40, help="trials, each giving one sample per condition")
    timing.add_argument("--length", type=int, default=1024, help="prompt tokens")
    timing.add_argument("--seed", type=int, help="of the prompts and condition order (default: a fresh one, "
                        "recorded in the report)")
    timing.add_argument("--threads", type=int, default=1, help="torch threads of the local node")
    timing.add_argument("--device", help="device of the local node")
    timing.add_argument("--group", action="store_true", help="A a member of a trust group, sending each prompt as "
                        "a system message shared with it, B a non-member (with --url, A's key must be a member)")
    timing.add_argument("--out", default="bench-results/audit-timing.json")
    timing.set_defaults(func=run_timing_audit)
