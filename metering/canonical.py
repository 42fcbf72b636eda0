"""RFC 8785 (JCS) canonical JSON: the one byte form that every signature and hash in metering covers.

Signatures and the hash chain are computed over bytes, so two encoders must agree byte for byte on
the same value. JCS fixes member order (UTF-16 code units), whitespace (none), string escaping and
number form. We use only the integer subset of JCS numbers: money is integer wei, and floats have no
place in a signed record, so a float is an error rather than something to round.

JCS serialises numbers as IEEE-754 doubles (ECMAScript `Number`), which represent integers exactly
only up to 2**53 - 1. An integer beyond that cannot be given a canonical JSON number, so it is
rejected; RFC 8785 section 6 recommends carrying such values as decimal strings, which is what the
usage record does for every wei amount (`wei_to_json` / `wei_from_json`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

MAX_SAFE_INTEGER = 2**53 - 1
"""Largest integer an IEEE-754 double, and so a JCS number, holds exactly (I-JSON, RFC 7493)."""

_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}
_NEEDS_ESCAPE = re.compile(r'[\x00-\x1f"\\]')


class CanonicalJsonError(ValueError):
    """A value has no RFC 8785 canonical form in the subset metering uses."""


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 canonical UTF-8 bytes of `value`.

    Accepted: dict with str keys, list or tuple, str, int within +-(2**53 - 1), bool, None.
    """
    parts: list[str] = []
    _encode(value, parts, "$")
    try:
        return "".join(parts).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CanonicalJsonError(
            f"string contains a lone UTF-16 surrogate at index {exc.start}; "
            "I-JSON allows only well-formed Unicode, so remove or pair the surrogate"
        ) from exc


def parse_canonical(data: bytes) -> Any:
    """Parse JSON bytes and require that they already are in canonical form.

    Rejects anything that re-encodes differently: whitespace, member order, escapes, duplicate
    member names (the parser keeps only the last, so the re-encoding is shorter) and floats.
    """
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CanonicalJsonError(f"not valid UTF-8 JSON: {exc}") from exc
    if canonical_json(value) != data:
        raise CanonicalJsonError(
            "JSON is valid but not RFC 8785 canonical (member order, whitespace, escaping or "
            "duplicate names differ); re-encode it with canonical_json"
        )
    return value


def wei_to_json(amount: int) -> str:
    """A wei amount as the decimal string JSON carries it in (no sign, no leading zeros)."""
    return str(amount)


def wei_from_json(text: Any, field: str) -> int:
    """Parse a wei amount written by `wei_to_json`; only its exact output is accepted."""
    if not isinstance(text, str) or not text.isascii() or not text.isdigit():
        raise CanonicalJsonError(f"{field} must be a decimal string of digits, got {text!r}")
    if len(text) > 1 and text[0] == "0":
        raise CanonicalJsonError(f"{field} must not have leading zeros, got {text!r}")
    return int(text)


def _encode(value: Any, parts: list[str], where: str) -> None:
    # bool is a subclass of int, so it is matched first.
    if value is None:
        parts.append("null")
    elif value is True:
        parts.append("true")
    elif value is False:
        parts.append("false")
    elif isinstance(value, int):
        if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            raise CanonicalJsonError(
                f"integer at {where} is outside +-(2**53 - 1) and has no exact JSON number form; "
                "carry it as a decimal string (see wei_to_json)"
            )
        parts.append(str(value))
    elif isinstance(value, float):
        raise CanonicalJsonError(
            f"float at {where}: signed metering data uses integers only (money is integer wei); "
            "convert the value to an int"
        )
    elif isinstance(value, str):
        parts.append(_encode_string(value))
    elif isinstance(value, Mapping):
        _encode_object(value, parts, where)
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        parts.append("[")
        for index, item in enumerate(value):
            if index:
                parts.append(",")
            _encode(item, parts, f"{where}[{index}]")
        parts.append("]")
    else:
        raise CanonicalJsonError(
            f"value at {where} has type {type(value).__name__}, which JSON cannot carry; "
            "use dict, list, str, int, bool or None"
        )


def _encode_object(value: Mapping[Any, Any], parts: list[str], where: str) -> None:
    for key in value:
        if not isinstance(key, str):
            raise CanonicalJsonError(f"object key {key!r} at {where} must be a str")
    # Big-endian UTF-16 bytes compare exactly like the sequence of UTF-16 code units (RFC 8785 3.2.3).
    keys = sorted(value, key=lambda key: key.encode("utf-16-be", "surrogatepass"))
    parts.append("{")
    for index, key in enumerate(keys):
        if index:
            parts.append(",")
        parts.append(_encode_string(key))
        parts.append(":")
        _encode(value[key], parts, f"{where}.{key}")
    parts.append("}")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _SHORT_ESCAPES.get(char) or f"\\u{ord(char):04x}"


def _encode_string(text: str) -> str:
    return '"' + _NEEDS_ESCAPE.sub(_escape, text) + '"'
