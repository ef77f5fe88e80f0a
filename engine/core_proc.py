"""The engine-core process: owns an EngineCore and loops; talks to the front end over ZMQ.

```
front end (AsyncLLM)                          engine-core process (this file)
  PUSH  input  ──  AddRequest | AbortRequests | UtilityRequest | Shutdown  ──▶  PULL
  PULL  output ◀──  CoreReady | EngineCoreOutputs | RequestRejected  ──  PUSH
                     | UtilityResult | CoreFailed
```

Messages are typed msgspec Structs in a tagged union, encoded as msgpack: no pickle, and a
malformed message fails to decode instead of running code. One `EngineCoreOutputs` carries every
request's new tokens of a step, so the message rate is the step rate, not the token rate.

The loop is tight: while the core has work it drains the input socket without blocking and steps;
when it has none it blocks on the socket, waking every `_PARENT_CHECK_S` to see whether the
front end is still alive (the process exits when its parent dies, so no orphan holds the model).
A request the core rejects (`validate_request`, full waiting queue, duplicate id) is answered
with `RequestRejected` at once; a bad request never takes the core down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

import msgspec
import zmq

from splitserve.engine.config import EngineConfig
from splitserve.engine.request import EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger(__name__)

_PARENT_CHECK_S = 0.5


# ------------------------------------------------------------------------------ front end → core
class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, tag="utility"):
    call_id: int
    method: str  # "stats"


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


CoreInput = AddRequest | AbortRequests | UtilityRequest | Shutdown


# ------------------------------------------------------------------------------ core → front end
class CoreReady(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded and the KV cache allocated."""

    engine_id: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    architecture: str


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    """Every request's news from one step."""

    outputs: list[EngineCoreOutput]
    timestamp: float


class RequestRejected(msgspec.Struct, tag="rejected"):
    request_id: str
    message: str
    code: str  # "invalid_request" | "queue_full"


class UtilityResult(msgspec.Struct, tag="utility_result"):
    call_id: int
    result: dict[str, Any] | None = None
    error: str | None = None


class CoreFailed(msgspec.Struct, tag="failed"):
    """Startup failed, or the step loop hit an engine bug: the process is about to exit."""

    message: str
    config_error: bool = False  # a ValueError at startup: the configuration cannot work


CoreOutput = CoreReady | EngineCoreOutputs | RequestRejected | UtilityResult | CoreFailed


