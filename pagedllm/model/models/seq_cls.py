"""Decoder models with a score head (`*ForSequenceClassification`: rerankers and classifiers built on Llama, Qwen2,
Qwen3): the causal decoder stack, and `score` [num_labels, hidden] (no bias) in place of the LM head. The pooling
runner pools the final-norm hidden states (the last token by default, as transformers picks the last non-pad
token) and `classify` applies the head."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.linear import ReplicatedLinear
from pagedllm.model.models.llama import LlamaForCausalLM
from pagedllm.model.models.qwen2 import Qwen2ForCausalLM
from pagedllm.model.models.qwen3 import Qwen3ForCausalLM


class _ScoreHead:
    default_pooling_type = "LAST"

    def _init_head(self, config: Any, dtype: torch.dtype, kernels: KernelDispatch | None) -> None:
        del self.lm_head  # type: ignore[attr-defined]
        self.tie_word_embeddings = False
        self.score = ReplicatedLinear(config.hidden_size, int(config.num_labels), False, dtype)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)


class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        self._init_head(config, dtype, kernels)


class Qwen2ForSequenceClassification(_ScoreHead, Qwen2ForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        self._init_head(config, dtype, kernels)


class Qwen3ForSequenceClassification(_ScoreHead, Qwen3ForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        self._init_head(config, dtype, kernels)
