"""The router's HTTP app: the one OpenAI-compatible endpoint clients see.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `POST /tokenize`,
`POST /detokenize`, `GET /health`, `GET /metrics`, `POST /register` / `DELETE /register`
(`{"url", "role"}`).

In a P/D fleet the router validates a body with the same protocol models the instances use,
but only to know whether it is valid: an invalid body is forwarded untouched to an instance, whose
error answer (status and bytes) goes back to the client, so errors through the router read
exactly as errors from an instance. A colocated fleet forwards every body untouched, so it skips
the validation. The optional API key and the body-size limit are checked here first.

The hot path is kept lean, since the router's own cost is latency added to every request: the
completion endpoints are served by `FrontDoor` ahead of FastAPI's stack, a non-streamed answer
goes back as one plain response (no stream relay), and aiohttp talks to the instances (see
upstream.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from splitserve.engine.fleet import FleetConfig, RouterConfig
from splitserve.engine.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.router.metrics import CONTENT_TYPE, RouterMetrics
from splitserve.router.pd import FleetProxy
from splitserve.router.policies import make_policy
from splitserve.router.registry import ROLES, InstanceRegistry
from splitserve.router.upstream import InstanceUnavailable, UpstreamClient, error_response

logger = logging.getLogger(__name__)


def build_app(config: RouterConfig, instances: list[tuple[str, str]]) -> FrontDoor:
    """A router over `instances` ((url, role) pairs; more may register at run time)."""
    client = UpstreamClient(config.connect_timeout_s, config.request_timeout_s)
    registry = InstanceRegistry(client, config.health_interval_s)
    for url, role in instances:
        registry.add(url, role)
    metrics = RouterMetrics()
    policies = {"prefill": make_policy(config.prefill_policy),
                "decode": make_policy(config.decode_policy),
                "colocated": make_policy(config.colocated_policy)}
    proxy = FleetProxy(client, registry, policies, metrics, config.prefill_retries)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await registry.check_all()
        registry.start()
        yield
        await registry.stop()
        await client.aclose()

    app = FastAPI(title="splitserve router", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.registry, app.state.proxy, app.state.metrics = registry, proxy, metrics
    _add_error_handlers(app)
    endpoints = _completion_endpoints(config.max_body_bytes, proxy, metrics)
    for path, endpoint in endpoints.items():
        # Served by the front door; listed here too, so other methods get FastAPI's 405.
        app.add_route(path, endpoint, methods=["POST"])
    _add_fleet_routes(app, client, registry, proxy, metrics)
    _add_register_routes(app, registry)
    return FrontDoor(app, config.api_key, config.max_body_bytes, endpoints)


def _completion_endpoints(max_body_bytes: int, proxy: FleetProxy, metrics: RouterMetrics
                          ) -> dict[str, Callable[[Request], Awaitable[Response]]]:
    """The hot path: `/v1/completions` and `/v1/chat/completions` through the fleet proxy."""

    async def handle(request: Request, model: type[BaseModel], chat: bool) -> Response:
        started = time.perf_counter()
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone while sending: nothing to answer, nothing to log
            return Response(status_code=499)
        if len(raw) > max_body_bytes:
            return error_response(413, f"request body larger than {max_body_bytes} "
                                  "bytes (router.max_body_bytes)", "request_too_large")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        colocated = proxy.colocated
        # Colocated, the body goes to the instance untouched whatever it holds, so only P/D
        # (which rewrites it) pays for the validation.
        body = _json_object(raw) if colocated else _valid_body(raw, model)
        path = request.scope["path"]
        metrics.requests.labels(path, "colocated" if colocated else "pd").inc()
        response = await _until_disconnect(
            request, proxy.handle(path, raw, body, chat, request_id, started, colocated))
        return response if response is not None else Response(status_code=499)

    async def completions(request: Request) -> Response:
        return await handle(request, CompletionRequest, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await handle(request, ChatCompletionRequest, chat=True)

    return {"/v1/completions": completions, "/v1/chat/completions": chat_completions}


def _add_fleet_routes(app: FastAPI, client: UpstreamClient, registry: InstanceRegistry,
                      proxy: FleetProxy, metrics: RouterMetrics) -> None:
    """`GET /v1/models`, `POST /tokenize` and `POST /detokenize` (answered by a healthy
    instance: every instance serves the same model), `/health` (every instance checked now) and
    `/metrics` (the router's)."""

    async def any_instance(method: str, path: str, content: bytes | None = None) -> Response:
        for role in ("colocated", "decode", "prefill"):
            for inst in registry.healthy(role):
                try:
                    status, body, ctype = await client.request(method, inst.url + path, content)
                    return Response(body, status_code=status, media_type=ctype)
                except InstanceUnavailable as err:  # try the next one
                    logger.warning("%s on %s failed: %s", path, inst.url, err)
        return error_response(503, "no healthy instance", "no_healthy_instance",
                              "service_unavailable")

    @app.get("/v1/models")
    async def models() -> Response:
        return await any_instance("GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await any_instance("POST", "/tokenize", await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await any_instance("POST", "/detokenize", await request.body())

    @app.get("/health")
    async def health() -> JSONResponse:
        # A fresh round of checks: the loop's last one can be health_interval_s old, and a
        # client reading /health right after its request expects that request's blocks free.
        await registry.check_all()
        described = [i.describe() for i in registry.all()]
        if proxy.colocated:
            ok = bool(registry.healthy("colocated"))
        else:
            ok = bool(registry.healthy("decode"))  # prefill down: decode-only still serves
        return JSONResponse({"status": "ok" if ok else "degraded", "instances": described},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _add_error_handlers(app: FastAPI) -> None:
    """Unknown routes, wrong methods and unexpected failures answer in OpenAI's error format too,
    as the instances do, instead of Starlette's `{"detail": ...}`."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> Response:
        return error_response(err.status_code, f"{err.detail} ({request.method} "
                              f"{request.url.path})", str(err.status_code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal error: {type(err).__name__}: {err}",
                              "internal_error", "internal_error")


def _add_register_routes(app: FastAPI, registry: InstanceRegistry) -> None:
    """`POST /register` and `DELETE /register` (`{"url", "role"}`): instances joining and leaving."""

    @app.post("/register")
    async def register(request: Request) -> Response:
        url, role, err = await _url_role(request)
        if err is not None:
            return err
        inst = registry.add(url, role)
        await registry.check(inst)
        return JSONResponse(inst.describe())

    @app.delete("/register")
    async def deregister(request: Request) -> Response:
        url, _, err = await _url_role(request, need_role=False)
        if err is not None:
            return err
        if not registry.remove(url):
            return error_response(404, f"instance {url!r} is not registered", "not_found",
                                  param="url")
        return JSONResponse({"url": url, "removed": True})


class FrontDoor:
    """What uvicorn runs: the API key and the body-size limit checked on every request, then
    `POST` to a completion endpoint served directly and everything else by the FastAPI app.

    The completion endpoints are the router's hot path, and what the router costs there is
    latency added to every request: going straight to them skips FastAPI's middleware layers
    (error, telemetry, body-limit, exception, exit-stack) and routing, ~7% of the router's CPU
    per request. Errors there still become a 500 (uvicorn's, like ServerErrorMiddleware's).
    """

    def __init__(self, api: FastAPI, api_key: str | None, max_body_bytes: int,
                 endpoints: dict[str, Callable[[Request], Awaitable[Response]]]) -> None:
        self.api, self.state, self.endpoints = api, api.state, endpoints
        self.max_body_bytes = max_body_bytes
        self.authorization = f"Bearer {api_key}" if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.refuse(scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
            endpoint = self.endpoints.get(scope["path"]) if scope["method"] == "POST" else None
            if endpoint is not None:
                response = await endpoint(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.api(scope, receive, send)

    def refuse(self, scope: Scope) -> Response | None:
        authorization = length = None  # the first of each, as Starlette's Headers.get
        for name, value in scope["headers"]:
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"content-length" and length is None:
                length = value
        if self.authorization is not None and scope["path"].startswith(_KEYED):
            if authorization != self.authorization:
                return error_response(401, "invalid or missing API key (send "
                                      "'Authorization: Bearer <key>')", "invalid_api_key")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return error_response(413, f"request body larger than {self.max_body_bytes} "
                                  "bytes (router.max_body_bytes)", "request_too_large")
        return None


_KEYED = ("/v1/", "/register", "/tokenize", "/detokenize")  # paths that need the API key


def build_fleet_app(fleet: FleetConfig) -> FrontDoor:
    return build_app(fleet.router, [(url, role) for role, _, url in fleet.instances()])


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """The body as a dict if it is a JSON object, else None; not validated."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return data if isinstance(data, dict) else None


def _valid_body(raw: bytes, model: type[BaseModel]) -> dict[str, Any] | None:
    """The body as a dict if an instance would accept it, else None (forwarded for the error)."""
    try:
        data = msgspec.json.decode(raw)
        if not isinstance(data, dict):
            return None
        model.model_validate(data)
    except (msgspec.DecodeError, ValidationError):
        return None
    return data


async def _url_role(request: Request, need_role: bool = True
                    ) -> tuple[str, str, Response | None]:
    try:
        data = msgspec.json.decode(await request.body())
        url, role = data.get("url"), data.get("role", "")
    except (msgspec.DecodeError, AttributeError):
        return "", "", error_response(400, "body must be a JSON object {\"url\", \"role\"}",
                                      "invalid_json")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return "", "", error_response(400, "url: must be an http(s) URL", "invalid_value",
                                      param="url")
    if need_role and role not in ROLES:
        return "", "", error_response(400, f"role: must be one of {', '.join(ROLES)}",
                                      "invalid_value", param="role")
    return url, role, None


async def _until_disconnect(request: Request, work: Coroutine[Any, Any, Response]
                            ) -> Response | None:
    """Run `work`; if the client leaves first, cancel it (closing the instance connections,
    which makes the instances abort the request and free its blocks)."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    listener = loop.create_task(wait_disconnect())
    try:
        return await task
    except (asyncio.CancelledError, Exception):
        if listener.done() and not listener.cancelled() and listener.exception() is None:
            return None  # the client left first: nobody reads this answer
        raise
    finally:
        listener.cancel()
