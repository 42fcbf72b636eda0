"""Resident memory of a serving node: `tenzro node serve` on the default model (or `--model`), its RSS once healthy
and after its first request, read from `/proc/<pid>/status` (VmRSS, and VmHWM: the peak).

    .venv/bin/python scripts/node_rss.py [--model default] [--threads 1] [--json OUT]

A benchmark's probe, not a test: run it on two trees (`PYTHONPATH=<tree>`) to compare what each holds resident,
e.g. the weight copies the CPU backend keeps (issue 37, `node/engine/forward.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from bench.client import open_session
from bench.local_node import LocalNode


def memory_of(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) // 1024
    return fields


async def measure(model: str, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tenzro-rss-") as workdir:
        node = LocalNode(Path(workdir), model, threads, None)
        node.start()
        try:
            async with open_session() as session:
                await node.wait_healthy(session)
                assert node.process is not None
                healthy = memory_of(node.process.pid)
                client = await node.client(session)
                await client.chat([{"role": "user", "content": "How much memory does a node hold?"}], max_tokens=16)
                served = memory_of(node.process.pid)
            forward = next((line for line in node.log.read_text().splitlines() if "forward (" in line), "")
        finally:
            node.stop()
    return {"model": model, "threads": threads, "healthy_mib": healthy, "after_first_request_mib": served,
            "forward": forward.split(": ", 1)[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(measure(args.model, args.threads))
    healthy, served = result["healthy_mib"], result["after_first_request_mib"]
    print(f"healthy: RSS {healthy['VmRSS']} MiB; after the first request: RSS {served['VmRSS']} MiB, peak "
          f"{served['VmHWM']} MiB ({result['forward']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
