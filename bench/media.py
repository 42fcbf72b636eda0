"""`tenzro bench media`: what reusing encodings saves a media node's jobs.

`--renders`: eight renders of one prompt at eight seeds, then eight edits of one reference image, on a local image
node with reuse and on one with `--no-reuse`. Reported per node and kind: text-encoder and VAE-encoder calls (the
node's operator counters, read before and after), the median job time the client saw and the median time the node
spent in the encoders. With reuse the encoders run once per content (the goal: text-encoder calls 1 instead of 8),
and the job time saved should equal the encoder time that `--no-reuse` spends.

`--chat` (`bench/media_chat.py`): a four-turn conversation about one image on a vision-language node with reuse and
with `--no-reuse`, and a new conversation about the same image. Both halves run when both flags are given.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import BenchError, open_session
from bench.local_node import LocalNode, model_dir
from bench.media_chat import add_chat_arguments, run_chat_bench
from bench.report import columns, failed, progress, write_report

RENDERS = 8
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
EDIT_PROMPT = "the same scene in winter"
MODES = {"reuse": (), "no-reuse": ("--no-reuse",)}


@dataclass(frozen=True, slots=True)
class MediaSettings:
    model: str
    threads: int
    device: str | None
    steps: int
    size: str
    renders: int


@dataclass(frozen=True, slots=True)
class JobSample:
    mode: str
    kind: str
    """"render" or "edit"."""
    seed: int
    job_ms: float
    """From sending the request to its whole answer, at the client."""
    server_encode_ms: float
    conditionings_encoded: int
    references_encoded: int


@dataclass(frozen=True, slots=True)
class MediaRow:
    mode: str
    kind: str
    text_encoder_calls: int
    vae_encoder_calls: int
    median_job_ms: float
    median_encode_ms: float


def reference_png(side: int) -> bytes:
    """A fixed reference image: a gradient, so that its latents vary."""
    from PIL import Image

    image = Image.new("RGB", (side, side))
    image.putdata([(x * 255 // side, y * 255 // side, 96) for y in range(side) for x in range(side)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


async def _post(session: aiohttp.ClientSession, node: LocalNode, path: str, body: dict[str, Any]
                ) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    async with session.post(node.root + "/v1" + path, json=body,
                            headers={"Authorization": f"Bearer {node.api_key}"}) as response:
        answer = await response.json()
        if response.status != 200:
            raise BenchError(f"{path} answered {response.status}: {answer.get('error', {}).get('message')}")
    return (time.perf_counter() - started) * 1000.0, answer


async def _counters(session: aiohttp.ClientSession, node: LocalNode, operator: str) -> tuple[int, int]:
    async with session.get(node.root + "/v1/node/state", headers={"Authorization": f"Bearer {operator}"}) as response:
        state = (await response.json())["media"]
    return int(state["text_encoder_calls"]), int(state["vae_encoder_calls"])


async def _measure(node: LocalNode, mode: str, settings: MediaSettings, samples: list[JobSample]) -> list[MediaRow]:
    operator = node.add_key("bench-operator", "operator")
    rows = []
    async with open_session() as session:
        await node.wait_healthy(session)
        image = "data:image/png;base64," + base64.b64encode(reference_png(64)).decode()
        for kind, path, extra in (("render", "/images/generations", {"prompt": PROMPT}),
                                  ("edit", "/images/edits", {"prompt": EDIT_PROMPT, "image": image})):
            before = await _counters(session, node, operator)
            kind_samples = []
            for seed in range(settings.renders):
                job_ms, answer = await _post(session, node, path, {
                    **extra, "size": settings.size, "seed": seed, "num_inference_steps": settings.steps})
                used = answer["usage"]
                kind_samples.append(JobSample(mode, kind, seed, round(job_ms, 3), used["server_encode_ms"],
                                              used["encodings"]["conditionings"]["encoded"],
                                              used["encodings"]["references"]["encoded"]))
                progress(f"bench media: {mode} {kind} seed {seed}: {job_ms:.0f} ms")
            after = await _counters(session, node, operator)
            samples += kind_samples
            rows.append(MediaRow(mode, kind, after[0] - before[0], after[1] - before[1],
                                 round(statistics.median(sample.job_ms for sample in kind_samples), 3),
                                 round(statistics.median(sample.server_encode_ms for sample in kind_samples), 3)))
    return rows


def run_media_bench(args: argparse.Namespace) -> int:
    if not (args.renders or args.chat):
        return failed(BenchError("say which half to run: --renders, --chat or both"))
    if args.renders and (status := run_renders(args)) != 0:
        return status
    return run_chat_bench(args) if args.chat else 0


def run_renders(args: argparse.Namespace) -> int:
    samples: list[JobSample] = []
    rows: list[MediaRow] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tenzro-bench-") as workdir:
            model = str(model_dir(args.model, Path(workdir)))
            settings = MediaSettings(model, args.threads, args.device, args.steps, args.size, args.count)
            for mode, extra in MODES.items():
                (Path(workdir) / mode).mkdir()
                with LocalNode(Path(workdir) / mode, model, args.threads, args.device, extra) as node:
                    rows += asyncio.run(_measure(node, mode, settings, samples))
    except BenchError as exc:
        return failed(exc)
    header = ("node", "jobs", "text-encoder calls", "VAE-encoder calls", "median job ms", "median encode ms")
    print(columns([header, *((row.mode, f"{settings.renders} {row.kind}s", str(row.text_encoder_calls),
                              str(row.vae_encoder_calls), f"{row.median_job_ms:.1f}", f"{row.median_encode_ms:.1f}")
                             for row in rows)], left=2))
    write_report(Path(args.out), settings, rows, samples)
    return 0


def add_media_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tenzro bench media` under the `bench` subcommands."""
    media = bench.add_parser("media", help="encoder reuse of image renders and edits, and of image chat")
    media.add_argument("--renders", action="store_true",
                       help=f"{RENDERS} renders of one prompt at {RENDERS} seeds and {RENDERS} edits of one "
                            "reference image, with reuse and with --no-reuse")
    media.add_argument("--chat", action="store_true", help="a four-turn conversation about one image, with reuse "
                       "and with --no-reuse (a vision-language model: --chat-model)")
    media.add_argument("--chat-model", default="vlm-llava",
                       help="a vision-language model dir, or a `models init` architecture (vlm-llava, vlm-qwen2, ...)")
    media.add_argument("--chat-out", default="bench-results/media-chat.json")
    add_chat_arguments(media)
    media.add_argument("--model", default="diffusion",
                       help="a diffusers directory, or 'diffusion' for the small model `models init` builds")
    media.add_argument("--threads", type=int, default=1, help="torch threads of the local nodes")
    media.add_argument("--device", help="device of the local nodes (default: cuda when present)")
    media.add_argument("--steps", type=int, default=4, help="denoising steps per image")
    media.add_argument("--size", default="64x64")
    media.add_argument("--count", type=int, default=RENDERS, help="renders (and edits) per node")
    media.add_argument("--out", default="bench-results/media.json")
    media.set_defaults(func=run_media_bench)
