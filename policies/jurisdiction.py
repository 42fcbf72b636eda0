"""Jurisdiction codes: the form a node policy and a caller's requirements both check.

A jurisdiction is an ISO 3166-1 alpha-2 country code in upper case (`DE`, `FR`, `NO`). Only the form is
checked, not membership in the ISO list: a code that names no country matches no node, which refuses
the caller rather than serving them somewhere they did not ask for. Region codes (`EU`) are not accepted:
a caller who accepts several countries lists them.
"""

from __future__ import annotations

import re

CODE = re.compile(r"[A-Z]{2}")
FORM = "an ISO 3166-1 alpha-2 country code in upper case (e.g. DE)"


def code_problem(value: object, accepted: str = FORM) -> str | None:
    """What is wrong with `value` as a jurisdiction code, phrased to follow its name; None when it is one.
    `accepted` describes what would be accepted instead."""
    if isinstance(value, bool):
        # YAML 1.1 reads an unquoted NO (Norway), no, off as false and ON, yes as true.
        return f"was read as {str(value).lower()}: write the code in quotes, e.g. 'NO'"
    if not isinstance(value, str) or not CODE.fullmatch(value):
        return f"must be {accepted}, got {value!r}"
    return None
