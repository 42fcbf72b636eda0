"""One served image model: its pipeline, the per-scope encoding cache its encoders' outputs are kept in, and the
worker its jobs queue for; what `GET /v1/node` and `/v1/models` say of it.

`tenzro node serve --model DIR` serves a diffusers directory (`model_dir.is_diffusers_dir`) with this service
instead of a text model's `ModelService`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cache.encodings import EncodingCache
from cache.scope import Scope
from cache.sealing import Sealer
from node.config import Caller, Limits
from node.media.image_request import ImageOptions, ImageRequest
from node.media.pipeline import ImagePipeline, Render
from node.media.worker import MediaWorker


@dataclass(frozen=True, slots=True)
class MediaService:
    pipeline: ImagePipeline
    worker: MediaWorker

    @classmethod
    def create(cls, model_id: str, path: Path, limits: Limits, reuse: bool = True, sealed: bool = True,
               device: str | None = None, dtype: str | None = None) -> MediaService:
        """`reuse` False (`--no-reuse`): no encoding is kept; `sealed` False (`--no-seal`): kept in the clear.
        The cache has its own sealer: dropping a scope destroys that scope's key in it."""
        target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = getattr(torch, dtype) if dtype else (torch.float16 if target.type == "cuda" else torch.float32)
        encodings = EncodingCache(Sealer() if sealed else None) if reuse else None
        pipeline = ImagePipeline.load(model_id, path, target, torch_dtype, encodings)
        return cls(pipeline, MediaWorker(pipeline, limits.max_queue))

    @property
    def model_id(self) -> str:
        return self.pipeline.model_id

    @property
    def reuse_enabled(self) -> bool:
        return self.pipeline.encodings is not None

    @property
    def options(self) -> ImageOptions:
        return ImageOptions(self.model_id, self.pipeline.sizes, f"{self.pipeline.base_size}x{self.pipeline.base_size}")

    def render(self, caller: Caller, request: ImageRequest) -> Render:
        """The job of `request` for `caller`: its encodings kept only when the caller's state is (`retention`)."""
        return Render(Scope(caller=caller.name, model=self.model_id), request, reuse=caller.retention == "keep")

    def drop_caller(self, caller: str) -> None:
        """A caller removed from the config loses its encodings and their keys (a router's callers theirs too)."""
        if self.pipeline.encodings is not None:
            self.pipeline.encodings.drop_caller(caller)

    def encodings_config(self) -> dict[str, Any]:
        """`GET /v1/node`'s view: fixed for the start, the same for every key."""
        encodings = self.pipeline.encodings
        if encodings is None:
            return {"reuse": False}
        return {"reuse": True, "sealed": encodings.sealing, "max_bytes": encodings.max_bytes,
                "scope_bytes": encodings.scope_bytes}

    def media_config(self) -> dict[str, Any]:
        pipeline = self.pipeline
        return {"kind": "image", "pipeline": type(pipeline.text).__name__, "sizes": list(pipeline.sizes),
                "default_size": self.options.default_size, "device": str(pipeline.device),
                "dtype": str(pipeline.dtype).removeprefix("torch."), "encodings": self.encodings_config(),
                "max_queue": self.worker.max_queue, "max_running": 1}

    def media_state(self) -> dict[str, Any]:
        """For operators (`GET /v1/node/state`): the queue and the cache's counts now."""
        encodings = self.pipeline.encodings
        return {**self.worker.describe(), "encodings": None if encodings is None else encodings.describe(),
                "text_encoder_calls": self.pipeline.text_encoder_calls,
                "vae_encoder_calls": self.pipeline.vae_encoder_calls}
