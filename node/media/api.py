"""An image node's HTTP API: `POST /v1/images/generations` and `/v1/images/edits` in OpenAI's form, its models and
node views, and the application that serves them.

A request is checked (its body, its image decoded off the event loop under the attachment limits), refused before
any compute when the node cannot meet its caller's requirements, queued for the media worker in its caller's turn
(a full queue answers 503 with a Retry-After, as the text queue does), and answered with the PNGs as base64 once
its usage is on the ledger: one signed record per request under the id the response carries (`img-...`), counts
only: the prompt's tokens, the conditionings encoded and reused, and the images, each at the image price. A client
that goes away cancels its job, at its next denoising step, and the job is still recorded.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_request import FileField

from metering.ledger import LedgerError
from metering.record import NO_MEDIA, Latency, MediaCounts, RecordStatus, TokenCounts
from node.api import identity, operations, records, rpc
from node.api.app import NodeEngine, node_app
from node.api.body import off_loop, read_body
from node.api.completions import METERING_RETRY_AFTER_S, RUNS_COMPLETIONS, check_requirements
from node.api.keys import CALLER, CONFIG, KEYRING, METER
from node.api.media_refusals import media_node_routes
from node.api.operations import QUEUE_READERS
from node.attachments import AttachmentLimits
from node.auth import require_role
from node.config import Caller, NodeConfig
from node.engine.caller_queue import QueueFullError
from node.errors import InvalidRequest, ModelFailure, NodeError, Unavailable, model_not_found, queue_full
from node.identity import NodeIdentity
from node.media.image_request import ImageRequest, parse_edit_form, parse_edit_json, parse_generation
from node.media.pipeline import Rendered
from node.media.service import MediaService
from node.meter import Completion, MeteringPaths, Usage
from node.metrics import NodeMetrics
from node.tls import NodeCertificate
from policies.node_policy import NodePolicy

MEDIA = web.AppKey("media", MediaService)
IMAGE_LIMITS = AttachmentLimits(max_attachments=1)
"""The reference image of an edit: decoded under the vision chat's limits."""

routes = web.RouteTableDef()


def counts_of(rendered: Rendered, stored: bool) -> TokenCounts:
    """What the signed record bills: the prompt's tokens, read from a reused conditioning or written to the cache
    (`stored`: the caller's encodings are kept), no output tokens. Counts only: no image, no prompt."""
    tokens = rendered.prompt_tokens
    reused = rendered.conditionings.reused > 0
    return TokenCounts(input_tokens=tokens, cached_read_tokens=tokens if reused else 0,
                       cached_write_tokens=tokens if stored and not reused else 0, output_tokens=0)


def media_counts_of(rendered: Rendered) -> MediaCounts:
    """What the signed record counts of the encoders and the output: the prompt's conditioning and an edit's
    reference latents together (each computed, or taken from the caller's cache), and the images rendered."""
    used = (rendered.conditionings, rendered.references)
    return MediaCounts(conditionings_encoded=sum(use.encoded for use in used),
                       conditionings_reused=sum(use.reused for use in used), images=len(rendered.images))


def usage(counts: TokenCounts, rendered: Rendered) -> dict[str, Any]:
    """OpenAI's images usage, from the signed counts, and this node's encoder counts for the caller's request."""
    return {
        "input_tokens": counts.input_tokens,
        "output_tokens": counts.output_tokens,
        "total_tokens": counts.input_tokens + counts.output_tokens,
        "input_tokens_details": {"text_tokens": counts.input_tokens, "image_tokens": 0,
                                 "cached_tokens": counts.cached_read_tokens},
        "encodings": {
            "conditionings": {"encoded": rendered.conditionings.encoded, "reused": rendered.conditionings.reused},
            "references": {"encoded": rendered.references.encoded, "reused": rendered.references.reused},
        },
        "server_encode_ms": round(rendered.encode_s * 1000.0, 3),
        "server_denoise_ms": round(rendered.denoise_s * 1000.0, 3),
    }


def _ms(seconds: float) -> int:
    return math.ceil(seconds * 1000)


async def _outcome(job_done: asyncio.Future[Rendered], started: float, stored: bool) -> Usage:
    """The record of a job once it ends: its status, counts (none unless it completed: a job stopped part way
    through is not charged for its images) and times."""
    media = NO_MEDIA
    try:
        rendered = await job_done
    except asyncio.CancelledError:
        status: RecordStatus = "cancelled"
        counts = TokenCounts(0, 0, 0, 0)
    except Exception:  # noqa: BLE001 - recorded as failed; the handler answers it
        status, counts = "failed", TokenCounts(0, 0, 0, 0)
    else:
        status, counts, media = "completed", counts_of(rendered, stored), media_counts_of(rendered)
    total = _ms(time.perf_counter() - started)
    return Usage(status, counts, Latency(queue_wait_ms=0, ttft_ms=0, total_ms=total), media)


