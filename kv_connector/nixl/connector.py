"""NIXL connector: the consumer READs the producer's blocks straight into its own.

The producer registers its whole KV tensor with a NIXL agent (DRAM on CPU, VRAM on CUDA) and
answers handshakes with the agent's metadata and the tensor's base address. The consumer loads
each producer once (cached per side-channel address), prepares one descriptor per block on both
sides (a block is one contiguous region), and issues one READ per request. It sends a Pin on the
side channel as the READ starts and a Release when it ends, and trusts the bytes only if the
Pin's reply says the producer held them (see p2p/consumer.py).

Measured facts this design follows:
- NIXL's progress thread spins a core per agent: agents run without it, and the I/O thread polls
  (transfer states on the consumer, notifications on the producer — the passive side must poll,
  or a peer's first transfer never completes).
- Deregistering memory does not revoke a peer's access: block lifetime is the lease protocol's job.
- On one host UCX moves DRAM with CMA (`process_vm_readv`), synchronously inside `transfer()`,
  which releases the GIL. Its speed depends on the pages, not on the descriptors: 64 MiB as 1 or
  2048 descriptors read at the same rate, 4.8 GB/s on 4 KiB pages and 7.8 GB/s on huge pages
  (hugepages.py), so descriptors stay one per block and runs are not merged.
- A peer killed mid-transfer raises nixlRemoteDisconnectError within ~20 ms: the affected loads
  fail and the cached agent is dropped, so the next request handshakes again.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from pydantic import Field

from splitserve.kv_connector.layout import set_loopback_env
from splitserve.kv_connector.p2p import Load, P2PConnectorBase, P2POptions, Peer
from splitserve.kv_connector.side_channel import Hello, HelloReply

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class NixlOptions(P2POptions):
    backends: list[str] = Field(default_factory=lambda: ["UCX"])
    """NIXL backends to create (the first that can serve both sides carries the transfer)."""


class NixlPeerInfo(msgspec.Struct, kw_only=True):
    """The producer's part of the handshake."""

    agent_name: str
    agent_metadata: bytes
    base_addr: int  # address of block 0 in the producer's KV tensor
    device_id: int
    mem_type: str  # DRAM | VRAM


@dataclass
class _RemoteAgent:
    name: str
    dlist: Any  # prepped descriptor list over all of the producer's blocks
    num_blocks: int


