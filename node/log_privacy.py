"""Keeps prompt and completion text out of the logs by construction: only what is marked safe is written.

A log line is a constant format string (our code never builds one: a test scans the sources for that) and
arguments. An argument is written only when it is a number, a bool, None or wrapped in `Safe` by the code
that logs it; anything else, a library's included, becomes `<withheld>`. An exception keeps its type and
frames: its message, and its causes' messages, are the likeliest place for request content (a parser
quoting the bytes it rejected, a tokenizer quoting the text), so they are never written.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping
from dataclasses import dataclass

WITHHELD = "<withheld>"
SCREENED = "_tenzro_screened"
"""Set on a record once screened: a second handler's filter would otherwise withhold the reduced traceback."""
PLAIN_TYPES = (int, float, bool, type(None))
CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


@dataclass(frozen=True, slots=True, repr=False)
class Safe:
    """A log argument its caller knows carries no request content: a model id, a path, a count, a reason."""

    value: object

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


def _screen(value: object) -> object:
    return value if type(value) in PLAIN_TYPES or isinstance(value, Safe) else WITHHELD


def _frames(exc: BaseException) -> str:
    """One exception as a traceback without its message; no source lines are read."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    lines = [f'  File "{frame.f_code.co_filename}", line {lineno}, in {frame.f_code.co_name}\n'
             for frame, lineno in traceback.walk_tb(exc.__traceback__)]
    return "Traceback (most recent call last):\n" + "".join(lines) + f"{name}: {WITHHELD}\n"


def reduced_traceback(exc: BaseException) -> str:
    """The exception and the chain that led to it, outermost last as Python prints it, messages withheld."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None:
        seen.add(id(current))
        parts.append(_frames(current))
        following = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
        if following is None or id(following) in seen:
            break
        parts.append(CAUSE if current.__cause__ is not None else CONTEXT)
        current = following
    return "".join(reversed(parts)).rstrip("\n")


class PrivacyFilter(logging.Filter):
    """Rewrites every record it sees (in place, so later handlers see it screened too); never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, SCREENED, False):
            return True
        setattr(record, SCREENED, True)
        if not isinstance(record.msg, str):
            record.msg, record.args = WITHHELD, ()
        elif isinstance(record.args, Mapping):
            # Only keys the constant format string names survive: "%s" of a dict would write every key.
            record.args = {key: _screen(value) for key, value in record.args.items()
                           if isinstance(key, str) and f"%({key})" in record.msg}
        elif record.args:
            record.args = tuple(_screen(arg) for arg in record.args)
        exception = record.exc_info[1] if record.exc_info else None
        # Formatter.format renders exc_info only while exc_text is empty, and keeps what it rendered.
        record.exc_text = reduced_traceback(exception) if exception is not None else None
        record.exc_info = None
        record.stack_info = None
        return True


def _filtered(handler: logging.Handler) -> None:
    if not any(isinstance(existing, PrivacyFilter) for existing in handler.filters):
        handler.addFilter(PrivacyFilter())


def install_privacy_filter() -> None:
    """Screen every handler of the root logger, and the last-resort handler; call after logging.basicConfig.

    Handlers added later, or to another logger, are not screened: add them before this call, to the root."""
    for handler in logging.getLogger().handlers:
        _filtered(handler)
    if logging.lastResort is not None:
        _filtered(logging.lastResort)
