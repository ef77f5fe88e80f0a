"""The producer's side channel: a ZMQ ROUTER that peers ask for its layout and its blocks' fate.

Wire format: each message is two frames, an 8-byte sequence number chosen by the caller and the
msgpack of one tagged msgspec Struct; the reply carries the same sequence number. Consumers hold
one DEALER per producer, so calls to the same producer stay in order. All of it runs on the
connector's I/O thread: ZMQ sockets are not thread-safe, and nothing here ever blocks.

```
consumer                                   producer
Hello(engine id, layout) ────────────────▶ same model and block layout? its transport info
          ◀──────────────── HelloReply     (the consumer checks compatibility again)
Pin(request id) ─────────────────────────▶ held? keep it past the lease until Release
          ◀──────────────── HoldReply      (+ checksums taken when the hold began)
Release(request id) ─────────────────────▶ held? free it (done_sending), else "no longer holds"
          ◀──────────────── HoldReply
```

A pulling consumer (nixl) sends Pin just before it starts reading and Release right after: the
Pin travels while the bytes move, and the read counts only if the Pin's reply says `held`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    engine_id: str  # the caller's
    connector: str
    model_fingerprint: str
    block_size: int
    block_nbytes: int


class HelloReply(msgspec.Struct, tag="hello_reply", kw_only=True):
    engine_id: str
    connector: str
    model_fingerprint: str
    block_size: int
    block_nbytes: int
    num_blocks: int
    transport: bytes = b""  # connector-specific, msgpack of its own Struct
    error: str | None = None


class Release(msgspec.Struct, tag="release", kw_only=True):
    request_id: str  # the producer's request id (remote_request_id)
    loaded: bool = False  # the caller read the blocks (counted in the producer's stats)


class Pin(msgspec.Struct, tag="pin", kw_only=True):
    """The consumer starts reading: hold the blocks past the lease until its Release, for at most
    the producer's timeout_s (a consumer that dies mid-read cannot pin them forever)."""

    request_id: str  # the producer's request id (remote_request_id)
    want_checksums: bool = False


class HoldReply(msgspec.Struct, tag="hold_reply", kw_only=True):
    """The answer to Pin and Release."""

    held: bool  # the producer held the blocks from request_finished until this message
    error: str | None = None
    checksums: list[int] | None = None  # of all the held blocks, in request order


COMMON_MESSAGES: tuple[type, ...] = (Hello, HelloReply, Pin, Release, HoldReply)

# (engine id, host) → port chosen for it in this process: both roles of one engine resolve the
# same free port, because they are built from the same config and only the worker binds it.
_chosen_ports: dict[tuple[str, str], int] = {}
_chosen_lock = threading.Lock()


def resolve_port(host: str, port: int, engine_id: str) -> int:
    if port:
        return port
    with _chosen_lock:
        key = (engine_id, host)
        if key not in _chosen_ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                _chosen_ports[key] = s.getsockname()[1]
        return _chosen_ports[key]


def advertised_host(host: str) -> str:
    """The address peers should dial when the side channel binds `host`."""
    if host in ("0.0.0.0", "", "*"):
        return socket.gethostbyname(socket.gethostname())
    return host


@dataclass
class _Call:
    on_reply: Callable[[Any], None]
    on_error: Callable[[str], None]
    deadline: float


@dataclass
class _Dealer:
    address: str
    sock: zmq.Socket
    calls: dict[int, _Call] = field(default_factory=dict)


