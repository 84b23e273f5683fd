"""POST /score, /v1/score and /rerank, /v1/rerank, /v2/rerank: scores of text pairs from a pooling model.

Contract:
* A cross-encoder (a model serving "classify" with one label) scores each pair on its own: the tokenizer's pair
  encoding (truncated longest-first to `truncate_prompt_tokens`, or to max_model_len), task "score", the head's
  output after its activation (sigmoid; `use_activation` false: the raw logit). A classifier of several labels is
  a 400 ("Score API is only enabled for num_labels == 1"). An embedder embeds every distinct text once (task
  "embed") and scores a pair by the cosine similarity of its two embeddings; usage counts each embedded text once.
* /score pairs `text_1` with `text_2` as `LLM.score` does (`score_pairs`: 1 -> 1, 1 -> N, N -> N; a 400
  otherwise). Rerank (Jina's and Cohere's shape) scores `query` against each document (a string or {"text": ...})
  and answers the results sorted by relevance, best first, cut to `top_n` (0, absent or at least the number of
  documents: all), each with its document unless `return_documents` is false.
* As for the other pooling routes: the model name (404), then the engine's checks (a generative model: a 400
  naming the runner), then every input, all before anything runs; all engine requests of one call are sent at
  once, and a failure or a client that goes away aborts the others.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.llm import cosine_score, score_pairs
from pagedllm.entrypoints.openai.protocol import (
    ActivationFields,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
    UsageInfo,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_embedding import PoolingServing
from pagedllm.outputs import ScoringRequestOutput
from pagedllm.pooling_params import PoolingParams


class OpenAIServingScore(PoolingServing):
    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        cross = self.check_score(request)
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as e:
            raise self.error_for(e, request) from e
        request_id = f"score-{random_uuid()}"
        scores, tokens = await self.score(pairs, cross, request, request_id, raw_request)
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens)
        body = ScoreResponse(id=request_id, model=self.model_name, data=data, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        cross = self.check_score(request)
        documents = [d if isinstance(d, str) else d.text for d in request.documents]
        try:
            pairs = score_pairs(request.query, documents)
        except ValueError as e:
            raise self.error_for(e, request) from e
        request_id = f"rerank-{random_uuid()}"
        scores, tokens = await self.score(pairs, cross, request, request_id, raw_request)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        top_n = request.top_n if request.top_n is not None and 0 < request.top_n < len(order) else len(order)
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=documents[i]) if request.return_documents else None,
                relevance_score=scores[i],
            )
            for i in order[:top_n]
        ]
        usage = RerankUsage(prompt_tokens=tokens, total_tokens=tokens)
        body = RerankResponse(id=request_id, model=self.model_name, usage=usage, results=results)
        return Response(body.model_dump_json(exclude_none=True), media_type="application/json")

    # ---- scoring ---------------------------------------------------------------------------------------------

    def check_score(self, request: ActivationFields) -> bool:
        """Whether the model scores as a cross-encoder (else: cosine of embeddings); a 400 for a generative model
        (the engine's message, naming the runner) or a classifier of several labels."""
        self.verify(PoolingParams(task="score"), request)
        mc = self.engine.model_config
        if "classify" not in mc.pooling_tasks:
            return False
        labels = int(getattr(mc.hf_config, "num_labels", 1))
        if labels != 1:
            raise self.error_for(
                ValueError(f"Score API is only enabled for num_labels == 1 (this model has {labels} labels)"), request
            )
        return True

    async def score(
        self,
        pairs: list[tuple[str, str]],
        cross: bool,
        request: ActivationFields,
        request_id: str,
        raw_request: Request,
    ) -> tuple[list[float], int]:
        """(the score of each pair, the prompt tokens the engine ran)."""
        if cross:
            params = self.activation_params("score", request)
            try:
                # The pair is cut here, longest first (a cut of the joined ids would lose the second text's end); the
                # engine's checks in `prepare` then refuse a cut longer than max_model_len.
                encode = self.engine.input_processor.encode_pair
                cut = request.truncate_prompt_tokens
                encoded = await self.off_loop(lambda: [encode(a, b, cut) for a, b in pairs])
            except Exception as e:
                raise self.error_for(e, request) from e
            params_list = [params.clone(token_type_split=split) for _, split in encoded]
            prompts = [{"prompt_token_ids": ids} for ids, _ in encoded]
            ids_list = await self.off_loop(self.prepare, prompts, params_list, request)
            outs = await self.run(ids_list, params_list, request_id, request, raw_request)
            scores = [ScoringRequestOutput.from_base(o).outputs.score for o in outs]
            return scores, sum(len(ids) for ids in ids_list)
        params = self.activation_params("embed", request)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        ids_list = await self.off_loop(self.prepare, texts, params, request)
        outs = await self.run(ids_list, params, request_id, request, raw_request)
        by_text = dict(zip(texts, outs))
        scores = [cosine_score(by_text[a], by_text[b]).outputs.score for a, b in pairs]
        return scores, sum(len(ids) for ids in ids_list)
