"""Typed API errors; only the HTTP layer turns them into OpenAI-shaped JSON bodies."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist on this node; GET /v1/models lists the models",
                    param="model", code="model_not_found")


def queue_full(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="queue_full")
