"""Typed API errors; only the HTTP layer turns them into OpenAI-shaped JSON bodies."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        """Seconds after which a retry makes sense (sent as `Retry-After`); None where a retry would fail again."""

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist on this node; GET /v1/models lists the models",
                    param="model", code="model_not_found")


def forbidden(message: str) -> ApiError:
    return ApiError(403, message, type="permission_error", code="forbidden")


QUEUE_RETRY_AFTER_S = 1
"""A full queue drains at the pace of generation: a second is a fair first back-off."""


def queue_full(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="queue_full", retry_after_s=QUEUE_RETRY_AFTER_S)
