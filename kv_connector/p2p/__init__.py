"""What the NIXL and NCCL connectors share: P/D bookkeeping, leases, and the I/O thread.

- messages.py: the scheduler → worker metadata (LoadSpec, HoldSpec, ReleaseSpec).
- scheduler.py: kv_transfer_params → metadata (consumer loads, producer holds).
- connector.py: P2PConnectorBase, the engine-thread API and the I/O thread loop.
- producer.py / consumer.py: the two halves of the I/O thread's work.
"""

from splitserve.kv_connector.p2p.connector import P2PConnectorBase, P2POptions
from splitserve.kv_connector.p2p.consumer import Load, Peer
from splitserve.kv_connector.p2p.messages import (
    HoldSpec,
    LoadSpec,
    P2PMetadata,
    ReleaseSpec,
    RemotePrefill,
)

__all__ = [
    "HoldSpec",
    "Load",
    "LoadSpec",
    "P2PConnectorBase",
    "P2PMetadata",
    "P2POptions",
    "Peer",
    "ReleaseSpec",
    "RemotePrefill",
]
