"""A/B two builds of the CPU kernels on the real forward of the default model, in one process.

    .venv/bin/python scripts/kernel_ab.py A.so B.so [LENGTH ...]

Build each library from a version of node/engine/kernels/cpu_kernels.cpp with
`g++ -O3 -march=x86-64-v4 -mtune=generic -std=c++17 -shared -fPIC -o X.so cpu_kernels.cpp` (setup.py's flags,
which the node runs). For each length (default 1024
and 2048) it prefills a prompt minus 32 tokens, then times the 32-token resumed forward plus its greedy
token, alternating the two libraries (the packed weights are shared), with caches flushed between runs,
and prints the medians: this machine drifts by more than most kernel changes, so only side by side counts.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch

from cache.working_cache import GrowableKVLayer
from node.config import tenzro_home
from node.engine.cpu_kernels import _SIGNATURES
from node.engine.loader import DEFAULT_MODEL, load_model, resolve_model_dir

RUNS = 15
NEW_TOKENS = 32


def library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, (arguments, result) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, result
    return lib


def main() -> None:
    torch.set_num_threads(1)
    libraries = [library(sys.argv[1]), library(sys.argv[2])]
    lengths = [int(arg) for arg in sys.argv[3:]] or [1024, 2048]
    loaded = load_model(*resolve_model_dir(DEFAULT_MODEL, tenzro_home()))
    decoder, state = loaded.forward.decoder, loaded.state
    assert decoder is not None and state is not None, "needs the CPU decoder: AVX-512, g++ and one thread"
    flush = torch.ones(80_000_000)  # 320 MB, more than the last-level cache
    with torch.inference_mode():
        for length in lengths:
            ids = torch.randint(10, 32000, (length,)).tolist()
            cache = state.working_cache(length + NEW_TOKENS)
            loaded.model(input_ids=torch.tensor([ids[:-NEW_TOKENS]]), cache=cache, use_cache=True)
            times: list[list[float]] = [[], []]
            for run in range(2 * RUNS):
                decoder._kernels._lib = libraries[run % 2]
                flush.sum()
                for layer in cache.layers:  # back to the prefix
                    assert isinstance(layer, GrowableKVLayer)
                    layer.truncate(length - NEW_TOKENS, length + NEW_TOKENS)
                started = time.perf_counter()
                decoder.forward(ids[-NEW_TOKENS:], length - NEW_TOKENS, cache).greedy()
                times[run % 2].append((time.perf_counter() - started) * 1e3)
            print(f"{length} tokens: A {statistics.median(times[0]):.2f} ms  B {statistics.median(times[1]):.2f} ms "
                  f"(medians of {RUNS})")


if __name__ == "__main__":
    main()
