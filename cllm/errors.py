"""The error every layer raises for a request that cannot be served: it becomes an HTTP response
with an OpenAI-shaped body (other protocols' routes reshape the body, not the error)."""
from __future__ import annotations


class APIError(Exception):
    """An error that becomes an HTTP response with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}
