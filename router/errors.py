"""Why the router refuses a request or a providers file, as domain errors; only `router/app.py` maps each kind of
refusal to a status code and an OpenAI-shaped body."""

from __future__ import annotations

from typing import Any


class RouterConfigError(ValueError):
    """The providers file is malformed; the message names the key to change."""


class RouterError(Exception):
    """A refusal: `message` says what to change, `param` names the request field or header at fault, `code` is a
    stable machine-readable id."""

    kind = "invalid_request_error"
    """OpenAI's error `type`."""
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class InvalidRequest(RouterError):
    """The request itself is wrong: its body, a requirement header."""


class Unauthenticated(RouterError):
    default_code = "invalid_api_key"


class RequestTimeout(RouterError):
    """The request's body did not arrive within `settings.body_timeout_s`."""

    default_code = "body_timeout"


class UnsupportedMediaType(RouterError):
    """The body is compressed (`Content-Encoding`): no route reads a compressed body."""

    default_code = "unsupported_media_type"


class ModelNotFound(RouterError):
    kind = "not_found_error"
    default_code = "model_not_found"


class GenerationNotFound(RouterError):
    """No provider shows this caller a generation with this id: the node's answer for an unknown id and for another
    caller's alike, with the node's message, so that the router's callers cannot probe ids either."""

    kind = "not_found_error"
    default_code = "generation_not_found"


class RequirementNotMet(RouterError):
    """No provider that serves the model meets the caller's requirements; `param` names the requirement that
    eliminated the last ones (`trust_tier`, `confidential_hardware`, `jurisdiction`, `max_price_wei.CLASS`)."""

    default_code = "requirement_not_met"


class NoProviderAvailable(RouterError):
    """Every provider that serves the model is down: a retry after the next health poll may succeed."""

    kind = "server_error"
    default_code = "no_provider_available"


class ProvidersFailed(RouterError):
    """Every provider tried failed before answering (connection refused, timed out, broke off)."""

    kind = "server_error"
    default_code = "provider_failed"
