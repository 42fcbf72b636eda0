"""Anthropic's `cache_control` breakpoints as the engine's write plan: where each one's prefix ends in the rendered
prompt, and for how long it is held.

Only prefixes up to a breakpoint are written (and billed as writes); the rest of the prompt and the reply are
not. The template's rendering can be split only at a message's end (`RenderedChat.ends`), so a breakpoint
inside a message, or one whose message ends inside a token, is refused naming its field: a request refused
computes, and so stores, nothing.
"""

from __future__ import annotations

from cache.ttl import AUTOMATIC, TtlClass, WritePlan
from cache.ttl import Breakpoint as Hold
from node.anthropic_schema import Breakpoint
from node.errors import invalid_request


def message_counts(breakpoints: tuple[Breakpoint, ...]) -> tuple[int, ...]:
    """For `render_chat`'s `ends_of`: how many messages each breakpoint's prefix holds."""
    return tuple(point.message + 1 for point in breakpoints)


def write_plan(breakpoints: tuple[Breakpoint, ...], ends: tuple[int | None, ...]) -> WritePlan:
    """The write plan of `breakpoints`, given where each one's prefix ends in the rendered prompt (`ends`, in the
    same order: `RenderedChat.ends` of `message_counts(breakpoints)`; shorter when the prompt did not fit, which
    is refused elsewhere). Two breakpoints at one end hold it for the longer time."""
    if not breakpoints:
        return AUTOMATIC
    by_end: dict[int, TtlClass] = {}
    for index, point in enumerate(breakpoints):
        end = ends[index] if index < len(ends) else None
        if not point.last_block:
            raise invalid_request(f"'{point.param}' is inside a message: this node caches prefixes that end at a "
                                  f"message's end; put 'cache_control' on the message's last block", param=point.param)
        if end is None:
            raise invalid_request(f"'{point.param}': this model's chat template cannot split the conversation at the "
                                  f"end of that message; put 'cache_control' on another message", param=point.param)
        ttl: TtlClass = "1h" if point.ttl == "1h" else "5m"
        by_end[end] = "1h" if "1h" in (ttl, by_end.get(end)) else ttl
    return WritePlan("default", tuple(Hold(end, by_end[end]) for end in sorted(by_end)))
