"""OpenAI error answers of the instance server: one exception type, one body, one status rule.

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}` with a status that
says whose fault it is: 400 bad JSON, bad field (named) or too-long prompt; 404 unknown model or
route; 413 body over `max_body_bytes`; 503 waiting queue full or engine dead (with `Retry-After`).
Handlers raise `APIError`; the app's exception handlers (`add_error_handlers`) write the body, so
bad input never reaches a 500 and never hurts the server.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.engine.async_llm import EngineDeadError, RequestRejectedError
from splitserve.engine.protocol_responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An OpenAI error answer: the server turns it into `{"error": {...}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )


def error_response(err: APIError) -> JSONResponse:
    """The answer to `err`: OpenAI's body, its status, `Retry-After` when retrying may help."""
    info = ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code)
    headers = {"Retry-After": "1"} if err.status in (429, 503) else None
    return JSONResponse(
        ErrorResponse(error=info).model_dump(), status_code=err.status, headers=headers
    )


def validation_error(err: ValidationError | RequestValidationError) -> APIError:
    """400 naming the fields: `max_tokens: Input should be greater than or equal to 1`."""
    problems, first = [], None
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        first = first or loc or None
        problems.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    message = "; ".join(p.replace("Value error, ", "") for p in problems)
    return APIError(400, message or "invalid request", param=first, code="invalid_value")


def engine_error(err: RequestRejectedError | EngineDeadError) -> APIError:
    """The core's refusal of a request as the client sees it: 503 when it is the server's state
    (queue full, engine dead), 400 when it is the prompt (too long, invalid tokens)."""
    if isinstance(err, EngineDeadError):
        return APIError(
            503, f"engine unavailable: {err}", code="engine_dead", type_="service_unavailable"
        )
    if err.code == "queue_full":
        return APIError(503, str(err), code=err.code, type_="server_busy")
    return APIError(400, str(err), param="prompt", code=err.code)


def add_error_handlers(app: FastAPI) -> None:
    """Every exception a route can raise becomes an OpenAI error body; unknown ones a 500 that
    says what failed (and is logged with its traceback)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(err.status_code, str(err.detail), code=str(err.status_code)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        message = f"internal error: {type(err).__name__}: {err}"
        return error_response(APIError(500, message, code="internal_error", type_="internal_error"))
