"""CoreClient: spawns the engine-core process and speaks its ZMQ protocol (see core_proc.py).

The front end binds both sockets in a private temp directory (`ipc://`), so two instances on one
host never collide and no port is hard-coded; the core connects to them. The process is started
with `spawn` (a fresh interpreter: no forked event loop, threads or CUDA state) and is told its
parent's pid, so it exits on its own if the front end dies without stopping it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from splitserve.engine.config import EngineConfig
from splitserve.engine.core_proc import CoreFailed, CoreOutput, CoreReady, Shutdown, run_engine_core

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process exited or failed; no request can be served."""


class EngineConfigError(ValueError):
    """The engine core refused to start with this configuration (the message says why)."""


class CoreClient:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)
        self._ipc_dir = tempfile.mkdtemp(prefix="splitserve-")
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"
        self._input.bind(input_addr)
        self._output.bind(output_addr)
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            name="splitserve-engine-core",
            args=(config, input_addr, output_addr, os.getpid(), log_level),
        )
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    async def start(self, timeout_s: float) -> CoreReady:
        """Spawn the core; return its CoreReady once the model is loaded, or raise why not."""
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if await self._output.poll(200):
                msg = self._decoder.decode(await self._output.recv())
                if isinstance(msg, CoreFailed) and msg.config_error:
                    raise EngineConfigError(f"engine cannot start: {msg.message}")
                if isinstance(msg, CoreFailed):
                    raise EngineDeadError(f"engine core failed to start: {msg.message}")
                if isinstance(msg, CoreReady):
                    return msg
            elif not self._proc.is_alive():
                raise EngineDeadError(
                    f"engine core exited during startup (exit code {self._proc.exitcode})"
                )
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine core not ready after {timeout_s:.0f} s")

    def send(self, msg: Any) -> None:
        # PUSH to a connected peer does not block: ZMQ queues the message in its I/O thread.
        self._input.send(self._encoder.encode(msg), copy=False)

    async def recv_batch(self) -> list[CoreOutput]:
        """Every message that has arrived, waiting for at least one; EngineDeadError if the
        process is gone."""
        while not await self._output.poll(1000):
            if not self._proc.is_alive():
                raise EngineDeadError(f"engine core exited (exit code {self._proc.exitcode})")
        messages = []
        while True:
            try:
                frame = await self._output.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(self._decoder.decode(frame.buffer))

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core (Shutdown message, then SIGTERM, then SIGKILL); close the sockets."""
        if self._closed:
            return
        self._closed = True
        proc = self._proc
        if proc.pid is not None and proc.is_alive():
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass
            await _join(proc, timeout_s)
            if proc.is_alive():
                if timeout_s >= 1:
                    logger.warning("engine core did not stop in %.0f s: terminating", timeout_s)
                proc.terminate()
                await _join(proc, 2.0)
            if proc.is_alive():
                proc.kill()
                await _join(proc, 2.0)
        self._ctx.destroy(linger=0)  # term() would hang while a socket is open
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


async def _join(proc: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    proc.join(timeout=0)