async def _respond(request: web.Request, caller: Caller, parsed: ImageRequest) -> web.Response:
    media = request.app[MEDIA]
    if parsed.model != media.model_id:
        raise model_not_found(parsed.model)
    render = media.render(caller, parsed)
    completion = Completion("img-" + uuid.uuid4().hex, caller.name, media.model_id)
    meter = request.app[METER]
    started = time.perf_counter()
    try:
        job = media.worker.submit(caller.name, render)
    except QueueFullError as exc:
        raise queue_full(str(exc)) from exc
    stored = render.reuse and media.reuse_enabled
    try:
        await asyncio.wait([job.done])
    except asyncio.CancelledError:  # the client went away: stop the job, record it when it ends
        job.cancel()
        meter.record_when_done(completion, _outcome(job.done, started, stored))
        raise
    ended = await _outcome(job.done, started, stored)
    latency = Latency(queue_wait_ms=_ms(job.queue_wait_s), ttft_ms=0, total_ms=max(ended.latency.total_ms,
                                                                                    _ms(job.queue_wait_s)))
    try:
        await meter.record_usage(completion, replace(ended, latency=latency))
    except LedgerError as exc:
        raise Unavailable("the node could not record the usage of this request, so it is not delivered; retry "
                          "later", code="metering_unavailable", retry_after_s=METERING_RETRY_AFTER_S) from exc
    error = job.done.exception()
    if error is not None:
        if isinstance(error, NodeError):
            raise error
        raise ModelFailure("the model failed on this request; the node keeps serving")
    rendered = job.done.result()
    return web.json_response({
        "id": completion.record_id,
        "created": int(time.time()),
        "data": [{"b64_json": base64.b64encode(png).decode("ascii")} for png in rendered.images],
        "output_format": "png",
        "size": f"{render.request.width}x{render.request.height}",
        "seed": render.request.seed,
        "usage": usage(ended.counts, rendered),
    })


@routes.post("/v1/images/generations")
async def generations(request: web.Request) -> web.Response:
    caller = require_role(request[CALLER], "POST /v1/images/generations", *RUNS_COMPLETIONS)
    check_requirements(request, caller)
    options = request.app[MEDIA].options
    return await _respond(request, caller, await read_body(request, lambda body: parse_generation(body, options)))


@routes.post("/v1/images/edits")
async def edits(request: web.Request) -> web.Response:
    """OpenAI's clients send multipart/form-data (the image a file part); JSON with a data: URL is taken too."""
    caller = require_role(request[CALLER], "POST /v1/images/edits", *RUNS_COMPLETIONS)
    check_requirements(request, caller)
    options = request.app[MEDIA].options
    if request.content_type == "multipart/form-data":
        fields, image = await _read_form(request)
        parsed = await off_loop(request, parse_edit_form, fields, image, options, IMAGE_LIMITS)
    else:
        body = await read_body(request, lambda body: body)
        parsed = await off_loop(request, parse_edit_json, body, options, IMAGE_LIMITS)
    return await _respond(request, caller, parsed)


async def _read_form(request: web.Request) -> tuple[dict[str, str], bytes | None]:
    """The form's text fields and its `image` file's bytes, within the body limits and `limits.body_timeout_s`."""
    limit = request.app[CONFIG].limits.body_timeout_s
    try:
        form = await asyncio.wait_for(request.post(), limit)
    except TimeoutError:
        raise InvalidRequest(f"the request body did not arrive within {limit} s", code="body_timeout") from None
    except ValueError as exc:
        raise InvalidRequest(f"the multipart body is malformed: {type(exc).__name__}", code="invalid_body") from None
    fields: dict[str, str] = {}
    image = None
    for name, value in form.items():
        if name in ("image", "image[]"):
            if image is not None:
                raise InvalidRequest("one image is edited per request; send one 'image' part", param="image")
            if not isinstance(value, FileField):
                raise InvalidRequest("'image' must be a file part", param="image")
            image = value.file.read()
        elif isinstance(value, str):
            fields[name] = value
        else:
            raise InvalidRequest(f"'{name}' must be a text field", param=name)
    return fields, image


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    media = request.app[MEDIA]
    return web.json_response({"object": "list", "data": [{
        "id": media.model_id, "object": "model", "created": 0, "owned_by": "tenzro", "kind": "image",
        "sizes": list(media.pipeline.sizes), "reuse": media.reuse_enabled,
    }]})


@routes.get("/v1/node")
async def node(request: web.Request) -> web.Response:
    """`GET /v1/node` of an image node: the identity every node shows, and its pipeline, queue and encoding cache
    as set up at start (the same for every key)."""
    media = request.app[MEDIA]
    return web.json_response({**identity.node_fields(request), "model": media.model_id,
                              "media": media.media_config()})


@routes.get("/v1/node/state")
async def node_state(request: web.Request) -> web.Response:
    """Operators only: the queue and the encoding cache's counts now."""
    require_role(request[CALLER], "GET /v1/node/state", "operator")
    return web.json_response({"object": "node.state", "boot_id": request.app[METER].boot_id,
                              "media": request.app[MEDIA].media_state()})


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    media = request.app[MEDIA]
    body: dict[str, Any] = {"status": "ok", "model": media.model_id}
    caller = request.get(CALLER)
    if caller is not None and caller.role in QUEUE_READERS:
        body.update(media.worker.describe())
    return web.json_response(body)


shared_routes = web.RouteTableDef()
shared_routes.get("/v1/attestation")(identity.attestation)
shared_routes.get("/metrics")(operations.metrics)


def create_media_app(config: NodeConfig, config_path: Path, media: MediaService, metering: MeteringPaths,
                     node_identity: NodeIdentity, policy: NodePolicy, hygiene: dict[str, Any] | None = None,
                     tls: NodeCertificate | None = None) -> web.Application:
    worker, encodings = media.worker, media.pipeline.encodings
    metrics = NodeMetrics(cached_bytes=lambda: float(encodings.bytes) if encodings is not None else 0.0,
                          queue_waiting=lambda: float(worker.waiting))
    app = node_app(config, config_path, metering, node_identity, policy, hygiene, tls,
                   NodeEngine(metrics, media.drop_caller, worker.start, worker.stop),
                   (routes, shared_routes, media_node_routes, records.routes, rpc.routes))
    worker.ttl_of = app[KEYRING].ttl_of
    app[MEDIA] = media
    return app
