"""The served image model: what the node says of it, and a removed caller's encodings gone with their keys."""

from __future__ import annotations

from pathlib import Path

import torch

from node.config import Caller, Limits
from node.media.image_request import ImageRequest
from node.media.pipeline import EncoderUse
from node.media.service import MediaService


def test_a_removed_callers_encodings_are_dropped_and_encoded_again(diffusion_dir: Path) -> None:
    torch.set_num_threads(1)
    media = MediaService.create("tiny", diffusion_dir, Limits(max_queue=3), device="cpu")
    assert media.options.default_size == "64x64"
    assert media.media_config() == {
        "kind": "image", "pipeline": "StableDiffusionPipeline", "sizes": ["32x32", "64x64", "128x128"],
        "default_size": "64x64", "device": "cpu", "dtype": "float32",
        "encodings": {"reuse": True, "sealed": True, "max_bytes": 256 << 20, "scope_bytes": 64 << 20},
        "max_queue": 3, "max_running": 1}
    alice = Caller(name="alice", key_sha256="0" * 64)
    request = ImageRequest("tiny", "a red cat", 1, 32, 32, 2, 1)
    uses = [media.pipeline.render(media.render(alice, request)).conditionings for _ in range(2)]
    media.drop_caller("alice")
    assert media.media_state()["encodings"]["scopes"] == 0
    uses.append(media.pipeline.render(media.render(alice, request)).conditionings)
    assert uses == [EncoderUse(1, 0), EncoderUse(0, 1), EncoderUse(1, 0)]
    keeps_nothing = Caller(name="bob", key_sha256="1" * 64, retention="none")
    assert media.render(keeps_nothing, request).reuse is False
