"""The per-instance OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming or not),
`POST /tokenize`, `POST /detokenize` (vLLM's), `GET /v1/models`, `GET /health`, `GET /metrics`.
The engine runs in its own process (AsyncLLM over ZMQ); this process parses, tokenizes,
detokenizes and writes HTTP.

Errors are OpenAI's bodies with a status that says whose fault it is (api_errors.py); bodies are
size-limited, parsed and validated on the way in (http_request.py). A client that disconnects,
mid-stream or while waiting for a non-streamed answer, has its requests aborted in the core, which
frees their KV blocks.

A streamed response's headers go out with its first token: the core's refusal (too long, queue
full) arrives before any token, so it can still be a proper error status instead of an SSE event.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from splitserve.engine.api_errors import APIError, add_error_handlers, engine_error
from splitserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestRejectedError
from splitserve.engine.config import EngineConfig
from splitserve.engine.http_request import BodyLimitMiddleware, parse_body, until_disconnect
from splitserve.engine.metrics import CONTENT_TYPE, ServerMetrics
from splitserve.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    KVReleaseRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from splitserve.engine.serving import OpenAIServing
from splitserve.kv_connector.side_channel import release_remote_kv

logger = logging.getLogger(__name__)


class ServerConfig(BaseModel):
    """The `server:` section of an instance config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    """Bind address; loopback by default (put the router in front for public traffic)."""
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=8 * 2**20, gt=0)
    """Larger request bodies are refused with 413."""
    max_waiting: int | None = Field(default=None, gt=0)
    """Bound of the engine's waiting queue (503 past it); overrides engine.scheduler.max_waiting."""
    role: Literal["colocated", "prefill", "decode"] = "colocated"
    """Reported by /health; the prefill/decode entry points set it."""
    access_log: bool = False
    """uvicorn's per-request access log line (off: it costs throughput)."""


def build_app(
    engine: AsyncLLM,
    engine_config: EngineConfig,
    server_config: ServerConfig,
    metrics: ServerMetrics,
) -> FastAPI:
    """The instance's app: generation and info routes, OpenAI error bodies, the body limit."""
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=server_config.max_body_bytes)
    add_error_handlers(app)
    _add_generation_routes(app, OpenAIServing(engine, engine_config.model.name))
    _add_info_routes(app, engine, engine_config, server_config, metrics)
    return app


Handler = Callable[[Any, str], Awaitable[Response]]


async def _handle(
    request: Request, serving: OpenAIServing, model: type[BaseModel], run: Handler
) -> Response:
    """Parse and check the body, run the handler under the request's id (`X-Request-Id`, or a
    fresh one), turn the core's refusals into error answers; 499 if the client left first."""
    body = await parse_body(request, model)
    if body.model is not None and body.model != serving.model_name:
        raise APIError(
            404,
            f"the model {body.model!r} does not exist (served: {serving.model_name!r})",
            param="model",
            code="model_not_found",
        )
    base_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        response = await until_disconnect(request, run(body, base_id))
    except (RequestRejectedError, EngineDeadError) as err:
        raise engine_error(err) from None
    if response is None:
        return Response(status_code=499)
    response.headers["X-Request-Id"] = base_id
    return response


def _route(serving: OpenAIServing, model: type[BaseModel], run: Handler
           ) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await _handle(request, serving, model, run)

    return endpoint


