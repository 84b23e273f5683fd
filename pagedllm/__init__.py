"""pagedllm: an LLM inference and serving engine with the architecture of vLLM V1.

Public API: `LLM` (offline), `SamplingParams`, `RequestOutput`, `CompletionOutput`.
"""

from pagedllm.logger import configure_logging

configure_logging()

from pagedllm.engine.llm import LLM  # noqa: E402
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]
__version__ = "0.1.0"
