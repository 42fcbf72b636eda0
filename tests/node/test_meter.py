"""The node's meter in process: outcomes to statuses and counts, followed jobs, failed and unrecordable
completions, the default price policy, and the metering routes' parameter checks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cache.arena import Scope
from metering.pricing import DEFAULT_PRICING, PriceSchedule, load_pricing, save_pricing
from metering.record import TokenCounts
from node.app import METER, create_app
from node.config import add_key, load_config
from node.engine.loader import load_model
from node.engine.runner import GenerationRequest, GenerationResult, Runner
from node.engine.sampling import SamplingParams
from node.engine.scheduler import Failed, Finished, Job, Scheduler
from node.meter import (
    DEFAULT_PRICE_POLICY,
    NO_TOKENS,
    Completion,
    Meter,
    MeteringPaths,
    ensure_price_file,
    usage_of,
)
from node.service import ModelService

PRICES = PriceSchedule(input_price_wei=7, output_price_wei=13, cached_read_price_wei=2, cached_write_price_wei=9)


def result(finish_reason: str, output: int = 3) -> GenerationResult:
    return GenerationResult(prompt_tokens=10, cached_read_tokens=4, cached_write_tokens=6,
                            output_ids=list(range(output)), text="", finish_reason=finish_reason,
                            queue_wait_s=0.0, ttft_s=0.0)


@pytest.mark.parametrize(("outcome", "status", "counts"), [
    (Finished(result("stop")), "completed", TokenCounts(10, 4, 6, 3)),
    (Finished(result("length", output=5)), "completed", TokenCounts(10, 4, 6, 5)),
    (Finished(result("cancelled", output=1)), "cancelled", TokenCounts(10, 4, 6, 1)),
    (Failed(asyncio.CancelledError()), "cancelled", TokenCounts(0, 0, 0, 0)),
    (Failed(RuntimeError("model fault")), "failed", TokenCounts(0, 0, 0, 0)),
], ids=["stop", "length", "cancelled-mid-decode", "cancelled-while-queued", "failed"])
def test_usage_of_an_outcome(outcome: Finished | Failed, status: str, counts: TokenCounts) -> None:
    assert usage_of(outcome) == (status, counts)


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


async def test_a_job_left_by_its_handler_is_recorded_when_it_ends(tmp_path: Path) -> None:
    meter = Meter.open(paths(tmp_path))
    request = GenerationRequest(Scope("alice", "m"), [1, 2], SamplingParams(max_tokens=8))
    job = Job("alice", request, asyncio.get_running_loop())
    metered = meter.track(job, Completion("cmpl-left", "alice", "m"))
    metered.close()  # the client went away before the outcome
    assert job.cancel_event.is_set()
    job.post(Finished(result("cancelled", output=2)))
    await meter.close(timeout_s=10)
    record = meter.ledger.get("cmpl-left")
    assert record is not None
    assert (record.status, record.caller_id, record.model, record.counts) == (
        "cancelled", "alice", "m", TokenCounts(10, 4, 6, 2))
    assert record.cost_wei == 0 * 7 + 4 * 2 + 6 * 9 + 2 * 13
    assert (record.input_price_wei, record.output_price_wei) == (7, 13)


async def test_a_job_that_never_ends_is_given_up_at_close(tmp_path: Path) -> None:
    meter = Meter.open(paths(tmp_path))
    request = GenerationRequest(Scope("alice", "m"), [1], SamplingParams(max_tokens=1))
    meter.track(Job("alice", request, asyncio.get_running_loop()), Completion("cmpl-never", "alice", "m")).close()
    await meter.close(timeout_s=0.05)
    assert len(meter.ledger) == 0
    assert meter.ledger.path.read_bytes().count(b"\n") == 1  # the header only


class FailingRunner(Runner):
    def generate(self, request: GenerationRequest, emit: Callable[[str], Any], cancelled: Callable[[], bool],
                 queue_wait_s: float = 0.0) -> GenerationResult:
        raise RuntimeError("a model fault")


@pytest.fixture(scope="module")
def small_loaded(small_model_dir: Path):
    return load_model(small_model_dir.name, small_model_dir)


async def serve(aiohttp_client, tmp_path: Path, loaded, runner_class: type[Runner] = Runner):
    config_path = tmp_path / "node.yaml"
    key = add_key(config_path, "alice")
    runner = runner_class(loaded, None)
    service = ModelService(loaded, runner, Scheduler(runner, 4))
    app = create_app(load_config(config_path), config_path, service, paths(tmp_path))
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