class SideChannel:
    """ROUTER (when serving) + one DEALER per peer + a wake-up pipe, polled by one thread."""

    def __init__(self, messages: tuple[type, ...], bind: tuple[str, int] | None) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        union = messages[0] if len(messages) == 1 else _union(messages)
        self._decoder = msgspec.msgpack.Decoder(union)
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._dealers: dict[str, _Dealer] = {}
        self._by_socket: dict[zmq.Socket, _Dealer] = {}
        self._seq = 0
        self.router: zmq.Socket | None = None
        if bind is not None:
            host, port = bind
            self.router = self._ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            try:
                self.router.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as e:
                self.close()
                raise RuntimeError(
                    f"KV side channel cannot bind tcp://{host}:{port} ({e}); "
                    "set kv_transfer.side_channel_port to a free port"
                ) from e
            self._poller.register(self.router, zmq.POLLIN)

    # ------------------------------------------------------------ any thread
    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the loop is already due to wake

    # ------------------------------------------------------------ I/O thread
    def poll(self, timeout_ms: float) -> set[Any]:
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        return set(events)

    def incoming(self, events: set[Any]) -> Iterator[tuple[bytes, bytes, Any]]:
        """(identity, seq, message) of each request waiting on the ROUTER."""
        if self.router is None or self.router not in events:
            return
        while True:
            try:
                identity, seq, payload = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # malformed frames: not one of ours
            try:
                yield identity, seq, self._decoder.decode(payload)
            except msgspec.DecodeError as e:
                logger.warning("KV side channel: dropping undecodable message (%s)", e)

    def reply(self, identity: bytes, seq: bytes, message: Any) -> None:
        assert self.router is not None
        self.router.send_multipart([identity, seq, self._encoder.encode(message)])

    def call(
        self,
        address: str,
        message: Any,
        on_reply: Callable[[Any], None],
        on_error: Callable[[str], None],
        timeout_s: float,
    ) -> None:
        dealer = self._dealers.get(address)
        if dealer is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            dealer = self._dealers[address] = _Dealer(address, sock)
            self._by_socket[sock] = dealer
            self._poller.register(sock, zmq.POLLIN)
        self._seq += 1
        dealer.calls[self._seq] = _Call(on_reply, on_error, time.monotonic() + timeout_s)
        dealer.sock.send_multipart([self._seq.to_bytes(8, "little"), self._encoder.encode(message)])

    def dispatch_replies(self, events: set[Any]) -> None:
        for sock in [s for s in events if s in self._by_socket]:
            dealer = self._by_socket[sock]
            while True:
                try:
                    seq, payload = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except ValueError:
                    continue
                call = dealer.calls.pop(int.from_bytes(seq, "little"), None)
                if call is None:
                    continue  # answered after we gave up on it
                try:
                    message = self._decoder.decode(payload)
                except msgspec.DecodeError as e:
                    call.on_error(f"undecodable reply from {dealer.address} ({e})")
                    continue
                call.on_reply(message)
                if self._dealers.get(dealer.address) is not dealer:
                    break  # the callback dropped this peer

    def expire_calls(self, now: float) -> None:
        for dealer in list(self._dealers.values()):
            late = [seq for seq, c in dealer.calls.items() if c.deadline <= now]
            for seq in late:
                call = dealer.calls.pop(seq)
                call.on_error(f"no reply from {dealer.address} in time (peer down?)")

    def has_calls(self) -> bool:
        return any(d.calls for d in self._dealers.values())

    def drop(self, address: str, reason: str) -> None:
        """Forget a peer: its pending calls fail with `reason`, its socket closes."""
        dealer = self._dealers.pop(address, None)
        if dealer is None:
            return
        self._poller.unregister(dealer.sock)
        del self._by_socket[dealer.sock]
        dealer.sock.close(linger=0)
        calls, dealer.calls = dealer.calls, {}
        for call in calls.values():
            call.on_error(reason)

    def close(self) -> None:
        for address in list(self._dealers):
            self.drop(address, "connector shut down")
        if self.router is not None:
            self.router.close(linger=0)
            self.router = None
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _union(types: tuple[type, ...]) -> Any:
    union = types[0]
    for t in types[1:]:
        union = union | t
    return union


def release_remote_kv(params: dict[str, Any], timeout_s: float = 2.0) -> bool:
    """Tell a producer to free the blocks it holds for `params` now (e.g. when the request stopped
    on its first token and no consumer will pull them). True when the producer still held them.

    For the router and tools: a blocking one-shot call, never used inside the engine.
    """
    host, port, rid = (
        params.get("remote_host"),
        params.get("remote_port"),
        params.get("remote_request_id"),
    )
    if not (host and port and rid):
        return False
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(HoldReply)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([(1).to_bytes(8, "little"), encoder.encode(Release(request_id=rid))])
        if not sock.poll(int(timeout_s * 1000)):
            return False
        _, payload = sock.recv_multipart()
        return decoder.decode(payload).held
    except (zmq.ZMQError, msgspec.DecodeError, ValueError):
        return False
    finally:
        sock.close(linger=0)
        ctx.term()
