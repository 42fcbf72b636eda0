"""A model with attachments behind a runner with reuse (sealed) and one without, fed the same chat requests: the
replies must be equal, and the runner without reuse encodes every attachment of every request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from cache.arena import Scope
from node.attachments import AttachmentLimits
from node.engine.loader import LoadedModel
from node.engine.media import SequenceMedia
from node.engine.runner import GenerationRequest, GenerationResult, ModelRunner
from node.engine.sampling import SamplingParams
from node.openai_schema import ChatBounds, parse_chat
from node.service import ModelService, Prompt
from tests.node.engine.runners import sealed_runner


class MediaPair:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.on = sealed_runner(loaded)
        self.off = ModelRunner(loaded, None)
        self.service = ModelService(loaded, self.on, None, None)  # type: ignore[arg-type]  # prompts only
        self.bounds = ChatBounds(100, loaded.context_length, loaded.max_token_bytes, loaded.message_tokens,
                                 AttachmentLimits())

    def prompt(self, messages: list[dict[str, Any]]) -> Prompt:
        chat = parse_chat({"model": self.loaded.model_id, "messages": messages}, self.bounds)
        return self.service.chat_prompt(chat.messages)

    def turn(self, messages: list[dict[str, Any]], caller: str = "a") -> GenerationResult:
        """The result with reuse, once the same request without reuse replied the same."""
        prompt = self.prompt(messages)
        results = []
        for runner in (self.on, self.off):
            request = GenerationRequest(Scope(caller, self.loaded.model_id), prompt.ids,
                                        SamplingParams(max_tokens=6, temperature=0.0),
                                        boundaries=prompt.rendered.boundaries, media=prompt.media)
            results.append(runner.generate(request, lambda _: None, lambda: False))
        on, off = results
        assert on.output_ids == off.output_ids
        assert off.attachments_encoded == (0 if prompt.media is None else len(prompt.media.items))
        return on


def counts(result: GenerationResult) -> tuple[int, int]:
    """(attachments encoded, attachments not encoded) of a request."""
    return result.attachments_encoded, result.attachments_reused


def keep_swap_drop_repeat(pair: MediaPair, user: Callable[..., dict[str, Any]], question: str,
                          follow_up: str) -> GenerationResult:
    """A conversation about attachment 1 (`user(text, *seeds)` makes a user message holding the attachments of
    those seeds), with reuse on and off at every turn (`MediaPair.turn`), and the encoder calls each turn makes:
    the first encodes it; a follow-up restores past it; a history whose first message holds attachment 2 encodes
    that one; one without the attachment encodes nothing; attachment 1 again in a new message is found in the
    caller's encoding cache. Returns the follow-up's result; the scope then holds the encodings of 1 and 2."""
    chat = [user(question, 1)]
    first = pair.turn(chat)
    assert counts(first) == (1, 0)
    chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": follow_up}]
    second = pair.turn(chat)
    assert counts(second) == (0, 1)
    assert counts(pair.turn([user(question, 2), *chat[1:]])) == (1, 0)
    assert counts(pair.turn([{"role": "user", "content": question}, *chat[1:]])) == (0, 0)
    again = pair.turn([*chat, {"role": "assistant", "content": second.text}, user("and this one?", 1)])
    assert counts(again) == (0, 2)
    cache = pair.on.reuse.encodings
    assert cache is not None and cache.sealing
    assert cache.counts(Scope("a", pair.loaded.model_id)).entries == 2
    return second


@torch.inference_mode()
def chunked_logits(model: Any, held: SequenceMedia, ids: list[int], cuts: list[int]) -> tuple[torch.Tensor, Any]:
    """Every position's logits of `ids` prefilled in chunks ending at `cuts`, each on `held`'s inputs (the
    attachments' encodings in their placeholders' places), and the cache they filled."""
    cache, start, logits = DynamicCache(config=model.config), 0, []
    for stop in cuts:
        out = model(**held.inputs(model, ids[start:stop], start), cache=cache, use_cache=True)
        logits.append(out.logits[0].float())
        start = stop
    return torch.cat(logits), cache