class _ShutdownSignal(BaseException):
    """Raised from the SIGTERM handler to leave the loop at once (not an Exception: no handler
    meant for errors may swallow it)."""


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    log_level: str = "INFO",
) -> None:
    """Entry point of the spawned process."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s"
    )
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_shutdown)
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    core, exit_code = None, 1
    try:
        core = _start_core(config, out_sock, encoder)
        if core is not None:
            EngineCoreProc(core, in_sock, out_sock, parent_pid).run()
            exit_code = 0
    except _ShutdownSignal:
        logger.info("SIGTERM: engine core exiting")
        exit_code = 0
    finally:
        if core is not None:
            core.shutdown()
        ctx.destroy(linger=0)
        if os.getppid() != parent_pid:  # killed front end: nobody else will clean its sockets
            _remove_ipc(input_addr, output_addr)
        logging.shutdown()
    # Everything is released; skip the interpreter's teardown of torch (about a second).
    os._exit(exit_code)


def _remove_ipc(*addrs: str) -> None:
    for addr in addrs:
        if addr.startswith("ipc://"):
            path = addr.removeprefix("ipc://")
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))  # only when empty: never more than ours


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise _ShutdownSignal()


def _start_core(config: EngineConfig, out_sock: zmq.Socket, encoder: msgspec.msgpack.Encoder):
    from splitserve.engine.core import EngineCore  # torch loads here, in the child only

    try:
        core = EngineCore(config)
    except ValueError as err:  # e.g. a KV budget too small for max_model_len: no traceback
        out_sock.send(encoder.encode(CoreFailed(str(err), config_error=True)))
        return None
    except Exception as err:  # report why, then exit: the front end prints it
        logger.exception("engine core failed to start")
        out_sock.send(encoder.encode(CoreFailed(f"{type(err).__name__}: {err}")))
        return None
    c = core.kv_cache_manager
    out_sock.send(
        encoder.encode(
            CoreReady(
                engine_id=core.engine_id,
                max_model_len=core.max_model_len,
                vocab_size=core.arch.vocab_size,
                num_blocks=c.num_blocks,
                block_size=c.block_size,
                architecture=core.arch.architecture,
            )
        )
    )
    return core


class EngineCoreProc:
    """The busy loop around one EngineCore."""

    def __init__(
        self, core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int
    ) -> None:
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.max_waiting = core.config.scheduler.max_waiting
        self.running = True
        self.next_parent_check = 0.0

    def run(self) -> None:
        logger.info("engine core %s ready (pid %d)", self.core.engine_id, os.getpid())
        core = self.core
        while self.running:
            self._process_input(block=not core.has_work())
            if not self.running:
                break
            if core.has_work():
                self._step()
            self._check_parent()

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as err:  # an engine bug, not a bad request: state is unknown, exit
            logger.exception("engine step failed")
            self._send(CoreFailed(f"engine step failed: {type(err).__name__}: {err}"))
            self.running = False
            return
        if outputs:
            self._send(EngineCoreOutputs(outputs, time.time()))
        elif not self.core.scheduler.num_running:
            # Only transfers to poll (nothing to compute): do not spin a core at 100 %.
            self.poller.poll(1)

    def _process_input(self, block: bool) -> None:
        if block and not self.poller.poll(int(_PARENT_CHECK_S * 1000)):
            return
        while True:
            try:
                frame = self.in_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self.decoder.decode(frame.buffer)
            except msgspec.DecodeError as err:
                logger.error("dropping undecodable input message: %s", err)
                continue
            self._handle(msg)
            if not self.running:
                return

    def _handle(self, msg: CoreInput) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg.request)
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, UtilityRequest):
            self._utility(msg)
        elif isinstance(msg, Shutdown):
            logger.info("shutdown requested by the front end")
            self.running = False

    def _add(self, req: EngineCoreRequest) -> None:
        rid = req.request_id
        if self.core.scheduler.num_waiting >= self.max_waiting:
            self._send(
                RequestRejected(
                    rid,
                    f"server busy: {self.max_waiting} requests already "
                    "waiting (scheduler.max_waiting); retry later",
                    "queue_full",
                )
            )
            return
        try:
            self.core.add_request(req)
        except ValueError as err:
            self._send(RequestRejected(rid, str(err), "invalid_request"))
        except Exception as err:  # never let one request take the core down
            logger.exception("%s: add_request failed", rid)
            self._send(RequestRejected(rid, f"{type(err).__name__}: {err}", "invalid_request"))

    def _utility(self, msg: UtilityRequest) -> None:
        if msg.method != "stats":
            self._send(UtilityResult(msg.call_id, error=f"unknown utility {msg.method!r}"))
            return
        stats = dict(self.core.stats())
        stats["kv_transfer"] = self._transfer_stats()
        stats["engine_id"] = self.core.engine_id
        self._send(UtilityResult(msg.call_id, result=stats))

    def _transfer_stats(self) -> dict[str, dict[str, Any]]:
        """{connector name: counters summed over its scheduler and worker halves}."""
        name = self.core.config.kv_transfer.connector
        total: dict[str, Any] = {}
        for connector in (self.core.connector_scheduler, self.core.connector_worker):
            stats = getattr(connector, "stats", None)
            if stats is None:
                continue
            for key, value in stats.as_dict().items():
                total[key] = total.get(key, 0) + value
        return {name: total} if total and name != "none" else {}

    def _send(self, msg: Any) -> None:
        self.out_sock.send(self.encoder.encode(msg), copy=False)

    def _check_parent(self) -> None:
        now = time.monotonic()
        if now < self.next_parent_check:
            return
        self.next_parent_check = now + _PARENT_CHECK_S
        if os.getppid() != self.parent_pid:
            logger.warning("front end (pid %d) is gone: engine core exiting", self.parent_pid)
            self.running = False
