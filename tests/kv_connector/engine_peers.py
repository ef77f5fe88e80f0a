"""Real engines (`LLM`) in spawned processes, driven over a pipe, for engine-level KV transfer
tests (a uniquely named module: tests/ has no packages).

One process may host several engines (each its own `LLM`: model, KV cache, both connector
halves), named by the caller; engines are cheap once torch is imported. A command runs on one
engine and answers when it is done. `send` + `recv` let the test start a command in one process
(a producer's `wait_for_transfers`, which steps it so it serves pulls and frees blocks) and run
another meanwhile (the consumer's `generate`).
"""

from __future__ import annotations

import time
from typing import Any

from splitserve.kv_connector.remote_engine import PipeProcess, serve_calls

ENGINE_ARGS: dict[str, Any] = {"num_threads": 1, "kv_cache_memory": "16MiB", "max_model_len": 512}


def _output(out: Any) -> dict[str, Any]:
    c = out.outputs[0]
    return {
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
        "error": out.error,
        "num_cached_tokens": out.num_cached_tokens,
        "kv_transfer_params": out.kv_transfer_params,
    }


class _Host:
    """The child side: engines by name, and the commands the parent sends."""

    def __init__(self, model: str, engines: dict[str, dict[str, Any]]) -> None:
        from splitserve.engine.llm import LLM

        self.llms = {
            name: LLM(model, kv_transfer=kv, **ENGINE_ARGS) for name, kv in engines.items()
        }

    def generate(
        self,
        name: str,
        prompts: list[list[int]],
        sampling: dict[str, Any],
        kv_transfer_params: list[dict[str, Any] | None] | None,
        timeout_s: float = 40.0,
        num_prior_output_tokens: int = 0,
    ) -> list[dict[str, Any]]:
        """`LLM.generate`, bounded: past `timeout_s` it raises TimeoutError between two engine
        steps (LLM.generate then aborts its requests) and steps until the aborted requests'
        transfers are over, so a hang fails the test without wedging this process."""
        from splitserve.engine.request import SamplingParams

        llm = self.llms[name]
        engine, step = llm.engine, llm.engine.step
        deadline = time.monotonic() + timeout_s

        def bounded_step() -> list:
            if time.monotonic() > deadline:
                raise TimeoutError(f"generate on {name} did not finish in {timeout_s}s")
            return step()

        engine.step = bounded_step
        try:
            outs = llm.generate(
                [
                    {"prompt_token_ids": p, "num_prior_output_tokens": num_prior_output_tokens}
                    for p in prompts
                ],
                SamplingParams(**sampling),
                use_tqdm=False,
                kv_transfer_params=kv_transfer_params,
            )
        except TimeoutError:
            del engine.step
            drain = time.monotonic() + 30
            while engine.has_work() and time.monotonic() < drain:
                engine.step()
                time.sleep(0.001)
            raise
        finally:
            engine.__dict__.pop("step", None)
        return [_output(o) for o in outs]

    def wait_for_transfers(self, name: str, timeout_s: float) -> dict[str, Any]:
        started = time.monotonic()
        ok = self.llms[name].wait_for_transfers(timeout_s)
        return {"ok": ok, "seconds": time.monotonic() - started}

    def step(self, name: str) -> None:
        self.llms[name].engine.step()

    def corrupt(self, name: str, block_ids: list[int]) -> None:
        """Change the KV bytes of held blocks under their lease (after the checksums)."""
        kv = self.llms[name].engine.model_runner.kv_cache
        for b in block_ids:
            kv[b].add_(1.0)

    def stats(self, name: str) -> dict[str, Any]:
        llm = self.llms[name]
        return {**llm.stats(), "connector": llm.engine.connector_worker.stats.as_dict()}

    def all_stats(self) -> dict[str, dict[str, Any]]:
        return {name: self.stats(name) for name in self.llms}

    def shutdown(self) -> None:
        for llm in self.llms.values():
            llm.shutdown()


def _serve(conn: Any, model: str, engines: dict[str, dict[str, Any]]) -> None:
    serve_calls(conn, lambda: _Host(model, engines))


class EngineProcess(PipeProcess):
    """Engines in their own (spawned) process. Start several, then `ready()` each."""

    def __init__(self, label: str, model: str, engines: dict[str, dict[str, Any]]) -> None:
        super().__init__(label, _serve, (model, engines))

    def ready(self, timeout: float = 180) -> EngineProcess:
        super().ready(timeout)
        return self
