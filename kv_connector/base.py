"""The KV connector API: one class built twice, once per role, with typed metadata in between.

```
 scheduler side (Scheduler)                         worker side (next to the KV cache)
 get_num_new_matched_tokens(req, n_computed)
 update_state_after_alloc(req, block_ids, n_ext)
 build_connector_meta() ──── KVConnectorMetadata ───▶ start_load_kv(meta)   before the forward
                                                      save_kv(meta)         after the forward
 request_finished(req, block_ids)                     get_finished()        start of each step
```

Contract with the engine (it calls every method once per step, idle steps included, while any
request waits for remote KV or is held for a consumer):

- A load the scheduler side started (`get_num_new_matched_tokens` said async, then
  `update_state_after_alloc` with `num_external_tokens > 0`) is reported exactly once by
  `get_finished`: in `done_recving` when every byte landed (and matched its checksum), or in
  `failed` with a reason. Never both, never garbage, never silence: every wait has a timeout.
  Until then the blocks are being written: an aborted request keeps them until it is reported.
- `request_finished` returning `delay_free=True` means: keep the blocks until the request id shows
  up in `done_sending` (the consumer said done, the save landed, or the lease expired).
- Connectors speak request ids, token ids, block ids and their own types; they never import
  `splitserve.engine`. The engine's Request satisfies `RequestView` structurally.

kv_transfer_params (vLLM's names where they exist):

| field | who sets it | meaning |
| --- | --- | --- |
| `do_remote_decode` | router → producer | hold this request's KV for a consumer |
| `do_remote_prefill` | producer → router → consumer | load this request's KV from the producer |
| `connector` | producer | connector name the KV is served by; the consumer checks it |
| `remote_engine_id`, `remote_host`, `remote_port` | producer | its engine id and side channel |
| `remote_block_ids` | producer | its blocks holding positions [0, num_tokens), in order |
| `remote_request_id` | producer | the request id the producer holds the blocks under |
| `num_tokens` | producer | prompt tokens whose KV the blocks hold |
| `lease_s` | router → producer, producer → router | how long the blocks are held |
| `block_hashes` | producer (redis) | hex content hashes of the stored full blocks |

Checksums (`verify: true`) travel with the data path, not in kv_transfer_params: the producer
computes them when it starts holding a request, which is after `request_finished` has returned.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import msgspec

from splitserve.kv_connector.config import ConnectorOptions, KVTransferConfig, validate_options
from splitserve.kv_connector.metrics import KVTransferStats

if TYPE_CHECKING:
    import torch


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class EngineInfo:
    """What a connector needs to know about its engine. Who sets this: the engine core."""

    engine_id: str  # unique per instance; names it to peers
    block_size: int  # tokens per KV block
    num_blocks: int  # blocks in the KV cache tensor
    block_nbytes: int  # bytes of one block: every layer's K and V, contiguous
    model_fingerprint: str  # hash of model config + weights identity + dtype + block size
    device: str  # "cpu" or "cuda[:N]"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_blocks <= 0 or self.block_nbytes <= 0:
            raise ValueError(
                f"EngineInfo needs positive block_size/num_blocks/block_nbytes: {self}"
            )


class RequestView(Protocol):
    """The parts of an engine request a connector reads (the engine's Request has them)."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]  # chained stable hash of each full block of all_token_ids
    kv_transfer_params: dict[str, Any] | None

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...  # prompt + prior output (t0 on a decode instance) + output


class KVConnectorMetadata(msgspec.Struct, kw_only=True):
    """Base of the per-step message from the scheduler side to the worker side."""


class FinishedSet:
    """Results a connector's threads report, handed to the engine by `get_finished`.

    Transfers finish on I/O threads while the engine thread drains between steps; the lock makes
    each drain see a result exactly once. Who sets this: the connector's threads (`sent`,
    `recved`, `failed`); who reads it: `KVConnectorBase.get_finished`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._failed: dict[str, str] = {}

    def sent(self, request_id: str) -> None:
        """The producer may free the request's blocks (consumer done, save landed, lease over)."""
        with self._lock:
            self._sending.add(request_id)

    def recved(self, request_id: str) -> None:
        """Every byte of the request's load landed (and matched its checksums)."""
        with self._lock:
            self._recving.add(request_id)

    def failed(self, request_id: str, reason: str) -> None:
        """The request's load failed; the engine applies the failure policy."""
        with self._lock:
            self._failed[request_id] = reason

    def drain(self) -> tuple[set[str], set[str], dict[str, str]]:
        """(done_sending, done_recving, failed) since the last drain."""
        with self._lock:
            out = (self._sending, self._recving, self._failed)
            self._sending, self._recving, self._failed = set(), set(), {}
        return out


class KVConnectorBase(ABC):
    """A KV connector; the engine builds one per role with the same config."""

    Options: ClassVar[type[ConnectorOptions]] = ConnectorOptions

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, engine_info: EngineInfo
    ) -> None:
        self.config = config
        self.role = role
        self.engine_info = engine_info
        self.options = validate_options(config.connector, self.Options, config.options)
        self.stats = KVTransferStats()
        self.finished = FinishedSet()  # filled by the worker side's threads

    @property
    def is_producer(self) -> bool:
        return self.config.kv_role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.config.kv_role in ("consumer", "both")

    # ------------------------------------------------------------ scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Prompt tokens beyond `num_computed_tokens` loadable from outside, and whether async."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Remember where the external tokens land: `block_ids` are all of the request's blocks;
        positions [num_computed_tokens, num_computed_tokens + num_external_tokens) are loaded."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's message to the worker side; drains what was recorded since the last one."""

    @abstractmethod
    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params for the client): hold the blocks for a consumer?"""

    # ------------------------------------------------------------ worker side
    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """Take the block-major KV tensor [num_blocks, layers, 2, block_size, kv_heads, head_dim]."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Begin this step's loads; never blocks."""

    @abstractmethod
    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """After the forward: begin saves, start holding finished requests' blocks."""

    def get_finished(self) -> tuple[set[str], set[str], dict[str, str]]:
        """(done_sending, done_recving, failed {request id: reason}) since the last call."""
        return self.finished.drain()

    # ------------------------------------------------------------ both
    @abstractmethod
    def shutdown(self) -> None:
        """Stop threads, close sockets, release memory registrations and held leases."""


class NoOpConnector(KVConnectorBase):
    """Transfer off: the engine calls the same methods and nothing happens."""

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        return None

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        return None

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        return None

    def shutdown(self) -> None:
        return None
