"""The metering of one node start: its signing key, ledger segment and prices, fed by the engine's jobs.

Every completion the node accepted gets one signed record under the completion id the client saw,
whether it completed, failed or was cancelled, with its token and media counts and service times (`Latency`).
The record is appended before the handler sees the job's outcome, so a client that has a response can
already look its record up. When a handler stops listening first (the client went away), the meter keeps
waiting for the cancelled job's outcome in the background and records that. Appends fsync, so they run in
a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metering.ledger import Ledger, LedgerError
from metering.pricing import PricingSource, load_pricing, save_pricing
from metering.record import NO_MEDIA, Latency, MediaCounts, RecordStatus, TokenCounts, UsageRecord
from metering.signer import NodeSigner
from node.engine.scheduler import Event, Failed, Finished, Job
from node.log_privacy import Safe
from policies import policy_file

log = logging.getLogger(__name__)

DEFAULT_PRICE_POLICY = policy_file("pricing.yaml")
"""Prices a node starts with when its price file does not exist yet: `policies/pricing.yaml`, installed with
the node as package data (a wheel has no source tree to read it from)."""

NO_TOKENS = TokenCounts(input_tokens=0, cached_read_tokens=0, cached_write_tokens=0, output_tokens=0)
NOT_QUEUED = Latency(queue_wait_ms=0, ttft_ms=0, total_ms=0)
"""The times of a completion whose job was never queued."""


@dataclass(frozen=True, slots=True)
class MeteringPaths:
    ledger_dir: Path
    """Directory of ledger segments; each node start writes a new one."""
    pricing_file: Path
    """Price file, re-read when it changes (`tenzro provider pricing set`)."""


@dataclass(frozen=True, slots=True)
class Completion:
    """Whom a job's record is for."""

    record_id: str  # the completion id the client got: chatcmpl-... or cmpl-...
    caller_id: str
    model: str


@dataclass(frozen=True, slots=True)
class Usage:
    """What a job's record says of it, beside whom it is for (`Completion`): from the engine's outcome for a token
    stream, or worked out by the handler of a job that is not one (an image render)."""

    status: RecordStatus
    counts: TokenCounts
    latency: Latency
    media: MediaCounts = NO_MEDIA


def ensure_price_file(path: Path) -> bool:
    """Write the default price policy to `path` unless a file is there; True when it was written.

    The policy is parsed first, so a broken policy file fails here rather than becoming prices.
    """
    if path.exists():
        return False
    save_pricing(path, load_pricing(DEFAULT_PRICE_POLICY))
    return True


def usage_of(outcome: Finished | Failed) -> tuple[RecordStatus, TokenCounts]:
    """The status and the tokens the engine processed for a job's outcome.

    A failure carries no counts (the engine reports none), and a job cancelled before it started
    processed nothing, so both record zero tokens and cost nothing.
    """
    if isinstance(outcome, Failed):
        return ("cancelled" if isinstance(outcome.error, asyncio.CancelledError) else "failed"), NO_TOKENS
    result = outcome.result
    status: RecordStatus = "cancelled" if result.finish_reason == "cancelled" else "completed"
    return status, TokenCounts(input_tokens=result.prompt_tokens, cached_read_tokens=result.cached_read_tokens,
                               cached_write_tokens=result.cached_write_tokens,
                               output_tokens=len(result.output_ids),
                               cached_write_1h_tokens=result.cached_write_1h_tokens,
                               cached_write_24h_tokens=result.cached_write_24h_tokens)


def media_of(outcome: Finished | Failed) -> MediaCounts:
    """The attachments of a job's prompt, encoded for it or reused; none for a failure (the engine reports none)."""
    if isinstance(outcome, Failed):
        return NO_MEDIA
    result = outcome.result
    return MediaCounts(attachments_encoded=result.attachments_encoded, attachments_reused=result.attachments_reused)


def latency_of(outcome: Finished | Failed, total_s: float) -> Latency:
    """The service times of a job whose `outcome` arrived `total_s` seconds after the job's enqueue.

    The engine measures its queue wait from the enqueue and its time to first token from the job's start,
    so the first token comes `queue_wait_s + ttft_s` after the enqueue. A job cancelled while it waited never
    started: it waited the whole time. A failure tells neither when the job started nor whether a token came.
    """
    total_ms = _ms(total_s)
    if isinstance(outcome, Failed):
        never_started = isinstance(outcome.error, asyncio.CancelledError)
        return Latency(queue_wait_ms=total_ms if never_started else 0, ttft_ms=0, total_ms=total_ms)
    result = outcome.result
    queue_wait_ms = _ms(result.queue_wait_s)
    ttft_ms = _ms(result.queue_wait_s + result.ttft_s) if result.output_ids else 0
    # The engine's intervals and this one are measured apart: their float rounding must not put the end first.
    return Latency(queue_wait_ms, ttft_ms, max(total_ms, ttft_ms, queue_wait_ms))


def _ms(seconds: float) -> int:
    """Whole milliseconds, rounded up as `Latency` defines."""
    return math.ceil(seconds * 1000)


def _since_enqueue(job: Job) -> float:
    return time.perf_counter() - job.enqueued_at


