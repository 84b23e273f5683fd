"""Model path -> ModelConfig: an HF folder (config.json) or a single .gguf file (its metadata), or the name of a
model that PyPI packages ship (model/packaged.py: the file they assemble, served under that name).

For GGUF the transformers config is built from the file's metadata directly (a fraction of a second,
where transformers' own GGUF config path parses the whole file). Only local paths are accepted: nothing is
ever fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from typing import Any

from pagedllm.config import ModelConfig, cache_dir, dtype_name, json_object
from pagedllm.model.gguf_arch import ARCH_FIELDS, phi3_rope
from pagedllm.model.gguf_file import open_gguf
from pagedllm.model.packaged import PACKAGED_MODELS, packaged_model
from pagedllm.model.registry import MODEL_TYPES, resolve_architecture, resolve_runner, supported_architectures

logger = logging.getLogger(__name__)
QUANTIZATIONS = (None, "gguf", "none")
# Bumped when what the config cache holds changes.
_CONFIG_CACHE_FORMAT = 4  # 3: with general.sampling.*; 4: eot and eom token ids


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (token lists are skipped: they are large), its tensor names, and the
    values of its rope factor tensors where it has them."""
    import numpy as np

    reader = open_gguf(path)
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ):
            meta[key + ".len"] = len(fld.data)
            continue
        try:
            meta[key] = fld.contents()
        except Exception:  # unusual field types are not needed for the config
            continue
    meta["__tensor_names__"] = [t.name for t in reader.tensors]
    # Phi-3's LongRoPE factors are tensors, not metadata: a few dozen floats each, kept with the config
    factors = {t.name.split("_")[2].split(".")[0]: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        meta["__rope_factors__"] = {k: [float(x) for x in np.asarray(t.data).reshape(-1)] for k, t in factors.items()}
    return meta


def _config_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """The part of a GGUF file's metadata that `gguf_to_hf_config` reads (small, JSON-serialisable)."""
    arch = meta.get("general.architecture")
    keep = {"general.architecture", "tokenizer.ggml.tokens.len", "tokenizer.ggml.bos_token_id"}
    keep |= {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if key in keep or (arch and key.startswith(f"{arch}.")) or key.startswith("general.sampling."):
            if isinstance(value, (str, int, float, bool)) or value is None:
                out[key] = value
    # the head (tied or not), and the first layer's tensors (which biases and norms the layers have)
    out["__tensor_names__"] = [n for n in meta["__tensor_names__"] if n == "output.weight" or n.startswith("blk.0.")]
    if "__rope_factors__" in meta:
        out["__rope_factors__"] = meta["__rope_factors__"]
    return out


def gguf_config_metadata(path: str) -> dict[str, Any]:
    """The config metadata of the GGUF file at `path`, from the config cache when the file is unchanged (a stat, no
    parse: parsing the metadata takes seconds for a large vocabulary), else parsed and cached. The cache is keyed by
    the file's path, size, mtime and inode; an unreadable entry is parsed again, never fatal."""
    st = os.stat(path)
    version = importlib.metadata.version("pagedllm")
    key = f"{_CONFIG_CACHE_FORMAT}|{version}|{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    folder = os.path.join(cache_dir(), "configs")
    file = os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    try:
        with open(file) as f:
            cached = json.load(f)
        if isinstance(cached, dict) and cached.get("key") == key and isinstance(cached.get("metadata"), dict):
            return cached["metadata"]
    except (OSError, ValueError):
        pass
    meta = _config_metadata(read_gguf_metadata(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "metadata": meta}, f)
        os.replace(tmp, file)
    except OSError as e:  # a read-only cache only costs the parse next time
        logger.warning("could not cache the GGUF config at %s: %s", file, e)
    return meta


class GgufConfig:
    """A model config built from a GGUF file's metadata: its fields as attributes, under the names transformers'
    configs give them (the models read only these, with getattr defaults for the optional ones). Not transformers'
    PretrainedConfig: importing transformers cost about a second in the engine-core process at every start."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GgufConfig) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        return f"GgufConfig({self.__dict__!r})"


def _moe_llama(get: Any, fields: dict[str, Any]) -> dict[str, Any]:
    # Mixtral: llama's layers with experts as wide as feed_forward_length, top-k renormalised
    return dict(architectures=["MixtralForCausalLM"])


def _moe_qwen3(get: Any, fields: dict[str, Any]) -> dict[str, Any]:
    # Every layer sparse (llama.cpp builds no dense qwen3moe layer), experts expert_feed_forward_length wide, top-k
    # renormalised (llama.cpp hard-codes it for qwen3moe)
    inter = int(get("expert_feed_forward_length") or fields["intermediate_size"])
    return dict(moe_intermediate_size=inter, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _moe_olmoe(get: Any, fields: dict[str, Any]) -> dict[str, Any]:
    # OLMoE: top-k weights not renormalised (llama.cpp builds its experts so), no q/k/v clamp in the file
    return dict(norm_topk_prob=False, clip_qkv=None)


def _moe_gpt_oss(get: Any, fields: dict[str, Any]) -> dict[str, Any]:
    # gpt-oss: experts expert_feed_forward_length wide; layers alternate sliding window (even) and full attention
    # (`attention.sliding_window_pattern`, 2 by default, as llama.cpp reads it); q/k/v/o biases; the clamped SwiGLU's
    # limit, which llama.cpp hard-codes (no key)
    layers, period = fields["num_hidden_layers"], int(get("attention.sliding_window_pattern") or 2)
    return dict(
        intermediate_size=int(get("expert_feed_forward_length") or fields["intermediate_size"]),
        sliding_window=int(get("attention.sliding_window") or 128),
        layer_types=["sliding_attention" if i % period < period - 1 else "full_attention" for i in range(layers)],
        attention_bias=True,
        swiglu_limit=7.0,
    )


_MOE_ARCHS = {"llama": _moe_llama, "qwen3moe": _moe_qwen3, "olmoe": _moe_olmoe, "gpt-oss": _moe_gpt_oss}


def gguf_to_hf_config(meta: dict[str, Any]) -> GgufConfig:
    arch = meta.get("general.architecture")
    if arch not in MODEL_TYPES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported architectures: {', '.join(supported_architectures())}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    experts = int(get("expert_count") or 0)
    if experts and arch not in _MOE_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} with {experts} experts is not supported (mixture-of-experts GGUF files: "
            f"{', '.join(sorted(_MOE_ARCHS))}, with llama's experts run as Mixtral)"
        )
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = get("vocab_size") or meta.get("tokenizer.ggml.tokens.len")
    kwargs: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        max_position_embeddings=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        tie_word_embeddings="output.weight" not in meta["__tensor_names__"],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        architectures=[MODEL_TYPES[arch]],
    )
    for key in ("eot_token_id", "eom_token_id"):  # llama.cpp's end of turn and of message: they end a request too
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            kwargs[key] = int(meta[f"tokenizer.ggml.{key}"])
    if experts:  # what llama.cpp reads of a mixture-of-experts file (docs/moe-notes.md)
        used = get("expert_used_count")
        if not used:
            raise ValueError(f"GGUF architecture {arch!r} has {experts} experts but no {arch}.expert_used_count")
        kwargs.update(num_local_experts=experts, num_experts=experts, num_experts_per_tok=int(used))
        kwargs.update(_MOE_ARCHS[arch](get, kwargs))
    theta = float(get("rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling == "yarn":  # as llama.cpp runs it: its correction dims always rounded to whole dims (truncate)
        rope.update(
            rope_type="yarn",
            factor=float(get("rope.scaling.factor")),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            beta_fast=float(get("rope.scaling.yarn_beta_fast") or 32.0),
            beta_slow=float(get("rope.scaling.yarn_beta_slow") or 1.0),
            truncate=True,
        )
    elif scaling not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
    if arch in ARCH_FIELDS:  # what llama.cpp's hyper-parameters of this architecture say beyond Llama's
        kwargs.update(ARCH_FIELDS[arch](get, set(meta["__tensor_names__"]), kwargs))
    if arch == "phi3":
        rope = phi3_rope(get, meta.get("__rope_factors__"), rope)
    if arch == "gemma3":
        # As llama.cpp runs a gemma3 file: every sixth layer global (the file's rope base and scaling), the others
        # local over `attention.sliding_window` tokens with a rope base of 10,000; the attention scale 1/sqrt(head
        # size); GELU(tanh) MLP; the head tied to the embedding unless the file has an output tensor.
        layers = kwargs["num_hidden_layers"]
        kwargs.update(
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            sliding_window=int(get("attention.sliding_window", 512)),
            query_pre_attn_scalar=kwargs["head_dim"],
            hidden_activation="gelu_pytorch_tanh",
        )
        local = {"rope_type": "default", "rope_theta": 10000.0}
        return GgufConfig(
            **kwargs,
            model_type=arch,
            rope_theta=theta,
            rope_parameters={"full_attention": rope, "sliding_attention": local},
        )
    if arch == "gemma2":
        # As llama.cpp runs a gemma2 file: even layers local over `attention.sliding_window` tokens, odd ones global,
        # one rope; the soft-caps from the file (llama.cpp's defaults 50 and 30 where it has none); the attention
        # scale 1/sqrt(head size), but 1/sqrt(hidden / heads) for the 27B (46 layers), as llama.cpp scales it.
        layers = kwargs["num_hidden_layers"]
        scalar = hidden // heads if layers == 46 else kwargs["head_dim"]
        kwargs.update(
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            sliding_window=int(get("attention.sliding_window", 4096)),
            query_pre_attn_scalar=scalar,
            attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)),
            final_logit_softcapping=float(get("final_logit_softcapping", 30.0)),
            hidden_activation="gelu_pytorch_tanh",
        )
    return GgufConfig(**kwargs, model_type=arch, rope_theta=theta, rope_parameters=rope)


def _max_len(hf_config: Any, requested: int | None) -> int:
    """The engine's max_model_len: `requested`, at most the model's limit (its max_position_embeddings, or that
    times the factor of a dynamic NTK rope scaling, which transformers stretches past it); the limit by default."""
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if (rope.get("rope_type") or rope.get("type")) == "dynamic" and rope.get("factor"):
        if requested is None:
            return limit  # the unscaled context by default: identical to transformers there
        limit = int(limit * float(rope["factor"]))
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(f"max_model_len {requested} must be between 1 and the model's limit {limit}")
    return requested


def load_model_config(
    model: str,
    tokenizer: str | None = None,
    dtype: str = "float32",
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    seed: int = 0,
    quantization: str | None = None,
    runner: str = "auto",
    convert: str = "auto",
    pooler_config: str | dict[str, Any] | None = None,
    hf_overrides: str | dict[str, Any] | None = None,
) -> ModelConfig:
    """The ModelConfig of an HF folder or .gguf file. `quantization`: None (a GGUF runs as stored), "gguf" (the
    same, and the model must be a GGUF file) or "none" (a GGUF is de-quantized at load to `dtype`). `runner`,
    `convert` and `pooler_config` as vLLM's flags (model/registry.py resolve_runner, pooling_params.py).
    `hf_overrides` (vLLM's --hf-overrides, a dict or its JSON): config fields set over the model's own, before
    anything is derived from them (e.g. max_position_embeddings, rope_scaling)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of gguf, none")
    path = os.path.abspath(os.path.expanduser(model))
    gguf_file = None
    if not os.path.exists(path) and model in PACKAGED_MODELS:  # a packaged model's name: its file, served as the name
        return load_model_config(
            packaged_model(model),
            tokenizer,
            dtype,
            max_model_len,
            served_model_name or model,
            seed,
            quantization,
            runner,
            convert,
            pooler_config,
            hf_overrides,
        )
    if os.path.isfile(path) and path.endswith(".gguf"):
        hf_config = gguf_to_hf_config(gguf_config_metadata(path))
        tok_dir, gguf_file = os.path.split(path)
        default_name = os.path.splitext(gguf_file)[0]
    elif os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            if len(ggufs) == 1:
                return load_model_config(
                    os.path.join(path, ggufs[0]),
                    tokenizer,
                    dtype,
                    max_model_len,
                    served_model_name,
                    seed,
                    quantization,
                    runner,
                    convert,
                    pooler_config,
                    hf_overrides,
                )
            raise ValueError(f"model folder {model!r} has no config.json (and not exactly one .gguf file)")
        from transformers import AutoConfig

        if quantization == "gguf":
            raise ValueError(f"quantization 'gguf' needs a .gguf model file, got the folder {model!r}")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        tok_dir = path
        default_name = os.path.basename(path.rstrip("/"))
    else:
        raise ValueError(
            f"model path {model!r} does not exist; give an HF model folder (config.json + *.safetensors), "
            f"a .gguf file or a packaged model's name ({', '.join(PACKAGED_MODELS)}; models are never downloaded)"
        )
    overrides = parse_hf_overrides(hf_overrides)
    apply_hf_overrides(hf_config, overrides)
    arch = resolve_architecture(getattr(hf_config, "architectures", None), getattr(hf_config, "model_type", None))
    runner, kind, arch = resolve_runner(arch, runner, convert)
    pooling: dict[str, Any] = {}
    if kind is not None:
        pooling = _pooling_settings(path if gguf_file is None else None, hf_config, arch, kind, pooler_config)
        limit = pooling.pop("max_len")
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} must be between 1 and the model's limit {limit}")
    elif pooler_config is not None:
        raise ValueError("--pooler-config applies to pooling models only (--runner pooling)")
    return ModelConfig(
        model=path,
        tokenizer=os.path.abspath(tokenizer) if tokenizer else tok_dir,
        gguf_file=None if tokenizer else gguf_file,
        hf_config=hf_config,
        architecture=arch,
        dtype=dtype_name(dtype),
        max_model_len=_max_len(hf_config, max_model_len),
        served_model_name=served_model_name or default_name,
        seed=seed,
        quantization=None if gguf_file is None or quantization == "none" else "gguf",
        runner=runner,
        hf_overrides=overrides,
        **pooling,
    )


def parse_hf_overrides(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """--hf-overrides as a dict of config fields (ValueError for what is not a JSON object of them)."""
    return json_object(value, "hf_overrides")


ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    """Set `overrides` on the config. The rope keys merge into `rope_parameters`, which the models read (vLLM's
    rope patching): a `rope_scaling` replaces the scaling and keeps the model's `rope_theta` (transformers 5 would
    drop it when `rope_scaling` is set as is), a `rope_theta` replaces the base, `rope_parameters` entries update."""
    for key, value in overrides.items():
        if key not in ROPE_KEYS:
            setattr(hf_config, key, value)
    if not any(key in overrides for key in ROPE_KEYS):
        return
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = getattr(hf_config, "rope_theta", None)
    if params and all(isinstance(v, dict) for v in params.values()):  # one rope per layer type (Gemma 3)
        hf_config.rope_parameters = {kind: _merged_rope(p, overrides, theta) for kind, p in params.items()}
        return
    hf_config.rope_parameters = merged = _merged_rope(params, overrides, theta)
    if getattr(hf_config, "rope_theta", None) is not None:
        hf_config.rope_theta = merged["rope_theta"]


def _merged_rope(params: dict[str, Any], overrides: dict[str, Any], theta: float | None) -> dict[str, Any]:
    theta = params.get("rope_theta") or theta
    params = dict(overrides["rope_scaling"] or {}) if "rope_scaling" in overrides else dict(params)
    params.update(overrides.get("rope_parameters") or {})
    theta = overrides.get("rope_theta", params.get("rope_theta") or theta)
    if theta is not None:
        params["rope_theta"] = float(theta)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _pooling_settings(
    folder: str | None, hf_config: Any, arch: str, kind: str, override: str | dict[str, Any] | None
) -> dict[str, Any]:
    """A pooling model's ModelConfig fields (pooler config, tasks, encoder, do_lower_case) and its longest input
    (`max_len`: the position table's, at most sentence-transformers' max_seq_length)."""
    from pagedllm.model.registry import POOLING_ARCHITECTURES, pooling_tasks
    from pagedllm.pooling_params import pooler_config_for

    encoder = POOLING_ARCHITECTURES.get(arch, (kind, False))[1]
    default_type = "CLS" if encoder else "LAST"
    pooler = pooler_config_for(folder, default_type, override, hf_config)
    if kind == "classify" and pooler.pooling_type == "ALL":
        raise ValueError("a classification model pools one state per input: pooling_type ALL does not apply")
    tasks = pooling_tasks(kind) if pooler.pooling_type != "ALL" else ("encode",)
    if encoder:  # the position table's rows; RoBERTa's start after its padding index (models/bert.py)
        limit = int(hf_config.max_position_embeddings)
        if "Roberta" in arch:
            limit -= int(getattr(hf_config, "pad_token_id", 1) or 0) + 1
    else:
        limit = _max_len(hf_config, None)
    lower = False
    st_config = os.path.join(folder, "sentence_bert_config.json") if folder else None
    if st_config and os.path.isfile(st_config):
        with open(st_config, encoding="utf-8") as f:
            st = json.load(f)
        if st.get("max_seq_length"):
            limit = min(limit, int(st["max_seq_length"]))
        lower = bool(st.get("do_lower_case", False))
    return {
        "pooler_config": pooler,
        "pooling_tasks": tasks,
        "is_encoder": encoder,
        "do_lower_case": lower,
        "max_len": limit,
    }
