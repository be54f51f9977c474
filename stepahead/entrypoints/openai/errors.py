"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, and the API-key middleware.

Every validation failure is a 400 (FastAPI's default 422 is overridden, non-JSON bodies included),
an unknown model a 404, engine failures a 500, requests refused or cut by a shutdown a 503. A
missing or wrong API key on /v1/* is a 401 with the plain body {"error": "Unauthorized"} that
OpenAI clients expect.
"""

from __future__ import annotations

import hashlib
import http
import json
import logging
import re
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from stepahead.errors import EngineDeadError, EngineShutdownError
from stepahead.validation import InvalidInputError, shorten

logger = logging.getLogger("stepahead.entrypoints.openai")

MAX_MESSAGE_CHARS = 2048


class APIError(Exception):
    """An error with its HTTP status, raised anywhere in a handler."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _type_for(status)


def _type_for(status: int) -> str:
    return {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}.get(
        status, _phrase(status))


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:
        return "Error"


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None) -> dict:
    return {"error": {"message": _sanitize(message), "type": err_type or _type_for(status), "param": param,
                      "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def error_from_exception(e: BaseException) -> APIError:
    """The status a failure maps to: bad input 400, engine failures 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidInputError):
        return APIError(str(e), 400, e.param)
    if isinstance(e, (ValueError, TypeError, OverflowError)):
        return APIError(str(e), 400, _param_of(str(e)))
    if isinstance(e, EngineDeadError):
        return APIError(f"The engine is dead: {e}", 500)
    if isinstance(e, EngineShutdownError):
        return APIError("The server is shutting down", 503)
    return APIError(f"Internal server error: {e!r}", 500)


def _param_of(message: str) -> str | None:
    """A ValueError that names a field first ("top_p must be in (0, 1], got 2.0"): that field."""
    field = re.match(r"([a-z_]+) (must|is|are) ", message)
    return field.group(1) if field else None


def _sanitize(message: str) -> str:
    """No object addresses, and never longer than MAX_MESSAGE_CHARS (a message may quote input)."""
    return shorten(re.sub(r" at 0x[0-9a-f]+>", ">", message), MAX_MESSAGE_CHARS)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        if param is None and loc and not loc[0].isdigit():  # a JSON decode error's loc is a character offset
            param = loc[0]
        where = ".".join(loc)
        # pydantic's error type too (e.g. greater_than_equal), which clients match on as they do with vLLM's
        kind = f" [type={err['type']}]" if err.get("type") else ""
        parts.append(f"{where}: {err.get('msg')}{kind}" if where else f"{err.get('msg')}{kind}")
    return "; ".join(parts) or "Invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(str(exc.detail), exc.status_code)
        response.headers.update(exc.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.status, exc.param, exc.err_type), status_code=exc.status)

    # Handlers keyed on Exception itself run in Starlette's outermost middleware, which re-raises
    # afterwards and drops the connection; naming the classes keeps them ordinary responses.
    for cls in (ValueError, TypeError, OverflowError, RuntimeError, KeyError, AttributeError, NotImplementedError):
        app.add_exception_handler(cls, exception_response)


async def exception_response(request: Request, exc: Exception) -> JSONResponse:
    err = error_from_exception(exc)
    if err.status >= 500:
        logger.error("Request failed: %r", exc, exc_info=exc)
    return JSONResponse(error_body(err.message, err.status, err.param), status_code=err.status)


class APIKeyMiddleware:
    """Bearer-token check on /v1/* (pure ASGI: works with streaming and disconnect detection).

    Keys are compared as SHA-256 digests with secrets.compare_digest, so the time taken does not
    depend on how much of a guess is right. /health, /metrics, /version, /tokenize stay open.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not _is_v1(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        given = header[7:] if header[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(hashlib.sha256(given.encode()).digest(), self._digest):
            body = json.dumps({"error": "Unauthorized"}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _is_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}
_ERROR_STATUSES = {"400": "Bad request", "401": "Missing or wrong API key", "404": "Unknown model",
                   "413": "Request body too large", "500": "Engine failure", "503": "Shutting down or engine dead"}
_STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# GET endpoints that answer an error: its status and what it means.
_GET_ERRORS = {"/v1/responses/{response_id}": {"404": "No stored response has this id"}}
_PLAIN_TEXT = {"/health": "Empty body: 200 while the engine is alive, 503 once it is dead",
               "/metrics": "Prometheus text exposition format"}


def document_errors(app: FastAPI) -> None:
    """An OpenAPI schema that tells the truth: FastAPI documents request validation failures as 422,
    which this server answers with 400 and an OpenAI-shaped body; every POST endpoint documents the
    error statuses it can answer, and /health and /metrics their plain-text bodies."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            error = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
            for path, operations in schema.get("paths", {}).items():
                for method, operation in operations.items():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    if method == "post":
                        for status, description in _ERROR_STATUSES.items():
                            responses[status] = {"description": description, **error}
                        if path in _STREAMING:  # "stream": true answers with server-sent events
                            responses["200"].setdefault("content", {})["text/event-stream"] = {}
                    elif method == "get":
                        for status, description in _GET_ERRORS.get(path, {}).items():
                            responses[status] = {"description": description, **error}
                    if path in _PLAIN_TEXT:
                        responses["200"] = {"description": _PLAIN_TEXT[path], "content": {"text/plain": {}}}
                        if path == "/health":
                            responses["503"] = {"description": "The engine is dead", "content": {"text/plain": {}}}
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI documents this override
