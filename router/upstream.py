"""Talking to instances: one pooled aiohttp session, error bodies, raw forwarding, SSE reading.

Every failure to reach an instance becomes `InstanceUnavailable` (the caller retries elsewhere
and marks the instance down); an instance's own error answer becomes `InstanceError` carrying
its status and body, so the router can pass a 4xx to the client byte for byte.

Why aiohttp, not httpx: the upstream call is most of the router's own cost per request. httpx
(pure-Python h11, anyio cancel scopes that each ask asyncio for the running loop, one getpid()
syscall apiece on Python 3.11, and headers and body in two writes) spent ~0.7 ms of CPU on a
1-token completion; aiohttp (C parser, one write) ~0.1 ms.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from fastapi.responses import Response, StreamingResponse

if TYPE_CHECKING:  # registry imports this module
    from splitserve.router.registry import Instance

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_FORWARDED_HEADERS = ("content-type", "cache-control")  # X-Request-Id is set by the router
# What aiohttp raises when an instance does not answer: refused, reset, cut short, timed out.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# Below uvicorn's default keep-alive (5 s) on the instances, so the router never sends a
# request on a connection the instance is closing (that would look like the instance is down).
_KEEPALIVE_S = 4.0


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


def _unavailable(url: str, err: BaseException) -> InstanceUnavailable:
    return InstanceUnavailable(f"{url}: {type(err).__name__}: {err}")


class UpstreamClient:
    """The one client of the router: keep-alive pools per instance, no proxies from the env.

    `request_timeout_s` bounds every wait for an instance's next byte (and for a pooled
    connection), `connect_timeout_s` a new connection. The aiohttp session is made on first use,
    inside the event loop, as aiohttp requires.
    """

    def __init__(self, connect_timeout_s: float, request_timeout_s: float) -> None:
        self.timeout = aiohttp.ClientTimeout(total=None, connect=request_timeout_s,
                                             sock_connect=connect_timeout_s,
                                             sock_read=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0,
                                             keepalive_timeout=_KEEPALIVE_S)
            # No cookie jar: a proxy must not carry one client's cookies to another's request.
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout,
                                                  cookie_jar=aiohttp.DummyCookieJar(),
                                                  auto_decompress=False, trust_env=False)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, url: str, content: bytes | None = None,
                      request_id: str | None = None, timeout_s: float | None = None
                      ) -> tuple[int, bytes, str]:
        """The whole answer, any status: (status, body, content type); raise
        InstanceUnavailable when there is none."""
        headers = {"content-type": "application/json"} if content is not None else {}
        if request_id:
            headers["x-request-id"] = request_id
        # (timeout=None would mean no timeout at all; leave it out for the session's)
        extra = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
        try:
            async with self.session.request(method, url, data=content, headers=headers,
                                            **extra) as r:
                return r.status, await r.read(), r.headers.get("content-type",
                                                               "application/json")
        except TRANSPORT_ERRORS as err:
            raise _unavailable(url, err) from None

    async def post_json(self, inst: Instance, path: str, body: dict[str, Any],
                        request_id: str) -> dict[str, Any]:
        """POST a JSON body, return the decoded JSON answer; raise InstanceError/Unavailable."""
        status, content, content_type = await self.request(
            "POST", inst.url + path, msgspec.json.encode(body), request_id)
        if status >= 500:
            text = content[:200].decode(errors="replace")
            raise InstanceUnavailable(f"{inst.url} answered {status}: {text}")
        if status != 200:
            raise InstanceError(status, content, content_type)
        return msgspec.json.decode(content)

    async def open_stream(self, inst: Instance, path: str, content: bytes,
                          request_id: str) -> aiohttp.ClientResponse:
        """Send a request and wait for the status line; the caller reads the body and closes
        the response (`read_body`, `relay`, `sse_events` do)."""
        headers = {"content-type": "application/json", "x-request-id": request_id}
        try:
            r = await self.session.post(inst.url + path, data=content, headers=headers)
        except TRANSPORT_ERRORS as err:
            raise _unavailable(inst.url, err) from None
        if r.status != 200:
            try:
                body = await r.read()
            except TRANSPORT_ERRORS:
                body = b""
            finally:
                r.release()
            if r.status >= 500:
                raise InstanceUnavailable(f"{inst.url} answered {r.status}: {body[:200]!r}")
            raise InstanceError(r.status, body, r.headers.get("content-type",
                                                              "application/json"))
        return r


def is_event_stream(response: aiohttp.ClientResponse) -> bool:
    return "event-stream" in response.headers.get("content-type", "")


def _client_headers(response: aiohttp.ClientResponse, request_id: str) -> dict[str, str]:
    headers = {k: v for k, v in response.headers.items() if k.lower() in _FORWARDED_HEADERS}
    headers["X-Request-Id"] = request_id
    return headers


async def read_body(response: aiohttp.ClientResponse) -> bytes:
    """The rest of a non-streamed answer; the connection goes back to the pool."""
    try:
        return await response.read()
    except TRANSPORT_ERRORS as err:
        raise _unavailable(str(response.url.origin()), err) from None
    finally:
        response.release()  # closes the connection instead if the body was cut short


def answer(response: aiohttp.ClientResponse, body: bytes, request_id: str) -> Response:
    """An instance's whole answer, passed on unchanged (status, content type, bytes)."""
    return Response(body, status_code=response.status,
                    headers=_client_headers(response, request_id))


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE body, until `[DONE]`; an `error` event is yielded too.
    A broken or timed-out stream raises InstanceUnavailable. The caller closes `response`."""
    pending = b""
    try:
        async for chunk in response.content.iter_any():
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].rstrip(b"\r")
                if data == b"[DONE]":
                    return
                yield msgspec.json.decode(data)
    except TRANSPORT_ERRORS as err:
        raise _unavailable(str(response.url.origin()), err) from None


def relay(response: aiohttp.ClientResponse, request_id: str,
          on_close: Callable[[Exception | None], None] | None = None) -> StreamingResponse:
    """Pass an instance's streamed answer through unchanged (colocated and decode-only)."""

    async def body() -> AsyncIterator[bytes]:
        failure: Exception | None = None
        try:
            async for chunk in response.content.iter_any():
                yield chunk
        except TRANSPORT_ERRORS as err:
            failure = err
            logger.warning("%s: upstream stream broke: %s: %s", request_id,
                           type(err).__name__, err)
            if is_event_stream(response):
                yield sse_error(f"instance failed mid-stream: {type(err).__name__}")
                yield DONE
        finally:
            response.release()  # closes the connection instead if the stream was cut short
            if on_close is not None:
                on_close(failure)

    return StreamingResponse(body(), status_code=response.status,
                             headers=_client_headers(response, request_id))
