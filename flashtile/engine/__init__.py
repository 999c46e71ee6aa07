"""flashtile.engine: an LLM inference engine on flashtile's attention (vLLM's API).

    from flashtile.engine import LLM, SamplingParams

The names load on first use, so that ``flashtile`` commands that do not need the engine's
dependencies (safetensors, tokenizers) do not import them.
"""

import importlib

_EXPORTS = {"LLM": "llm", "SamplingParams": "sampling_params", "RequestOutput": "outputs",
            "CompletionOutput": "outputs", "RequestMetrics": "outputs",
            "BeamSearchParams": "beam_search"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashtile.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flashtile.engine.{_EXPORTS[name]}"), name)
