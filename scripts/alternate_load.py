"""Side by side, alternating: `tenzro bench load` on vLLM's CPU build and on one or more trees of this node, in
rounds (vLLM, then each tree, then again), so that a noisy machine's drift falls on every engine alike; prints the
median of each measure per engine and client count, and writes every run's JSON.

    .venv/bin/python scripts/alternate_load.py --out DIR [--peer PEER_DIR] [--tree NAME=PATH ...]
        [--rounds 3] [--clients 8,32] [--duration 90] [--threads 1]

`--tree NAME=PATH` runs `python -m node bench load` with PYTHONPATH=PATH (a checkout of another commit, its native
kernels built or copied in); without any, this tree runs as `tenzro`. `--peer` is the directory
`../shared/peers/vllm-cpu.sh install` made: vLLM serves the same default model there for the whole run (its first
start compiles for minutes), and is measured through `bench load --url`. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MEASURES = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
VLLM_SH = HERE.parent / "shared" / "peers" / "vllm-cpu.sh"


def default_model_dir() -> Path:
    from node.config import tenzro_home
    from node.engine.loader import resolve_model_dir

    return resolve_model_dir("default", tenzro_home())[1]


def start_vllm(peer: Path, threads: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    from bench.local_node import free_port

    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(["bash", str(VLLM_SH), "serve", str(peer), str(default_model_dir()), str(port),
                                    str(threads), "32"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1800):
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return process, url + "/v1"
        except OSError:
            if process.poll() is not None:
                raise SystemExit(f"vLLM exited; see {log}") from None
            time.sleep(1)
    raise SystemExit(f"vLLM did not start in 30 minutes; see {log}")


def bench(label: str, args: argparse.Namespace, out: Path, path: Path | None = None, url: str | None = None
          ) -> Path:
    result = out / f"{label}.json"
    command = [sys.executable, "-m", "node", "bench", "load", "--label", label.rsplit("-", 1)[0],
               "--clients", args.clients, "--duration", str(args.duration), "--json", str(result)]
    command += ["--url", url, "--api-key", "none", "--model", "default"] if url else ["--threads", str(args.threads)]
    env = dict(os.environ, **({"PYTHONPATH": str(path)} if path else {}))
    subprocess.run(command, check=True, env=env, cwd=path or HERE)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--peer", type=Path, help="vLLM's environment (vllm-cpu.sh install PEER_DIR)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--duration", type=float, default=90)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engines: list[tuple[str, Path | None]] = [(name, Path(path).resolve()) for name, _, path in
                                              (tree.partition("=") for tree in args.tree)] or [("tenzro", None)]
    vllm, url = start_vllm(args.peer.resolve(), args.threads, args.out / "vllm.log") if args.peer else (None, None)
    runs: dict[str, list[Path]] = {}
    try:
        for round_ in range(1, args.rounds + 1):
            if url:
                runs.setdefault("vllm", []).append(bench(f"vllm-{round_}", args, args.out, url=url))
            for name, path in engines:
                runs.setdefault(name, []).append(bench(f"{name}-{round_}", args, args.out, path=path))
    finally:
        if vllm is not None:
            os.killpg(vllm.pid, signal.SIGTERM)
            vllm.wait()
    summary = summarize(runs)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"medians of {args.rounds} alternating runs, {args.duration:.0f} s each, {args.threads} thread(s)")
    print(f"{'engine':>14} {'clients':>7} " + " ".join(f"{measure:>19}" for measure in MEASURES))
    for row in summary:
        print(f"{row['engine']:>14} {row['clients']:>7} " + " ".join(
            f"{row[measure]:>10.1f} ({row[measure + '_spread']})".rjust(19) for measure in MEASURES))


def summarize(runs: dict[str, list[Path]]) -> list[dict[str, object]]:
    """Per engine and client count: each measure's median over the rounds, and its spread (min-max)."""
    summary = []
    for engine, files in runs.items():
        rows: dict[int, list[dict[str, float]]] = {}
        for file in files:
            for row in json.loads(file.read_text())["rows"]:
                rows.setdefault(row["clients"], []).append(row)
        for clients, measured in sorted(rows.items()):
            entry: dict[str, object] = {"engine": engine, "clients": clients, "runs": len(measured)}
            for measure in MEASURES:
                values = [row[measure] for row in measured]
                entry[measure] = statistics.median(values)
                entry[measure + "_spread"] = f"{min(values):.0f}-{max(values):.0f}"
            summary.append(entry)
    return summary


if __name__ == "__main__":
    main()