def _block_descs(base: int, block_nbytes: int, num_blocks: int, device_id: int) -> np.ndarray:
    """[num_blocks, 3] (address, length, device) rows, one per block."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_nbytes)
    descs[:, 1] = block_nbytes
    descs[:, 2] = device_id
    return descs


class NixlConnector(P2PConnectorBase):
    Options = NixlOptions

    def _io_setup(self, kv_cache: torch.Tensor) -> None:
        set_loopback_env(self.bind_host, ("UCX_NET_DEVICES",))
        quiet = "NIXL_LOG_LEVEL" not in os.environ
        if quiet:  # NIXL logs INFO lines to stdout by default
            os.environ["NIXL_LOG_LEVEL"] = "WARN"
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError(
                "connector 'nixl' needs the nixl package: pip install 'splitserve[nixl]'"
            ) from e
        if quiet:  # in case nixl was imported (and configured its logger) before
            logging.getLogger("nixl").setLevel(logging.WARNING)
        info = self.engine_info
        self._agent_name = f"{self.engine_id}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=list(self.options.backends),
        )
        self._agent = nixl_agent(self._agent_name, config)
        self._reg_descs = self._agent.register_memory(kv_cache)
        device_id = max(kv_cache.get_device(), 0)
        mem_type = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        self._local = NixlPeerInfo(
            agent_name=self._agent_name,
            agent_metadata=b"",
            base_addr=kv_cache.data_ptr(),
            device_id=device_id,
            mem_type=mem_type,
        )
        descs = _block_descs(kv_cache.data_ptr(), info.block_nbytes, info.num_blocks, device_id)
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem_type)
        self._reading: dict[str, Load] = {}
        self._poll_until = 0.0  # keep polling a while after a handshake: the peer wires up
        logger.info(
            "NIXL agent %s registered %d blocks (%s)", self._agent_name, info.num_blocks, mem_type
        )

    # ------------------------------------------------------------ producer
    def _io_hello(self, message: Hello) -> bytes:
        self._poll_until = time.monotonic() + 5.0
        info = msgspec.structs.replace(self._local, agent_metadata=self._agent.get_agent_metadata())
        return msgspec.msgpack.encode(info)

    # ------------------------------------------------------------ consumer
    def _io_connect(self, peer: Peer, reply: HelloReply) -> None:
        remote = msgspec.msgpack.decode(reply.transport, type=NixlPeerInfo)
        name = self._agent.add_remote_agent(remote.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        descs = _block_descs(
            remote.base_addr, reply.block_nbytes, reply.num_blocks, remote.device_id
        )
        dlist = self._agent.prep_xfer_dlist(name, descs, remote.mem_type)
        peer.transport = _RemoteAgent(name, dlist, reply.num_blocks)
        self._io_peer_ready(peer)

    def _io_begin_load(self, load: Load) -> None:
        spec, remote = load.spec, load.peer.transport
        assert isinstance(remote, _RemoteAgent)
        bad = [b for b in spec.remote_block_ids if not 0 <= b < remote.num_blocks]
        if bad:
            self._io_fail(load, f"remote block ids {bad[:4]} out of range [0, {remote.num_blocks})")
            return
        load.state = "reading"
        # The deadline starts before the Pin leaves: the producer's pin outlasts it.
        load.transport = (time.monotonic() + self.timeout_s, None)
        self._io_pin(load)
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", self._local_dlist, spec.local_block_ids, remote.dlist, spec.remote_block_ids
            )
            load.transport = (load.transport[0], handle)
            state = self._agent.transfer(handle)  # may copy synchronously (shared memory)
        except Exception as e:
            self._io_transfer_error(load, e)
            return
        self._io_after_state(load, state)

    def _io_after_state(self, load: Load, state: str) -> None:
        rid = load.spec.request_id
        if state == "DONE":
            self._reading.pop(rid, None)
            deadline, handle = load.transport
            load.transport = None
            handle.release()
            if time.monotonic() > deadline:  # past it the Pin may have ended under the read
                self._io_fail(load, f"NIXL transfer did not finish in {self.timeout_s}s")
            else:
                self._io_read(load)
        elif state == "ERR":
            self._reading.pop(rid, None)
            self._io_fail(load, "NIXL transfer failed (state ERR)", release=False)
            self._io_peer_failed(load.peer, "NIXL transfer failed (state ERR)")
        else:
            self._reading[rid] = load

    def _io_transfer_error(self, load: Load, e: Exception) -> None:
        self._reading.pop(load.spec.request_id, None)
        reason = f"{type(e).__name__}: {e}"
        if "Disconnect" in type(e).__name__:
            reason = f"peer disconnected ({reason})"
        # Drop the cached agent either way: a producer that restarted on the same address
        # gets a fresh handshake on the next request instead of failing them all.
        self._io_fail(load, f"NIXL transfer failed ({reason})", release=False)
        self._io_peer_failed(load.peer, f"NIXL transfer failed ({reason})")

    def _io_progress(self) -> None:
        if self._io_busy():
            self._agent.get_new_notifs()  # drives the passive side of peers' transfers
        now = time.monotonic()
        for load in list(self._reading.values()):
            deadline, handle = load.transport
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:
                self._io_transfer_error(load, e)
                continue
            if state == "PROC" and now > deadline:
                self._reading.pop(load.spec.request_id, None)
                self._io_fail(load, f"NIXL transfer did not finish in {self.timeout_s}s")
                continue
            self._io_after_state(load, state)

    def _io_busy(self) -> bool:
        return bool(self._held or self._reading) or time.monotonic() < self._poll_until

    def _io_abort_load(self, load: Load) -> None:
        self._reading.pop(load.spec.request_id, None)
        if isinstance(load.transport, tuple) and load.transport[1] is not None:
            handle = load.transport[1]
            load.transport = None
            handle.release()  # aborts a transfer still in flight

    def _io_disconnect(self, peer: Peer) -> None:
        remote = peer.transport
        peer.transport = None
        if isinstance(remote, _RemoteAgent):
            for load in [ld for ld in self._reading.values() if ld.peer is peer]:
                self._io_abort_load(load)
            remote.dlist.release()
            self._agent.remove_remote_agent(remote.name)

    def _io_close(self) -> None:
        for peer in list(self._peers.values()):
            try:
                self._io_disconnect(peer)
            except Exception:
                logger.debug("NIXL: disconnect at shutdown failed", exc_info=True)
        try:
            self._local_dlist.release()
            self._agent.deregister_memory(self._reg_descs)
        except Exception:
            logger.debug("NIXL: deregister at shutdown failed", exc_info=True)
