"""Which trust group's scope a request asks to share its prefix in, checked against the config as it is now.

A request asks in its dialect: Anthropic's with a `cache_control` breakpoint carrying `"scope": "group"` (the
prefix up to that breakpoint's message), OpenAI's with the header `Tenzro-Cache-Scope: group` and a
`prompt_cache_key` (the prefix up to the end of the system message). Membership is read from the key ring on
every request (`KeyRing.group_of`), so a caller removed from its group reads nothing of it from its next request
on. A caller of no group that asks is refused with a 400 naming the field, before anything is computed or stored;
the refusal names no group.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from node.anthropic_schema import Breakpoint
from node.api.keys import KEYRING
from node.config import Caller
from node.errors import invalid_request
from node.openai_schema import Message

SCOPE_HEADER = "Tenzro-Cache-Scope"
SCOPES = ("caller", "group")
"""The header's values; absent means "caller": everything stays in the caller's own scope."""


@dataclass(frozen=True, slots=True)
class GroupAsk:
    """A request's ask to share the prefix of its first `messages` messages in its trust group's scope."""

    group: str
    messages: int
    """Messages whose rendering is the shared prefix (the system message alone: 1)."""
    param: str
    """The field that asked, blamed when the chat cannot be split there."""


def _member_group(request: web.Request, caller: Caller, param: str) -> str:
    group = request.app[KEYRING].group_of(caller.name)
    if group is None:
        raise invalid_request(f"'{param}' asks for a trust group's scope, and this caller is a member of no trust "
                              f"group on this node (node.yaml 'groups'); send the request without it",
                              param=param, code="not_in_group")
    return group


def openai_ask(request: web.Request, caller: Caller, messages: tuple[Message, ...], cache_key: bool
               ) -> GroupAsk | None:
    """The ask of an OpenAI chat request (`SCOPE_HEADER`), or None. `cache_key`: it sent a `prompt_cache_key`."""
    value = request.headers.get(SCOPE_HEADER, SCOPES[0])
    if value not in SCOPES:
        raise invalid_request(f"'{SCOPE_HEADER}' must be {' or '.join(map(repr, SCOPES))}", param=SCOPE_HEADER)
    if value == SCOPES[0]:
        return None
    group = _member_group(request, caller, SCOPE_HEADER)
    if not cache_key:
        raise invalid_request(f"'{SCOPE_HEADER}: group' needs a 'prompt_cache_key' naming the shared prefix",
                              param="prompt_cache_key")
    if messages[0].role != "system":
        raise invalid_request(f"'{SCOPE_HEADER}: group' shares the system message: the first message must be the "
                              f"system message", param="messages[0].role")
    return GroupAsk(group, 1, SCOPE_HEADER)


def refuse_text_ask(request: web.Request) -> None:
    """A text completion has no system message to share: the header is refused there."""
    if request.headers.get(SCOPE_HEADER, SCOPES[0]) != SCOPES[0]:
        raise invalid_request(f"'{SCOPE_HEADER}' is for chat requests (it shares the system message); send this "
                              f"text completion without it", param=SCOPE_HEADER)


def anthropic_ask(request: web.Request, caller: Caller, breakpoints: tuple[Breakpoint, ...]) -> GroupAsk | None:
    """The ask of a Messages request: its last breakpoint with `"scope": "group"`, which must end its message (a
    message's end is where the template's rendering splits), or None."""
    asked = [point for point in breakpoints if point.group]
    if not asked:
        return None
    point = max(asked, key=lambda point: point.message)
    param = f"{point.param}.scope"
    group = _member_group(request, caller, param)
    if not point.last_block:
        raise invalid_request("a group breakpoint must be on the last block of its message: the shared prefix ends "
                              "where a message ends", param=param)
    return GroupAsk(group, point.message + 1, param)
