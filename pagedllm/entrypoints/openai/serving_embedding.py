"""POST /v1/embeddings, POST /pooling and POST /classify: a pooling model's results through `AsyncLLM.encode`.

Contract:
* `input` is a string, a list of strings, a list of token ids or a list of token-id lists; each one is one engine
  request (ids `{request id}-{i}`), all sent at once so that the engine batches them. Results come back in input
  order, with `usage.prompt_tokens` the tokens of all inputs as the engine ran them (after truncation).
* Everything that can reject a request runs before anything is sent: the model name (404), then the engine's
  own checks of the task and its parameters (a generative model, a task the model does not serve, `dimensions`
  on a model without Matryoshka dimensions: 400 with the engine's message, which names the runner), then each
  input (empty, out of the vocabulary, longer than max_model_len without `truncate_prompt_tokens`: 400). A bad
  input rejects the whole request and nothing runs.
* If one input fails in the engine, or the client goes away, the others are aborted.
* /v1/embeddings answers OpenAI's shape (`encoding_format` "base64": each vector's little-endian float32 bytes,
  base64-encoded); /pooling the model's raw pooled states (task "encode": one vector, or one per token);
  /classify the class probabilities with the model's label of the likeliest class.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.input_processor import PromptType
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    ActivationFields,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    OpenAIBaseModel,
    PoolingInput,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    UsageInfo,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    merge_async_iterators,
    run_until_disconnected,
)
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams


class PoolingServing(OpenAIServing):
    """What the pooling handlers share: checks before anything runs, and running several inputs at once."""

    def verify(self, params: PoolingParams, request: OpenAIBaseModel) -> PoolingParams:
        """`params`, once the engine's check of the task and its parameters for the served model passed (a
        ValueError naming the runner for a generative model): a 400 before any input is looked at."""
        try:
            self.engine.input_processor.verify_pooling(params)
        except Exception as e:
            raise self.error_for(e, request) from e
        return params

    def params_for(self, request: OpenAIBaseModel, **fields: Any) -> PoolingParams:
        """The request's PoolingParams, checked for the served model (400 with the engine's message otherwise)."""
        try:
            params = PoolingParams(truncate_prompt_tokens=getattr(request, "truncate_prompt_tokens", None), **fields)
        except ValueError as e:
            raise self.error_for(e, request) from e
        return self.verify(params, request)

    def activation_params(self, task: str, request: ActivationFields) -> PoolingParams:
        """Classify and score: `use_activation` or its older names."""
        return self.params_for(
            request,
            task=task,
            use_activation=request.use_activation,
            softmax=request.softmax,
            activation=request.activation,
        )

    def parse_input(self, value: PoolingInput, field: str = "input") -> list[PromptType]:
        """The prompts of an `input` field: texts, or {"prompt_token_ids": [...]} for token ids."""
        if isinstance(value, str):
            return [value]
        if not value:
            raise OpenAIError(f"{field} must not be empty", 400, field)
        if isinstance(value[0], str):
            return list(value)  # type: ignore[arg-type]
        if isinstance(value[0], int):
            return [{"prompt_token_ids": list(value)}]  # type: ignore[arg-type]
        return [{"prompt_token_ids": list(ids)} for ids in value]  # type: ignore[union-attr]

    def prepare(
        self,
        prompts: Sequence[PromptType],
        params: PoolingParams | Sequence[PoolingParams],
        request: OpenAIBaseModel,
        add_special_tokens: bool = True,
    ) -> list[list[int]]:
        """Each prompt's token ids as the engine will run them (tokenized, lower-cased where the model says so,
        truncated), checked by the engine's own rules; the first bad one rejects the request (400)."""
        params_list = [params] * len(prompts) if isinstance(params, PoolingParams) else list(params)
        processor = self.engine.input_processor
        priority = int(getattr(request, "priority", 0))
        try:
            return [
                list(processor.process_pooling("check", p, pp, 0.0, priority, add_special_tokens)[1].prompt_token_ids)
                for p, pp in zip(prompts, params_list)
            ]
        except OpenAIError:
            raise
        except Exception as e:
            raise self.error_for(e, request) from e

    async def run(
        self,
        ids_list: Sequence[list[int]],
        params: PoolingParams | Sequence[PoolingParams],
        request_id: str,
        request: OpenAIBaseModel,
        raw_request: Request,
    ) -> list[PoolingRequestOutput]:
        """Send every prompt at once (ids `{request_id}-{i}`) and wait for all results, in order. A failure or a
        client that goes away aborts the unfinished ones."""
        self.check_engine()
        params_list = [params] * len(ids_list) if isinstance(params, PoolingParams) else list(params)
        priority = int(getattr(request, "priority", 0))
        call_tokens = sum(len(ids) for ids in ids_list)  # a short call's inputs take the engine's express lane
        gens = [
            # The ids are final (truncated already): the cut is not applied again.
            self.engine.encode(
                {"prompt_token_ids": ids},
                pp.clone(truncate_prompt_tokens=None, call_tokens=call_tokens),
                f"{request_id}-{i}",
                priority,
            )
            for i, (ids, pp) in enumerate(zip(ids_list, params_list))
        ]
        try:
            return await run_until_disconnected(self._collect(gens), raw_request)
        except (OpenAIError, ClientDisconnected):
            raise
        except Exception as e:
            raise self.error_for(e, request) from e

    async def _collect(self, gens: list) -> list[PoolingRequestOutput]:
        finals: list[PoolingRequestOutput | None] = [None] * len(gens)
        async for i, out in merge_async_iterators(*gens):
            if out.outputs.data.numel() == 0:
                raise OpenAIError(f"request {out.request_id} finished in the engine without a result", 500)
            finals[i] = out
        return finals  # type: ignore[return-value]

    @staticmethod
    def usage(outs: Sequence[PoolingRequestOutput]) -> UsageInfo:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return UsageInfo(prompt_tokens=n, total_tokens=n)


