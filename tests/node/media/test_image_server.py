"""An image node on loopback: OpenAI's images API through the official client, reuse per caller with the same
bytes as a `--no-reuse` node, one signed counts-only record per request (images at the image price), bad input
refused by field and a full queue by 503 with a Retry-After while the node keeps serving, and the node's views."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from PIL import Image

from metering.segment import read_records
from metering.verify import verify_ledger
from tests.node.conftest import NodeFactory
from tests.node.media.images import png

STEPS = {"seed": 3, "num_inference_steps": 3}
PROMPT = "a lighthouse at dusk"


def call(url: str, key: str | None = None, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a GET, or of a POST of `body`, on loopback."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # loopback only
            return response.status, dict(json.load(response))
    except urllib.error.HTTPError as refused:
        return refused.code, dict(json.load(refused))


def post(base: str, key: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = call(base + path, key, body)
    assert status == 200, answer
    return answer


def images(body: dict[str, Any]) -> list[bytes]:
    return [base64.b64decode(item["b64_json"]) for item in body["data"]]


def encodings(body: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    used = body["usage"]["encodings"]
    return ((used["conditionings"]["encoded"], used["conditionings"]["reused"]),
            (used["references"]["encoded"], used["references"]["reused"]))


def test_an_image_node_serves_openais_images_api_with_reuse_per_caller(node_factory: NodeFactory,
                                                                      diffusion_dir: Path) -> None:
    node, plain = node_factory.all((diffusion_dir,), (diffusion_dir, "--no-reuse"))
    alice, bob, operator = (node.add_key("alice"), node.add_key("bob"), node.add_key("ops", "operator"))
    plain_key = plain.add_key("alice")
    model = diffusion_dir.name

    # The official client: b64_json images of the size asked, the seed and steps as extensions.
    client = openai.OpenAI(base_url=node.base, api_key=alice, max_retries=0)
    first = client.images.generate(model=model, prompt=PROMPT, n=2, size="64x64",  # type: ignore[arg-type]
                                   extra_body=STEPS)
    assert first.data is not None and len(first.data) == 2
    rendered = [base64.b64decode(item.b64_json or "") for item in first.data]
    assert Image.open(io.BytesIO(rendered[0])).size == (64, 64)
    assert first.usage is not None and first.usage.output_tokens == 0
    assert first.usage.input_tokens == first.usage.input_tokens_details.text_tokens > 0

    # The same prompt again: its conditioning reused, the same seed the same bytes; another caller encodes again.
    body = {"model": model, "prompt": PROMPT, "n": 2, "size": "64x64", **STEPS}
    again = post(node.base, alice, "/images/generations", body)
    theirs = post(node.base, bob, "/images/generations", body)
    unreused = post(plain.base, plain_key, "/images/generations", body)
    assert [encodings(again), encodings(theirs), encodings(unreused)] == [((0, 1), (0, 0)), ((1, 0), (0, 0)),
                                                                          ((1, 0), (0, 0))]
    assert images(again) == images(theirs) == images(unreused) == rendered
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == again["usage"]["input_tokens"]
    assert theirs["usage"]["input_tokens_details"]["cached_tokens"] == 0

    # Edits: multipart from the official client, JSON with a data: URL; the reference encoded once per caller.
    reference = png()
    edit_fields = {"prompt": "in winter", "size": "64x64", **STEPS}
    edited = client.images.edit(model=model, image=("ref.png", reference, "image/png"), prompt="in winter",
                                size="64x64", extra_body=STEPS)  # type: ignore[arg-type]
    assert edited.data is not None and len(edited.data) == 1
    url = "data:image/png;base64," + base64.b64encode(reference).decode()
    as_json = post(node.base, alice, "/images/edits", {**edit_fields, "image": url})
    unreused_edit = post(plain.base, plain_key, "/images/edits", {**edit_fields, "image": url})
    assert encodings(as_json) == ((0, 1), (0, 1))
    assert encodings(unreused_edit) == ((1, 0), (1, 0))
    assert images(as_json) == images(unreused_edit) == [base64.b64decode(edited.data[0].b64_json or "")]

    # Bad input: a 400 naming the field, and the node keeps serving.
    for change, param in (({"size": "65x64"}, "size"), ({"n": 11}, "n"), ({"response_format": "url"},
                                                                          "response_format")):
        status, refused = call(node.base + "/images/generations", alice, {**body, **change})
        assert (status, refused["error"]["param"]) == (400, param)
    with pytest.raises(openai.BadRequestError) as corrupt:
        client.images.edit(model=model, image=("ref.png", reference[:80], "image/png"), prompt="x")
    assert isinstance(corrupt.value.body, dict) and corrupt.value.body["param"] == "image"
    assert "corrupt" in corrupt.value.body["message"]
    post(node.base, alice, "/images/generations", {**body, "n": 1})
    status, chat = call(node.base + "/chat/completions", alice, {"model": model, "messages": []})
    assert status == 404 and "serves an image model" in chat["error"]["message"]

    # One signed record per request, counts only: the first request's, then the reused one's.
    records = []
    for record_id in (first.model_extra or {})["id"], again["id"]:
        status, found = call(f"{node.base}/generation?id={record_id}", alice)
        assert status == 200
        records.append(found)
    assert [(r["status"], r["input_tokens"], r["cached_read_tokens"], r["cached_write_tokens"], r["output_tokens"])
            for r in records] == [("completed", first.usage.input_tokens, 0, first.usage.input_tokens, 0),
                                  ("completed", first.usage.input_tokens, first.usage.input_tokens, 0, 0)]
    # Two images each, at the image price in force: none set, so 0, and named as such.
    assert [(r["images"], r["image_price_wei"], r.get("conditionings_encoded", 0), r.get("conditionings_reused", 0))
            for r in records] == [(2, "0", 1, 0), (2, "0", 0, 1)]
    ledger = "".join(path.read_text() for path in (node.config.parent / "home" / "ledger").glob("*.jsonl"))
    # Six requests ran (two generations by alice and one by bob, two edits, the one after the refusals); a
    # request refused before it was queued computed nothing and has no record.
    assert ledger.count('"record_id"') == 6 and "lighthouse" not in ledger and "winter" not in ledger

    # The node's views: an image model, its cache set up (public), its counts (operators).
    view = call(node.base + "/node")[1]
    assert view["prices"]["image_price_wei"] == "0"
    assert (view["model"], view["media"]["kind"], view["media"]["sizes"]) == (model, "image",
                                                                              ["32x32", "64x64", "128x128"])
    assert view["media"]["encodings"]["reuse"] is True and view["media"]["encodings"]["sealed"] is True
    listed = call(node.base + "/models", alice)[1]
    assert listed["data"][0]["kind"] == "image"
    state = node.state(operator)["media"]
    assert (state["text_encoder_calls"], state["vae_encoder_calls"]) == (3, 1)
    assert {key: state["encodings"][key] for key in ("scopes", "encoded")} == {"scopes": 2, "encoded": 4}


IMAGE_PRICES = "input_price_wei: 3\noutput_price_wei: 11\ncached_read_price_wei: 1\ncached_write_price_wei: 5\n"


def test_images_are_billed_at_the_image_price_and_a_full_queue_answers_503(node_factory: NodeFactory,
                                                                           diffusion_dir: Path, tmp_path: Path) -> None:
    pricing = tmp_path / "prices.yaml"
    pricing.write_text(IMAGE_PRICES + "image_price_wei: 700\n")
    node = node_factory(diffusion_dir, "--pricing", str(pricing), config_text="limits:\n  max_queue: 1\n")
    alice, operator = node.add_key("alice"), node.add_key("ops", "operator")
    body = {"model": diffusion_dir.name, "prompt": PROMPT, "n": 2, "size": "32x32", **STEPS}

    # n=2: two images at 700 wei, on top of the prompt's tokens (written to the cache at 5 wei each).
    answer = post(node.base, alice, "/images/generations", body)
    tokens = answer["usage"]["input_tokens"]
    status, record = call(f"{node.base}/generation?id={answer['id']}", alice)
    assert status == 200 and tokens > 0
    assert ({name: record[name] for name in ("images", "image_price_wei", "conditionings_encoded", "cost_wei")}
            == {"images": 2, "image_price_wei": "700", "conditionings_encoded": 1, "cost_wei": str(tokens * 5 + 1400)})
    assert "conditionings_reused" not in record and "attachments_encoded" not in record
    assert call(node.base + "/node")[1]["prices"]["image_price_wei"] == "700"

    # One job runs, one waits (max_queue 1): the next is refused, 503 with the text queue's Retry-After.
    slow = {**body, "num_inference_steps": 50}  # long enough to be waited on, and still light on a CPU

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            async def send(request: dict[str, Any]) -> tuple[int, str | None, dict[str, Any]]:
                async with session.post(node.base + "/images/generations", json=request,
                                        headers={"Authorization": f"Bearer {alice}"}) as response:
                    return response.status, response.headers.get("Retry-After"), await response.json()

            async def until(running: int, waiting: int) -> None:  # the queue as an operator sees it
                for _ in range(3000):
                    async with session.get(node.url + "/health",
                                           headers={"Authorization": f"Bearer {operator}"}) as health:
                        queue = await health.json()
                    if (queue["running"], queue["waiting"]) == (running, waiting):
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"the queue never held {running} running and {waiting} waiting: {queue}")

            busy = [asyncio.create_task(send(slow))]
            await until(running=1, waiting=0)
            busy.append(asyncio.create_task(send(slow)))
            await until(running=1, waiting=1)
            status, retry_after, refused = await send(body)
            assert (status, retry_after, refused["error"]["code"], refused["error"]["type"]) == (
                503, "1", "queue_full", "server_error")
            assert [status for status, _, _ in await asyncio.gather(*busy)] == [200, 200]
            assert (await send({**body, "n": 1}))[0] == 200  # the node keeps serving

    asyncio.run(run())
    # Four records (the refused request computed nothing and has none), verified as the audit verifies them.
    ledger = node.config.parent / "home" / "ledger"
    reports = verify_ledger(ledger)
    assert [(report.ok, report.good_records) for report in reports] == [(True, 4)]
    assert [record.media.images for record in read_records(reports[0].path)[1]] == [2, 2, 2, 1]
