"""Anthropic's stop reason from the engine's result (`node/api/messages.py`)."""

from __future__ import annotations

import pytest

from node.api.messages import _stop_reason
from node.engine.sequence import GenerationResult


def result(finish_reason: str, stop_sequence: str | None = None) -> GenerationResult:
    return GenerationResult(prompt_tokens=3, cached_read_tokens=0, cached_write_tokens=0, output_ids=[1], text="x",
                            finish_reason=finish_reason, queue_wait_s=0.0, ttft_s=0.0, stop_sequence=stop_sequence)


@pytest.mark.parametrize(("finish", "stop", "reason"), [("length", None, "max_tokens"), ("stop", None, "end_turn"),
                                                         ("stop", "\n\n", "stop_sequence")])
def test_a_stop_string_is_anthropics_stop_sequence(finish: str, stop: str | None, reason: str) -> None:
    assert _stop_reason(result(finish, stop)) == reason
