"""Config validation, the registry, the no-op connector, block arithmetic and metrics."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.kv_connector.base import (
    EngineInfo,
    KVConnectorMetadata,
    KVConnectorRole,
    NoOpConnector,
)
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.driver import SimRequest
from splitserve.kv_connector.layout import block_range, contiguous_runs, first_mismatch
from splitserve.kv_connector.metrics import KVTransferCollector, KVTransferStats
from splitserve.kv_connector.registry import (
    connector_class,
    create_connector,
    known_connectors,
    register_connector,
)

INFO = EngineInfo(
    engine_id="e0",
    block_size=16,
    num_blocks=8,
    block_nbytes=1024,
    model_fingerprint="fp",
    device="cpu",
)


def _error(**kwargs: object) -> str:
    with pytest.raises(ValidationError) as e:
        KVTransferConfig(**kwargs)
    return str(e.value)


def test_defaults_are_transfer_off() -> None:
    config = KVTransferConfig()
    assert (config.connector, config.kv_role, config.failure_policy) == (
        "none",
        "both",
        "recompute",
    )
    assert config.lease_s == 30.0 and config.verify is False and config.side_channel_port == 0
    with pytest.raises(ValidationError):
        config.lease_s = 5  # frozen


def test_unknown_connector_names_the_known_ones() -> None:
    assert "unknown connector 'nixll' (known: nccl, nixl, none, redis" in _error(connector="nixll")


def test_known_connectors_resolve_without_their_transport_library() -> None:
    assert {"nccl", "nixl", "none", "redis"} <= set(known_connectors())
    for name in ("nixl", "nccl", "redis", "none"):
        assert connector_class(name).Options is not None


def test_unknown_option_names_it_and_the_known_ones() -> None:
    msg = _error(connector="redis", options={"ttl": 5})
    assert "unknown option 'ttl'" in msg
    assert (
        "known options: key_prefix, lookup_timeout_s, max_pipeline_bytes, timeout_s, ttl_s, "
        "url, wait_s" in msg
    )
    msg = _error(connector="nixl", options={"backend": ["UCX"]})
    assert "unknown option 'backend'" in msg and "backends" in msg


def test_bad_option_value_is_explained() -> None:
    assert "option 'ttl_s'" in _error(connector="redis", options={"ttl_s": -1})
    assert "option 'timeout_s'" in _error(connector="nccl", options={"timeout_s": 0})
    KVTransferConfig(connector="nccl", options={"backend": "gloo", "timeout_s": 2})


@pytest.mark.parametrize(
    "field,value",
    [
        ("lease_s", 0),
        ("kv_role", "leader"),
        ("failure_policy", "retry"),
        ("side_channel_port", -1),
        ("bogus", 1),
    ],
)
def test_fields_are_checked(field: str, value: object) -> None:
    _error(**{field: value})


def test_out_of_tree_connector_by_module_path() -> None:
    config = KVTransferConfig(
        connector="example",
        options={"depth": 3},
        module_path="kvc_example_connector:ExampleConnector",
    )
    connector = create_connector(config, KVConnectorRole.WORKER, INFO)
    assert type(connector).__name__ == "ExampleConnector"
    assert connector.options.depth == 3
    assert "example" in known_connectors()
    assert "unknown option 'width'" in _error(connector="example", options={"width": 1})


def test_module_path_errors() -> None:
    assert "is not a KVConnectorBase subclass" in _error(
        connector="not-one", module_path="kvc_example_connector:NotAConnector"
    )
    assert "cannot import 'no_such_module_here'" in _error(
        connector="missing", module_path="no_such_module_here:Thing"
    )
    assert "package.module:Class" in _error(connector="bad-format", module_path="no_colon")
    assert "already registered" in _error(
        connector="nixl", module_path="kvc_example_connector:ExampleConnector"
    )
    with pytest.raises(ValueError, match="already registered"):
        register_connector("redis", "elsewhere:Redis")
    assert not {"not-one", "missing", "bad-format"} & set(known_connectors())


def test_noop_connector_does_nothing() -> None:
    for role in KVConnectorRole:
        connector = create_connector(KVTransferConfig(), role, INFO)
        assert isinstance(connector, NoOpConnector)
        req = SimRequest("r", [1, 2, 3], {"do_remote_prefill": True}, all_token_ids=[1, 2, 3])
        assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
        connector.update_state_after_alloc(req, [0], 0)
        meta = connector.build_connector_meta()
        assert type(meta) is KVConnectorMetadata
        assert connector.request_finished(req, [0]) == (False, None)
        connector.start_load_kv(meta)
        connector.save_kv(meta)
        assert connector.get_finished() == (set(), set(), {})
        connector.shutdown()


def test_engine_info_is_checked() -> None:
    with pytest.raises(ValueError, match="positive"):
        EngineInfo(
            engine_id="e",
            block_size=0,
            num_blocks=1,
            block_nbytes=1,
            model_fingerprint="f",
            device="cpu",
        )


def test_block_range() -> None:
    assert list(block_range(8, 6, 4)) == [2, 3]  # the diagram in layout.py
    assert list(block_range(0, 50, 16)) == [0, 1, 2, 3]
    assert list(block_range(16, 32, 16)) == [1, 2]
    assert list(block_range(16, 0, 16)) == []


def test_contiguous_runs() -> None:
    assert contiguous_runs([3, 4, 5, 9, 10], [7, 8, 9, 1, 2]) == [(3, 7, 3), (9, 1, 2)]
    assert contiguous_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert contiguous_runs([], []) == []
    with pytest.raises(ValueError):
        contiguous_runs([1], [])


def test_first_mismatch() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1


def test_prometheus_collector_exposes_stats() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    stats = KVTransferStats()
    stats.record(0.5, 4096, 4, loaded=True)
    stats.num_failed_transfers += 1
    stats.expired_leases += 2
    registry = CollectorRegistry()
    registry.register(KVTransferCollector(lambda: {"nixl": stats}))
    text = generate_latest(registry).decode()
    assert 'splitserve:kv_transfer_bytes_loaded_total{connector="nixl"} 4096.0' in text
    assert 'splitserve:kv_transfer_expired_leases_total{connector="nixl"} 2.0' in text
    assert 'splitserve:kv_transfer_failed_total{connector="nixl"} 1.0' in text
    assert 'splitserve:kv_transfer_seconds_total{connector="nixl"} 0.5' in text
    assert stats.mean_transfer_seconds == 0.5
