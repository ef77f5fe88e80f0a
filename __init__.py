"""splitserve: disaggregated prefill/decode LLM serving.

The public offline API mirrors vLLM's so users can switch:

    from splitserve import LLM, SamplingParams
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import splitserve.kv_connector` does not pull in torch and the model code.
    if name == "LLM":
        from splitserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from splitserve.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
