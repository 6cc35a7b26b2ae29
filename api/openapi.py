"""The OpenAPI document says what the server does: errors in OpenAI's shape under the statuses the
routes send (a request that fails validation is a 400, never FastAPI's 422), Bearer auth, and the
response models of ``kiln.types`` (the SDK's). ``OPTIONS`` on any route answers 204 with every
method its path takes in ``Allow``, and so does the ``Allow`` of a 405.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from starlette.routing import Match, Mount

from api.errors import error_response, responses
from kiln.types import ErrorResponse

METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


def _document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    bad_request = responses(400)[400]
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for item in doc.get("paths", {}).values():
        for method, op in item.items():
            if method not in METHODS:
                continue
            codes = op.setdefault("responses", {})
            if codes.pop("422", None) is not None or op.get("parameters") or op.get("requestBody"):
                codes.setdefault(
                    "400",
                    {
                        "description": bad_request["description"],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                    },
                )
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.setdefault("ErrorResponse", ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}"))
    for name, schema in (
        ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {}).items()
    ):
        schemas.setdefault(name, schema)
    schemas["ErrorResponse"].pop("$defs", None)
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    return doc


def allowed(app: FastAPI, scope: MutableMapping[str, Any]) -> list[str]:
    """Every method some route takes at the request's path (HEAD with GET, and OPTIONS)."""
    methods = {
        m
        for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
        for route in app.router.routes
        if route.matches({**scope, "method": m})[0] == Match.FULL and (m == "GET" or not isinstance(route, Mount))
    }  # a mount is the web page's static files: GET and HEAD
    if methods:
        methods |= {"OPTIONS"} | ({"HEAD"} if "GET" in methods else set())
    return sorted(methods)


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    # Plain routes and handlers, not a middleware: an http middleware holds each request's
    # dependencies (its database session) until the response is sent, and under load the pool
    # ran dry (tests/integration/test_load.py).
    @app.options("/{path:path}", include_in_schema=False, status_code=204)
    def _options(request: Request) -> Response:
        methods = allowed(app, request.scope)
        if not methods:
            return error_response(404, "Not Found")
        return Response(status_code=204, headers={"Allow": ", ".join(methods)})

    @app.exception_handler(405)
    async def _not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(405, "Method Not Allowed", headers={"Allow": ", ".join(allowed(app, request.scope))})
