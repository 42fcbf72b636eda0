"""A model with attachments behind a runner with reuse (sealed) and one without, fed the same chat requests: the
replies must be equal, and the runner without reuse encodes every attachment of every request."""

from __future__ import annotations

from typing import Any

from cache.arena import Scope
from node.attachments import AttachmentLimits
from node.engine.loader import LoadedModel
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
