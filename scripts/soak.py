"""A load run with abandoned requests and a crash: every answer and every cancellation is on the ledger.

    .venv/bin/python scripts/soak.py [--clients 64] [--duration 60] [--model default|DIR] [--out FILE]

Starts a node on loopback, runs N clients for the duration (chat and text completions, plain and streamed;
a third of them give up after 0.05 to 1.5 s, by closing the connection), then kills the node with SIGKILL
mid-traffic and checks its ledger offline: `tenzro metering verify` passes, every completion a client got
whole has a `completed` record under its id, and every request a client abandoned at least two seconds
before the kill, under an id it had seen, has a record (`cancelled`, or `completed` when it had finished
first), and no record says `failed`. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.local_node import TENZRO, LocalNode  # noqa: E402
from metering.segment import read_records, segment_files  # noqa: E402

SETTLE_S = 2.0
"""An abandoned request is expected on the ledger if it was abandoned at least this long before the kill."""


@dataclass
class Tally:
    answered: dict[str, str] = field(default_factory=dict)
    """completion id -> route, for answers received whole."""
    abandoned: list[tuple[float, str | None]] = field(default_factory=list)
    """(when, completion id if the client had seen it) per request given up."""
    refused: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    stopped: bool = False
    """Set when the node is killed: connection errors after that are the point, not failures."""


async def one_request(session: aiohttp.ClientSession, base: str, key: str, model: str, rng: random.Random,
                      tally: Tally) -> None:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    give_up = rng.uniform(0.05, 1.5) if rng.random() < 1 / 3 else None
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randrange(5, 200)))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randrange(1, 64), "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words}]
    else:
        body["prompt"] = words
    path = "/chat/completions" if chat else "/completions"
    seen_id: list[str | None] = [None]

    async def run() -> None:
        async with session.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status != 200:
                payload = await resp.json(content_type=None)
                code = str(payload.get("error", {}).get("code"))
                if resp.status == 503:  # a well-behaved client waits as told
                    tally.refused += 1
                    await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                else:
                    tally.errors[f"{resp.status} {code}"] = tally.errors.get(f"{resp.status} {code}", 0) + 1
                return
            if not stream:
                answer = await resp.json()
                tally.answered[answer["id"]] = path
                return
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    seen_id[0] = seen_id[0] or json.loads(line[6:]).get("id")
                elif line.startswith(b"data: [DONE]"):
                    assert seen_id[0] is not None
                    tally.answered[seen_id[0]] = path
                    return

    try:
        await asyncio.wait_for(run(), timeout=give_up)
    except TimeoutError:
        tally.abandoned.append((time.monotonic(), seen_id[0]))


async def client_loop(base: str, key: str, model: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            try:
                await one_request(session, base, key, model, rng, tally)
            except (aiohttp.ClientError, ConnectionError) as exc:
                if not tally.stopped:
                    tally.errors[type(exc).__name__] = tally.errors.get(type(exc).__name__, 0) + 1


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="tenzro-soak-"))
    node = LocalNode(workdir, args.model, 1, None, ())
    node.start()
    async with aiohttp.ClientSession() as session:
        await node.wait_healthy(session)
    base = node.root + "/v1"
    started = time.monotonic()
    tally = Tally()
    until = started + args.duration
    tasks = [asyncio.create_task(client_loop(base, node.api_key, "default" if args.model == "default"
                                             else Path(args.model).name, seed, until + 60, tally))
             for seed in range(args.clients)]
    await asyncio.sleep(args.duration)
    killed_at = time.monotonic()
    tally.stopped = True
    assert node.process is not None
    node.process.send_signal(signal.SIGKILL)  # mid-traffic: requests are in flight
    node.process.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    (segment,) = segment_files(workdir / "ledger")
    key = (workdir / "node.log").read_text().split("signed by node key ")[1].split()[0]
    verify = subprocess.run([*TENZRO, "metering", "verify", str(segment), "--node-key", key],
                            capture_output=True, text=True, check=False)
    records = {record.record_id: record for record in read_records(segment)[1]}
    missing_answers = [i for i in tally.answered if i not in records or records[i].status != "completed"]
    settled = [(when, rid) for when, rid in tally.abandoned if when <= killed_at - SETTLE_S]
    cancelled = sum(1 for record in records.values() if record.status == "cancelled")
    failed = sum(1 for record in records.values() if record.status == "failed")
    missing_abandoned = [rid for _, rid in settled if rid is not None and rid not in records]
    report = {
        "clients": args.clients, "duration_s": args.duration, "answered": len(tally.answered),
        "abandoned": len(tally.abandoned), "abandoned_settled": len(settled), "refused_503": tally.refused,
        "client_errors": tally.errors, "records": len(records), "cancelled_records": cancelled,
        "answers_without_completed_record": len(missing_answers),
        "abandoned_streams_without_record": len(missing_abandoned),
        "metering_verify": verify.returncode == 0, "verify_output": verify.stdout.strip()[-300:],
    }
    # Each answer is on the ledger as completed, each abandoned stream under the id it had seen; abandoned
    # plain requests have no id on the client, so they show as cancelled records (or completed ones, when
    # generation ended before the disconnect was seen; none at all when abandoned before the node took them).
    report["passed"] = (report["metering_verify"] and not missing_answers and not missing_abandoned
                        and not failed and not tally.errors)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", default="bench-results/soak.json")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    for name, value in report.items():
        print(f"{name:36s} {value}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
