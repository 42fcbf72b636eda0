"""Why the node refuses a request, as domain errors; only the HTTP layer (`node/api/middleware.py`) maps each
kind to a status code and an OpenAI-shaped body."""

from __future__ import annotations

from typing import Any


class NodeError(Exception):
    """A refusal: `message` says what to change, `param` names the request field at fault, `code` is a stable
    machine-readable id, `retry_after_s` how long a retry should wait (None: a retry fails again)."""

    kind = "invalid_request_error"
    """OpenAI's error `type`."""
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class InvalidRequest(NodeError):
    """The request itself is wrong: a field, the body, the prompt's size."""


class Unauthenticated(NodeError):
    default_code = "invalid_api_key"


class RequestTimeout(NodeError):
    """The request's body did not arrive within `limits.body_timeout_s`."""

    default_code = "body_timeout"


class BodyTooLarge(NodeError):
    """The request's body is larger than its route takes."""

    default_code = "request_too_large"


class UnsupportedMediaType(NodeError):
    """The body is in a form no route reads: compressed (`Content-Encoding`), or not JSON where JSON is required."""

    default_code = "unsupported_media_type"


class PermissionDenied(NodeError):
    kind = "permission_error"
    default_code = "forbidden"


class NotFound(NodeError):
    kind = "not_found_error"


class RequirementNotMet(NodeError):
    """The caller requires what this node does not offer (confidential hardware, a jurisdiction, a price
    ceiling): refused before any compute. `param` names the requirement."""

    default_code = "requirement_not_met"


class Overloaded(NodeError):
    kind = "server_error"
    default_code = "queue_full"


class Unavailable(NodeError):
    """A part the node needs to answer is failing (the ledger's disk, the TEE interface)."""

    kind = "server_error"


class ModelFailure(NodeError):
    kind = "server_error"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def model_not_found(model: str) -> NotFound:
    return NotFound(f"the model {model!r} does not exist on this node; GET /v1/models lists the models",
                    param="model", code="model_not_found")


QUEUE_RETRY_AFTER_S = 1
"""A full queue drains at the pace of generation: a second is a fair first back-off."""


def queue_full(message: str) -> Overloaded:
    return Overloaded(message, retry_after_s=QUEUE_RETRY_AFTER_S)
