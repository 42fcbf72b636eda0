"""The signed usage record of one completion: token and media counts, the prices charged, the cost, service times,
ids.

A record carries counts, times and identifiers only. It never holds prompt or completion text, images, nor any
hash of them: a digest of short or guessable text can be reversed by trying candidates, and the
ledger is read by people who must not learn what callers asked.

In JSON, wei amounts are decimal strings (RFC 8785 section 6: integers beyond 2**53 - 1 have no
exact JSON number form, and a day of tokens at wei prices exceeds that); every other number is a
JSON integer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from metering.canonical import CanonicalJsonError, canonical_json, wei_from_json, wei_to_json
from metering.pricing import PriceSchedule, PricingError
from metering.signer import signed_payload

RecordStatus = Literal["completed", "failed", "cancelled"]
STATUSES: tuple[RecordStatus, ...] = ("completed", "failed", "cancelled")

ZERO_HASH = "0" * 64
"""`prev_hash` of the first record in a segment."""

UNSIGNED = ""
"""`signature` of a draft record that has not been signed yet; never written to a ledger."""

MAX_ID_CHARS = 256
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_BOOT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RecordError(ValueError):
    """A usage record or its JSON is invalid; the message names the field."""


class CostMismatch(RecordError):
    """A record's `cost_wei` is not what its counts and prices give."""


def check_boot_id(boot_id: object) -> str:
    """Boot ids name segment files, so they are restricted to 1-64 of [A-Za-z0-9_-]."""
    if not isinstance(boot_id, str) or not _BOOT_ID.fullmatch(boot_id):
        raise RecordError(f"boot_id must be 1-64 characters of A-Z a-z 0-9 _ -, got {boot_id!r}")
    return boot_id


def check_evidence_digest(digest: object) -> str:
    """The SHA-256 of the node start's attestation evidence, which binds the signing key: records and tree
    heads name it, so that each signed statement says which attested start made it."""
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise RecordError(
            f"evidence_digest must be 64 lowercase hex characters (SHA-256 of the attestation evidence), "
            f"got {digest!r}"
        )
    return digest


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """Token counts of one completion.

    `input_tokens` is the whole prompt (as OpenAI clients expect); of it, `cached_read_tokens` were
    served from reused state and `cached_write_tokens` were newly stored for reuse. The two cached
    classes are disjoint parts of the prompt, so together they never exceed `input_tokens`. Of the
    writes, `cached_write_1h_tokens` and `cached_write_24h_tokens` were stored to be held for an hour
    and a day (the caller's time-to-live class), each priced apart; the rest for the default time.
    """

    input_tokens: int
    cached_read_tokens: int
    cached_write_tokens: int
    output_tokens: int
    cached_write_1h_tokens: int = 0
    cached_write_24h_tokens: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or value < 0:
                raise RecordError(f"{field.name} must be a non-negative integer, got {value!r}")
        if self.cached_read_tokens + self.cached_write_tokens > self.input_tokens:
            raise RecordError(
                f"cached_read_tokens ({self.cached_read_tokens}) + cached_write_tokens "
                f"({self.cached_write_tokens}) exceed input_tokens ({self.input_tokens}); cached "
                "tokens are part of the prompt, so count them in input_tokens too"
            )
        if self.cached_write_1h_tokens + self.cached_write_24h_tokens > self.cached_write_tokens:
            raise RecordError(
                f"cached_write_1h_tokens ({self.cached_write_1h_tokens}) + cached_write_24h_tokens "
                f"({self.cached_write_24h_tokens}) exceed cached_write_tokens ({self.cached_write_tokens}); "
                "they are part of the writes, so count them in cached_write_tokens too"
            )

    @property
    def uncached_input_tokens(self) -> int:
        """Prompt tokens charged at the plain input price."""
        return self.input_tokens - self.cached_read_tokens - self.cached_write_tokens


@dataclass(frozen=True, slots=True)
class MediaCounts:
    """What a completion's media took beyond its tokens: counts only, never content or a digest of it.

    - `attachments_encoded`, `attachments_reused`: the images and audio clips a chat prompt sent, run through the
      model's encoder for this request, or not (restored with the prefix, or found in the caller's encoding cache).
    - `conditionings_encoded`, `conditionings_reused`: on an image node, the prompt's conditioning and an edit's
      reference-image latents, computed for this request or taken from the caller's encoding cache.
    - `images`: the images an image node produced, each charged the image price.

    Encoded and reused are counted, not priced: their tokens already are (a reused attachment's positions are
    cached reads rather than input), and one price per encoder run would bill the caller for the node's cache
    misses. Only `images` adds to the cost.
    """

    attachments_encoded: int = 0
    attachments_reused: int = 0
    conditionings_encoded: int = 0
    conditionings_reused: int = 0
    images: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or value < 0:
                raise RecordError(f"{field.name} must be a non-negative integer, got {value!r}")


