"""Talking to instances: one pooled httpx client, error bodies, raw forwarding, SSE reading.

Every failure to reach an instance becomes `InstanceUnavailable` (the caller retries elsewhere
and marks the instance down); an instance's own error answer becomes `InstanceError` carrying
its status and body, so the router can pass a 4xx to the client byte for byte.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
from fastapi.responses import Response, StreamingResponse

from splitserve.router.registry import Instance

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_FORWARDED_HEADERS = ("content-type", "x-request-id", "cache-control")


class InstanceUnavailable(Exception):
    """The instance did not answer (refused, reset, timed out) or answered 5xx."""


class InstanceError(Exception):
    """The instance answered with an error status; `body` is its bytes, passed on as is."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        super().__init__(f"instance answered {status}: {body[:200]!r}")
        self.status, self.body, self.content_type = status, body, content_type

    def response(self, request_id: str | None = None) -> Response:
        headers = {"X-Request-Id": request_id} if request_id else None
        return Response(self.body, status_code=self.status, media_type=self.content_type,
                        headers=headers)


def error_response(status: int, message: str, code: str | None = None,
                   type_: str = "invalid_request_error", param: str | None = None,
                   request_id: str | None = None) -> Response:
    """OpenAI's error body, the same shape the instances answer with."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(msgspec.json.encode(body), status_code=status,
                    media_type="application/json", headers=headers)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def sse_error(message: str, code: str = "upstream_failed") -> bytes:
    return sse({"error": {"message": message, "type": "server_error", "param": None,
                          "code": code}})


def make_client(connect_timeout_s: float, request_timeout_s: float) -> httpx.AsyncClient:
    """The one client of the router: keep-alive pools per instance, no proxies from the env."""
    timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def post_json(client: httpx.AsyncClient, inst: Instance, path: str,
                    body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """POST a JSON body, return the decoded JSON answer; raise InstanceError/Unavailable."""
    try:
        r = await client.post(inst.url + path, content=msgspec.json.encode(body),
                              headers={"content-type": "application/json",
                                       "x-request-id": request_id})
    except httpx.HTTPError as err:
        raise InstanceUnavailable(f"{inst.url}: {type(err).__name__}: {err}") from None
    if r.status_code >= 500:
        raise InstanceUnavailable(f"{inst.url} answered {r.status_code}: {r.text[:200]}")
    if r.status_code != 200:
        raise InstanceError(r.status_code, r.content, r.headers.get("content-type",
                                                                     "application/json"))
    return msgspec.json.decode(r.content)


async def open_stream(client: httpx.AsyncClient, inst: Instance, path: str, content: bytes,
                      request_id: str) -> httpx.Response:
    """Send a request and wait for the status line; the caller reads and closes the body."""
    req = client.build_request("POST", inst.url + path, content=content,
                               headers={"content-type": "application/json",
                                        "x-request-id": request_id})
    try:
        r = await client.send(req, stream=True)
    except httpx.HTTPError as err:
        raise InstanceUnavailable(f"{inst.url}: {type(err).__name__}: {err}") from None
    if r.status_code != 200:
        try:
            body = await r.aread()
        except httpx.HTTPError:
            body = b""
        finally:
            await r.aclose()
        if r.status_code >= 500:
            raise InstanceUnavailable(f"{inst.url} answered {r.status_code}: {body[:200]!r}")
        raise InstanceError(r.status_code, body, r.headers.get("content-type",
                                                               "application/json"))
    return r


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE body, until `[DONE]`; an `error` event is yielded too."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return
        yield msgspec.json.decode(data)


def relay(response: httpx.Response, request_id: str, on_close: Any = None) -> Response:
    """Pass an instance's streamed answer through unchanged (colocated and decode-only)."""
    headers = {k: v for k, v in response.headers.items() if k.lower() in _FORWARDED_HEADERS}
    headers["X-Request-Id"] = request_id

    async def body() -> AsyncIterator[bytes]:
        failure: Exception | None = None
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as err:
            failure = err
            logger.warning("%s: upstream stream broke: %s", request_id, err)
            if "event-stream" in response.headers.get("content-type", ""):
                yield sse_error(f"instance failed mid-stream: {type(err).__name__}")
                yield DONE
        finally:
            await response.aclose()
            if on_close is not None:
                on_close(failure)

    return StreamingResponse(body(), status_code=response.status_code, headers=headers)
