"""What hashing the code and a model directory costs at a node's start, against loading the model.

For each model, `--runs` times, in three modes, each after its files are evicted from the page cache
(posix_fadvise DONTNEED: the guest's cache; a host below it may still hold the bytes):
- read: every file of the model read once, nothing done with the bytes: the bound hashing must stay within;
- load: `load_model` alone, as a node started before digests existed;
- hash: the code digest, then the model digest, alone;
- both: `start_hashing` then `load_model` then the join, as `tenzro node serve` does; "ready" is when both are done,
  "added" is ready minus the median of load alone: what hashing delays the first request by.
Prints medians and writes JSON (`--out`).

    .venv/bin/python scripts/identity_cost.py --model default --model 1gb --runs 3

`default` is the embedded default model ($TENZRO_HOME/models); `1gb` a dense model of the same recipe widened to
about 1 GB of float32 weights, built on first use into $TENZRO_HOME/models/dense-1gb; anything else is a directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from node.cli import default_threads
from node.code_identity import compute_code_identity, compute_model_identity, start_hashing, tree_files
from node.config import tenzro_home
from node.engine.loader import load_model, resolve_model_dir
from node.engine.synthetic import ARCHITECTURES, SEED, SIZES, build_tokenizer

ONE_GB = dataclasses.replace(SIZES["default"], hidden=1024, heads=16, kv_heads=16, intermediate=2816, layers=16)
"""About 271 M parameters: 16 layers of 12.85 M and two 32,000 x 1,024 embeddings, 1.08 GB in float32."""


def one_gb_model(models_dir: Path) -> Path:
    target = models_dir / "dense-1gb"
    if (target / "config.json").is_file():
        return target
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(ARCHITECTURES["dense"](ONE_GB), dtype=torch.float32)
    staging = models_dir / ".building-dense-1gb"
    model.save_pretrained(staging)
    build_tokenizer().save_pretrained(staging)
    os.rename(staging, target)
    return target


def model_dir(spec: str) -> tuple[str, Path]:
    if spec == "1gb":
        return "dense-1gb", one_gb_model(tenzro_home() / "models")
    return resolve_model_dir(spec, tenzro_home())


def evict(directory: Path) -> None:
    for name in tree_files(directory):
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_alone(model_id: str, path: Path) -> dict[str, float]:
    started = time.perf_counter()
    buffer = bytearray(1 << 20)
    for name in tree_files(path):
        with open(path / name, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass
    return {"read_s": time.perf_counter() - started}


def load_alone(model_id: str, path: Path) -> dict[str, float]:
    started = time.perf_counter()
    load_model(model_id, path)
    return {"load_s": time.perf_counter() - started}


def hash_alone(model_id: str, path: Path) -> dict[str, float]:
    started = time.perf_counter()
    compute_code_identity()
    code = time.perf_counter()
    compute_model_identity(model_id, path)
    return {"code_s": code - started, "model_s": time.perf_counter() - code}


def both(model_id: str, path: Path) -> dict[str, float]:
    started = time.perf_counter()
    pending = start_hashing({model_id: path})
    load_model(model_id, path)
    loaded = time.perf_counter()
    served = pending.result()
    return {"load_s": loaded - started, "ready_s": time.perf_counter() - started, "waited_s": pending.waited_s,
            "code_s": served.code_s, "model_s": served.model_s}


MODES = {"read": read_alone, "load": load_alone, "hash": hash_alone, "both": both}


def measure(spec: str, runs: int) -> dict[str, Any]:
    model_id, path = model_dir(spec)
    identity = compute_model_identity(model_id, path)
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for run in range(runs):
        order = list(MODES) if run % 2 == 0 else list(reversed(MODES))  # neither mode always follows the other
        for mode in order:
            evict(path)
            samples[mode].append(MODES[mode](model_id, path))
    medians = {mode: {key: statistics.median(sample[key] for sample in rows) for key in rows[0]}
               for mode, rows in samples.items()}
    medians["both"]["added_s"] = medians["both"]["ready_s"] - medians["load"]["load_s"]
    return {"model": model_id, "path": str(path), "bytes": sum(file.size for file in identity.files),
            "files": len(identity.files), "digest": identity.digest, "runs": runs, "medians": medians,
            "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="default, 1gb or a model directory (repeatable)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_threads(), help="torch threads, as the node's")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    code = compute_code_identity()
    results = [measure(spec, args.runs) for spec in args.model or ["default"]]
    print(f"code: {code.source}, {len(code.files)} files, {sum(f.size for f in code.files)} bytes; "
          f"torch threads {args.threads}, {os.cpu_count()} CPUs; medians of {args.runs} runs, seconds")
    print("| model | bytes | read | load alone | code hash | model hash | both: load | both: ready | waited | added |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        m = result["medians"]
        print(f"| {result['model']} | {result['bytes']:,} | {m['read']['read_s']:.2f} | {m['load']['load_s']:.2f} | "
              f"{m['hash']['code_s']:.3f} | {m['hash']['model_s']:.2f} | {m['both']['load_s']:.2f} | "
              f"{m['both']['ready_s']:.2f} | {m['both']['waited_s']:.2f} | {m['both']['added_s']:+.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"code_files": len(code.files), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