NO_MEDIA = MediaCounts()
"""A text completion without attachments."""


@dataclass(frozen=True, slots=True)
class Latency:
    """Service times of one completion in whole milliseconds, each measured from the job's enqueue (the node
    taking it into its queue), so that a caller can show from signed data that a latency promise was missed.

    Each is rounded up: for an integer N, `ttft_ms <= N` holds exactly when the measured time was at most N ms.

    - `queue_wait_ms`: enqueue to the engine's worker starting the job. A job cancelled before it started
      waited the whole time (`queue_wait_ms == total_ms`). A job that failed in the engine records 0: the
      engine does not report when such a job started.
    - `ttft_ms`: enqueue to the first generated token, queue wait included (what the caller waits for). 0 when
      the record has no output token: none came, or the job failed (a failure reports no tokens).
    - `total_ms`: enqueue to the end: the job's outcome reaching the request's handler (or the meter, for a
      client that went away).

    A completion whose job was never queued (its client went away first) records 0 for all three.
    `UsageRecord` adds the checks that need the token counts.
    """

    queue_wait_ms: int
    ttft_ms: int
    total_ms: int

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or value < 0:
                raise RecordError(f"{field.name} must be a non-negative integer (milliseconds), got {value!r}")
        for name in ("queue_wait_ms", "ttft_ms"):
            if getattr(self, name) > self.total_ms:
                raise RecordError(
                    f"{name} ({getattr(self, name)}) exceeds total_ms ({self.total_ms}); every time is "
                    "measured from the enqueue, and the end comes last"
                )


