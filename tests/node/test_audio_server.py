"""Audio chat through a real node (a small Audio Flamingo 3 shape): an `input_audio` part through the official openai
client, encoded once per caller across a conversation, `GET /v1/node` saying the model takes audio, and bad audio
refused by name while the node keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from node.engine.synthetic import init_model
from tests.node.conftest import Node, node_view, start_node, stop_node
from tests.node.engine.test_media_audio import audio_part, wav
from tests.node.test_attachments_audio import part

MODEL = "alm-audioflamingo3"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("audio")
    started = start_node(root / "node", init_model(MODEL, root / MODEL, size="small"))
    yield started
    stop_node(started)


def ask(text: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, *parts]}


def counts(usage: dict[str, Any]) -> tuple[int, int]:
    return usage["attachments"]["encoded"], usage["attachments"]["reused"]


def test_a_conversation_about_one_clip_encodes_it_once_per_caller(node: Node) -> None:
    alice, bob = node.add_key("alice"), node.add_key("bob")
    client = openai.OpenAI(base_url=node.base, api_key=alice, max_retries=0)
    first = client.chat.completions.create(model=MODEL, messages=[ask("what is this?", audio_part(1))],  # type: ignore[list-item]
                                           max_tokens=5, temperature=0)
    assert first.usage is not None and counts(first.usage.model_dump()) == (1, 0)
    history = [ask("what is this?", audio_part(1)), {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "louder?"}]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=5, temperature=0)  # type: ignore[arg-type]
    assert second.usage is not None and counts(second.usage.model_dump()) == (0, 1)
    theirs = openai.OpenAI(base_url=node.base, api_key=bob, max_retries=0).chat.completions.create(
        model=MODEL, messages=[ask("what is this?", audio_part(1))], max_tokens=5, temperature=0)  # type: ignore[list-item]
    assert theirs.usage is not None and counts(theirs.usage.model_dump()) == (1, 0)  # never another caller's
    view = node_view(node)["attachments"]
    assert (view["audio"], view["images"], view["encoder"]) == (True, False,
                                                                "audioflamingo3:audio:WhisperFeatureExtractor")


def test_bad_audio_is_refused_by_name_and_the_node_keeps_serving(node: Node) -> None:
    key = node.add_key("carol")
    bad = [part("@@@"), part(b"not a wav file"), part(wav(7, seconds=0.01)[:-5]), part(wav(7), "mp3")]

    async def run() -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
            for body in bad:
                request = {"model": MODEL, "messages": [ask("hear", body)], "max_tokens": 2}
                async with session.post(node.base + "/chat/completions", json=request) as response:
                    answer = await response.json()
                assert response.status == 400
                assert answer["error"]["param"].startswith("messages[0].content[1].input_audio.")
            request = {"model": MODEL, "messages": [ask("hear", audio_part(8))], "max_tokens": 2}
            async with session.post(node.base + "/chat/completions", json=request) as response:
                answer = await response.json()
            assert response.status == 200 and counts(answer["usage"]) == (1, 0)

    asyncio.run(run())
