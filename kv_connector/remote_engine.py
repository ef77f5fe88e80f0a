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


class PipeProcess:
    """The client side of `serve_calls`: a spawned process running `target(conn, *args)`, and
    calls to it over the pipe. `send` and `recv` apart let a caller start a slow call in several
    processes before collecting the answers; `call` is both."""

    def __init__(self, label: str, target: Callable[..., None], args: tuple) -> None:
        self.label = label
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()
        self._in_flight: str | None = "startup"  # serve_calls answers once the target is built

    def ready(self, timeout: float = 120) -> PipeProcess:
        """Wait until the target is built (start several, then ready() each)."""
        if self._in_flight == "startup":
            self.recv(timeout)
        return self

    def send(self, method: str, *args: Any) -> None:
        if self._in_flight is not None:  # an answer nobody collected (a failed test): drop it
            try:
                self.recv(60)
            except (RuntimeError, TimeoutError):
                pass
        self._in_flight = method
        self.conn.send((method, args))

    def recv(self, timeout: float = 60) -> Any:
        what, self._in_flight = self._in_flight, None
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.label} (pid {self.process.pid}): {what} hung > {timeout}s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(
                f"{self.label} (pid {self.process.pid}) died during {what}, "
                f"exit code {self.process.exitcode}"
            ) from None
        if kind == "error":
            raise RuntimeError(f"{self.label}: {what}: {value}")
        return value

    def call(self, method: str, *args: Any, timeout: float = 60) -> Any:
        self.send(method, *args)
        return self.recv(timeout)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no goodbye to peers."""
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                if self._in_flight is not None:
                    self.recv(30)
                self.call("exit", timeout=30)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)


class RemoteEngine(PipeProcess):
    """A SimEngine in its own (spawned) process, stepped every `step_interval_s` between calls."""

    def __init__(
        self, *args: Any, step_interval_s: float = 0.001, wait: bool = True, **kwargs: Any
    ) -> None:
        super().__init__("sim engine", _serve, (args, kwargs, step_interval_s))
        if wait:
            self.ready()

    def ready(self, timeout: float = 120) -> RemoteEngine:
        super().ready(timeout)
        return self

    def wait_for(self, predicate: Any, timeout: float, interval: float = 0.005) -> dict[str, Any]:
        """Poll status() until predicate(status) holds; the last status on timeout (no raise)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.call("status")
            if predicate(status) or time.monotonic() > deadline:
                return status
            time.sleep(interval)
