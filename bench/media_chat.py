"""`tenzro bench media --chat`: a four-turn conversation about one image, with reuse and with `--no-reuse`.

Two local nodes serve the same vision-language model, one of them with `--no-reuse`; each run is a new caller
(nothing of an earlier run is held) that sends the same conversation to both, which going first alternating. The
first turn attaches the image; each later turn sends the whole history back, the image in its first message, as
chat clients do. Per turn the table gives the image encoder calls (the node's `usage.attachments`), the time the
encoder ran inside the node, and the time to first token over HTTP streaming, medians over the runs.

What it shows: with reuse the image is encoded once (turn 1) instead of four times, and the later turns' time to
first token drops by the encoder's time plus the prefill of the restored history; `encoder_saved_ms` and
`saved_ms` in the JSON give the two parts of a conversation's saving. A fifth request starts a new conversation
about the same image: no prefix of it is stored, so the only reuse is the image's encoding (the caller's encoding
cache), and the time it saves is the encoder time the node without reuse spends (`same_image_new_chat`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client import BenchError, Client, open_session
from bench.local_node import LocalNode, model_dir
from bench.report import Target, columns, failed, progress, write_report

TURNS = ("What is in this picture?", "Describe its colours.", "What would you call it?", "Summarise it in one line.")
MODES = ("reuse", "no-reuse")


@dataclass(frozen=True, slots=True)
class ChatSettings(Target):
    runs: int
    new_tokens: int
    image_side: int


@dataclass(frozen=True, slots=True)
class ChatSample:
    mode: str
    run: int
    turn: int
    ttft_ms: float
    encoded: int
    reused: int
    encode_ms: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class ChatRow:
    mode: str
    turn: int
    encoder_calls: float
    encode_ms: float
    ttft_ms: float
    cached_tokens: float


def random_png(seed: int, width: int, height: int) -> bytes:
    """A seeded random PNG of `width` x `height` pixels; Pillow and torch are the node's own dependencies."""
    import torch
    from PIL import Image

    pixels = torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed))
    out = io.BytesIO()
    Image.fromarray((pixels * 255).to(torch.uint8).numpy()).save(out, "PNG")
    return out.getvalue()


def picture(seed: int, side: int) -> str:
    """A random `side`-pixel PNG as a data: URL."""
    return "data:image/png;base64," + base64.b64encode(random_png(seed, side, side)).decode()


async def conversation(client: Client, mode: str, run: int, image: str, new_tokens: int) -> list[ChatSample]:
    """The four turns, each sending the history back with the replies the node gave."""
    messages: list[dict[str, Any]] = []
    samples = []
    for turn, text in enumerate(TURNS, start=1):
        content: Any = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}] \
            if turn == 1 else text
        messages.append({"role": "user", "content": content})
        got = await client.chat(messages, max_tokens=new_tokens)  # type: ignore[arg-type]
        usage = got.usage
        attachments = usage.get("attachments") or {}
        if turn == 1 and attachments.get("encoded", 0) + attachments.get("reused", 0) != 1:
            raise BenchError(f"the {mode} node reports no image in the first turn's usage: is it a vision model?")
        samples.append(ChatSample(mode, run, turn, got.ttft_s * 1000.0, int(attachments.get("encoded", 0)),
                                  int(attachments.get("reused", 0)), float(attachments.get("encode_ms", 0.0)),
                                  int(usage.get("prompt_tokens", 0)),
                                  int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))))
        messages.append({"role": "assistant", "content": got.text})
    # A new conversation about the same image: nothing of its prefix is stored, so both nodes compute the whole
    # prompt, and with reuse the image's encoding is found in the caller's encoding cache.
    fresh = [{"role": "user", "content": [{"type": "text", "text": "A new question about an old picture: "},
                                          {"type": "image_url", "image_url": {"url": image}}]}]
    got = await client.chat(fresh, max_tokens=new_tokens)  # type: ignore[arg-type]
    attachments = got.usage.get("attachments") or {}
    samples.append(ChatSample(mode, run, len(TURNS) + 1, got.ttft_s * 1000.0, int(attachments.get("encoded", 0)),
                              int(attachments.get("reused", 0)), float(attachments.get("encode_ms", 0.0)),
                              int(got.usage.get("prompt_tokens", 0)),
                              int((got.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))))
    return samples


