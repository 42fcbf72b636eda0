"""RFC 8785 canonical JSON: published JCS vectors (integer and string subset) and rejections."""

from __future__ import annotations

import pytest

from metering.canonical import (
    MAX_SAFE_INTEGER,
    CanonicalJsonError,
    canonical_json,
    parse_canonical,
    wei_from_json,
    wei_to_json,
)

# Vectors from the JCS reference test data (cyberphone/json-canonicalization testdata/, the
# examples of RFC 8785 sections 3.2.2 and 3.2.3). Inputs are written as Python values; the
# expected outputs are the published bytes.


def test_rfc8785_property_sorting_by_utf16_code_units() -> None:
    # testdata/input/weird.json: U+1F602 is the surrogate pair D83D DE02, so it sorts before U+FB33
    # although its code point is larger; U+007F is not escaped.
    value = {
        "\u20ac": "Euro Sign",
        "1": "One",
        "\u0080": "Control\u007f",
        "\U0001f602": "Smiley",
        "\u00f6": "Latin Small Letter O With Diaeresis",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "</script>": "Browser Challenge",
    }
    expected = (
        '{"1":"One","</script>":"Browser Challenge","\u0080":"Control\u007f",'
        '"\u00f6":"Latin Small Letter O With Diaeresis","\u20ac":"Euro Sign",'
        '"\U0001f602":"Smiley","\ufb33":"Hebrew Letter Dalet With Dagesh"}'
    )
    assert canonical_json(value) == expected.encode("utf-8")


def test_rfc8785_string_escaping() -> None:
    # testdata/input/values.json without its float members: "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/"
    value = {"escaping": '\u20ac$\u000f\nA\'B"\\\\"/', "literals": [None, True, False]}
    expected = '{"escaping":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/","literals":[null,true,false]}'
    assert canonical_json(value) == expected.encode("utf-8")
    assert canonical_json(value) == (
        b'{"escaping":"\xe2\x82\xac$\\u000f\\nA\'B\\"\\\\\\\\\\"/","literals":[null,true,false]}'
    )


def test_rfc8785_nested_structures() -> None:
    # testdata/input/structures.json (its 56.0 written as the integer 56, which JCS prints alike)
    value = {"1": {"f": {"f": "hi", "F": 5}, "\n": 56}, "10": {}, "": "empty", "a": {}, "111": [{}], "A": {}}
    assert (
        canonical_json(value)
        == b'{"":"empty","1":{"\\n":56,"f":{"F":5,"f":"hi"}},"10":{},"111":[{}],"A":{},"a":{}}'
    )


def test_rfc8785_arrays_keep_order() -> None:
    # testdata/input/arrays.json
    assert canonical_json([56, {"d": True, "10": None, "1": []}]) == b'[56,{"1":[],"10":null,"d":true}]'


def test_rfc8785_sorting_ignores_locale() -> None:
    # testdata/input/french.json
    value = {
        "peach": "This sorting order",
        "p\u00e9ch\u00e9": "is wrong according to French",
        "p\u00eache": "but canonicalization MUST",
        "sin": "ingnore locale",
    }
    expected = (
        '{"peach":"This sorting order","p\u00e9ch\u00e9":"is wrong according to French",'
        '"p\u00eache":"but canonicalization MUST","sin":"ingnore locale"}'
    )
    assert canonical_json(value) == expected.encode("utf-8")


def test_rfc8785_no_unicode_normalization() -> None:
    # testdata/input/unicode.json
    assert canonical_json({"Unnormalized Unicode": "\u1e0d\u0307"}) == (
        b'{"Unnormalized Unicode":"\xe1\xb8\x8d\xcc\x87"}'
    )


def test_rfc8785_simple_string_bytes() -> None:
    # testdata/outhex/simpleString.txt
    expected = bytes.fromhex(
        "22 74 68 69 73 20 69 73 20 61 20 74 65 73 74 20 73 74 72 69 6E 67 20 31 32 33 35 22"
    )
    assert canonical_json("this is a test string 1235") == expected


def test_control_characters_use_short_or_lowercase_unicode_escapes() -> None:
    text = "".join(chr(code) for code in range(0x20))
    expected = (
        '"\\u0000\\u0001\\u0002\\u0003\\u0004\\u0005\\u0006\\u0007\\b\\t\\n\\u000b\\f\\r\\u000e\\u000f'
        "\\u0010\\u0011\\u0012\\u0013\\u0014\\u0015\\u0016\\u0017\\u0018\\u0019\\u001a\\u001b\\u001c"
        '\\u001d\\u001e\\u001f"'
    )
    assert canonical_json(text) == expected.encode("ascii")


def test_integers_at_the_exact_double_limit() -> None:
    assert (
        canonical_json([0, -1, MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER])
        == b"[0,-1,9007199254740991,-9007199254740991]"
    )
    assert canonical_json((1, 2)) == b"[1,2]"


@pytest.mark.parametrize("value", [MAX_SAFE_INTEGER + 1, -MAX_SAFE_INTEGER - 1, 10**18])
def test_integers_beyond_the_double_limit_are_rejected(value: int) -> None:
    with pytest.raises(CanonicalJsonError, match=r"outside \+-\(2\*\*53 - 1\).*decimal string"):
        canonical_json({"cost_wei": value})


def test_floats_are_rejected_with_their_location() -> None:
    with pytest.raises(CanonicalJsonError, match=r"float at \$\.a\[1\].*convert the value to an int"):
        canonical_json({"a": [1, 2.0]})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1: "x"}, "object key 1 at \\$ must be a str"),
        (b"raw", "type bytes"),
        ({"s": {1, 2}}, "type set"),
        ("\ud800", "lone UTF-16 surrogate"),
    ],
)
def test_other_values_are_rejected(value: object, message: str) -> None:
    with pytest.raises(CanonicalJsonError, match=message):
        canonical_json(value)


def test_parse_canonical_accepts_exactly_the_canonical_bytes() -> None:
    assert parse_canonical(b'{"a":1,"b":[true,null,"x"]}') == {"a": 1, "b": [True, None, "x"]}


@pytest.mark.parametrize(
    "data",
    [
        b'{"b":1,"a":2}',  # member order
        b'{"a": 1}',  # whitespace
        b'{"a":1,"a":2}',  # duplicate member names
        b'{"a":"\\u0041"}',  # needless escape
        b'{"a":1.0}',  # float
    ],
)
def test_parse_canonical_rejects_other_encodings(data: bytes) -> None:
    with pytest.raises(CanonicalJsonError):
        parse_canonical(data)


def test_parse_canonical_rejects_invalid_json() -> None:
    with pytest.raises(CanonicalJsonError, match="not valid UTF-8 JSON"):
        parse_canonical(b'{"a":')


def test_wei_round_trips_as_decimal_string() -> None:
    amount = 123_456_789_012_345_678_901_234_567_890
    assert wei_to_json(amount) == "123456789012345678901234567890"
    assert wei_from_json("123456789012345678901234567890", "cost_wei") == amount
    assert wei_from_json("0", "cost_wei") == 0


@pytest.mark.parametrize("text", ["", "-1", "+1", "01", "1e3", " 1", "\u0661", 5])
def test_wei_from_json_rejects_anything_but_plain_digits(text: object) -> None:
    with pytest.raises(CanonicalJsonError, match="cost_wei"):
        wei_from_json(text, "cost_wei")
