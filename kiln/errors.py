"""Exceptions of the SDK: one class per HTTP status, carrying the server's error."""

from __future__ import annotations

from typing import Any


class KilnError(Exception):
    pass


class APIConnectionError(KilnError):
    """The server could not be reached (after the retries)."""


class APIStatusError(KilnError):
    status_code: int = 0

    def __init__(self, status_code: int, body: dict[str, Any] | None, request_id: str | None = None):
        err = (body or {}).get("error") or {}
        self.status_code = status_code
        self.message: str = err.get("message") or f"HTTP {status_code}"
        self.type, self.param, self.code = err.get("type"), err.get("param"), err.get("code")
        self.issues: list[dict[str, Any]] = err.get("issues") or []  # dataset problems: line, field, message
        self.request_id: str | None = request_id or err.get("request_id")  # the server's log lines carry it
        self.body = body
        super().__init__(f"{status_code} {self.message}" + (f" (request {self.request_id})" if self.request_id else ""))


class BadRequestError(APIStatusError): ...


class AuthenticationError(APIStatusError): ...


class PermissionDeniedError(APIStatusError): ...


class NotFoundError(APIStatusError): ...


class ConflictError(APIStatusError): ...


class PayloadTooLargeError(APIStatusError): ...


class UnprocessableEntityError(APIStatusError): ...


class RateLimitError(APIStatusError): ...


class InternalServerError(APIStatusError): ...


_BY_STATUS = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    415: BadRequestError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def from_response(status_code: int, body: dict[str, Any] | None, request_id: str | None = None) -> APIStatusError:
    cls = _BY_STATUS.get(status_code, InternalServerError if status_code >= 500 else APIStatusError)
    return cls(status_code, body, request_id)
