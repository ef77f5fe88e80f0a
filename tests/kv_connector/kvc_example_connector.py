"""An out-of-tree connector, loaded by `module_path` in test_config.py."""

from __future__ import annotations

from pydantic import Field

from splitserve.kv_connector.base import NoOpConnector
from splitserve.kv_connector.config import ConnectorOptions


class ExampleOptions(ConnectorOptions):
    depth: int = Field(default=1, gt=0)
    """How deep the example goes."""


class ExampleConnector(NoOpConnector):
    Options = ExampleOptions


class NotAConnector:
    pass
