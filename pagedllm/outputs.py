"""What callers receive: RequestOutput and CompletionOutput, with vLLM's field names.

`logprobs` is one dict per generated token (token id -> Logprob), holding the sampled token and the top-N;
`prompt_logprobs` the same per prompt position, with None for the first (nothing predicts it).
Pooling models' results: PoolingRequestOutput (raw tensor) and its typed forms (embedding, classification, score),
as vLLM's classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones, seen from the front end."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)


# ---- pooling (vLLM's classes: pooling models' results) ---------------------------------------------------------


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's raw result: a float32 torch tensor ([hidden], [num_labels], or [tokens, hidden])."""

    data: Any

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"


@dataclass(slots=True)
class PoolingRequestOutput:
    """The result of one pooling request. `outputs` is one object (not a list, unlike RequestOutput.outputs): a
    PoolingOutput, or for the typed subclasses an EmbeddingOutput, ClassificationOutput or ScoringOutput."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    prompt: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        if output.data.dim() != 1:
            raise ValueError(f"an embedding is one vector; the pooled data has shape {tuple(output.data.shape)}")
        return EmbeddingOutput(output.data.tolist())


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @staticmethod
    def from_base(output: PoolingOutput) -> ClassificationOutput:
        if output.data.dim() != 1:
            raise ValueError(f"class scores are one vector; the pooled data has shape {tuple(output.data.shape)}")
        return ClassificationOutput(output.data.tolist())


@dataclass(slots=True)
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> ScoringOutput:
        data = output.data.squeeze()
        if data.dim() != 0:
            raise ValueError(f"a score is one number; the pooled data has shape {tuple(output.data.shape)}")
        return ScoringOutput(float(data.item()))


def _typed(kind: Any) -> Any:
    """`from_base(request_output)` of a typed PoolingRequestOutput: the same request, its output as `kind`."""

    def from_base(cls: Any, request_output: PoolingRequestOutput) -> Any:
        return cls(
            request_output.request_id,
            kind.from_base(request_output.outputs),
            request_output.prompt_token_ids,
            request_output.num_cached_tokens,
            request_output.finished,
            request_output.prompt,
        )

    return classmethod(from_base)


class EmbeddingRequestOutput(PoolingRequestOutput):
    """A PoolingRequestOutput whose `outputs` is an EmbeddingOutput (`from_base` converts)."""

    __slots__ = ()
    from_base = _typed(EmbeddingOutput)


class ClassificationRequestOutput(PoolingRequestOutput):
    """A PoolingRequestOutput whose `outputs` is a ClassificationOutput (`from_base` converts)."""

    __slots__ = ()
    from_base = _typed(ClassificationOutput)


class ScoringRequestOutput(PoolingRequestOutput):
    """A PoolingRequestOutput whose `outputs` is a ScoringOutput (`from_base` converts)."""

    __slots__ = ()
    from_base = _typed(ScoringOutput)
