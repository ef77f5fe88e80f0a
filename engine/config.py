"""Engine configuration: frozen, validated pydantic models, and YAML loading.

Every field that a user can set lives here, with a docstring-style description, so that
`LLM(...)`, `splitserve serve --flag` and the fleet YAML files share one schema. Models are
frozen: a config is a value, never mutated after validation; derived values are properties.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from splitserve.kv_connector.config import KVTransferConfig

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str) -> int:
    """`"512MiB"`, `"1.5 GiB"`, `"200MB"` or an int → bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse {value!r} as a size (examples: 536870912, '512MiB', '2GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    model: str
    """Local HF-format model directory (config.json, *.safetensors, tokenizer.json)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute/weight dtype; `auto` takes `torch_dtype` from config.json."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Longest prompt + output in tokens; defaults to the model's max_position_embeddings."""
    served_model_name: str | None = None
    """Name clients use in `model`; defaults to the directory name."""

    @field_validator("model")
    @classmethod
    def _model_dir_exists(cls, v: str) -> str:
        path = Path(v).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model directory {v!r} has no config.json (make one with "
                "`python scripts/make_tiny_model.py --out DIR`)"
            )
        return str(path)

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def hf_config(self) -> dict[str, Any]:
        return json.loads((Path(self.model) / "config.json").read_text())


class CacheConfig(_Frozen):
    block_size: Literal[8, 16, 32, 64, 128] = 16
    """Tokens per KV block."""
    kv_cache_memory: int = Field(default=512 * 2**20, gt=0)
    """Bytes given to the KV cache; the block count is derived from it (accepts '512MiB')."""
    num_blocks: int | None = Field(default=None, gt=0)
    """Override the derived block count (tests use this to force preemption)."""
    enable_prefix_caching: bool = True

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_memory(cls, v: Any) -> int:
        return parse_bytes(v)


class SchedulerConfig(_Frozen):
    max_num_seqs: int = Field(default=256, gt=0)
    """Most requests in one batch."""
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    """Token budget of one step; prompts longer than the budget are chunked. Unset: 2048 on
    CUDA, 1024 on CPU (see `token_budget`)."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """Waiting-queue order; `priority`: lower value first, then arrival."""
    enable_chunked_prefill: bool = True
    max_waiting: int = Field(default=4096, gt=0)
    """Bound of the waiting queue; the server answers 503 past it."""

    def token_budget(self, device_type: str, max_model_len: int) -> int:
        """The step budget for this device when none was set.

        On CPU a step's GEMMs already run near peak at 1024 tokens, and a smaller budget lets a
        burst of new prompts reach their first token sooner while the batch keeps decoding:
        serving the tiny model at 64 concurrent requests here, 1024 against 2048 gave TTFT p50
        319–461 vs 431–726 ms at the same throughput (1707–1793 vs 1698–1755 tok/s, three runs
        each). GPUs want larger GEMMs. Without chunked prefill a whole prompt must fit.
        """
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if device_type == "cuda" else 1024
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        return budget


class EngineConfig(_Frozen):
    model: ModelConfig
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    """`auto`: Triton kernels on CUDA; on CPU the C++ decode kernel (`cpu`, built on first use)
    or, if it cannot be built, plain PyTorch (`torch`). `triton` on CPU runs the kernels in the
    Triton interpreter (set TRITON_INTERPRET=1 before start; for testing only: slow)."""
    num_threads: int | None = Field(default=None, gt=0)
    """torch intra-op threads of the engine core (default: torch's choice)."""
    seed: int = 0
    """Seed of the unseeded sampling stream."""
    engine_id: str | None = None
    """Stable id of this instance (for KV transfer); random when unset."""

    @model_validator(mode="after")
    def _check_budget(self) -> EngineConfig:
        s = self.scheduler
        if not s.enable_chunked_prefill and self.model.max_model_len is not None:
            if s.max_num_batched_tokens is not None and (
                s.max_num_batched_tokens < self.model.max_model_len
            ):
                raise ValueError(
                    "scheduler.max_num_batched_tokens must be >= model.max_model_len "
                    "when chunked prefill is disabled"
                )
        return self

    @classmethod
    def from_flat(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM-style flat keyword arguments (`LLM(model=..., block_size=...)`)."""
        sections: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            for name, section in (("model", ModelConfig), ("cache", CacheConfig),
                                  ("scheduler", SchedulerConfig)):
                if key in section.model_fields:
                    sections[name][key] = value
                    break
            else:
                if key not in cls.model_fields or key in sections:
                    raise ValueError(f"unknown engine argument {key!r}")
                top[key] = value
        return build_config(cls, {**sections, **top})


def format_validation_error(err: ValidationError, source: str = "") -> str:
    """One line per problem, each naming the field path: `cache.block_size: ...`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}")
    where = f" in {source}" if source else ""
    return f"invalid configuration{where}: " + "; ".join(lines)


def build_config(model_cls: type[BaseModel], data: dict[str, Any], source: str = "") -> Any:
    """Validate `data`, turning pydantic's error into a ValueError that names the field."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        raise ValueError(format_validation_error(err, source)) from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: invalid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data