def cost_wei(counts: TokenCounts, prices: PriceSchedule, media: MediaCounts = NO_MEDIA) -> int:
    """The charge for a completion, in wei: its tokens at their classes' prices, and its images at the image price."""
    return (
        counts.uncached_input_tokens * prices.input_price_wei
        + counts.cached_read_tokens * prices.cached_read_price_wei
        + (counts.cached_write_tokens - counts.cached_write_1h_tokens - counts.cached_write_24h_tokens)
        * prices.cached_write_price_wei
        + counts.cached_write_1h_tokens * prices.write_1h_price_wei
        + counts.cached_write_24h_tokens * prices.write_24h_price_wei
        + counts.output_tokens * prices.output_price_wei
        + media.images * prices.image_price_wei
    )


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One ledger entry. `signature` is Ed25519 over the canonical JSON of all other fields.

    Attachments and conditionings, encoded or reused, are counted and not priced; images are priced (`MediaCounts`).
    """

    record_id: str  # the completion id the caller saw
    seq: int  # position in the segment, from 0, no gaps
    timestamp_ms: int  # Unix epoch milliseconds when the record was appended
    node_key_id: str  # `NodeSigner.key_id` of the signing key
    boot_id: str  # the node start (and ledger segment) this record belongs to
    evidence_digest: str  # SHA-256 hex of that node start's attestation evidence
    caller_id: str
    model: str
    status: RecordStatus
    input_tokens: int
    cached_read_tokens: int
    cached_write_tokens: int
    output_tokens: int
    input_price_wei: int
    output_price_wei: int
    cached_read_price_wei: int
    cached_write_price_wei: int
    cost_wei: int  # == cost_wei(self.counts, self.prices, self.media), checked on construction
    queue_wait_ms: int  # the three times form `self.latency`; `Latency` defines them
    ttft_ms: int  # 0 when output_tokens is 0, else at least queue_wait_ms
    total_ms: int
    prev_hash: str  # SHA-256 hex of the previous record's line, ZERO_HASH for seq 0
    signature: str  # 128 hex characters, or UNSIGNED for a draft
    # Writes of a time-to-live class priced apart, and that price; in JSON only when the count is not 0 (both
    # then), so that records from before the classes keep their bytes and signatures (PRICED_FIELDS).
    cached_write_1h_tokens: int = 0
    cached_write_1h_price_wei: int = 0
    cached_write_24h_tokens: int = 0
    cached_write_24h_price_wei: int = 0
    # Media (`MediaCounts`), each in JSON only when not 0 (the image price with `images`, PRICED_FIELDS), for the
    # same reason. Reused attachments and conditionings are counted, not priced apart (`MediaCounts` says why).
    attachments_encoded: int = 0
    attachments_reused: int = 0
    conditionings_encoded: int = 0
    conditionings_reused: int = 0
    images: int = 0
    image_price_wei: int = 0

    def __post_init__(self) -> None:
        for name in ("record_id", "caller_id", "model"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
                raise RecordError(f"{name} must be a string of 1 to {MAX_ID_CHARS} characters, got {value!r}")
        for name in ("seq", "timestamp_ms", "cost_wei"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise RecordError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.node_key_id, str) or not _KEY_ID.fullmatch(self.node_key_id):
            raise RecordError(f"node_key_id must be 16 lowercase hex characters, got {self.node_key_id!r}")
        check_boot_id(self.boot_id)
        check_evidence_digest(self.evidence_digest)
        if self.status not in STATUSES:
            raise RecordError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        if not isinstance(self.prev_hash, str) or not _HEX64.fullmatch(self.prev_hash):
            raise RecordError(f"prev_hash must be 64 lowercase hex characters, got {self.prev_hash!r}")
        for count, price in PRICED_FIELDS:
            if getattr(self, count) == 0 and getattr(self, price) != 0:
                raise RecordError(f"{price} must be 0 when {count} is 0: a record names only prices it charged")
        if self.signature != UNSIGNED and (
            not isinstance(self.signature, str) or not _HEX128.fullmatch(self.signature)
        ):
            raise RecordError("signature must be 128 lowercase hex characters")
        try:
            expected = cost_wei(self.counts, self.prices, self.media)
        except PricingError as exc:
            raise RecordError(str(exc)) from exc
        if self.cost_wei != expected:
            raise CostMismatch(
                f"cost_wei is {self.cost_wei} but counts and prices give {expected}; "
                "cost = uncached input * input price + cached reads * read price "
                "+ cached writes * write price (1h and 24h writes at theirs) + output * output price "
                "+ images * image price"
            )
        latency = self.latency
        if self.output_tokens == 0 and latency.ttft_ms != 0:
            raise RecordError(f"ttft_ms is {latency.ttft_ms} but no token came (output_tokens 0); it must be 0")
        if self.output_tokens > 0 and latency.ttft_ms < latency.queue_wait_ms:
            raise RecordError(
                f"ttft_ms ({latency.ttft_ms}) is below queue_wait_ms ({latency.queue_wait_ms}); the first "
                "token comes after the job starts, and both are measured from the enqueue"
            )

    @classmethod
    def draft(
        cls,
        *,
        record_id: str,
        seq: int,
        timestamp_ms: int,
        node_key_id: str,
        boot_id: str,
        evidence_digest: str,
        caller_id: str,
        model: str,
        status: RecordStatus,
        counts: TokenCounts,
        prices: PriceSchedule,
        latency: Latency,
        prev_hash: str,
        media: MediaCounts = NO_MEDIA,
    ) -> UsageRecord:
        """An unsigned record with its cost computed from `counts`, `media` and `prices`."""
        return cls(
            record_id=record_id,
            seq=seq,
            timestamp_ms=timestamp_ms,
            node_key_id=node_key_id,
            boot_id=boot_id,
            evidence_digest=evidence_digest,
            caller_id=caller_id,
            model=model,
            status=status,
            **asdict(counts),
            input_price_wei=prices.input_price_wei,
            output_price_wei=prices.output_price_wei,
            cached_read_price_wei=prices.cached_read_price_wei,
            cached_write_price_wei=prices.cached_write_price_wei,
            cached_write_1h_price_wei=prices.write_1h_price_wei if counts.cached_write_1h_tokens else 0,
            cached_write_24h_price_wei=prices.write_24h_price_wei if counts.cached_write_24h_tokens else 0,
            **asdict(media),
            image_price_wei=prices.image_price_wei if media.images else 0,
            cost_wei=cost_wei(counts, prices, media),
            **asdict(latency),
            prev_hash=prev_hash,
            signature=UNSIGNED,
        )

    def with_signature(self, signature: bytes) -> UsageRecord:
        return replace(self, signature=signature.hex())

    @property
    def counts(self) -> TokenCounts:
        return TokenCounts(
            self.input_tokens, self.cached_read_tokens, self.cached_write_tokens, self.output_tokens,
            self.cached_write_1h_tokens, self.cached_write_24h_tokens,
        )

    @property
    def prices(self) -> PriceSchedule:
        return PriceSchedule(
            self.input_price_wei,
            self.output_price_wei,
            self.cached_read_price_wei,
            self.cached_write_price_wei,
            self.cached_write_1h_price_wei if self.cached_write_1h_tokens else None,
            self.cached_write_24h_price_wei if self.cached_write_24h_tokens else None,
            self.image_price_wei,
        )

    @property
    def media(self) -> MediaCounts:
        return MediaCounts(self.attachments_encoded, self.attachments_reused, self.conditionings_encoded,
                           self.conditionings_reused, self.images)

    @property
    def latency(self) -> Latency:
        return Latency(self.queue_wait_ms, self.ttft_ms, self.total_ms)

    def to_json(self) -> dict[str, Any]:
        """The JSON object form: field names as members, wei amounts as decimal strings."""
        obj: dict[str, Any] = {field.name: getattr(self, field.name) for field in fields(self)}
        for count, price in PRICED_FIELDS:
            if obj[count] == 0:
                del obj[count], obj[price]
        for name in MEDIA_COUNT_FIELDS:
            if obj[name] == 0:
                del obj[name]
        for name in WEI_FIELDS:
            if name in obj:
                obj[name] = wei_to_json(obj[name])
        return obj

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> UsageRecord:
        """Parse `to_json` output; exactly the record's members, each of its exact JSON type."""
        if not isinstance(obj, Mapping):
            raise RecordError(f"a usage record is a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(RECORD_FIELDS))
        missing = [name for name in RECORD_FIELDS if name not in obj and name not in OPTIONAL_FIELDS]
        for count, price in PRICED_FIELDS:
            if (count in obj) != (price in obj) or obj.get(count, 1) == 0:
                raise RecordError(f"{count} and {price} are members together, and only when {count} is not 0")
        for name in MEDIA_COUNT_FIELDS:
            if obj.get(name, 1) == 0:
                raise RecordError(f"{name} is a member only when it is not 0")
        if unknown or missing:
            raise RecordError(
                f"usage record members differ: unknown {unknown or 'none'}, missing {missing or 'none'}"
            )
        values: dict[str, Any] = {}
        for name in RECORD_FIELDS:
            if name not in obj:
                continue  # an optional member left out: its default
            value = obj[name]
            if name in WEI_FIELDS:
                try:
                    value = wei_from_json(value, name)
                except CanonicalJsonError as exc:
                    raise RecordError(str(exc)) from exc
            elif name in _INT_FIELDS and type(value) is not int:
                raise RecordError(f"{name} must be a JSON integer, got {value!r}")
            elif name not in _INT_FIELDS and not isinstance(value, str):
                raise RecordError(f"{name} must be a JSON string, got {value!r}")
            values[name] = value
        return cls(**values)

    def signing_payload(self) -> bytes:
        """The bytes `signature` covers."""
        return signed_payload(self.to_json())

    def canonical_bytes(self) -> bytes:
        """The record's ledger line, without the newline."""
        return canonical_json(self.to_json())

    def entry_hash(self) -> str:
        """SHA-256 hex of the ledger line; the next record's `prev_hash`."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()


RECORD_FIELDS: tuple[str, ...] = tuple(field.name for field in fields(UsageRecord))
WEI_FIELDS: tuple[str, ...] = tuple(name for name in RECORD_FIELDS if name.endswith("_wei"))
PRICED_FIELDS: tuple[tuple[str, str], ...] = (
    ("cached_write_1h_tokens", "cached_write_1h_price_wei"),
    ("cached_write_24h_tokens", "cached_write_24h_price_wei"),
    ("images", "image_price_wei"),
)
"""(count, price) of each time-to-live class priced apart, and of images: members of a record's JSON only when the
count is not 0, so that a record without them has the bytes (and signature) it had before they existed."""
MEDIA_COUNT_FIELDS: tuple[str, ...] = tuple(field.name for field in fields(MediaCounts) if field.name != "images")
"""Counts priced nowhere: members of a record's JSON only when not 0, for the same reason."""
OPTIONAL_FIELDS = frozenset({name for pair in PRICED_FIELDS for name in pair} | set(MEDIA_COUNT_FIELDS))
_INT_FIELDS = frozenset(
    {"seq", "timestamp_ms", "input_tokens", "cached_read_tokens", "cached_write_tokens", "output_tokens",
     "cached_write_1h_tokens", "cached_write_24h_tokens"}
    | {field.name for field in fields(MediaCounts)}
    | {field.name for field in fields(Latency)}
)
