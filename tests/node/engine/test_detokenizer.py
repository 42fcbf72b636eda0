"""Text deltas and stop strings."""

from __future__ import annotations

from node.engine.detokenizer import Detokenizer


class CharTokenizer:
    """Token i is chr(i): enough to test the delta and stop logic exactly."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def feed(text: str, stop: tuple[str, ...]) -> tuple[list[str], str, bool]:
    detok = Detokenizer(CharTokenizer(), stop)
    deltas = []
    for ch in text:
        deltas.append(detok.push(ord(ch)))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return [d for d in deltas if d], detok.text, detok.stopped


def test_no_stop_strings_stream_every_character() -> None:
    assert feed("abc", ()) == (["a", "b", "c"], "abc", False)


def test_stop_string_cuts_and_is_never_sent() -> None:
    deltas, text, stopped = feed("hello END world", ("END",))
    assert text == "hello " and stopped and "".join(deltas) == "hello "


def test_partial_stop_prefix_is_held_then_released() -> None:
    deltas, text, stopped = feed("abEx", ("EN",))
    assert deltas == ["a", "b", "Ex"] and text == "abEx" and not stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    _, text, _ = feed("one two three", ("three", "two"))
    assert text == "one "


def test_the_stop_string_that_ended_the_text_is_named_the_earliest_when_one_token_holds_two() -> None:
    detok = Detokenizer(CharTokenizer(), ("three", "two"))
    for ch in "one t":
        detok.push(ord(ch))
    assert detok.matched is None
    detok._ids.extend(ord(ch) for ch in "wo thre")  # one token's worth of text that completes both at once
    detok.push(ord("e"))
    assert (detok.text, detok.matched) == ("one ", "two")
