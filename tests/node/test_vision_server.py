"""Vision chat through a real node (a small Llava shape): image parts through the official openai client, the usage
that says which images were encoded, the attachments section of `GET /v1/node`, callers that do not share
encodings, and refused attachments that leave the node serving."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
from PIL import Image

from bench.media_chat import random_png
from metering.record import MediaCounts
from metering.segment import read_records, segment_files
from metering.verify import verify_ledger
from node.engine.synthetic import init_model
from tests.node.conftest import Node, node_view, start_node, stop_node

MODEL = "vlm-llava"


def png(seed: int, size: tuple[int, int] = (70, 50)) -> bytes:
    return random_png(seed, *size)


def blank_png(size: tuple[int, int]) -> bytes:
    """A one-colour PNG: a few KiB however many pixels its header declares."""
    out = io.BytesIO()
    Image.new("RGB", size).save(out, "PNG")
    return out.getvalue()


def image_part(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


def ask(text: str, *images: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, *images]}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("vision")
    started = start_node(root / "node", init_model(MODEL, root / MODEL, size="small"))
    yield started
    stop_node(started)


def counts(usage: dict[str, Any]) -> tuple[int, int]:
    """(images encoded, images not encoded) of a response's usage."""
    return usage["attachments"]["encoded"], usage["attachments"]["reused"]


def chat(node: Node, key: str, messages: list[dict[str, Any]]) -> Any:
    client = openai.OpenAI(base_url=node.base, api_key=key, max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)  # type: ignore[arg-type]


def test_a_conversation_about_one_image_encodes_it_once_per_caller(node: Node) -> None:
    alice, bob = node.add_key("alice"), node.add_key("bob")
    picture = image_part(png(1))
    first = chat(node, alice, [ask("what is this?", picture)])
    usage = first.usage.model_dump()
    assert counts(usage) == (1, 0) and usage["attachments"]["encode_ms"] > 0
    history = [ask("what is this?", picture), {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "and its colour?"}]
    second = chat(node, alice, history).usage.model_dump()
    assert counts(second) == (0, 1) and second["attachments"]["encode_ms"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] - 2  # past the image
    theirs = chat(node, bob, [ask("what is this?", picture)]).usage.model_dump()
    assert counts(theirs) == (1, 0)  # never another caller's encoding
    assert theirs["prompt_tokens_details"]["cached_tokens"] == 0
    operator = node.add_key("ops", "operator")
    encodings = node.state(operator)["attachments"]["encodings"]
    assert (encodings["entries"], encodings["scopes"], encodings["encoded"], encodings["sealed"]) == (2, 2, 2, True)


def test_the_node_says_it_takes_images_and_how_it_keeps_their_encodings(node: Node) -> None:
    view = node_view(node)["attachments"]
    assert view["images"] is True and view["encoding_cache"]["sealed"] is True
    assert "entries" not in view["encoding_cache"]  # counts of every caller's traffic are the operator's only


BAD = {
    "corrupt base64": ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "url"),
    "not an image": (image_part(b"plain text, not pixels"), "url"),
    "a remote URL": ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "url"),
    "a declared type that lies": (image_part(png(2), "image/jpeg"), "url"),
    "an unsupported format": (image_part(b"BM" + bytes(60), "image/bmp"), "url"),
    "too many pixels": (image_part(blank_png((5000, 4000))), "url"),
}


async def post(node: Node, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(
            node.base + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        return response.status, await response.json()


def test_bad_attachments_are_refused_by_name_and_the_node_keeps_serving(node: Node) -> None:
    key = node.add_key("carol")

    async def run() -> None:
        for what, (part, field) in BAD.items():
            status, answer = await post(node, key, {"model": MODEL, "messages": [ask("see", part)], "max_tokens": 2})
            assert status == 400, what
            assert answer["error"]["param"] == f"messages[0].content[1].image_url.{field}", what
        many = [image_part(png(4))] * 17
        status, answer = await post(node, key, {"model": MODEL, "messages": [ask("see", *many)], "max_tokens": 2})
        assert (status, answer["error"]["code"]) == (400, "array_above_max_length")
        status, answer = await post(node, key, {"model": MODEL, "messages": [ask("see", image_part(png(5)))],
                                                "max_tokens": 2})
        assert status == 200 and counts(answer["usage"]) == (1, 0)

    asyncio.run(run())


def test_four_callers_at_once_get_what_each_gets_alone(node: Node) -> None:
    """Concurrent requests with different images decode together (batched) and reply as they do alone."""
    keys = [node.add_key(f"dave{index}") for index in range(4)]
    bodies = [{"model": MODEL, "messages": [ask("which one?", image_part(png(10 + index)))], "max_tokens": 6,
               "temperature": 0} for index in range(4)]

    async def together() -> list[dict[str, Any]]:
        answers = await asyncio.gather(*(post(node, key, body) for key, body in zip(keys, bodies, strict=True)))
        assert all(status == 200 for status, _ in answers)
        return [answer for _, answer in answers]

    async def alone() -> list[dict[str, Any]]:
        answers = [await post(node, key, body) for key, body in zip(keys, bodies, strict=True)]
        return [answer for _, answer in answers]

    operator = node.add_key("ops4", "operator")
    batched = node.state(operator)["engine"]["batched_steps"]
    at_once = asyncio.run(together())
    assert node.state(operator)["engine"]["batched_steps"] > batched
    one_by_one = asyncio.run(alone())
    assert [a["choices"][0]["message"]["content"] for a in at_once] == \
        [a["choices"][0]["message"]["content"] for a in one_by_one]
    assert [a["usage"]["attachments"]["encoded"] for a in one_by_one] == [0, 0, 0, 0]  # the second time: restored


def test_the_signed_records_count_an_image_encoded_then_reused_and_verify_offline(node: Node) -> None:
    """One image sent twice in a conversation: its records say encoded 1, then reused 1 (counts, no digest), and the
    ledger verifies with the audit's own verifier."""
    key = node.add_key("erin")
    picture = image_part(png(20))
    first = chat(node, key, [ask("what is this?", picture)])
    history = [ask("what is this?", picture), {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "and its colour?"}]
    second = chat(node, key, history)

    async def record(record_id: str) -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(
                node.base + "/generation", params={"id": record_id},
                headers={"Authorization": f"Bearer {key}"}) as response:
            assert response.status == 200
            return dict(await response.json())

    records = [asyncio.run(record(answer.id)) for answer in (first, second)]
    assert [{name: value for name, value in found.items() if name.startswith(("attachments", "conditionings",
                                                                            "image"))}
            for found in records] == [{"attachments_encoded": 1}, {"attachments_reused": 1}]
    assert [found["input_tokens"] for found in records] == [first.usage.prompt_tokens, second.usage.prompt_tokens]
    ledger = node.config.parent / "home" / "ledger"
    reports = verify_ledger(ledger)
    assert reports and all(report.ok for report in reports), [str(report.problem) for report in reports]
    signed = {record.record_id: record.media for path in segment_files(ledger) for record in read_records(path)[1]}
    assert [signed[first.id], signed[second.id]] == [MediaCounts(attachments_encoded=1),
                                                     MediaCounts(attachments_reused=1)]
