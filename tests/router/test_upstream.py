"""The router's upstream path against a fake instance (in-process uvicorn, no model): plain and
streamed answers passed through, error mapping, retries, timeouts, client disconnects, the guard."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from fastapi.responses import StreamingResponse

from splitserve.engine.fleet import RouterConfig
from splitserve.router.app import build_app
from splitserve.router.metrics import RouterMetrics
from splitserve.router.pd import FleetProxy
from splitserve.router.policies import make_policy
from splitserve.router.registry import InstanceRegistry
from splitserve.router.upstream import InstanceError, InstanceUnavailable, UpstreamClient

ANSWER = b'{"id":"cmpl-x","choices":[{"index":0,"text":" a","finish_reason":"length"}]}'
EVENTS = [b'data: {"choices":[{"index":0,"text":"a"}]}\n\n',
          b'data: {"choices":[{"index":0,"text":"b"}]}\n\n', b"data: [DONE]\n\n"]
BAD = b'{"error":{"message":"max_tokens: must be >= 1","type":"invalid_request_error"}}'


class FakeInstance:
    """An ASGI app that answers like an instance; the prompt says how."""

    def __init__(self) -> None:
        self.disconnected = asyncio.Event()
        self.health = {"status": "ok", "model": "fake"}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw, more = b"", True
        while more:
            message = await receive()
            raw, more = raw + message.get("body", b""), message.get("more_body", False)
        rid = dict(scope["headers"]).get(b"x-request-id", b"")
        if scope["path"] == "/health":
            await self.reply(send, 200, msgspec.json.encode(self.health), rid)
            return
        prompt = msgspec.json.decode(raw).get("prompt")
        if prompt == "hang":  # like a long generation: answers only when the client leaves
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
        elif prompt == "slow":
            await asyncio.sleep(2.0)
            await self.reply(send, 200, ANSWER, rid)
        elif prompt == "bad":
            await self.reply(send, 400, BAD, rid)
        elif prompt == "boom":
            await self.reply(send, 500, b'{"error":{"message":"boom"}}', rid)
        elif prompt == "drip":  # a stream that goes on until the client leaves
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            left = asyncio.ensure_future(receive())  # only http.disconnect can come now
            while not left.done():
                await send({"type": "http.response.body", "body": EVENTS[0], "more_body": True})
                await asyncio.sleep(0.05)
            self.disconnected.set()
        elif prompt == "stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"x-request-id", rid)]})
            for event in EVENTS:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await self.reply(send, 200, ANSWER, rid)

    @staticmethod
    async def reply(send: Any, status: int, body: bytes, rid: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"x-request-id", rid),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serve(app: Any, lifespan: str = "off") -> AsyncIterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan=lifespan))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "server did not start"
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def free_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections refused


def proxy_for(urls: list[str], client: UpstreamClient) -> FleetProxy:
    registry = InstanceRegistry(client)
    for url in urls:
        registry.add(url, "colocated", healthy=True)
    policies = {role: make_policy("round_robin") for role in ("prefill", "decode", "colocated")}
    return FleetProxy(client, registry, policies, RouterMetrics())


def body(prompt: str, **extra: Any) -> bytes:
    return msgspec.json.encode({"prompt": prompt, "max_tokens": 1, **extra})


async def forward(proxy: FleetProxy, raw: bytes, request_id: str = "rid-1") -> Any:
    return await proxy.handle("/v1/completions", raw, msgspec.json.decode(raw), False,
                              request_id, time.perf_counter(), colocated=True)


def test_plain_answer_is_one_response_with_the_instance_bytes():
    async def main() -> None:
        async with serve(FakeInstance()) as url:
            client = UpstreamClient(1.0, 5.0)
            proxy = proxy_for([url], client)
            r = await forward(proxy, body("hi"))
            assert not isinstance(r, StreamingResponse)
            assert r.status_code == 200 and r.body == ANSWER
            assert r.headers.getlist("x-request-id") == ["rid-1"]
            assert r.headers["content-type"] == "application/json"
            assert proxy.registry.get(url).in_flight == 0
            await client.aclose()

    asyncio.run(main())


def test_stream_is_relayed_unchanged():
    async def main() -> None:
        async with serve(FakeInstance()) as url:
            client = UpstreamClient(1.0, 5.0)
            proxy = proxy_for([url], client)
            r = await forward(proxy, body("stream", stream=True))
            assert isinstance(r, StreamingResponse)
            assert r.headers["content-type"].startswith("text/event-stream")
            assert proxy.registry.get(url).in_flight == 1
            chunks = [chunk async for chunk in r.body_iterator]
            assert b"".join(chunks) == b"".join(EVENTS)
            assert proxy.registry.get(url).in_flight == 0
            await client.aclose()

    asyncio.run(main())


def test_instance_4xx_passes_byte_for_byte_and_5xx_is_unavailable():
    async def main() -> None:
        async with serve(FakeInstance()) as url:
            client = UpstreamClient(1.0, 5.0)
            proxy = proxy_for([url], client)
            r = await forward(proxy, body("bad"))
            assert (r.status_code, r.body) == (400, BAD)
            inst = proxy.registry.get(url)
            with pytest.raises(InstanceError) as err:
                await client.post_json(inst, "/v1/completions", {"prompt": "bad"}, "rid")
            assert (err.value.status, err.value.body) == (400, BAD)
            with pytest.raises(InstanceUnavailable, match="answered 500"):
                await client.post_json(inst, "/v1/completions", {"prompt": "boom"}, "rid")
            await client.aclose()

    asyncio.run(main())


def test_refused_instance_is_marked_down_and_the_next_one_serves():
    async def main() -> None:
        async with serve(FakeInstance()) as url:
            client = UpstreamClient(1.0, 5.0)
            dead = free_port_url()
            proxy = proxy_for([dead, url], client)
            r = await forward(proxy, body("hi"))
            assert r.status_code == 200 and r.body == ANSWER
            assert proxy.registry.get(dead).healthy is False
            assert proxy.registry.get(dead).in_flight == 0
            r = await forward(proxy, body("hi"))  # the dead one is out of rotation
            assert r.status_code == 200
            await client.aclose()

    asyncio.run(main())


def test_read_timeout_is_unavailable():
    async def main() -> None:
        async with serve(FakeInstance()) as url:
            client = UpstreamClient(1.0, 0.3)
            proxy = proxy_for([url], client)
            inst = proxy.registry.get(url)
            started = time.perf_counter()
            with pytest.raises(InstanceUnavailable, match="Timeout"):
                await client.post_json(inst, "/v1/completions", {"prompt": "slow"}, "rid")
            assert time.perf_counter() - started < 1.5
            await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("prompt", ["hang", "drip"])
def test_client_disconnect_aborts_the_upstream_request(prompt: str):
    async def main() -> None:
        fake = FakeInstance()
        async with serve(fake) as url:
            app = build_app(RouterConfig(port=0, request_timeout_s=30), [(url, "colocated")])
            async with serve(app, lifespan="on") as router:
                host, port = router.removeprefix("http://").split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                raw = body(prompt, stream=prompt == "drip")
                writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                             b"content-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
                await writer.drain()
                if prompt == "drip":
                    assert b"200 OK" in await reader.read(4096)
                await asyncio.sleep(0.3)
                assert not fake.disconnected.is_set()
                writer.close()
                await asyncio.wait_for(fake.disconnected.wait(), 3.0)
                inst = app.state.registry.get(url)
                for _ in range(100):
                    if inst.in_flight == 0:
                        break
                    await asyncio.sleep(0.01)
                assert inst.in_flight == 0 and inst.healthy

    asyncio.run(main())


def test_guard_checks_key_and_size_before_routing():
    async def main() -> None:
        config = RouterConfig(port=0, api_key="k", max_body_bytes=100)
        app = build_app(config, [])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            r = await c.post("/v1/completions", content=body("hi"))
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await c.post("/v1/completions", content=b"x" * 200,
                             headers={"authorization": "Bearer k"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await c.get("/health")  # not under /v1/: no key needed
            assert r.status_code == 503
            for path in ("/tokenize", "/detokenize", "/register"):
                r = await c.post(path, content=b"{}")
                assert r.status_code == 401, path

    asyncio.run(main())


def test_health_checks_every_instance_when_asked():
    """The background poll is an hour apart here: /health must still show the load of now."""

    async def main() -> None:
        fake = FakeInstance()
        async with serve(fake) as url:
            app = build_app(RouterConfig(port=0, health_interval_s=3600), [(url, "colocated")])
            async with serve(app, lifespan="on") as router:
                async with httpx.AsyncClient(base_url=router) as c:
                    fake.health = {"status": "ok", "running": 3, "kv_blocks_free": 5,
                                   "kv_blocks_total": 8}
                    inst = (await c.get("/health")).json()["instances"][0]
                    assert (inst["running"], inst["kv_blocks_free"]) == (3, 5)
                    fake.health = {"status": "ok", "running": 0, "kv_blocks_free": 8,
                                   "kv_blocks_total": 8}
                    r = await c.get("/health")
                    assert r.status_code == 200
                    inst = r.json()["instances"][0]
                    assert (inst["running"], inst["kv_blocks_free"], inst["healthy"]) == (0, 8, True)
                    fake.health = {"status": "starting"}
                    r = await c.get("/health")
                    assert r.status_code == 503 and not r.json()["instances"][0]["healthy"]

    asyncio.run(main())


def test_unknown_route_and_wrong_method_are_openai_errors():
    async def main() -> None:
        app = build_app(RouterConfig(port=0), [])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            for method, path, status in (("GET", "/v1/nothing", 404),
                                         ("GET", "/v1/completions", 405),
                                         ("DELETE", "/v1/chat/completions", 405)):
                r = await c.request(method, path)
                assert r.status_code == status, (method, path)
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert path in error["message"] and error["code"] == str(status)

    asyncio.run(main())
