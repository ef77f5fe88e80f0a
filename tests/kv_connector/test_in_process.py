"""Producer and consumer in one process (two NIXL agents / two gloo ranks on threads): cheap
checks of the protocol paths that need no process boundary."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kvc_helpers import nixl_missing

from splitserve.kv_connector.driver import PRESETS, KVShape, SimEngine
from splitserve.kv_connector.side_channel import (
    COMMON_MESSAGES,
    HoldReply,
    Pin,
    Release,
    SideChannel,
    release_remote_kv,
)

SHAPE = PRESETS["tiny"]


def _engine(
    connector: str,
    role: str,
    engine_id: str,
    shape: KVShape = SHAPE,
    shuffle: bool = True,
    **extra: object,
) -> SimEngine:
    config = {"connector": connector, "kv_role": role, "options": {"timeout_s": 2.0}, **extra}
    return SimEngine(
        config, shape, 32, engine_id, seed=sum(map(ord, engine_id)), shuffle_blocks=shuffle
    )


def _step_until(engines: list[SimEngine], done: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, [e.status() for e in engines]
        for e in engines:
            e.step()
        time.sleep(0.001)


@pytest.fixture(params=["nixl", "nccl"])
def connector(request: pytest.FixtureRequest) -> str:
    if request.param == "nixl" and (why := nixl_missing()):
        pytest.skip(why)
    return request.param


@pytest.fixture
def producer(connector: str) -> Iterator[SimEngine]:
    p = _engine(connector, "producer", f"p-{connector}")
    yield p
    p.shutdown()


def test_release_remote_kv_frees_held_blocks_early(producer: SimEngine) -> None:
    """Stop on t0: the router tells the producer nobody will pull the blocks."""
    params = producer.prefill("r1", list(range(40)), {"do_remote_decode": True})["params"]
    producer.step()  # the hold begins
    held = {}

    def release() -> bool:
        held["r1"] = release_remote_kv(params, timeout_s=5)
        return True

    import threading

    t = threading.Thread(target=release)
    t.start()
    _step_until([producer], lambda: "r1" in producer.done_sending)
    t.join(5)
    assert held == {"r1": True}
    assert len(producer.free) == 32
    assert release_remote_kv(params, timeout_s=2) is False  # already released


def _ask(producer: SimEngine, params: dict, message: object) -> HoldReply:
    """One side-channel call to the producer, stepping it until the reply comes."""
    channel = SideChannel(COMMON_MESSAGES, None)
    replies: list = []

    def answered() -> bool:
        channel.dispatch_replies(channel.poll(1))
        return bool(replies)

    try:
        address = f"tcp://{params['remote_host']}:{params['remote_port']}"
        channel.call(address, message, replies.append, replies.append, 5.0)
        _step_until([producer], answered)
    finally:
        channel.close()
    assert isinstance(replies[0], HoldReply), replies
    return replies[0]


def test_pin_keeps_blocks_past_the_lease(producer: SimEngine) -> None:
    """A consumer reading (Pin) outlives the lease: the blocks stay until its Release; a pin
    whose Release never comes ends after timeout_s (2 s here) and the lease with it."""
    rid = "pinned"
    params = producer.prefill(rid, list(range(40)), {"do_remote_decode": True, "lease_s": 0.2})
    params = params["params"]
    pinned = _ask(producer, params, Pin(request_id=rid, want_checksums=True))
    assert pinned.held and pinned.checksums is not None and len(pinned.checksums) == 3
    time.sleep(0.4)
    producer.step()
    producer.step()
    assert rid not in producer.done_sending  # the lease is over, the pin is not
    assert _ask(producer, params, Release(request_id=rid, loaded=True)).held
    _step_until([producer], lambda: rid in producer.done_sending)
    assert producer.worker.stats.expired_leases == 0

    rid = "abandoned"
    params = producer.prefill(rid, list(range(40)), {"do_remote_decode": True, "lease_s": 0.2})
    assert _ask(producer, params["params"], Pin(request_id=rid)).held
    _step_until([producer], lambda: rid in producer.done_sending, timeout=10)
    assert producer.worker.stats.expired_leases == 1
    late = _ask(producer, params["params"], Pin(request_id=rid))
    assert not late.held and "lease expired" in (late.error or "")
    assert len(producer.free) == 32


def test_model_mismatch_fails_the_load_with_a_reason(connector: str, producer: SimEngine) -> None:
    other = KVShape(num_layers=2, num_kv_heads=4, head_dim=32)
    consumer = _engine(connector, "consumer", f"d-{connector}", shape=other)
    try:
        params = producer.prefill("r1", list(range(40)), {"do_remote_decode": True})["params"]
        assert consumer.load("d1", list(range(41)), params) == 40
        _step_until([producer, consumer], lambda: "d1" in consumer.failed)
        assert "model fingerprint" in consumer.failed["d1"]
        assert "d1" not in consumer.done_recving
        _step_until([producer, consumer], lambda: "r1" in producer.done_sending)  # released
    finally:
        consumer.shutdown()


@pytest.mark.parametrize("layout", ["scattered", "contiguous"])
def test_one_handshake_serves_many_loads(connector: str, layout: str) -> None:
    """Scattered tiny blocks (nccl packs them) and contiguous small ones (sent in place)."""
    shape, shuffle = (SHAPE, True) if layout == "scattered" else (PRESETS["small"], False)
    producer = _engine(connector, "producer", f"p-{connector}", shape=shape, shuffle=shuffle)
    consumer = _engine(
        connector, "consumer", f"d-{connector}", shape=shape, shuffle=shuffle, verify=True
    )
    try:
        rids = [f"r{i}" for i in range(5)]
        outs = {
            r: producer.prefill(r, list(range(i, i + 20 + 7 * i)), {"do_remote_decode": True})
            for i, r in enumerate(rids)
        }
        for i, r in enumerate(rids):
            consumer.load(f"d{r}", list(range(i, i + 21 + 7 * i)), outs[r]["params"])
        _step_until([producer, consumer], lambda: len(consumer.done_recving) == 5)
        assert not consumer.failed
        for r in rids:
            src = outs[r]["block_ids"]
            dst = consumer.block_ids(f"d{r}")[: len(src)]
            assert producer.block_data(src) == consumer.block_data(dst)
        assert len(consumer.worker._peers) == 1  # type: ignore[attr-defined]
        _step_until([producer, consumer], lambda: len(producer.free) == 32)
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_gloo_connections_are_the_producers() -> None:
    """A producer with 3 gloo connections per pair and a consumer left at the default: the
    consumer builds the pair with the producer's 3 (a mismatch would hang the group), and the
    bytes arrive intact."""
    options = {"timeout_s": 2.0, "gloo_connections": 3}
    producer = _engine("nccl", "producer", "p-lanes", shuffle=False, options=options)
    consumer = _engine("nccl", "consumer", "d-lanes", shuffle=False)
    try:
        out = producer.prefill("r", list(range(300)), {"do_remote_decode": True})
        consumer.load("dr", list(range(301)), out["params"])
        _step_until([producer, consumer], lambda: "dr" in consumer.done_recving)
        assert not consumer.failed
        src = out["block_ids"]
        assert producer.block_data(src) == consumer.block_data(consumer.block_ids("dr")[: len(src)])
        (peer,) = consumer.worker._peers.values()  # type: ignore[attr-defined]
        assert peer.transport.lanes == 3
    finally:
        consumer.shutdown()
        producer.shutdown()
