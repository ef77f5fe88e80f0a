"""An HTTP request on its way in: body size limit, JSON parsing and validation, disconnects.

The size limit is enforced while the body is read (413 before any parsing), the body is decoded by
msgspec and validated by the protocol models (a 400 that names the field), and a client that goes
away while its non-streamed answer is computed has the work cancelled, which aborts its requests
in the core and frees their KV blocks. (Streamed answers abort through their body: streaming.py.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from splitserve.engine.api_errors import APIError, error_response, validation_error

logger = logging.getLogger(__name__)


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length up front or by counting chunked ones."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await self._reject(scope, receive, send)
        received = 0

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        # Only `receive` is wrapped (a wrapped `send` would cost a call per streamed chunk): the
        # routes read the whole body before they answer, so nothing was sent when this raises.
        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"request body larger than {self.max_body_bytes} bytes (server.max_body_bytes)"
        response = error_response(APIError(413, message, code="request_too_large"))
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The body as `model`, or an APIError 400 (`invalid_json`, or naming the bad field); 499
    (answered to nobody, not logged as a server error) if the client left while sending it."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise APIError(499, "client disconnected while sending the body",
                       code="client_disconnected") from None
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise APIError(400, f"invalid JSON body: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response | None:
    """Run `work`, cancelling it (and so aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    logger.debug("client disconnected before the response")
    return None
