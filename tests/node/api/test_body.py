"""Request bodies parse by one set of rules whichever parser the size picks (orjson small, json large)."""

from __future__ import annotations

import pytest

from node.api.body import MAX_JSON_OBJECTS, ORJSON_MAX_BYTES, parse_json
from node.errors import InvalidRequest

PAD = b" " * ORJSON_MAX_BYTES  # whitespace: the same document, parsed by the large-body path


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": -Infinity}', b"\xff{}", b"[1,]", b'{"a": ', b""])
def test_invalid_bodies_are_refused_the_same_small_and_large(raw: bytes) -> None:
    for body in (raw, raw + PAD):
        with pytest.raises(InvalidRequest) as caught:
            parse_json(body)
        assert caught.value.code == "invalid_json"


def test_valid_bodies_parse_the_same_small_and_large() -> None:
    raw = '{"prompt": "h\\u00e9llo w\u00f6rld", "ids": [1, 2.5, -3], "flags": [true, false, null]}'.encode()
    small, large = parse_json(raw), parse_json(raw + PAD)
    assert small == large == {"prompt": "h\u00e9llo w\u00f6rld", "ids": [1, 2.5, -3], "flags": [True, False, None]}


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"n": ' + b"7" * 5000 + b"}", "an integer has more than 4300 digits"),
    (b"[" * 100_000 + b"]" * 100_000, "it nests too deeply"),
])
def test_numbers_and_nesting_past_the_parsers_limits_are_refused_the_same_small_and_large(raw: bytes,
                                                                                         message: str) -> None:
    """The large-body parser (json) raised ValueError past 4,300 digits and RecursionError past its depth: 500s."""
    for body in (raw, raw + PAD):
        with pytest.raises(InvalidRequest) as caught:
            parse_json(body)
        assert caught.value.code == "invalid_json"
    assert caught.value.message == f"the request body is not valid JSON: {message}"


def test_a_large_body_holding_more_objects_than_any_request_needs_is_refused_part_way() -> None:
    """289,255 empty messages took seconds to parse; the parse now stops at the object past the bound."""
    one = b'{"role":"user","content":""}'
    bounded = b'{"messages":[' + b",".join([one] * (MAX_JSON_OBJECTS - 1)) + b"]}"
    assert len(parse_json(bounded.ljust(ORJSON_MAX_BYTES + 1))["messages"]) == MAX_JSON_OBJECTS - 1  # type: ignore[index]
    over = b'{"messages":[' + b",".join([one] * MAX_JSON_OBJECTS) + b"]}"
    with pytest.raises(InvalidRequest) as caught:
        parse_json(over.ljust(ORJSON_MAX_BYTES + 1))
    assert (caught.value.code, caught.value.message) == (
        "too_many_objects", f"the request body holds more than {MAX_JSON_OBJECTS} JSON objects")
    assert isinstance(parse_json(over), dict)  # a small body is parsed whole: it cannot hold many
