"""`bench media --chat`'s summary: medians per mode and turn, and what reuse saved of a conversation."""

from __future__ import annotations

from bench.media_chat import ChatSample, summarise, totals


def sample(mode: str, run: int, turn: int, ttft: float, encoded: int, encode_ms: float) -> ChatSample:
    return ChatSample(mode, run, turn, ttft, encoded, 1 - encoded, encode_ms, 100 * turn, 0)


def test_the_conversation_and_the_new_chat_are_summed_apart() -> None:
    samples = [sample(mode, run, turn, ttft, encoded, encode_ms)
               for run in range(3)
               for mode, first, later, fresh in (("reuse", (1, 30.0), (0, 0.0), (0, 0.0)),
                                                 ("no-reuse", (1, 30.0 + run), (1, 20.0), (1, 25.0)))
               for turn, (encoded, encode_ms), ttft in ((1, first, 100.0), (2, later, 40.0 if mode == "reuse"
                                                                              else 90.0 + run),
                                                        (3, later, 50.0), (4, later, 60.0), (5, fresh, 70.0))]
    rows = summarise(samples)
    assert [(row.mode, row.turn, row.encoder_calls) for row in rows][:5] == [("reuse", t, int(t == 1)) for t in
                                                                             range(1, 6)]
    found = totals(rows)
    assert found["reuse"] == {"encoder_calls": 1, "encode_ms": 30.0, "ttft_ms": 250.0}
    assert found["no-reuse"] == {"encoder_calls": 4, "encode_ms": 91.0, "ttft_ms": 301.0}  # medians: 31 and 91
    assert (found["saved_ms"], found["encoder_saved_ms"]) == (51.0, 61.0)
    assert found["same_image_new_chat"] == {"saved_ms": 0.0, "encoder_ms": 25.0,
                                            "encoder_calls": {"reuse": 0, "no-reuse": 1}}
