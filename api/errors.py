"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, and the one place
that maps the services' domain errors to HTTP.

Services raise ``NotFound``, ``Invalid`` (with ``param``) and ``Conflict``; the transport raises
``ApiError`` with its own status (401, 413, 415, 429, 507). A request body that fails validation is
a 400 naming each field once (``kiln.spec.explain``: no pydantic-internal names, "did you mean"
for a typo), never FastAPI's 422. Every error names its ``request_id`` (also the
``x-request-id`` header). Client errors other than 408 and 429 carry
``x-should-retry: false`` so the OpenAI SDK does not retry what cannot succeed.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import logs
from kiln.chat import ChatRequest
from kiln.spec import JobRequest, SpecError, explain
from kiln.types import ErrorResponse

log = logging.getLogger("kiln.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        extra: dict | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.extra = extra or {}  # more fields inside "error", e.g. a dataset's "issues"
        self.headers = headers or {}


class NotFound(ApiError):
    """No such object for this owner (another owner's objects are not found either)."""

    def __init__(self, kind: str, id: str, param: str | None = None):
        super().__init__(
            404, f"No {kind} found with id {id!r}", param=param, code=f"{kind.replace(' ', '_')}_not_found"
        )


class Invalid(ApiError):
    """The request cannot be carried out as given; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, extra: dict | None = None):
        super().__init__(400, message, param=param, code=code, extra=extra)


class Conflict(ApiError):
    """The request is well formed but the object's state refuses it (a finished job, an
    Idempotency-Key used for another request)."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(409, message, param=param, code=code)


def not_found(kind: str, id: str, param: str | None = None) -> ApiError:
    return NotFound(kind, id, param)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
    extra: dict | None = None,
) -> JSONResponse:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code, **(extra or {})}}
    headers = dict(headers or {})
    rid = logs.current().get("request_id")
    if rid:  # quoted in a support request, it finds the request's log lines
        body["error"]["request_id"] = rid
        headers["x-request-id"] = rid
    if 400 <= status < 500 and status not in (408, 429):  # our 409s (finished job, adapter not ready) are final
        headers.setdefault("x-should-retry", "false")
    return JSONResponse(body, status_code=status, headers=headers)


BODIES: dict[tuple[str, str], type[BaseModel]] = {  # for "did you mean" on an unknown field
    ("POST", "/v1/fine_tuning/jobs"): JobRequest,
    ("POST", "/v1/chat/completions"): ChatRequest,
}


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.code, headers=exc.headers, extra=exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(req: Request, exc: RequestValidationError):
        text, param = explain(list(exc.errors()), BODIES.get((req.method, req.url.path)))
        return error_response(400, text, param=param, code="invalid_request")

    @app.exception_handler(SpecError)
    async def _spec(_req: Request, exc: SpecError):
        return error_response(400, str(exc), param=exc.param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unhandled(_req: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "The server had an error while processing your request.", code="server_error")


_MEANING = {
    400: "The request is invalid; the message names the field",
    401: "Missing or wrong API key",
    404: "No such object for this API key's owner",
    409: "The object's state refuses the request, or the Idempotency-Key was used for another request",
    413: "The upload is larger than the limit",
    415: "The upload is not multipart/form-data",
    429: "Rate limit reached; retry after the Retry-After header's seconds",
    503: "The inference server is not reachable; retry later",
    507: "The store is out of space",
}


def responses(*statuses: int) -> dict[int | str, dict]:
    """The OpenAPI ``responses`` of the errors a route sends, each in OpenAI's shape."""
    return {s: {"model": ErrorResponse, "description": _MEANING[s]} for s in statuses}