class Meter:
    """Signer, ledger and price source of this node start, and the jobs still to be recorded."""

    def __init__(self, signer: NodeSigner, ledger: Ledger, pricing: PricingSource) -> None:
        self.signer = signer
        self.ledger = ledger
        self.pricing = pricing
        self._following: set[asyncio.Task[None]] = set()

    @classmethod
    def open(cls, paths: MeteringPaths, signer: NodeSigner, evidence_digest: str, boot_id: str | None = None, *,
             code_digest: str | None = None, model_digests: Mapping[str, str] | None = None) -> Meter:
        """A new segment signed by this start's new key `signer`, whose header, records and tree heads name
        `evidence_digest`: the SHA-256 hex of the attestation evidence that binds the key (so the key comes
        first, then the evidence, then the meter). The header also names `code_digest` and `model_digests`
        (model id -> digest, `node.code_identity`) when given. Raises PricingError, LedgerError or RecordError
        (a malformed digest) when one cannot be used."""
        pricing = PricingSource(paths.pricing_file)  # first: bad prices must not leave an empty segment behind
        ledger = Ledger(paths.ledger_dir, signer, boot_id or uuid.uuid4().hex, evidence_digest=evidence_digest,
                        code_digest=code_digest, model_digests=model_digests)
        return cls(signer, ledger, pricing)

    @property
    def boot_id(self) -> str:
        return self.ledger.boot_id

    def _append(self, completion: Completion, outcome: Finished | Failed, latency: Latency) -> UsageRecord:
        return self._append_usage(completion, Usage(*usage_of(outcome), latency, media_of(outcome)))

    def _append_usage(self, completion: Completion, usage: Usage) -> UsageRecord:
        return self.ledger.append(record_id=completion.record_id, caller_id=completion.caller_id,
                                  model=completion.model, status=usage.status, counts=usage.counts,
                                  prices=self.pricing.current(), latency=usage.latency, media=usage.media)

    async def record(self, completion: Completion, outcome: Finished | Failed, latency: Latency) -> UsageRecord:
        """Sign and durably append the record of `outcome`, with the prices in force now."""
        return await asyncio.to_thread(self._append, completion, outcome, latency)

    async def record_usage(self, completion: Completion, usage: Usage) -> UsageRecord:
        """Sign and durably append a record whose usage the caller worked out: a job that is not a token stream
        (an image render), with the prices in force now."""
        return await asyncio.to_thread(self._append_usage, completion, usage)

    def record_when_done(self, completion: Completion, outcome: Awaitable[Usage]) -> None:
        """Record, in the background, a job whose handler stopped listening (its client went away): once
        `outcome` gives its usage. `close` waits for it as for followed jobs."""
        async def record() -> None:
            try:
                await self.record_usage(completion, await outcome)
            except LedgerError as exc:
                log.error("the usage of a cancelled job was not recorded: %s", Safe(exc))

        self._in_background(record())

    def track(self, job: Job, completion: Completion) -> MeteredJob:
        return MeteredJob(self, job, completion)

    def follow(self, job: Job, completion: Completion) -> None:
        """Record a job whose handler stopped listening before its outcome; the job is cancelled."""
        self._in_background(self._record_when_done(job, completion))

    def record_unstarted(self, completion: Completion) -> None:
        """Record, as cancelled with no tokens, a completion whose client may have seen its id (a stream's
        first chunk) but went away before its job was queued."""
        self._in_background(self._record_quietly(completion, Failed(asyncio.CancelledError()), NOT_QUEUED))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._following.add(task)
        task.add_done_callback(self._following.discard)

    async def _record_quietly(self, completion: Completion, outcome: Finished | Failed, latency: Latency) -> None:
        try:
            await self.record(completion, outcome, latency)
        except LedgerError as exc:
            log.error("the usage of a cancelled completion was not recorded: %s", Safe(exc))

    async def _record_when_done(self, job: Job, completion: Completion) -> None:
        while not isinstance(event := await job.events.get(), Finished | Failed):
            pass
        await self._record_quietly(completion, event, latency_of(event, _since_enqueue(job)))

    async def close(self, timeout_s: float) -> None:
        """Record the followed jobs (cancelled, so they end soon while the engine runs), then close."""
        if self._following:
            _, pending = await asyncio.wait(set(self._following), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                log.error("%d cancelled completions did not end within %.0f s and are not recorded",
                          len(pending), timeout_s)
        self.ledger.close()


class MeteredJob:
    """A job's events as its handler reads them: the outcome is on the ledger before it is returned."""

    def __init__(self, meter: Meter, job: Job, completion: Completion) -> None:
        self.meter = meter
        self.job = job
        self.completion = completion
        self.ended = False
        self.record: UsageRecord | None = None
        """The signed record of the outcome, once `next_event` returned it: what the response's usage reads."""

    async def next_event(self) -> Event:
        """The next event; raises LedgerError when the outcome could not be recorded."""
        event = await self.job.events.get()
        if isinstance(event, Finished | Failed):
            self.ended = True
            self.record = await self.meter.record(self.completion, event, latency_of(event, _since_enqueue(self.job)))
        return event

    def close(self) -> None:
        """Stop the job if it still runs (the handler is done with it) and have it recorded when it ends."""
        self.job.cancel()
        if not self.ended:
            self.meter.follow(self.job, self.completion)
