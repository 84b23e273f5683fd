"""pagedllm: an LLM inference and serving engine with the architecture of vLLM V1.

Public API: `LLM` (offline), `SamplingParams`, `StructuredOutputsParams`, `RequestOutput`, `CompletionOutput`,
`PoolingParams` (pooling models), `LoRARequest` (adapters), `BeamSearchParams` (`LLM.beam_search`).

The names are imported on first use (PEP 562), not with the package: `import pagedllm.x` for a light module (the
CLI's argument parsing, the engine-core launcher) must not pay for torch and transformers, so that `pagedllm serve`
can start the engine-core process before the front end imports them.
"""

from typing import TYPE_CHECKING, Any

from pagedllm.logger import configure_logging

configure_logging()

if TYPE_CHECKING:
    from pagedllm.engine.llm import LLM
    from pagedllm.lora.request import LoRARequest
    from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

_EXPORTS = {
    "LLM": "pagedllm.engine.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "PoolingParams": "pagedllm.pooling_params",
    "LoRARequest": "pagedllm.lora.request",
    "BeamSearchParams": "pagedllm.sampling_params",
}

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestOutputKind",
    "PoolingParams",
    "LoRARequest",
    "BeamSearchParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
