"""pagedllm: an LLM inference and serving engine with the architecture of vLLM V1.

Public API: `LLM` (offline), `SamplingParams`, `RequestOutput`, `CompletionOutput`.
"""

from pagedllm.engine.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]
__version__ = "0.1.0"
