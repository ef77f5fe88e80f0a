"""One side of a two-rank process group and the messages a block transfer becomes on it.

A transfer is a list of runs `(src_start, dst_start, length)` (`contiguous_runs`); both sides
derive the same message plan from the same runs, the sender reading source blocks, the receiver
writing destination blocks:

```
runs      [0..63]→[10..73]   [80]→[5]   [93]→[200]   [96..97]→[3..4]   ...
messages  in place, ≤ 8 MiB  └──────── one packed message ────────┘    ...
          each (0, 1, 2, 3)   (short runs gathered into a staging buffer of ≤ 16 MiB;
                               three buffers in flight so packing overlaps the wire)
lane      i % L: message i travels on TCP connection i % L of the pair (L: gloo_connections)
```

Why (gloo over loopback TCP on 2 cores, 64 MiB, kv_connector/hugepages.py on): one TCP stream
carries ~2 GB/s here whatever sends on it (a plain Python `sendall`/`recv_into` too), two
streams ~2.9 and four ~3.8; one gloo message of 64 MiB ran at 1.3 GB/s, 2–4 pieces over two
connections at 2.1. Messages of 64 KiB cost more than their bytes (1.0 GB/s), hence packing;
unpacking is a scattered write (~4.5 GB/s, half a plain copy) and is the price of a scattered
destination. Every wait has the connector's timeout; the pair thread is the only caller of its
process group.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from splitserve.kv_connector.hugepages import empty_on_huge_pages

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DIRECT_MIN = 1 << 20  # runs at least this long travel in place
PIECE = 8 << 20  # bytes per in-place message
PACK_CHUNK = 16 << 20  # bytes per packed message
PACK_BUFFERS = 3  # staging buffers (packed messages in flight) per pair
TAG_BITS = 6  # message i of a job is tagged job.tag << TAG_BITS | i % 2**TAG_BITS


@dataclass
class Job:
    send: bool  # send (producer) or recv (consumer)
    request_id: str
    runs: list[tuple[int, int, int]]  # (src_start, dst_start, length)
    tag: int  # < 2**24, chosen by the consumer; see TAG_BITS
    started: float


def plan(job: Job, block_nbytes: int) -> list[tuple[int, int] | list[int]]:
    """The job's messages: (first block, count) moved in place, or a list of block ids packed.
    Block ids are this side's (source on the sender, destination on the receiver)."""
    per_piece = max(1, PIECE // block_nbytes)
    per_pack = max(1, PACK_CHUNK // block_nbytes)
    out: list[tuple[int, int] | list[int]] = []
    packed: list[int] = []
    for src, dst, n in job.runs:
        first = src if job.send else dst
        if n * block_nbytes >= DIRECT_MIN:
            out.extend(
                (b, min(per_piece, first + n - b)) for b in range(first, first + n, per_piece)
            )
            continue
        for b in range(first, first + n):
            packed.append(b)
            if len(packed) == per_pack:
                out.append(packed)
                packed = []
    if packed:
        out.append(packed)
    return out


class Pair(threading.Thread):
    """One side of a two-rank process group; runs its jobs one at a time.

    `owner` is the NcclConnector: its `blocks`, `timeout_s`, `device` and `_submit` (results
    go back to its I/O thread as `pair_ready` and `job_done` events)."""

    def __init__(
        self, owner: Any, pair_id: str, rank: int, store: Any, backend: str, lanes: int = 2
    ) -> None:
        super().__init__(daemon=True, name=f"kv-nccl-pair-{pair_id[:8]}-r{rank}")
        self.owner, self.pair_id, self.rank, self.backend = owner, pair_id, rank, backend
        self.lanes = lanes  # gloo: TCP connections, the same number on both sides
        self.store = store  # a TCPStore (producer) or (host, port) to dial (consumer)
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.broken: str | None = None
        self._staging: list[torch.Tensor] = []  # made on first packed message, then reused

    def run(self) -> None:
        owner = self.owner
        timeout = datetime.timedelta(seconds=owner.timeout_s)
        try:
            pg = self._make_group(timeout)
        except Exception as e:
            self.broken = f"building the {self.backend} process group failed: {e}"
            owner._submit("pair_ready", (self, self.broken))
            return
        owner._submit("pair_ready", (self, None))
        while (job := self.jobs.get()) is not None:
            if self.broken is None:
                try:
                    self._run(pg, job, timeout)
                    owner._submit("job_done", (self, job, None))
                    continue
                except Exception as e:
                    self.broken = f"{'send' if job.send else 'recv'} failed: {e}"
            owner._submit("job_done", (self, job, self.broken))
        try:
            pg.abort() if self.broken else pg.shutdown()
        except Exception:
            logger.debug("process group teardown failed", exc_info=True)

    def _make_group(self, timeout: datetime.timedelta) -> Any:
        import torch.distributed as dist

        if isinstance(self.store, tuple):  # consumer: dial the producer's store
            host, port = self.store
            self.store = dist.TCPStore(host, port, 2, False, timeout)
        prefix = dist.PrefixStore(f"splitserve/kv/{self.pair_id}", self.store)
        if self.backend == "nccl":
            import torch

            torch.cuda.set_device(self.owner.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(prefix, self.rank, 2, options)
        # One gloo context, and so one TCP connection, per device: gloo sends a message on
        # context `tag % len(devices)`, so consecutive messages take different connections.
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [
            dist.ProcessGroupGloo.create_default_device() for _ in range(self.lanes)
        ]
        return dist.ProcessGroupGloo(prefix, self.rank, 2, options)

    def _run(self, pg: Any, job: Job, timeout: datetime.timedelta) -> None:
        """Post every message in plan order (gloo matches a tag's messages in order); a packed
        message waits only for a free staging buffer, so packing overlaps the wire."""
        import torch

        blocks = self.owner.blocks
        words = _as_words(blocks)  # gather/scatter 8 bytes at a time
        peer = 1 - self.rank
        op = pg.send if job.send else pg.recv
        direct: list[Any] = []
        free = list(self._staging)
        staged: deque[tuple[Any, torch.Tensor, torch.Tensor]] = deque()  # (work, buffer, ids)
        for i, msg in enumerate(plan(job, blocks.shape[1])):
            tag = job.tag << TAG_BITS | i % (1 << TAG_BITS)  # same on both sides
            if isinstance(msg, tuple):
                view = blocks[msg[0] : msg[0] + msg[1]]  # [count, block_nbytes], in place
                direct.append(op([view], peer, tag))
                continue
            if not free and len(self._staging) < PACK_BUFFERS:
                free.append(self._new_buffer())
            buf = free.pop() if free else self._retire(staged, words, job.send, timeout)
            ids = torch.tensor(msg, device=blocks.device)
            rows = buf[: len(msg)]  # [len(msg), block_nbytes]
            if job.send:
                torch.index_select(words, 0, ids, out=_as_words(rows))
            staged.append((op([rows], peer, tag), buf, ids))
        while staged:
            self._retire(staged, words, job.send, timeout)
        for work in direct:
            work.wait(timeout)
        if self.backend == "nccl":
            torch.cuda.synchronize(self.owner.device)

    def _new_buffer(self) -> torch.Tensor:
        """A staging buffer kept for the pair's life: its pages fault in once (a fresh buffer
        per message cost more than the copy itself)."""
        blocks = self.owner.blocks
        rows = max(1, PACK_CHUNK // blocks.shape[1])
        buf = empty_on_huge_pages(rows * blocks.shape[1], blocks.device)
        self._staging.append(buf.view(rows, blocks.shape[1]))  # [rows, block_nbytes]
        return self._staging[-1]

    @staticmethod
    def _retire(
        staged: deque, words: torch.Tensor, send: bool, timeout: datetime.timedelta
    ) -> torch.Tensor:
        """Wait for the oldest packed message; scatter it into the blocks when receiving.
        Returns its staging buffer, free again."""
        work, buf, ids = staged.popleft()
        work.wait(timeout)
        if not send:
            words.index_copy_(0, ids, _as_words(buf[: len(ids)]))
        return buf


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """A [rows, nbytes] uint8 tensor as int64 words when the row size allows (faster copies)."""
    import torch

    return t.view(torch.int64) if t.shape[1] % 8 == 0 else t
