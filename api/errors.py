"""OpenAI's error object and the exception that becomes one: every 4xx and 5xx the API answers
is an :class:`APIError` turned into :class:`ErrorResponse` (``api.edge.error_response``)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str = Field(description="what was wrong, and the limit where one was passed")
    type: str = Field(description="the class of error, e.g. invalid_request_error")
    param: str | None = Field(description="the offending field's dotted path, or header")
    code: str | None = Field(description="a stable code a client may branch on")


class ErrorResponse(BaseModel):
    """OpenAI's error object: the body of every 4xx and 5xx answer."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorInfo


class APIError(Exception):
    """An error the client sees as OpenAI's error object with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        default = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type or _ERROR_TYPES.get(status, default)
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds (RFC 9110), rounded up, when there is one."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def bad_request(param: str | None, message: str) -> APIError:
    """A 400 naming the offending field (its dotted path) or header."""
    return APIError(400, message, param=param)