def encode_base64(data: Any) -> str:
    """A float tensor's little-endian float32 bytes, base64-encoded (what the openai client decodes)."""
    return base64.b64encode(np.ascontiguousarray(data.numpy(), dtype="<f4").tobytes()).decode()


def encode_vector(data: Any, encoding_format: str) -> Any:
    """A pooled result as the request wants it: nested lists of floats, or base64 (see `encode_base64`)."""
    return encode_base64(data) if encoding_format == "base64" else data.tolist()


class OpenAIServingEmbedding(PoolingServing):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        return await self._vectors(request, raw_request, "embed", "embd")

    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Response:
        return await self._vectors(request, raw_request, "encode", "pool")

    async def _vectors(
        self, request: EmbeddingRequest | PoolingRequest, raw_request: Request, task: str, prefix: str
    ) -> Response:
        """/v1/embeddings (task embed) and /pooling (task encode): one vector (or one per token) per input."""
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        params = self.params_for(request, task=task, dimensions=request.dimensions, normalize=request.normalize)
        prompts = self.parse_input(request.input)
        ids_list = await self.off_loop(self.prepare, prompts, params, request, request.add_special_tokens)
        request_id = f"{prefix}-{random_uuid()}"
        outs = await self.run(ids_list, params, request_id, request, raw_request)
        vectors = [encode_vector(o.outputs.data, request.encoding_format) for o in outs]
        usage = self.usage(outs)
        if task == "embed":
            data = [EmbeddingResponseData(index=i, embedding=v) for i, v in enumerate(vectors)]
            body: Any = EmbeddingResponse(id=request_id, model=self.model_name, data=data, usage=usage)
        else:
            pooled = [PoolingResponseData(index=i, data=v) for i, v in enumerate(vectors)]
            body = PoolingResponse(id=request_id, model=self.model_name, data=pooled, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def create_classify(self, request: ClassificationRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        params = self.activation_params("classify", request)
        prompts = self.parse_input(request.input)
        ids_list = await self.off_loop(self.prepare, prompts, params, request, request.add_special_tokens)
        request_id = f"classify-{random_uuid()}"
        outs = await self.run(ids_list, params, request_id, request, raw_request)
        id2label = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.view(-1).tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            label = id2label.get(best, id2label.get(str(best)))
            data.append(
                ClassificationData(
                    index=i, label=None if label is None else str(label), probs=probs, num_classes=len(probs)
                )
            )
        body = ClassificationResponse(id=request_id, model=self.model_name, data=data, usage=self.usage(outs))
        return Response(body.model_dump_json(), media_type="application/json")
