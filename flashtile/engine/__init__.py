"""flashtile.engine: an LLM inference engine on flashtile's attention (vLLM's API).

    from flashtile.engine import LLM, SamplingParams
"""

from flashtile.engine.llm import LLM
from flashtile.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flashtile.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