def _add_generation_routes(app: FastAPI, serving: OpenAIServing) -> None:
    for path, model, run in (
        ("/v1/completions", CompletionRequest, serving.completions),
        ("/v1/chat/completions", ChatCompletionRequest, serving.chat_completions),
        ("/tokenize", TokenizeRequest, serving.tokenize),
        ("/detokenize", DetokenizeRequest, serving.detokenize),
    ):
        app.add_api_route(path, _route(serving, model, run), methods=["POST"])

    @app.post("/v1/kv/release")
    async def release_kv(request: Request) -> JSONResponse:
        """Free the blocks a finished request holds for a consumer (the router calls this when
        generation stopped at the first token, so no decode instance will pull them, or with the
        `request_id` when it gave up before the answer came). Connectors without holds (redis
        frees once its write lands) answer `released: false`."""
        body = await parse_body(request, KVReleaseRequest)
        if body.request_id is not None:
            return JSONResponse({"released": serving.release_unanswered(body.request_id)})
        # Through the connector's side channel, as a consumer's "done" would come: the
        # connector owns the hold (it may be serving or saving the blocks right now).
        held = await asyncio.to_thread(release_remote_kv, body.kv_transfer_params)
        return JSONResponse({"released": held})


_HEALTH_FIELDS = (
    "running",
    "waiting",
    "kv_blocks_free",
    "kv_blocks_total",
    "kv_usage",
    "engine_id",
)


def _add_info_routes(
    app: FastAPI,
    engine: AsyncLLM,
    engine_config: EngineConfig,
    server_config: ServerConfig,
    metrics: ServerMetrics,
) -> None:
    model_name = engine_config.model.name

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(
            id=model_name, root=engine_config.model.model, max_model_len=engine.max_model_len
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        body: dict[str, Any] = {"status": "ok", "role": server_config.role, "model": model_name}
        try:
            stats = await engine.stats()
        except (EngineDeadError, RuntimeError, asyncio.TimeoutError) as err:
            body.update(status="error", error=str(err) or type(err).__name__)
            return JSONResponse(body, status_code=503)
        body.update({k: stats[k] for k in _HEALTH_FIELDS})
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        try:
            metrics.update_engine_stats(await engine.stats())
        except (EngineDeadError, RuntimeError, asyncio.TimeoutError):
            pass  # still serve the front end's own metrics
        return Response(metrics.render(), media_type=CONTENT_TYPE)


async def serve(
    engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info"
) -> None:
    """Start the engine core, then serve HTTP until SIGTERM/SIGINT; always stop the core.

    A signal during startup (loading the model can take minutes) cancels the startup, which
    stops the core; asyncio.CancelledError then leaves this function.
    """
    metrics = ServerMetrics(engine_config.model.name)
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, task.cancel)
    try:
        engine = await AsyncLLM.start(engine_config, metrics, log_level.upper())
    finally:
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
    # uvicorn re-raises a captured signal once it is done; make that re-raise harmless so the
    # finally below (stopping the core) runs instead of the default "terminate now".
    for sig in _SIGNALS:
        signal.signal(sig, _log_signal)
    try:
        app = build_app(engine, engine_config, server_config, metrics)
        server = _http_server(app, server_config, log_level)
        # What exists now lives as long as the server: freeze it, so the collections that the
        # per-token garbage triggers never walk it again (they cost ~5% of the CPU otherwise).
        gc.collect()
        gc.freeze()
        watchdog = asyncio.create_task(_exit_when_dead(engine, server))
        logger.info(
            "serving %s (%s) on http://%s:%d",
            engine_config.model.name,
            server_config.role,
            server_config.host,
            server_config.port,
        )
        await server.serve()
        watchdog.cancel()
        if engine.is_dead:  # not a requested stop: let the supervisor see a failure
            raise EngineDeadError(f"engine core died: {engine.dead_reason}")
    finally:
        await engine.shutdown()
        logger.info("shut down")


def _http_server(app: FastAPI, server_config: ServerConfig, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=log_level.lower(),
        access_log=server_config.access_log,
        lifespan="off",
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _log_signal(signum: int, frame: Any) -> None:
    logger.info("received %s", signal.Signals(signum).name)


async def _exit_when_dead(engine: AsyncLLM, server: uvicorn.Server) -> None:
    """An instance whose core died cannot serve: stop so the supervisor restarts it."""
    while not engine.is_dead:
        await asyncio.sleep(1.0)
    if not server.should_exit:
        logger.error("engine core died (%s): stopping the server", engine.dead_reason)
        server.should_exit = True
