"""The node's meter in process: outcomes to statuses, counts and service times, followed jobs, failed and
unrecordable completions, the default price policy, and the metering routes' parameter checks."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from cache.arena import Scope
from metering.pricing import DEFAULT_PRICING, PriceSchedule, load_pricing, save_pricing
from metering.record import NO_MEDIA, Latency, MediaCounts, TokenCounts
from metering.signer import NodeSigner
from node.api.app import create_app
from node.api.keys import METER
from node.config import add_key, load_config
from node.engine.device import plan_device
from node.engine.loader import load_model
from node.engine.runner import GenerationRequest, GenerationResult, ModelRunner, Sequence
from node.engine.sampling import SamplingParams
from node.engine.scheduler import Failed, Finished, Job, Scheduler
from node.identity import NodeIdentity
from node.meter import (
    DEFAULT_PRICE_POLICY,
    NO_TOKENS,
    Completion,
    Meter,
    MeteringPaths,
    ensure_price_file,
    latency_of,
    media_of,
    usage_of,
)
from node.service import ModelService
from policies.node_policy import load_node_policy

PRICES = PriceSchedule(input_price_wei=7, output_price_wei=13, cached_read_price_wei=2, cached_write_price_wei=9)
EVIDENCE_DIGEST = "e1" * 32


def result(finish_reason: str, output: int = 3, queue_wait_s: float = 0.0, ttft_s: float = 0.0) -> GenerationResult:
    return GenerationResult(prompt_tokens=10, cached_read_tokens=4, cached_write_tokens=6,
                            output_ids=list(range(output)), text="", finish_reason=finish_reason,
                            queue_wait_s=queue_wait_s, ttft_s=ttft_s)


@pytest.mark.parametrize(("outcome", "status", "counts"), [
    (Finished(result("stop")), "completed", TokenCounts(10, 4, 6, 3)),
    (Finished(result("length", output=5)), "completed", TokenCounts(10, 4, 6, 5)),
    (Finished(result("cancelled", output=1)), "cancelled", TokenCounts(10, 4, 6, 1)),
    (Failed(asyncio.CancelledError()), "cancelled", TokenCounts(0, 0, 0, 0)),
    (Failed(RuntimeError("model fault")), "failed", TokenCounts(0, 0, 0, 0)),
], ids=["stop", "length", "cancelled-mid-decode", "cancelled-while-queued", "failed"])
def test_usage_of_an_outcome(outcome: Finished | Failed, status: str, counts: TokenCounts) -> None:
    assert usage_of(outcome) == (status, counts)


def test_media_of_an_outcome_counts_its_attachments() -> None:
    with_images = replace(result("stop"), attachments_encoded=1, attachments_reused=2)
    assert media_of(Finished(with_images)) == MediaCounts(attachments_encoded=1, attachments_reused=2)
    assert media_of(Finished(result("stop"))) == NO_MEDIA
    assert media_of(Failed(RuntimeError("model fault"))) == NO_MEDIA


@pytest.mark.parametrize(("outcome", "total_s", "latency"), [
    # The first token comes queue_wait_s + ttft_s after the enqueue; every time is rounded up to a whole ms.
    (Finished(result("stop", queue_wait_s=0.0042, ttft_s=0.0311)), 0.25, Latency(5, 36, 250)),
    (Finished(result("length", queue_wait_s=0.002, ttft_s=0.003)), 0.0101, Latency(2, 5, 11)),
    (Finished(result("cancelled", output=1, queue_wait_s=0.0, ttft_s=0.0005)), 0.0005, Latency(0, 1, 1)),
    # Measured apart, the end may read a hair before the first token: it is never put first.
    (Finished(result("stop", queue_wait_s=0.010, ttft_s=0.0201)), 0.0295, Latency(10, 31, 31)),
    (Finished(result("stop", output=0, queue_wait_s=0.003, ttft_s=0.0)), 0.004, Latency(3, 0, 4)),
    (Failed(asyncio.CancelledError()), 0.0405, Latency(41, 0, 41)),
    (Failed(RuntimeError("model fault")), 0.5, Latency(0, 0, 500)),
], ids=["stop", "length", "cancelled-mid-decode", "end-read-early", "no-token", "cancelled-while-queued",
        "failed"])
def test_latency_of_an_outcome(outcome: Finished | Failed, total_s: float, latency: Latency) -> None:
    assert latency_of(outcome, total_s) == latency


def test_default_price_policy_is_written_once_and_equals_the_cli_defaults(tmp_path: Path) -> None:
    assert load_pricing(DEFAULT_PRICE_POLICY) == DEFAULT_PRICING
    path = tmp_path / "home" / "pricing.yaml"
    assert ensure_price_file(path) is True
    assert load_pricing(path) == DEFAULT_PRICING
    save_pricing(path, PRICES)
    assert ensure_price_file(path) is False
    assert load_pricing(path) == PRICES


def paths(tmp_path: Path) -> MeteringPaths:
    save_pricing(tmp_path / "pricing.yaml", PRICES)
    return MeteringPaths(ledger_dir=tmp_path / "ledger", pricing_file=tmp_path / "pricing.yaml")


def open_meter(tmp_path: Path) -> Meter:
    return Meter.open(paths(tmp_path), NodeSigner.generate(), EVIDENCE_DIGEST)


async def test_a_job_left_by_its_handler_is_recorded_when_it_ends(tmp_path: Path) -> None:
    meter = open_meter(tmp_path)
    request = GenerationRequest(Scope("alice", "m"), [1, 2], SamplingParams(max_tokens=8))
    job = Job("alice", request, asyncio.get_running_loop())
    job.enqueued_at -= 0.2  # it was queued 200 ms ago
    metered = meter.track(job, Completion("cmpl-left", "alice", "m"))
    metered.close()  # the client went away before the outcome
    assert job.cancel_event.is_set()
    job.post(Finished(result("cancelled", output=2, queue_wait_s=0.05, ttft_s=0.06)))
    await meter.close(timeout_s=10)
    record = meter.ledger.get("cmpl-left")
    assert record is not None
    assert (record.status, record.caller_id, record.model, record.counts) == (
        "cancelled", "alice", "m", TokenCounts(10, 4, 6, 2))
    assert record.cost_wei == 0 * 7 + 4 * 2 + 6 * 9 + 2 * 13
    assert (record.input_price_wei, record.output_price_wei) == (7, 13)
    assert (record.queue_wait_ms, record.ttft_ms, record.evidence_digest) == (50, 110, EVIDENCE_DIGEST)
    assert 200 <= record.total_ms < 10_200  # from the enqueue to the meter reading the outcome


async def test_a_completion_never_queued_is_recorded_with_no_times(tmp_path: Path) -> None:
    meter = open_meter(tmp_path)
    meter.record_unstarted(Completion("chatcmpl-gone", "alice", "m"))
    await meter.close(timeout_s=10)
    record = meter.ledger.get("chatcmpl-gone")
    assert record is not None
    assert (record.status, record.counts, record.latency) == ("cancelled", NO_TOKENS, Latency(0, 0, 0))


def test_a_meter_needs_a_well_formed_evidence_digest(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="evidence_digest must be 64 lowercase hex characters"):
        Meter.open(paths(tmp_path), NodeSigner.generate(), "not-a-digest")
    assert not (tmp_path / "ledger").exists()


async def test_the_meter_signs_with_the_key_it_is_given(tmp_path: Path) -> None:
    signer = NodeSigner.from_seed(bytes(range(32)))
    meter = Meter.open(paths(tmp_path), signer, EVIDENCE_DIGEST)
    assert meter.signer is signer
    assert (meter.ledger.header.public_key, meter.ledger.header.evidence_digest) == (
        signer.public_key_hex, EVIDENCE_DIGEST)
    assert meter.ledger.tree_head().evidence_digest == EVIDENCE_DIGEST
    await meter.close(timeout_s=1)


async def test_a_job_that_never_ends_is_given_up_at_close(tmp_path: Path) -> None:
    meter = open_meter(tmp_path)
    request = GenerationRequest(Scope("alice", "m"), [1], SamplingParams(max_tokens=1))
    meter.track(Job("alice", request, asyncio.get_running_loop()), Completion("cmpl-never", "alice", "m")).close()
    await meter.close(timeout_s=0.05)
    assert len(meter.ledger) == 0
    assert meter.ledger.path.read_bytes().count(b"\n") == 1  # the header only


class FailingRunner(ModelRunner):
    def prefill(self, seq: Sequence) -> None:
        raise RuntimeError("a model fault")


@pytest.fixture(scope="module")
def small_loaded(small_model_dir: Path):
    return load_model(small_model_dir.name, small_model_dir)


async def serve(aiohttp_client, tmp_path: Path, loaded, runner_class: type[ModelRunner] = ModelRunner):
    config_path = tmp_path / "node.yaml"
    key = add_key(config_path, "alice")
    runner = runner_class(loaded, None)
    service = ModelService(loaded, runner, Scheduler(runner, 4), plan_device(loaded.device, None, 0))
    app = create_app(load_config(config_path), config_path, service, paths(tmp_path), NodeIdentity.start(),
                     load_node_policy("standard"))
    return await aiohttp_client(app), {"Authorization": f"Bearer {key}"}


async def test_failed_completions_are_recorded_with_status_failed(aiohttp_client, tmp_path: Path,
                                                                  small_loaded) -> None:
    client, auth = await serve(aiohttp_client, tmp_path, small_loaded, FailingRunner)
    model = small_loaded.model_id
    plain = await client.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7]}, headers=auth)
    assert plain.status == 500
    assert (await plain.json())["error"]["type"] == "server_error"
    stream = await client.post("/v1/chat/completions", headers=auth, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    events = [line[6:] for line in (await stream.text()).splitlines() if line.startswith("data: ")]
    first, error, done = json.loads(events[0]), json.loads(events[1]), events[2]
    assert (error["error"]["type"], done, len(events)) == ("server_error", "[DONE]", 3)
    records = client.server.app[METER].ledger.records_since(0)
    assert [(r.seq, r.record_id[:5], r.status, r.caller_id, r.counts, r.cost_wei) for r in records] == [
        (0, "cmpl-", "failed", "alice", NO_TOKENS, 0),
        (1, "chatc", "failed", "alice", NO_TOKENS, 0),
    ]
    # A failure tells neither when its job started nor of a token: only its total time is known.
    assert [(r.queue_wait_ms, r.ttft_ms) for r in records] == [(0, 0), (0, 0)]
    looked_up = await client.get("/v1/generation", params={"id": first["id"]}, headers=auth)
    assert (await looked_up.json()) == records[1].to_json()


async def test_a_completion_that_cannot_be_recorded_is_not_delivered(aiohttp_client, tmp_path: Path,
                                                                      small_loaded) -> None:
    client, auth = await serve(aiohttp_client, tmp_path, small_loaded)
    body = {"model": small_loaded.model_id, "prompt": [5, 6, 7], "max_tokens": 2}
    assert (await client.post("/v1/completions", json=body, headers=auth)).status == 200
    client.server.app[METER].ledger.close()  # every later append fails
    refused = await client.post("/v1/completions", json=body, headers=auth)
    assert refused.status == 503
    assert (await refused.json())["error"]["code"] == "metering_unavailable"
    assert refused.headers["Retry-After"] == "5"
    stream = await client.post("/v1/completions", json={**body, "stream": True}, headers=auth)
    events = [line[6:] for line in (await stream.text()).splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "metering_unavailable"
    assert events[-1] == "[DONE]"
    assert all("finish_reason" not in event or json.loads(event)["choices"][0]["finish_reason"] is None
               for event in events[:-2])


@pytest.mark.parametrize(("path", "query", "param"), [
    ("/v1/generation", {}, "id"),
    ("/v1/generation", {"id": ""}, "id"),
    ("/v1/generation", {"id": "x" * 257}, "id"),
    ("/v1/metering/proof", {}, "id"),
    ("/v1/metering/records", {"since": "-1"}, "since"),
    ("/v1/metering/records", {"since": "one"}, "since"),
    ("/v1/metering/records", {"since": "1.5"}, "since"),
    ("/v1/metering/records", {"limit": "0"}, "limit"),
    ("/v1/metering/records", {"limit": "10001"}, "limit"),
])
async def test_bad_query_parameters_answer_400(aiohttp_client, tmp_path: Path, small_loaded, path: str,
                                               query: dict[str, str], param: str) -> None:
    client, _ = await serve(aiohttp_client, tmp_path, small_loaded)
    auditor = add_key(tmp_path / "node.yaml", "audit", role="auditor")
    response = await client.get(path, params=query, headers={"Authorization": f"Bearer {auditor}"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