async def measure(settings: ChatSettings, nodes: dict[str, LocalNode]) -> list[ChatSample]:
    samples: list[ChatSample] = []
    async with open_session() as session:
        for node in nodes.values():
            await node.wait_healthy(session)
        for run in range(settings.runs):
            order = list(MODES) if run % 2 == 0 else list(reversed(MODES))
            for mode in order:
                node = nodes[mode]
                client = await node.client(session, node.add_key(f"chat-{run}"))
                samples += await conversation(client, mode, run, picture(run, settings.image_side),
                                              settings.new_tokens)
            progress(f"bench media --chat: run {run + 1} of {settings.runs}")
    return samples


def summarise(samples: list[ChatSample]) -> list[ChatRow]:
    rows = []
    for mode in MODES:
        for turn in range(1, len(TURNS) + 2):
            mine = [s for s in samples if s.mode == mode and s.turn == turn]
            rows.append(ChatRow(mode, turn, statistics.median(s.encoded for s in mine),
                                statistics.median(s.encode_ms for s in mine),
                                statistics.median(s.ttft_ms for s in mine),
                                statistics.median(s.cached_tokens for s in mine)))
    return rows


def totals(rows: list[ChatRow]) -> dict[str, Any]:
    """Per mode, the conversation's encoder calls, encoder time and time to first token summed over its four turns;
    what reuse saved of each; and for the new conversation about the same image (only its encoding reusable), the
    time to first token saved against the encoder time it skipped."""
    turns = [row for row in rows if row.turn <= len(TURNS)]
    sums = {mode: {"encoder_calls": sum(r.encoder_calls for r in turns if r.mode == mode),
                   "encode_ms": round(sum(r.encode_ms for r in turns if r.mode == mode), 3),
                   "ttft_ms": round(sum(r.ttft_ms for r in turns if r.mode == mode), 3)} for mode in MODES}
    fresh = {row.mode: row for row in rows if row.turn == len(TURNS) + 1}
    return {**sums, "saved_ms": round(sums["no-reuse"]["ttft_ms"] - sums["reuse"]["ttft_ms"], 3),
            "encoder_saved_ms": round(sums["no-reuse"]["encode_ms"] - sums["reuse"]["encode_ms"], 3),
            "same_image_new_chat": {"saved_ms": round(fresh["no-reuse"].ttft_ms - fresh["reuse"].ttft_ms, 3),
                                    "encoder_ms": round(fresh["no-reuse"].encode_ms, 3),
                                    "encoder_calls": {mode: fresh[mode].encoder_calls for mode in MODES}}}


def run_chat_bench(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="tenzro-bench-media-") as tmp:
        work = Path(tmp)
        try:
            model = str(model_dir(args.chat_model, work))
            settings = ChatSettings(url="local", model=model, local=True, threads=args.threads, device=args.device,
                                    runs=args.runs, new_tokens=args.new_tokens, image_side=args.image_side)
            nodes = {mode: LocalNode(work / mode, model, args.threads, args.device,
                                     extra=() if mode == "reuse" else ("--no-reuse",)) for mode in MODES}
            for node in nodes.values():
                node.workdir.mkdir()
                node.start()
            try:
                samples = asyncio.run(measure(settings, nodes))
            finally:
                for node in nodes.values():
                    node.stop()
        except BenchError as exc:
            return failed(exc)
    rows = summarise(samples)
    print(columns([["mode", "turn", "encoder calls", "encode ms", "TTFT ms", "cached tokens"],
                   *([r.mode, str(r.turn), f"{r.encoder_calls:g}", f"{r.encode_ms:.1f}", f"{r.ttft_ms:.1f}",
                      f"{r.cached_tokens:g}"] for r in rows)], left=1))
    found = totals(rows)
    print(f"conversation: encoder calls {found['reuse']['encoder_calls']:g} with reuse, "
          f"{found['no-reuse']['encoder_calls']:g} without; time to first token saved {found['saved_ms']:.1f} ms, "
          f"of which the encoder {found['encoder_saved_ms']:.1f} ms")
    same = found["same_image_new_chat"]
    print(f"the same image in a new conversation (turn {len(TURNS) + 1}): encoder calls "
          f"{same['encoder_calls']['reuse']:g} with reuse, {same['encoder_calls']['no-reuse']:g} without; time to "
          f"first token saved {same['saved_ms']:.1f} ms against {same['encoder_ms']:.1f} ms of encoder time")
    write_report(Path(args.chat_out), settings, rows, samples, totals=found)
    return 0


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The conversation half's flags, for `tenzro bench media`."""
    parser.add_argument("--chat-runs", dest="runs", type=int, default=3, help="conversations per mode")
    parser.add_argument("--chat-new-tokens", dest="new_tokens", type=int, default=16)
    parser.add_argument("--image-side", type=int, default=224, help="pixels of the square image")
