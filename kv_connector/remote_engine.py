"""A `SimEngine` (driver.py) in its own spawned process, stepping continuously and answering
calls over a pipe: how transport tests and `scripts/bench_transfer.py` get a producer and a
consumer that really are two processes. `serve_calls` is the process side of that pipe RPC,
also used by tests that serve a real engine the same way.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from typing import Any

from splitserve.kv_connector.driver import SimEngine


def serve_calls(conn: Any, make: Callable[[], Any], idle: Callable[[Any], None] | None = None,
                idle_interval_s: float = 0.001) -> None:
    """Process side of a pipe RPC: build `make()`, then answer `(method, args)` calls with
    `("ok", result)` or `("error", traceback)` until `("exit", ())`. Between calls `idle(target)`
    runs every `idle_interval_s` (an engine keeps stepping so its transfers progress)."""
    try:
        target = make()
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn.send(("ok", None))
    while True:
        if idle is not None:
            idle(target)
            if not conn.poll(idle_interval_s):
                continue
        try:
            method, margs = conn.recv()
        except EOFError:
            break
        if method == "exit":
            target.shutdown()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(target, method)(*margs)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _serve(conn: Any, args: tuple, kwargs: dict, step_interval_s: float) -> None:
    serve_calls(conn, lambda: SimEngine(*args, **kwargs), SimEngine.step, step_interval_s)


class RemoteEngine:
    """A SimEngine in its own (spawned) process."""

    def __init__(
        self, *args: Any, step_interval_s: float = 0.001, wait: bool = True, **kwargs: Any
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, args, kwargs, step_interval_s), daemon=True
        )
        self.process.start()
        child.close()
        if wait:
            self.ready()

    def ready(self, timeout: float = 120) -> RemoteEngine:
        """Wait until the engine is built (start several with wait=False, then ready() each)."""
        self._wait(timeout)
        return self

    def _wait(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"sim engine (pid {self.process.pid}) did not answer in {timeout}s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(
                f"sim engine (pid {self.process.pid}) died, exit code {self.process.exitcode}"
            ) from None
        if kind == "error":
            raise RuntimeError(f"sim engine: {value}")
        return value

    def call(self, method: str, *args: Any, timeout: float = 30) -> Any:
        self.conn.send((method, args))
        return self._wait(timeout)

    def wait_for(self, predicate: Any, timeout: float, interval: float = 0.005) -> dict[str, Any]:
        """Poll status() until predicate(status) holds; the last status on timeout (no raise)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.call("status")
            if predicate(status) or time.monotonic() > deadline:
                return status
            time.sleep(interval)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout=15)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
