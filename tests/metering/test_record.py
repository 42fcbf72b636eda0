"""Usage records: exact cost arithmetic, service times, validation, and the exact signed JSON form."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from ledger_fixtures import EVIDENCE_DIGEST, NODE_SEED, PRICES

from metering.pricing import DEFAULT_PRICING, PriceSchedule
from metering.record import (
    NO_MEDIA,
    RECORD_FIELDS,
    UNSIGNED,
    ZERO_HASH,
    CostMismatch,
    Latency,
    MediaCounts,
    RecordError,
    TokenCounts,
    UsageRecord,
    cost_wei,
)
from metering.signer import NodeSigner, verify_signed_object


def make_draft(**changes: Any) -> UsageRecord:
    fields: dict[str, Any] = dict(
        record_id="chatcmpl-1",
        seq=0,
        timestamp_ms=1_700_000_000_000,
        node_key_id=NodeSigner.from_seed(NODE_SEED).key_id,
        boot_id="boot-a",
        evidence_digest=EVIDENCE_DIGEST,
        caller_id="caller-a",
        model="tiny",
        status="completed",
        counts=TokenCounts(1200, 1000, 150, 300),
        prices=DEFAULT_PRICING,
        latency=Latency(queue_wait_ms=12, ttft_ms=85, total_ms=2400),
        prev_hash=ZERO_HASH,
    )
    fields.update(changes)
    return UsageRecord.draft(**fields)


def test_cost_splits_the_prompt_into_uncached_read_and_write() -> None:
    counts = TokenCounts(
        input_tokens=1200, cached_read_tokens=1000, cached_write_tokens=150, output_tokens=300
    )
    # 50 * 1e9 + 1000 * 1e8 + 150 * 1.25e9 + 300 * 4e9
    assert counts.uncached_input_tokens == 50
    assert cost_wei(counts, DEFAULT_PRICING) == 1_537_500_000_000


def test_cost_with_small_prices() -> None:
    # (105 - 50 - 5) * 3 + 50 * 1 + 5 * 5 + 25 * 11
    assert cost_wei(TokenCounts(105, 50, 5, 25), PRICES) == 150 + 50 + 25 + 275 == 500


def test_cost_is_exact_far_beyond_float_precision() -> None:
    prices = PriceSchedule(10**18 + 1, 10**18 + 3, 10**17 + 7, 10**18 + 9)
    counts = TokenCounts(2_000_001, 1_000_000, 500_000, 777_777)
    expected = (
        500_001 * (10**18 + 1) + 1_000_000 * (10**17 + 7) + 500_000 * (10**18 + 9) + 777_777 * (10**18 + 3)
    )
    assert cost_wei(counts, prices) == expected == 1_877_778_000_000_000_014_333_332


def test_cached_tokens_may_equal_but_not_exceed_the_prompt() -> None:
    assert TokenCounts(10, 6, 4, 0).uncached_input_tokens == 0
    with pytest.raises(
        RecordError, match=r"cached_read_tokens \(6\) \+ cached_write_tokens \(5\) exceed input_tokens \(10\)"
    ):
        TokenCounts(10, 6, 5, 0)


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ((-1, 0, 0, 0), "input_tokens must be a non-negative integer, got -1"),
        ((5, 0, 0, -2), "output_tokens must be a non-negative integer, got -2"),
        ((5, 1.0, 0, 0), "cached_read_tokens must be a non-negative integer, got 1.0"),
        ((5, 0, True, 0), "cached_write_tokens must be a non-negative integer, got True"),
    ],
)
def test_counts_must_be_non_negative_ints(counts: tuple[Any, ...], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        TokenCounts(*counts)


def test_draft_copies_counts_and_prices_and_computes_cost() -> None:
    draft = make_draft()
    assert draft.counts == TokenCounts(1200, 1000, 150, 300)
    assert draft.prices == DEFAULT_PRICING
    assert draft.cost_wei == 1_537_500_000_000
    assert draft.signature == UNSIGNED


def test_record_with_wrong_cost_is_rejected() -> None:
    with pytest.raises(CostMismatch, match="cost_wei is 1 but counts and prices give 1537500000000"):
        replace(make_draft(), cost_wei=1)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"status": "done"}, "status must be one of completed, failed, cancelled, got 'done'"),
        ({"record_id": ""}, "record_id must be a string of 1 to 256 characters"),
        ({"caller_id": "x" * 257}, "caller_id must be a string of 1 to 256 characters"),
        ({"boot_id": "../etc"}, "boot_id must be 1-64 characters of A-Z a-z 0-9 _ -"),
        ({"node_key_id": "ABCDEF0123456789"}, "node_key_id must be 16 lowercase hex characters"),
        ({"prev_hash": "0" * 63}, "prev_hash must be 64 lowercase hex characters"),
        ({"seq": -1}, "seq must be a non-negative integer, got -1"),
        ({"evidence_digest": "E1" * 32}, "evidence_digest must be 64 lowercase hex characters"),
        ({"evidence_digest": ""}, "evidence_digest must be 64 lowercase hex characters"),
    ],
)
def test_invalid_fields_name_the_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        make_draft(**changes)


def test_signature_must_be_128_lowercase_hex() -> None:
    with pytest.raises(RecordError, match="signature must be 128 lowercase hex characters"):
        replace(make_draft(), signature="AB" * 64)


def test_statuses_failed_and_cancelled_are_records_too() -> None:
    assert make_draft(status="failed").status == "failed"
    cancelled = make_draft(status="cancelled", counts=TokenCounts(5, 0, 0, 0), latency=Latency(40, 0, 40))
    assert cancelled.cost_wei == 5 * 10**9


def test_latency_is_carried_and_read_back() -> None:
    draft = make_draft()
    assert (draft.queue_wait_ms, draft.ttft_ms, draft.total_ms) == (12, 85, 2400)
    assert draft.latency == Latency(queue_wait_ms=12, ttft_ms=85, total_ms=2400)


@pytest.mark.parametrize(
    ("times", "message"),
    [
        ((-1, 0, 0), r"queue_wait_ms must be a non-negative integer \(milliseconds\), got -1"),
        ((0, 1.5, 2), r"ttft_ms must be a non-negative integer \(milliseconds\), got 1.5"),
        ((0, 0, True), r"total_ms must be a non-negative integer \(milliseconds\), got True"),
        ((0, 11, 10), r"ttft_ms \(11\) exceeds total_ms \(10\)"),
        ((11, 0, 10), r"queue_wait_ms \(11\) exceeds total_ms \(10\)"),
    ],
)
def test_latency_times_are_ordered_non_negative_ints(times: tuple[Any, ...], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        Latency(*times)


def test_latency_may_be_all_equal_or_zero() -> None:
    assert Latency(7, 7, 7).total_ms == 7
    assert Latency(0, 0, 0).ttft_ms == 0


def test_ttft_is_zero_without_a_token_and_never_before_the_start() -> None:
    no_output = TokenCounts(5, 0, 0, 0)
    assert make_draft(counts=no_output, latency=Latency(30, 0, 30)).ttft_ms == 0
    with pytest.raises(RecordError, match=r"ttft_ms is 25 but no token came \(output_tokens 0\); it must be 0"):
        make_draft(counts=no_output, latency=Latency(30, 25, 30))
    with pytest.raises(RecordError, match=r"ttft_ms \(29\) is below queue_wait_ms \(30\)"):
        make_draft(latency=Latency(30, 29, 40))
    assert make_draft(latency=Latency(30, 30, 30)).ttft_ms == 30


def test_record_carries_counts_times_and_ids_only() -> None:
    assert RECORD_FIELDS == (
        "record_id",
        "seq",
        "timestamp_ms",
        "node_key_id",
        "boot_id",
        "evidence_digest",
        "caller_id",
        "model",
        "status",
        "input_tokens",
        "cached_read_tokens",
        "cached_write_tokens",
        "output_tokens",
        "input_price_wei",
        "output_price_wei",
        "cached_read_price_wei",
        "cached_write_price_wei",
        "cost_wei",
        "queue_wait_ms",
        "ttft_ms",
        "total_ms",
        "prev_hash",
        "signature",
        "cached_write_1h_tokens",
        "cached_write_1h_price_wei",
        "cached_write_24h_tokens",
        "cached_write_24h_price_wei",
        "attachments_encoded",
        "attachments_reused",
        "conditionings_encoded",
        "conditionings_reused",
        "images",
        "image_price_wei",
    )


CLASS_PRICES = PriceSchedule(10, 40, 1, 12, cached_write_1h_price_wei=20, cached_write_24h_price_wei=30)


def test_writes_of_each_time_to_live_class_are_charged_at_its_price() -> None:
    counts = TokenCounts(100, 10, 60, 5, cached_write_1h_tokens=40, cached_write_24h_tokens=15)
    # 30 uncached * 10 + 10 reads * 1 + 5 default writes * 12 + 40 * 20 + 15 * 30 + 5 output * 40
    assert cost_wei(counts, CLASS_PRICES) == 300 + 10 + 60 + 800 + 450 + 200 == 1820
    # A schedule without class prices charges them as plain writes.
    assert cost_wei(counts, PriceSchedule(10, 40, 1, 12)) == 300 + 10 + 60 * 12 + 200
    with pytest.raises(RecordError, match="exceed cached_write_tokens"):
        TokenCounts(100, 10, 60, 5, cached_write_1h_tokens=50, cached_write_24h_tokens=15)


def test_a_class_write_is_signed_with_its_price_and_only_then_in_the_json() -> None:
    record = make_draft(counts=TokenCounts(100, 10, 60, 5, cached_write_1h_tokens=40), prices=CLASS_PRICES)
    assert (record.cached_write_1h_tokens, record.cached_write_1h_price_wei) == (40, 20)
    assert (record.cached_write_24h_tokens, record.cached_write_24h_price_wei) == (0, 0)  # none: no price named
    obj = record.to_json()
    assert obj["cached_write_1h_tokens"] == 40 and obj["cached_write_1h_price_wei"] == "20"
    assert "cached_write_24h_tokens" not in obj and "cached_write_24h_price_wei" not in obj
    assert UsageRecord.from_json(obj) == record
    assert record.cost_wei == 30 * 10 + 10 * 1 + 20 * 12 + 40 * 20 + 5 * 40 == 1550
    with pytest.raises(RecordError, match="members together"):
        UsageRecord.from_json({**obj, "cached_write_24h_tokens": 0, "cached_write_24h_price_wei": "0"})
    with pytest.raises(RecordError, match="members together"):
        UsageRecord.from_json({k: v for k, v in obj.items() if k != "cached_write_1h_price_wei"})
    with pytest.raises(RecordError, match="must be 0 when cached_write_24h_tokens is 0"):
        replace(record, cached_write_24h_price_wei=5)
    with pytest.raises(CostMismatch):
        replace(record, cached_write_1h_price_wei=21)


IMAGE_PRICES = PriceSchedule(10, 40, 1, 12, image_price_wei=1000)


def test_images_are_charged_at_the_image_price_and_encodings_at_nothing() -> None:
    counts = TokenCounts(7, 0, 7, 0)
    # 7 cached writes * 12 + 2 images * 1000; the conditionings are counted, not priced.
    media = MediaCounts(conditionings_encoded=1, images=2)
    assert cost_wei(counts, IMAGE_PRICES, media) == 84 + 2000 == 2084
    assert cost_wei(counts, IMAGE_PRICES, MediaCounts(attachments_encoded=3, attachments_reused=5,
                                                      conditionings_reused=2)) == 84
    assert cost_wei(counts, PriceSchedule(10, 40, 1, 12), media) == 84  # no image price: images add nothing
    with pytest.raises(RecordError, match="images must be a non-negative integer, got -1"):
        MediaCounts(images=-1)


def test_media_counts_are_signed_and_in_the_json_only_when_not_zero() -> None:
    media = MediaCounts(conditionings_encoded=1, conditionings_reused=1, images=2)
    record = make_draft(counts=TokenCounts(7, 0, 7, 0), prices=IMAGE_PRICES, media=media,
                        latency=Latency(3, 0, 900))
    assert (record.media, record.image_price_wei, record.cost_wei) == (media, 1000, 2084)
    obj = record.to_json()
    assert {name: obj[name] for name in obj if name.startswith(("conditionings", "image"))} == {
        "conditionings_encoded": 1, "conditionings_reused": 1, "images": 2, "image_price_wei": "1000"}
    assert "attachments_encoded" not in obj and "attachments_reused" not in obj
    assert UsageRecord.from_json(obj) == record
    chat = make_draft(media=MediaCounts(attachments_encoded=1, attachments_reused=2), prices=IMAGE_PRICES)
    chat_obj = chat.to_json()
    assert (chat_obj["attachments_encoded"], chat_obj["attachments_reused"]) == (1, 2)
    assert "images" not in chat_obj and "image_price_wei" not in chat_obj  # no image: its price is not named
    assert chat.cost_wei == make_draft(prices=IMAGE_PRICES).cost_wei  # attachments add nothing to the cost
    with pytest.raises(RecordError, match="attachments_reused is a member only when it is not 0"):
        UsageRecord.from_json({**chat_obj, "attachments_reused": 0})
    with pytest.raises(RecordError, match="images and image_price_wei are members together"):
        UsageRecord.from_json({k: v for k, v in obj.items() if k != "image_price_wei"})
    with pytest.raises(RecordError, match="must be 0 when images is 0"):
        replace(chat, image_price_wei=5)
    with pytest.raises(CostMismatch, match="counts and prices give 2084"):
        replace(record, cost_wei=84)
    with pytest.raises(CostMismatch):
        replace(record, image_price_wei=999)


NODE_KEY_ID = "56475aa75463474c"  # key_id of NODE_SEED's public key
SIGNATURE = (
    "979877b73b53a2cc42fb48ab34cb325de5b7d49f69c232ac5ae628daa727db97"
    "f5b44a79090106f38945986a378745af85c1e7717080a7cdb3976a8fbf41d307"
)
PAYLOAD = (
    b'{"boot_id":"boot-a","cached_read_price_wei":"100000000","cached_read_tokens":1000,'
    b'"cached_write_price_wei":"1250000000","cached_write_tokens":150,"caller_id":"caller-a",'
    b'"cost_wei":"1537500000000","evidence_digest":"' + EVIDENCE_DIGEST.encode() + b'",'
    b'"input_price_wei":"1000000000","input_tokens":1200,'
    b'"model":"tiny","node_key_id":"56475aa75463474c","output_price_wei":"4000000000",'
    b'"output_tokens":300,"prev_hash":"0000000000000000000000000000000000000000000000000000000000000000",'
    b'"queue_wait_ms":12,"record_id":"chatcmpl-1","seq":0,"status":"completed","timestamp_ms":1700000000000,'
    b'"total_ms":2400,"ttft_ms":85}'
)


def test_exact_signing_payload_signature_and_line() -> None:
    signer = NodeSigner.from_seed(NODE_SEED)
    assert signer.key_id == NODE_KEY_ID
    draft = make_draft()
    assert draft.signing_payload() == PAYLOAD
    record = draft.with_signature(signer.sign(PAYLOAD))
    assert record.signature == SIGNATURE
    verify_signed_object(signer.public_key_hex, record.to_json())
    # The line is the payload with the signature member in its sorted place.
    assert record.canonical_bytes() == PAYLOAD.replace(
        b',"status"', b',"signature":"' + SIGNATURE.encode() + b'","status"'
    )
    assert record.entry_hash() == "741caff22c380ba5535b8df2038d61ee4ba6f8f84640c5ee560c93e45b22a671"


def test_a_record_without_media_keeps_the_bytes_it_had_before_media_counts() -> None:
    # An image price in force names nothing in a record without images: text records sign what they always did.
    priced = make_draft(media=NO_MEDIA, prices=replace(DEFAULT_PRICING, image_price_wei=5))
    assert priced.signing_payload() == PAYLOAD


def test_json_round_trip_with_wei_as_strings() -> None:
    record = make_draft(prices=PriceSchedule(10**18, 10**18, 10**17, 10**18))
    obj = record.to_json()
    assert obj["cost_wei"] == "600000000000000000000"  # (50 + 150 + 300) * 1e18 + 1000 * 1e17
    assert obj["input_tokens"] == 1200
    assert UsageRecord.from_json(obj) == record


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"extra": 1}, r"unknown \['extra'\], missing none"),
        ({"signature": None}, "signature must be a JSON string"),
        ({"seq": True}, "seq must be a JSON integer, got True"),
        ({"input_tokens": "1200"}, "input_tokens must be a JSON integer"),
        ({"cost_wei": 1537500000000}, "cost_wei must be a decimal string"),
        ({"input_price_wei": "01000000000"}, "input_price_wei must not have leading zeros"),
        ({"model": 5}, "model must be a JSON string"),
        ({"ttft_ms": 85.0}, "ttft_ms must be a JSON integer, got 85.0"),
        ({"total_ms": "2400"}, "total_ms must be a JSON integer"),
        ({"evidence_digest": 5}, "evidence_digest must be a JSON string"),
    ],
)
def test_from_json_requires_exact_members_and_types(changes: dict[str, Any], message: str) -> None:
    obj = {**make_draft().to_json(), **changes}
    with pytest.raises(RecordError, match=message):
        UsageRecord.from_json(obj)


def test_from_json_names_missing_members() -> None:
    obj = make_draft().to_json()
    del obj["prev_hash"]
    with pytest.raises(RecordError, match=r"unknown none, missing \['prev_hash'\]"):
        UsageRecord.from_json(obj)
