"""`tenzro bench route`: local nodes (`--nodes`) behind a router, many callers in multi-turn chats sharing system
prompts; how often a follow-up turn lands on the node holding its conversation, and how evenly the nodes load.

Each routing (`warm`: the bounded warm bias; `least-loaded`: price, load and latency alone; `round-robin`) runs
against the same nodes with its own router and its own callers (so no routing inherits another's warm state).
Callers arrive `--arrival-s` apart and send their turns one after the other, streamed, greedy. Two kinds take
turns: agents send each follow-up as soon as the reply before it has ended (back to back), people pause about
`--think-s` first (`--paced` of the callers). Back-to-back follow-ups are reported on their own: they reach the
router while the turn before is freshest, the case a router counting finished requests as load sends elsewhere.
Arrivals spread over time, rather than all callers at once in step, leave the nodes unevenly busy, as traffic
does. A follow-up turn lands warm when the node that served it is the one that served the caller's previous
turn: the node holding its conversation. Load is the number of requests each node served.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import random
import secrets
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from bench.client import BenchError, Client, Messages, open_session
from bench.local_node import TENZRO, LocalNode, free_port, tenzro
from bench.report import columns, failed, progress, write_json

ROUTINGS = ("warm", "least-loaded", "round-robin")
WORDS = ("dock pallet route crane manifest berth cargo ledger invoice shipment forklift quay tide harbor "
         "container customs freight rail barge warehouse audit schedule carrier inbound outbound").split()
WARM_GOAL, SPREAD_GOAL = 0.9, 1.5
ROUTER_START_S = 60.0


@dataclass(frozen=True, slots=True)
class Turn:
    routing: str
    caller: int
    turn: int
    back_to_back: bool
    """Sent as soon as the caller's previous reply ended (an agent's follow-up); False for a first turn."""
    provider: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float


@dataclass(frozen=True, slots=True)
class Row:
    routing: str
    follow_ups: int
    warm_rate: float
    back_to_back: int
    """How many of the follow-ups were sent back to back."""
    warm_back_to_back: float
    reused_fraction: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    load: dict[str, int]

    @property
    def spread(self) -> float:
        """The busiest node's requests over the mean."""
        return max(self.load.values()) / statistics.mean(self.load.values())


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Router:
    """`tenzro router serve` over `nodes`, with `callers` keys of its own, on a free port."""

    def __init__(self, workdir: Path, nodes: list[tuple[str, str, str, str]], callers: int, routing: str) -> None:
        self.keys = [f"tz-bench-{secrets.token_hex(16)}" for _ in range(callers)]
        providers = {
            "settings": {"poll_interval_s": 1},
            "providers": [{"name": name, "url": url, "api_key": key, "models": [model]}
                          for name, url, key, model in nodes],
            "callers": {f"{routing}-{index}": {"key_sha256": hashlib.sha256(key.encode()).hexdigest()}
                        for index, key in enumerate(self.keys)},
        }
        path = workdir / f"providers-{routing}.yaml"
        path.write_text(yaml.safe_dump(providers))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"router-{routing}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([*TENZRO, "router", "serve", "--providers", str(path), "--port",
                                             str(self.port), "--routing", routing], stdout=log,
                                            stderr=subprocess.STDOUT)

    async def wait_up(self, session: aiohttp.ClientSession, providers: int) -> None:
        deadline = time.monotonic() + ROUTER_START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(f"the router exited: {self.log.read_text(errors='replace')[-2000:]}")
            try:
                async with session.get(self.url + "/health") as response:
                    if response.status == 200 and (await response.json()).get("providers_up") == providers:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise BenchError(f"the router did not see its {providers} providers up in {ROUTER_START_S:.0f} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


@dataclass(frozen=True, slots=True)
class Caller:
    """One caller's part: when it arrives and how long it pauses before each follow-up (0: back to back)."""

    index: int
    start_s: float
    think_s: float


def callers(count: int, arrival_s: float, paced: float, think_s: float, rng: random.Random) -> list[Caller]:
    """`count` callers arriving `arrival_s` apart. The share `paced` of them, spread evenly through the arrivals,
    pause before each follow-up (between half and one and a half `think_s`); the others are agents."""
    made = []
    for index in range(count):
        is_paced = think_s > 0 and int((index + 1) * paced) > int(index * paced)
        made.append(Caller(index, index * arrival_s, rng.uniform(0.5, 1.5) * think_s if is_paced else 0.0))
    return made


async def _conversation(client: Client, routing: str, caller: Caller, system: str, turns: int, new_tokens: int,
                        rng: random.Random) -> list[Turn]:
    await asyncio.sleep(caller.start_s)
    messages: Messages = [{"role": "system", "content": system}]
    seen = []
    for turn in range(turns):
        if turn and caller.think_s:
            await asyncio.sleep(caller.think_s)
        messages.append({"role": "user", "content": f"Step {turn}: " + _text(rng, 12)})
        answer = await client.chat(messages, max_tokens=new_tokens)
        timing = answer.timing()
        seen.append(Turn(routing, caller.index, turn, turn > 0 and not caller.think_s,
                         answer.headers.get("Tenzro-Provider", "?"), timing.prompt_tokens or 0,
                         timing.cached_tokens or 0, timing.ttft_s * 1000))
        messages.append({"role": "assistant", "content": answer.text})
    return seen


def _warm_share(follow_ups: list[tuple[Turn, Turn]]) -> float:
    return sum(turn.provider == previous.provider for previous, turn in follow_ups) / max(1, len(follow_ups))


def summarize(routing: str, turns: list[Turn], providers: list[str]) -> Row:
    by_caller = {caller: sorted(group, key=lambda t: t.turn)
                 for caller, group in itertools.groupby(sorted(turns, key=lambda t: t.caller), key=lambda t: t.caller)}
    follow_ups = [(previous, turn) for seen in by_caller.values() for previous, turn in itertools.pairwise(seen)]
    back_to_back = [(previous, turn) for previous, turn in follow_ups if turn.back_to_back]
    reused = sum(turn.cached_tokens for _, turn in follow_ups) / max(1, sum(t.prompt_tokens for _, t in follow_ups))
    ttfts = sorted(turn.ttft_ms for turn in turns)
    load = Counter(turn.provider for turn in turns)
    return Row(routing, len(follow_ups), _warm_share(follow_ups), len(back_to_back), _warm_share(back_to_back),
               reused, statistics.median(ttfts), ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
               {name: load.get(name, 0) for name in providers})


async def _run(args: argparse.Namespace, workdir: Path) -> tuple[list[Row], list[Turn]]:
    model = workdir / "model"
    tenzro("models", "init", "--size", args.size, str(model))
    nodes = [LocalNode(workdir / f"node{index}", str(model), 1, None) for index in range(args.nodes)]
    for index, node in enumerate(nodes):
        (workdir / f"node{index}").mkdir()
        node.start()
    routers: list[Router] = []
    try:
        async with open_session() as session:
            for node in nodes:
                await node.wait_healthy(session)
            specs = [(f"node{index}", node.root, node.add_key("router", role="router"), model.name)
                     for index, node in enumerate(nodes)]
            rng = random.Random(args.seed)
            systems = [f"You are dispatcher {index}. " + _text(rng, args.system_words) for index in range(args.systems)]
            rows, turns = [], []
            for routing in args.routings.split(","):
                progress(f"bench route: {routing}, {args.callers} callers x {args.turns} turns")
                router = Router(workdir, specs, args.callers, routing)
                routers.append(router)
                await router.wait_up(session, len(specs))
                clients = [Client(session, router.url + "/v1", key, model.name) for key in router.keys]
                parts = callers(args.callers, args.arrival_s, args.paced, args.think_s, random.Random(args.seed))
                seen = await asyncio.gather(*(
                    _conversation(client, routing, part, systems[part.index % len(systems)], args.turns,
                                  args.new_tokens, random.Random(args.seed * 1000 + part.index))
                    for part, client in zip(parts, clients, strict=True)))
                routed = [turn for conversation in seen for turn in conversation]
                rows.append(summarize(routing, routed, [name for name, *_ in specs]))
                turns += routed
                router.stop()
            return rows, turns
    finally:
        for router in routers:
            router.stop()
        for node in nodes:
            node.stop()


def format_report(rows: list[Row]) -> str:
    table = [("routing", "follow-ups", "warm", "back to back", "warm", "reused", "TTFT p50 ms", "TTFT p90 ms",
              "requests per node", "max/mean")]
    table += [(row.routing, str(row.follow_ups), f"{row.warm_rate:.1%}", str(row.back_to_back),
               f"{row.warm_back_to_back:.1%}", f"{row.reused_fraction:.1%}", f"{row.ttft_p50_ms:.1f}",
               f"{row.ttft_p90_ms:.1f}", " ".join(map(str, row.load.values())), f"{row.spread:.2f}") for row in rows]
    return columns(table, left=1)


def goals(rows: list[Row]) -> list[tuple[str, bool]]:
    checks = []
    for row in rows:
        if row.routing == "warm":
            checks.append((f"warm bias: at least {WARM_GOAL:.0%} of follow-up turns land warm ({row.warm_rate:.1%})",
                           row.warm_rate >= WARM_GOAL))
            checks.append((f"warm bias: at least {WARM_GOAL:.0%} of back-to-back follow-ups land warm "
                           f"({row.warm_back_to_back:.1%} of {row.back_to_back})",
                           row.back_to_back > 0 and row.warm_back_to_back >= WARM_GOAL))
            checks.append((f"warm bias: no node above {SPREAD_GOAL}x the mean load ({row.spread:.2f}x)",
                           row.spread <= SPREAD_GOAL))
    return checks


def run_route_bench(args: argparse.Namespace) -> int:
    if any(routing not in ROUTINGS for routing in args.routings.split(",")):
        print(f"tenzro: error: --routings takes {', '.join(ROUTINGS)}")
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="tenzro-route-") as workdir:
            rows, turns = asyncio.run(_run(args, Path(workdir)))
    except BenchError as exc:
        return failed(exc)
    print(format_report(rows))
    checks = goals(rows)
    for text, met in checks:
        print(f"  [{'met' if met else 'NOT MET'}] {text}")
    write_json(Path(args.out), {
        "settings": {name: value for name, value in vars(args).items() if name != "func"},
        "rows": [{"routing": row.routing, "follow_ups": row.follow_ups, "warm_rate": row.warm_rate,
                  "back_to_back": row.back_to_back, "warm_back_to_back": row.warm_back_to_back,
                  "reused_fraction": row.reused_fraction, "ttft_p50_ms": row.ttft_p50_ms,
                  "ttft_p90_ms": row.ttft_p90_ms, "load": row.load, "max_over_mean": row.spread} for row in rows],
        "goals": [{"goal": text, "met": met} for text, met in checks],
        "turns": [{"routing": t.routing, "caller": t.caller, "turn": t.turn, "back_to_back": t.back_to_back,
                   "provider": t.provider, "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                   "ttft_ms": t.ttft_ms} for t in turns]})
    return 0


def add_route_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    summary = ("local nodes (--nodes) behind a router: warm-hit rate of multi-turn callers' follow-ups "
               "(back-to-back ones on their own) and load spread, warm bias against least-loaded and round-robin")
    route = bench.add_parser("route", help=summary, description=summary)
    route.add_argument("--nodes", type=int, default=3, help="local nodes behind the router (default: 3)")
    route.add_argument("--callers", type=int, default=20)
    route.add_argument("--turns", type=int, default=4)
    route.add_argument("--arrival-s", type=float, default=0.25, help="seconds between two callers' first turns")
    route.add_argument("--paced", type=float, default=0.5,
                       help="share of the callers that pause before each follow-up; the others (agents) send it "
                            "as soon as the reply before it ends")
    route.add_argument("--think-s", type=float, default=2.0,
                       help="a paced caller's pause before a follow-up, drawn between half and 1.5 times this")
    route.add_argument("--systems", type=int, default=3, help="distinct system prompts the callers share")
    route.add_argument("--system-words", type=int, default=150)
    route.add_argument("--new-tokens", type=int, default=8)
    route.add_argument("--size", choices=["default", "small"], default="small", help="the nodes' model size")
    route.add_argument("--routings", default=",".join(ROUTINGS))
    route.add_argument("--seed", type=int, default=0)
    route.add_argument("--out", default="bench-results/route.json")
    route.set_defaults(func=run_route_bench)
