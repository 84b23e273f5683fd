"""LLM: the offline front door. `generate()` and `chat()` block until every request is done.

`LLM(model=None, **engine_args)` builds the EngineConfig once (vLLM argument names), loads the tokenizer in
this process, and drives an engine core through a client. Results come back in input order. `generate` and `chat`
without sampling params run `get_default_sampling_params()`: SamplingParams' defaults, with the model's generation
config's values (--generation-config). An LLM lives as long as its last reference: dropping it stops its engine core
and the core's workers (the client's finalizer; nothing in it refers back to the LLM), as does `shutdown()`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.beam_search import BeamSearchOutput
from pagedllm.config import EngineConfig, engine_client_default
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.exceptions import EngineSleepingError
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.lora.request import LoRARegistry, LoRARequest, lora_errors
from pagedllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.reasoning import ReasoningParser
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.tokenizer import end_token_ids, eos_token_id, get_tokenizer

logger = logging.getLogger(__name__)


def make_client(engine_args: EngineArgs, kind: str) -> tuple[EngineConfig, Any]:
    """The engine config and a client of the engine core, not yet connected (call its `connect()`): 'mp' (the
    default) starts the core in its own process first, which loads the model while this process builds the config
    (and then the tokenizer); 'inproc' builds the core in this process (tests, debugging). A failure stops the
    core."""
    from pagedllm.engine.core_client import InprocClient, SyncMPClient

    if kind == "inproc":
        config = engine_args.create_engine_config()
        return config, InprocClient(config, engine_args)
    if kind != "mp":
        raise ValueError(f"engine_client must be 'mp' or 'inproc', got {kind!r}")
    client = SyncMPClient(None, engine_args, connect=False)
    try:
        return engine_args.create_engine_config(), client
    except BaseException:
        client.shutdown()
        raise


def start_front_end(
    mc: Any, client: Any, reasoning_parser: str | None = None, lora_enabled: bool = False, stream_interval: int = 1
) -> tuple[Any, InputProcessor, OutputProcessor]:
    """The front end's tokenizer and processors, loaded while the core process (started, not yet connected) loads
    the model; then the client connects. A failure stops the core (also a reasoning parser the tokenizer cannot
    serve: its end tag must be one token)."""
    try:
        tokenizer = get_tokenizer(mc)
        eos = eos_token_id(tokenizer, mc.hf_config)
        if reasoning_parser is not None:
            ReasoningParser.for_tokenizer(reasoning_parser, tokenizer)
        processors = (
            InputProcessor(mc, tokenizer, eos, lora_enabled, end_token_ids(tokenizer, mc, eos)),
            OutputProcessor(tokenizer, stream_interval),
        )
        client.connect()
    except BaseException:
        client.shutdown()
        raise
    return tokenizer, *processors


# vLLM's flags for fetching a model from the hub: accepted, and said to change nothing
HUB_FLAGS = ("download_dir", "revision", "code_revision", "tokenizer_revision", "hf_token")


def log_startup_notes(engine_args: EngineArgs, mc: Any) -> None:
    """What the front end says once at start-up about flags that change nothing or change request defaults."""
    if engine_args.trust_remote_code:
        logger.info(
            "--trust-remote-code: accepted for vLLM compatibility; pagedllm runs no code from the model folder (its "
            "architectures are built in)"
        )
    hub = [f"--{name.replace('_', '-')}" for name in HUB_FLAGS if getattr(engine_args, name) is not None]
    if hub:
        logger.info(
            "%s: accepted for vLLM compatibility; pagedllm downloads nothing (the model is the local file or folder "
            "given)",
            ", ".join(hub),
        )
    if mc.sampling_defaults and mc.sampling_defaults_source == "--override-generation-config":
        logger.info("Default sampling parameters set by --override-generation-config: %s", mc.sampling_defaults)
    elif mc.sampling_defaults:
        logger.warning(
            "Default sampling parameters have been overridden by the model's Hugging Face generation config "
            "recommended from the model creator (%s): %s. If this is not intended, relaunch with "
            "`--generation-config vllm`.",
            mc.sampling_defaults_source,
            mc.sampling_defaults,
        )


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs of a score call: 1 -> 1, 1 -> N (text_1 against each) or N -> N (in order)."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side")
    if not all(isinstance(t, str) for t in first + second):
        raise ValueError("score takes texts (strings) on both sides")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(f"score pairs 1 -> N or N -> N texts; got {len(first)} against {len(second)}")
    return list(zip(first, second))


def cosine_score(a: PoolingRequestOutput, b: PoolingRequestOutput) -> ScoringRequestOutput:
    """The cosine similarity of two embedding outputs, as a ScoringRequestOutput of the pair (tokens: both)."""
    import torch.nn.functional as F

    from pagedllm.outputs import PoolingOutput

    score = F.cosine_similarity(a.outputs.data.view(1, -1), b.outputs.data.view(1, -1)).view(1)
    pair = PoolingRequestOutput(
        f"{a.request_id}_{b.request_id}", PoolingOutput(score), a.prompt_token_ids + b.prompt_token_ids
    )
    return ScoringRequestOutput.from_base(pair)


def _check_one_label(mc: Any) -> None:
    labels = int(getattr(mc.hf_config, "num_labels", 1))
    if labels != 1:
        raise ValueError(f"Score API is only enabled for num_labels == 1 (this model has {labels} labels)")


def check_sleep_level(level: object) -> int:
    """A sleep level (1 or 2); ValueError naming any other value."""
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    return int(level)  # type: ignore[arg-type]


class LLM:
    """An offline engine: `LLM().generate("Hello")` runs the default model."""

    def __init__(self, model: str | None = None, *, engine_client: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        # The core process builds its config from the same arguments (with the KV budget fixed in them).
        self.engine_args = EngineArgs(model=model, **kwargs).for_engine_core()
        self.config, self.engine_core = make_client(self.engine_args, engine_client or engine_client_default())
        mc = self.config.model_config
        log_startup_notes(self.engine_args, mc)
        self.tokenizer, self.input_processor, self.output_processor = start_front_end(
            mc, self.engine_core, self.engine_args.reasoning_parser, self.engine_args.enable_lora
        )
        self._counter = itertools.count()
        self.loras = LoRARegistry()  # the adapters the engines hold
        self._sleep_level = 0
        self._enqueued: list[str] = []  # enqueue's request ids, not yet collected by wait_for_completion
        self._finished: dict[str, Any] = {}  # their outputs that came while another call ran the engine

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, engine_client: str | None = None) -> LLM:
        """The LLM of `engine_args` (vLLM's)."""
        return cls(engine_client=engine_client, **dataclasses.asdict(engine_args))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a call given none: SamplingParams' defaults, with the model's generation config's
        values where --generation-config supplies some (vLLM's)."""
        return SamplingParams(**self.config.model_config.get_diff_sampling_param())

    # ---- generation ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list: strings, token-id lists or {"prompt_token_ids": [...]} dicts.
        `lora_request`: the adapter of every prompt, or one per prompt (None: the base model)."""
        prompt_list, params_list, loras = self._generate_inputs(prompts, sampling_params, priority, lora_request)
        return self._run(prompt_list, params_list, priority, use_tqdm, add_special_tokens=True, loras=loras)

    def _generate_inputs(
        self, prompts: Any, sampling_params: Any, priority: list[int] | None, lora_request: Any
    ) -> tuple[list[PromptType], list[SamplingParams], list[LoRARequest | None] | None]:
        """`generate`'s (and `enqueue`'s) arguments as one prompt, params and adapter per prompt."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        return prompt_list, params_list, self._as_lora_list(lora_request, len(prompt_list))

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: the `params.beam_width` best sequences of each prompt, best first (beam_search.py)."""
        from pagedllm.beam_search import beam_search

        return beam_search(self, self._as_prompt_list(prompts), params, lora_request, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them (with `tools`, OpenAI-style function
        definitions, given to the template as in vLLM; `chat_template_kwargs`, the template's own variables such as
        Qwen3's `enable_thinking`), then generate."""
        prompts = self._chat_prompts(
            messages, chat_template, add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
            chat_template_content_format,
        )  # fmt: skip
        # The template already holds the special tokens (BOS etc.); do not add them twice.
        params_list, loras = self._chat_params(prompts, sampling_params, lora_request)
        return self._run(prompts, params_list, None, use_tqdm, add_special_tokens=False, loras=loras)

    def _chat_params(
        self, prompts: list[PromptType], sampling_params: Any, lora_request: Any
    ) -> tuple[list[SamplingParams], list[LoRARequest | None] | None]:
        """A chat call's (params per prompt, adapters per prompt)."""
        return self._as_params_list(sampling_params, len(prompts)), self._as_lora_list(lora_request, len(prompts))

    def _chat_prompts(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        content_format: str,
    ) -> list[PromptType]:
        """The prompt text of one conversation or of each of a list of them, through the chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = messages if isinstance(messages[0], list) else [messages]
        return [
            self.input_processor.apply_chat_template(
                conv,
                add_generation_prompt,
                chat_template,
                continue_final_message,
                tools,
                chat_template_kwargs=chat_template_kwargs,
                content_format=content_format,
            )
            for conv in conversations
        ]

    # ---- pooling models (--runner pooling) ---------------------------------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str = "encode",
    ) -> list[PoolingRequestOutput]:
        """The pooled states of each prompt (`pooling_task` "encode": the model's pooling, per token with pooling
        type ALL), or another task's raw results, as PoolingRequestOutputs (the data a float32 tensor)."""
        if self.config.model_config.runner != "pooling":
            raise ValueError(
                "LLM.encode() is only supported for pooling models. Try passing `--runner pooling` to use the model "
                "as a pooling model."
            )
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_pooling_list(pooling_params, len(prompt_list), pooling_task, truncate_prompt_tokens)
        return self._run(prompt_list, params_list, None, use_tqdm, add_special_tokens=True)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (normalised unless the model or the params say otherwise)."""
        self._require_task("embed", "Embedding API", "embed")
        outs = self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            pooling_task="embed",
        )  # fmt: skip
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (the model's head; softmax, or sigmoid for one label)."""
        self._require_task("classify", "Classification API", "classify")
        outs = self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            pooling_task="classify",
        )  # fmt: skip
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """The score of each pair (1 -> 1, 1 -> N, or N -> N texts): a cross-encoder's head on the pair, or the cosine
        similarity of an embedder's two embeddings."""
        if self.config.model_config.runner != "pooling":
            raise ValueError("LLM.score() is only supported for pooling models (--runner pooling)")
        pairs = score_pairs(data_1, data_2)
        params = pooling_params or PoolingParams()
        if "classify" in self.config.model_config.pooling_tasks:
            _check_one_label(self.config.model_config)
            prompts, params_list = [], []
            for a, b in pairs:
                ids, split = self.input_processor.encode_pair(a, b, truncate_prompt_tokens)
                prompts.append({"prompt_token_ids": ids})
                params_list.append(params.clone(task="score", token_type_split=split))
            outs = self._run(prompts, params_list, None, use_tqdm, add_special_tokens=False)
            return [ScoringRequestOutput.from_base(o) for o in outs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embeds = self.encode(
            texts, params.clone(task=None), truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            pooling_task="embed",
        )  # fmt: skip
        by_text = dict(zip(texts, embeds))
        return [cosine_score(by_text[a], by_text[b]) for a, b in pairs]

    def _require_task(self, task: str, api: str, convert: str) -> None:
        mc = self.config.model_config
        if mc.runner != "pooling":
            raise ValueError(
                f"{api} is not supported by this model: it runs as a generative model (--runner generate). Try "
                f"`--runner pooling --convert {convert}`."
            )
        if task not in mc.pooling_tasks:
            raise ValueError(
                f"{api} is not supported by this model. Try converting the model using `--convert {convert}`."
            )

    def _as_pooling_list(
        self, params: Any, n: int, task: str, truncate_prompt_tokens: int | None
    ) -> list[PoolingParams]:
        if params is None or isinstance(params, PoolingParams):
            params = [params or PoolingParams()] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} pooling params for {n} prompts")
        out = []
        for p in params:
            if not isinstance(p, PoolingParams):
                raise ValueError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
            if truncate_prompt_tokens is not None:
                p = p.clone(truncate_prompt_tokens=truncate_prompt_tokens)
            out.append(p if p.task is not None else p.clone(task=task))
        return out

    def _as_prompt_list(self, prompts: Any) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        if isinstance(prompts, Sequence):
            if not prompts:
                raise ValueError("prompts is empty")
            return list(prompts)
        raise ValueError(f"unsupported prompts type {type(prompts).__name__}")

    def _as_params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _as_lora_list(self, lora_request: Any, n: int) -> list[LoRARequest | None] | None:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return None if lora_request is None else [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora requests for {n} prompts")
        return loras

    def _run(
        self,
        prompts: list[PromptType],
        params_list: Sequence[SamplingParams | PoolingParams],
        priority: list[int] | None,
        use_tqdm: bool,
        add_special_tokens: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[Any]:
        ids = self._submit(prompts, params_list, priority, add_special_tokens, loras)
        done = self._drain(set(ids), use_tqdm)
        return [done.pop(i) for i in ids]

    def _submit(
        self,
        prompts: list[PromptType],
        params_list: Sequence[SamplingParams | PoolingParams],
        priority: list[int] | None,
        add_special_tokens: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Check every prompt, then hand them all to the engine; their request ids, in order."""
        if self._sleep_level:
            raise EngineSleepingError(f"the engine is asleep (level {self._sleep_level}): call LLM.wake_up() first")
        # Validate everything first: a bad prompt rejects the call before any request enters the engine.
        now = time.time()
        staged = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            if isinstance(params, SamplingParams):
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            request_id = str(next(self._counter))
            lora = loras[i] if loras else None
            text, req = self.input_processor.process(
                request_id, prompt, params, now, priority[i] if priority else 0, add_special_tokens, lora
            )
            staged.append((text, req))
        for lora in {lr.lora_int_id: lr for lr in loras or () if lr is not None}.values():
            self.add_lora(lora)  # loaded in the engines before its first request
        for text, req in staged:
            self._add(text, req)
        return [req.request_id for _, req in staged]

    def _drain(self, want: set[str], use_tqdm: bool) -> dict[str, Any]:
        """Run the engine until every request in `want` has finished; their outputs by request id. Requests of
        `enqueue` that finish meanwhile keep their outputs for `wait_for_completion`."""
        results = {i: self._finished.pop(i) for i in list(want) if i in self._finished}
        queued = set(self._enqueued)
        bar = tqdm(total=len(want), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        bar.update(len(results))
        try:
            while len(results) < len(want) and self.output_processor.has_unfinished_requests():
                outputs = self.engine_core.get_output()
                processed = self.output_processor.process_outputs(outputs.outputs)
                self.engine_core.abort_requests(processed.reqs_to_abort)
                for ro in processed.request_outputs:
                    if not ro.finished:
                        continue
                    if ro.request_id in want:
                        results[ro.request_id] = ro
                        bar.update(1)
                    elif ro.request_id in queued:
                        self._finished[ro.request_id] = ro
        except BaseException:
            # Leave the engine clean for the next call: nothing of this batch, nor of what was enqueued, keeps running.
            self.engine_core.abort_requests(
                self.output_processor.abort_requests(list(self.output_processor.request_states))
            )
            if self._enqueued:
                logger.warning("%d enqueued requests were aborted with this call", len(self._enqueued))
            self._enqueued.clear()
            self._finished.clear()
            raise
        finally:
            bar.close()
        return results

    # ---- requests queued now, collected later (vLLM's enqueue API) --------------------------------------

    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[str]:
        """Hand prompts to the engine without waiting for them (as `generate` takes them); their request ids.
        `wait_for_completion` collects the outputs; a `generate` call meanwhile runs them too."""
        prompt_list, params_list, loras = self._generate_inputs(prompts, sampling_params, priority, lora_request)
        ids = self._submit(prompt_list, params_list, priority, True, loras)
        self._enqueued += ids
        return ids

    def enqueue_chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[str]:
        """`chat`'s conversations handed to the engine without waiting; their request ids (`wait_for_completion`)."""
        prompts = self._chat_prompts(
            messages, chat_template, add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
            chat_template_content_format,
        )  # fmt: skip
        params_list, loras = self._chat_params(prompts, sampling_params, lora_request)
        ids = self._submit(prompts, params_list, None, False, loras)
        self._enqueued += ids
        return ids

    def wait_for_completion(
        self, output_type: type | tuple[type, ...] | None = None, *, use_tqdm: bool = True
    ) -> list[Any]:
        """Run the engine until every enqueued request has finished; their outputs in the order they were enqueued
        (then forgotten). `output_type`: the class(es) every output must be (a TypeError otherwise)."""
        ids = list(self._enqueued)
        done = self._drain(set(ids), use_tqdm)
        outputs = [done.pop(i) for i in ids]
        if output_type is not None:
            wrong = [type(o).__name__ for o in outputs if not isinstance(o, output_type)]
            if wrong:  # the outputs stay for a call that asks for their type
                self._finished.update(zip(ids, outputs))
                raise TypeError(f"wait_for_completion: expected {output_type}, got {wrong[0]}")
        self._enqueued = []  # all of them collected (nothing enqueues while this call runs the engine)
        return outputs

    def _add(self, prompt_text: str | None, req: EngineCoreRequest) -> None:
        engine = None  # the n children of a request share an engine (and its prefix cache)
        for child in self.output_processor.add_engine_request(prompt_text, req):
            engine = self.engine_core.add_request(child, engine)

    # ---- LoRA adapters (--enable-lora) -----------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in the engines (False when it is loaded); ValueError naming what is wrong with it."""
        self.input_processor.verify_lora(lora_request)
        if not self.loras.needs_loading(lora_request):
            return False
        with lora_errors():
            self.engine_core.call_utility_all("add_lora", lora_request)
        self.loras.added(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unload adapter `lora_id` (requests using it finish first); False when it was not loaded."""
        if self.loras.removed(lora_id) is None:
            return False
        return any(self.engine_core.call_utility_all("remove_lora", lora_id))

    def list_loras(self) -> list[int]:
        """The ids of the adapters the engines hold."""
        return sorted(set().union(*self.engine_core.call_utility_all("list_loras")))

    # ---- sleep mode ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory without stopping it (vLLM's sleep mode): level 1 frees the KV cache and sets the
        weights aside in a temporary file, for a fast `wake_up`; level 2 stops the workers (wake_up loads the model
        again). Generating while asleep raises EngineSleepingError."""
        check_sleep_level(level)
        self.engine_core.call_utility_all("sleep", level)
        self._sleep_level = max(self._sleep_level, level)

    def wake_up(self) -> None:
        """Back from `sleep`: the same outputs as before it; the prefix cache starts empty."""
        self.engine_core.call_utility_all("wake_up")
        self._sleep_level = 0

    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    # ---- utilities ----------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return all(self.engine_core.call_utility_all("reset_prefix_cache"))

    def check_invariants(self) -> dict[str, Any]:
        """Verify the KV block pools (raises AssertionError on corruption) and return their counts (summed over
        data-parallel engines, each engine's own under "engines" when there are several)."""
        from pagedllm.engine.core_client import merge_invariants

        return merge_invariants(self.engine_core.call_utility_all("check_invariants"))

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
