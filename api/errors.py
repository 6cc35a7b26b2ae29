"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

FastAPI's own 422 body is rewritten into this shape too. Client errors other than 408 and 429 carry
``x-should-retry: false`` so the OpenAI SDK does not retry what cannot succeed.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


def not_found(kind: str, id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No {kind} found with id {id!r}", param=param, code=f"{kind.replace(' ', '_')}_not_found")


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
    if 400 <= status < 500 and status not in (408, 429):  # our 409s (finished job, adapter not ready) are final
        headers.setdefault("x-should-retry", "false")
    return JSONResponse(body, status_code=status, headers=headers)


_UNION_TAGS = {"int", "float", "str", "bool", "list", "dict", "none"}


def _field(loc: tuple) -> str:
    """``("body", "lora", "target_modules", 0)`` -> ``lora.target_modules[0]``; union branch tags
    that pydantic adds (``literal['auto']``, ``int``) are dropped."""
    parts = [
        str(p)
        for p in loc
        if p not in ("body", "query", "path", "header") and not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))
    ]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.code, headers=exc.headers, extra=exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        by_field: dict[str, list[str]] = {}
        for e in exc.errors():  # the branches of a union ('auto' or an int >= 1) join with "or"
            msgs = by_field.setdefault(_field(tuple(e.get("loc", ()))), [])
            if e.get("msg") not in msgs:
                msgs.append(e.get("msg"))
        text = "; ".join(f"{f or 'body'}: {' or '.join(m)}" for f, m in list(by_field.items())[:5])
        param = next(iter(by_field), "") or None
        return error_response(400, text or "invalid request", param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unhandled(_req: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "The server had an error while processing your request.", code="server_error")
