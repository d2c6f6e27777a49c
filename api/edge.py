"""The FastAPI application's edges (docs/design.md#api): what no route answers, what a route
that fails answers, and what the OpenAPI document says about the routes.

- A request no route takes gets OpenAI's error object, as every other error does: 404
  ``unknown_url`` for an unknown path, 405 ``method_not_allowed`` (with ``Allow``) for a known
  path and the wrong method.
- An exception no code handled is a 500 error object of type ``internal_error`` naming the
  request (its id, or its method and path), logged with its traceback under the same name:
  never Starlette's plain-text 500. The generation routes catch their own (``api.app``), so
  their log line carries the response id the client can quote.
- The generation routes read their body raw (``api.app`` parses it itself, so a 400 names the
  field as OpenAI's does, never FastAPI's 422), so FastAPI cannot see the body's type: each
  route declares it (``json_body``), and the document carries the request models' JSON
  schemas, so schema-driven clients and fuzzers can build requests.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from api.errors import APIError, ErrorResponse
from api.protocol import JSON_MEDIA_TYPE

logger = logging.getLogger("tandem.api")
_SCHEMA_REF = "#/components/schemas/{model}"
_CODES = {404: "unknown_url", 405: "method_not_allowed"}

# ``responses`` of a route that generates: every refusal and failure is an error object.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the response object; with stream: true, server-sent events ending "
        "with data: [DONE]",
        # Before OpenAPI 3.2 an event stream's schema describes one event.
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string"}},
                    "required": ["data"],
                    "description": "data: a JSON chunk, an error object, or [DONE] last",
                }
            }
        },
    },
    "4XX": {"model": ErrorResponse, "description": "the request was refused"},
    "5XX": {"model": ErrorResponse, "description": "the request failed before its first token"},
}


class OpenAIApp(FastAPI):
    """FastAPI whose routing errors are OpenAI error objects and whose OpenAPI document
    declares the JSON bodies its routes read raw."""

    def __init__(self, **kwargs: Any) -> None:
        self._body_models: dict[str, type[BaseModel]] = {}
        # One URL per endpoint: a trailing slash is an unknown path, not a redirect a client
        # may or may not follow with its body.
        super().__init__(
            exception_handlers={HTTPException: _routing_error, Exception: _unhandled},
            redirect_slashes=False,
            **kwargs,
        )

    def json_body(self, model: type[BaseModel]) -> dict[str, Any]:
        """The ``openapi_extra`` of a route that reads a ``model`` from its JSON body itself."""
        self._body_models[model.__name__] = model
        ref = _SCHEMA_REF.format(model=model.__name__)
        content = {JSON_MEDIA_TYPE: {"schema": {"$ref": ref}}}
        return {"requestBody": {"required": True, "content": content}}

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document, with the declared body models (and the models they use) among
        its components."""
        if self.openapi_schema is None:
            doc = super().openapi()  # cached by FastAPI in self.openapi_schema
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, model in self._body_models.items():
                schema = model.model_json_schema(ref_template=_SCHEMA_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[name] = schema
        return self.openapi_schema  # type: ignore[return-value]


async def _routing_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's router raises HTTPException for a path no route matches (404) and for a
    route's path with another method (405, ``Allow`` in its headers)."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"no endpoint at {where}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method not allowed: {where} (allowed: {allowed})"
    else:
        message = f"{where}: {exc.detail}"
    err = APIError(exc.status_code, message, code=_CODES.get(exc.status_code))
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


def error_response(error: APIError) -> JSONResponse:
    """An error's HTTP answer: its object, its status and its ``Retry-After``, if any."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def internal_error(exc: BaseException, request_id: str) -> APIError:
    """The 500 of a bug: the client learns the exception's class and the request, the log the
    traceback under the same request."""
    logger.error("%s: internal error", request_id, exc_info=exc)
    message = f"internal error: {type(exc).__name__} (request {request_id})"
    return APIError(500, message, type="internal_error")


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's last resort (its ServerErrorMiddleware, which re-raises ``exc`` to the
    server once this answer is sent)."""
    return error_response(internal_error(exc, f"{request.method} {request.url.path}"))
