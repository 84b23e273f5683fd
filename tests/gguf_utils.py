"""Test helpers: an HF model folder -> a GGUF file with the type mix llama.cpp's quantizer gives a real model.

`write_gguf(folder, path, layout)` writes the folder's weights (HF names mapped to llama.cpp's, q/k rows permuted
for llama's rotary layout where llama.cpp does) with each matrix quantized by tests/quant_utils.py to the type
`tensor_type(layout, ...)` picks: a model of the folder's config, with the metadata pagedllm's GGUF config reader
needs. The tokenizer stays in the folder: pass it as `tokenizer=folder`.

`tensor_type` follows llama.cpp's `llama_tensor_get_type` for the layouts tested (Q4_K_M, Q5_K_M, Q3_K_M, Q2_K,
Q8_0, IQ4_XS): the base type, the head in Q6_K (the token embedding when tied), attn_v and ffn_down with more bits
in the first and last eighths of the layers and every third in between (`use_more_bits`), and llama.cpp's fallback
where a row is not a whole number of 256-weight blocks: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K /
IQ4_XS -> IQ4_NL. That is how a 0.5B Qwen2.5's Q4_K_M holds Q5_0, Q8_0, Q4_K, Q6_K and F32 tensors at once.
Norms and biases stay F32. Quantized bytes are cached per (tensor, type) for the process, so layouts that share a
type for a large tensor (the embedding, the head) quantize it once. Layout "F32" writes every matrix in float32.

Granite, OLMo 2, SmolLM3, StableLM, Starcoder2, Phi-2 (`phi2`) and Phi-3 take their tensor names from gguf-py's own
HF -> GGUF map (the one convert_hf_to_gguf.py uses; Phi-3's fused attn_qkv and ffn_up as they are, its LongRoPE
factors as the rope_factors_long / rope_factors_short tensors) and the metadata keys convert_hf_to_gguf.py writes
for each (_ARCH_METADATA); q/k rows are permuted for the architectures whose converter permutes them.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

import numpy as np

from tests.quant_utils import (
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TYPES,
    block_size,
    quantize,
)

LAYOUTS = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "Q8_0", "IQ4_XS")
F32 = 0
_BASE = {"Q4_K_M": Q4_K, "Q5_K_M": Q5_K, "Q3_K_M": Q3_K, "Q2_K": Q2_K, "Q8_0": Q8_0, "IQ4_XS": IQ4_XS}
_FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0, Q2_K: IQ4_NL, Q3_K: IQ4_NL, IQ4_XS: IQ4_NL}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Gemma's norms as llama.cpp names them (its ffn_norm is the pre-feedforward norm there).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# HF model_type -> GGUF general.architecture, where they differ
_GGUF_ARCH = {"gemma3_text": "gemma3", "phi": "phi2", "mixtral": "llama", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
# A MoE layer's tensors: the router, and every expert's projection stacked [experts, rows, cols] (HF per-expert
# checkpoint names: Mixtral's block_sparse_moe.experts.E.w1/w3/w2, the others' mlp.experts.E.gate/up/down_proj)
_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# Architectures whose tensor names come from gguf-py's own HF -> GGUF name map (the one convert_hf_to_gguf.py uses):
# the writer then names them as llama.cpp's converter does, independently of the loader's tables.
_NAME_MAPPED = ("granite", "olmo2", "smollm3", "stablelm", "starcoder2", "phi2", "phi3")
# Architectures whose q/k rows convert_hf_to_gguf.py permutes (LlamaModel and its subclasses)
_PERMUTED = ("llama", "mistral", "granite", "smollm3")
_quantized: dict[tuple[str, int, int], np.ndarray] = {}  # (folder/tensor, type, seed) -> bytes


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(layout: str, name: str, cols: int, n_layers: int, tied: bool) -> int:
    """The GGML type llama.cpp's `layout` gives the matrix `name` (llama.cpp's name) whose rows are `cols` long
    ("F32": every matrix in float32, as convert_hf_to_gguf.py --outtype f32 writes them)."""
    if layout == "F32":
        return F32
    if layout == "MXFP4_MOE":  # gpt-oss as released: experts MXFP4, every other matrix Q8_0
        return MXFP4 if "_exps." in name else Q8_0
    if layout not in _BASE:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS} or F32")
    base = _BASE[layout]
    qtype = base
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = base if base == Q8_0 else Q6_K
    elif ".attn_v." in name:
        qtype = {
            "Q4_K_M": Q6_K if _use_more_bits(layer, n_layers) else Q4_K,
            "Q5_K_M": Q6_K if _use_more_bits(layer, n_layers) else Q5_K,
            "Q3_K_M": Q5_K if layer < 2 else Q4_K,
            "Q2_K": Q3_K,
            "Q8_0": Q8_0,
            "IQ4_XS": Q5_K,
        }[layout]
    elif ".ffn_down." in name or ".ffn_down_exps." in name:
        more = _use_more_bits(layer, n_layers)
        qtype = {
            "Q4_K_M": Q6_K if more else Q4_K,
            "Q5_K_M": Q6_K if more else Q5_K,
            "Q3_K_M": Q5_K if layer < n_layers // 16 else Q4_K if more else Q3_K,
            "Q2_K": Q3_K,
            "Q8_0": Q8_0,
            "IQ4_XS": IQ4_XS,
        }[layout]
    elif ".attn_output." in name:
        qtype = {"Q3_K_M": Q4_K, "Q2_K": Q3_K}.get(layout, base)
    elif ".attn_qkv." in name:  # a fused q/k/v (Phi)
        qtype = {"Q3_K_M": Q4_K, "Q4_K_M": Q5_K, "Q5_K_M": Q6_K}.get(layout, base)
    if cols % block_size(qtype)[0]:
        qtype = _FALLBACK[qtype]
    return qtype


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleave of q/k rows per head (convert_hf_to_gguf's permute): the inverse of the loader's."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@functools.cache
def _name_map(arch: str) -> Any:
    import gguf

    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(kind, 64)


def _stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert HF tensors stacked as llama.cpp stores them: `model.layers.N.mlp.experts.<part>_exps`
    [experts, rows, cols] (named by gguf_name), the router as `model.layers.N.mlp.gate.weight`."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if len(parts) == 8 and parts[3:5] == ["mlp", "experts"] and parts[6] in _EXPERT_PARTS:
            stacks.setdefault((parts[2], _EXPERT_PARTS[parts[6]]), {})[int(parts[5])] = t
        else:
            out[name] = t
    for (layer, part), experts in stacks.items():
        out[f"model.layers.{layer}.mlp.experts.{part}_exps"] = np.stack([experts[e] for e in sorted(experts)])
    for name in [n for n in out if ".mlp.experts." in n and n.split(".")[-1] in _GPT_OSS_EXPERTS]:
        # gpt-oss's experts, stacked in x @ W orientation with gate and up interleaved: de-interleaved and
        # transposed as convert_hf_to_gguf.py writes them
        t, prefix, kind = out.pop(name), name.rsplit(".", 1)[0], name.rsplit(".", 1)[1]
        if kind == "gate_up_proj":
            out[prefix + ".gate_exps"] = np.ascontiguousarray(t[..., 0::2].transpose(0, 2, 1))
            out[prefix + ".up_exps"] = np.ascontiguousarray(t[..., 1::2].transpose(0, 2, 1))
        elif kind == "down_proj":
            out[prefix + ".down_exps"] = np.ascontiguousarray(t.transpose(0, 2, 1))
        elif kind == "gate_up_proj_bias":
            out[prefix + ".gate_exps_bias"], out[prefix + ".up_exps_bias"] = t[..., 0::2].copy(), t[..., 1::2].copy()
        else:
            out[prefix + ".down_exps_bias"] = t
    for name in [n for n in out if ".mlp.router." in n]:
        out[name.replace(".mlp.router.", ".mlp.gate.")] = out.pop(name)
    return out


_GPT_OSS_EXPERTS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    parts = hf_name.split(".")
    if len(parts) == 6 and parts[3:5] == ["mlp", "experts"] and parts[5].endswith("_exps"):
        return f"blk.{parts[2]}.ffn_{parts[5]}.weight"  # stacked experts (_stack_experts)
    if len(parts) == 6 and parts[3:5] == ["mlp", "experts"] and parts[5].endswith("_exps_bias"):
        return f"blk.{parts[2]}.ffn_{parts[5][: -len('_bias')]}.bias"
    if parts[:2] == ["model", "layers"] and hf_name.endswith((".mlp.gate.weight", ".mlp.gate.bias")):
        return f"blk.{parts[2]}.ffn_gate_inp.{parts[-1]}"
    if parts[:2] == ["model", "layers"] and hf_name.endswith(".self_attn.sinks"):
        return f"blk.{parts[2]}.attn_sinks.weight"
    if arch == "gpt-oss" and hf_name.endswith(".post_attention_layernorm.weight"):
        return f"blk.{parts[2]}.post_attention_norm.weight"  # its name for the norm before the experts
    if arch in _NAME_MAPPED:
        return _name_map(arch).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    key = ".".join(parts[3:-1])
    names = _GEMMA_LAYER_NAMES if arch in ("gemma2", "gemma3") else _LAYER_NAMES
    return f"blk.{parts[2]}.{names[key]}.{parts[-1]}" if key in names else None


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _rotary_fraction(cfg: dict[str, Any], rope: dict[str, Any]) -> float:
    return float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)


def _llama_like(w: Any, cfg: dict[str, Any], rope: dict[str, Any], head_dim: bool = True) -> None:
    """What convert_hf_to_gguf.py's TextModel and LlamaModel write beside the common keys."""
    if head_dim:
        w.add_key_length(_head_dim(cfg))
        w.add_value_length(_head_dim(cfg))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))


def _granite(w: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    _llama_like(w, cfg, rope, head_dim=False)  # its converter drops head_dim
    w.add_rope_dimension_count(_head_dim(cfg))
    if cfg.get("attention_multiplier"):  # the converter's names, written where set
        w.add_attention_scale(float(cfg["attention_multiplier"]))
    if cfg.get("embedding_multiplier"):
        w.add_embedding_scale(float(cfg["embedding_multiplier"]))
    if cfg.get("residual_multiplier"):
        w.add_residual_scale(float(cfg["residual_multiplier"]))
    if cfg.get("logits_scaling"):
        w.add_logit_scale(float(cfg["logits_scaling"]))


def _smollm3(w: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    _llama_like(w, cfg, rope)  # no key for its layers without rope: llama.cpp takes every fourth
    w.add_rope_dimension_count(_head_dim(cfg))


def _stablelm(w: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    # StableLMModel.set_gguf_parameters: no rope base (llama.cpp's default 10,000), no head size keys
    w.add_rope_dimension_count(int(_rotary_fraction(cfg, rope) * _head_dim(cfg)))
    w.add_parallel_residual(bool(cfg.get("use_parallel_residual", True)))
    w.add_layer_norm_eps(float(cfg["layer_norm_eps"]))


def _starcoder2(w: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    w.add_key_length(_head_dim(cfg))
    w.add_value_length(_head_dim(cfg))
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_eps(float(cfg["norm_epsilon"]))


def _phi2(w: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    # Phi2Model.set_gguf_parameters: its rope dims from the hidden size, no rope base
    heads = int(cfg["num_attention_heads"])
    w.add_rope_dimension_count(int(_rotary_fraction(cfg, rope) * int(cfg["hidden_size"])) // heads)
    w.add_layer_norm_eps(float(cfg["layer_norm_eps"]))


def _phi3(w: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    original = int(rope.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_dimension_count(int(_rotary_fraction(cfg, rope) * hidden) // heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    if rope.get("long_factor"):
        scale = int(cfg["max_position_embeddings"]) / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


# GGUF architecture -> what convert_hf_to_gguf.py writes for it beside the common keys (the others: Llama's)
_ARCH_METADATA = {
    "granite": _granite,
    "olmo2": _llama_like,
    "smollm3": _smollm3,
    "stablelm": _stablelm,
    "starcoder2": _starcoder2,
    "phi2": _phi2,
    "phi3": _phi3,
}


def write_gguf(
    folder: str,
    path: str,
    layout: str,
    overrides: dict[str, int] | None = None,
    sampling: dict[str, float | int] | None = None,
) -> dict[str, int]:
    """Write the HF model in `folder` as a GGUF file at `path` in llama.cpp's `layout`; returns {GGUF tensor name:
    GGML type} for the matrices. `overrides` sets the type of named tensors (e.g. an F16 one); `sampling` writes
    `general.sampling.*` keys as llama.cpp's converter does (temp, top_p, min_p in float32; top_k an int32)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as f:
        cfg: dict[str, Any] = json.load(f)
    arch = _GGUF_ARCH.get(cfg["model_type"], cfg["model_type"])
    weights: dict[str, np.ndarray] = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            weights.update(load_file(os.path.join(folder, file)))
    weights = _stack_experts(weights)
    tied = "lm_head.weight" not in weights or bool(cfg.get("tie_word_embeddings"))
    n_layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's per-kind rope: the file holds the global layers' base
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n_layers)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(hidden)
    # Phi2Model.set_gguf_parameters writes 4 * hidden (Phi-2's width) whatever the config says
    w.add_feed_forward_length(4 * hidden if arch == "phi2" else int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_uint32("tokenizer.ggml.bos_token_id", int(cfg.get("bos_token_id") or 1))
    w.add_uint32("tokenizer.ggml.eos_token_id", int(cfg.get("eos_token_id") or 2))
    if arch in _ARCH_METADATA:
        _ARCH_METADATA[arch](w, cfg, rope)
    else:
        w.add_key_length(int(cfg.get("head_dim") or hidden // heads))
        w.add_value_length(int(cfg.get("head_dim") or hidden // heads))
        w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
        w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts:  # what convert_hf_to_gguf.py writes for a MoE model
        w.add_expert_count(experts)
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
        if arch == "gpt-oss":  # GptOssModel.set_gguf_parameters
            w.add_expert_feed_forward_length(int(cfg["intermediate_size"]))
            w.add_sliding_window(int(cfg["sliding_window"]))
            if rope.get("rope_type") == "yarn":
                w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
                w.add_rope_scaling_factor(float(rope["factor"]))
                w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if arch in ("gemma2", "gemma3"):  # llama.cpp reads the window; its layers alternate (gemma3: five local, one
        w.add_sliding_window(int(cfg["sliding_window"]))  # global; gemma2: one and one)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters writes both caps
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if arch == "phi3" and rope.get("long_factor"):  # the LongRoPE factors are tensors of their own
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    types: dict[str, int] = {}
    for hf_name in sorted(weights):
        name = gguf_name(hf_name, arch)
        if name is None or (tied and name == "output.weight"):
            continue
        t = np.ascontiguousarray(weights[hf_name], dtype=np.float32)
        if arch in GEMMA_NORMS and name.endswith("norm.weight"):  # the converter stores 1 + w
            t = t + np.float32(1.0)
        if arch in _PERMUTED and name.endswith(("attn_q.weight", "attn_q.bias")):
            t = _permute(t, heads)
        elif arch in _PERMUTED and name.endswith(("attn_k.weight", "attn_k.bias")):
            t = _permute(t, kv_heads)
        if t.ndim == 1 or name.endswith(("ffn_gate_inp.weight", ".bias")):  # the router and biases stay F32
            w.add_tensor(name, t)
            continue
        qtype = (overrides or {}).get(name) or tensor_type(layout, name, t.shape[-1], n_layers, tied)
        types[name] = qtype
        if qtype in (0, 1, 30):  # F32, F16, BF16
            if qtype == 0:
                w.add_tensor(name, t)
            else:
                raw = gguf.quants.quantize(t, gguf.GGMLQuantizationType(qtype))
                w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(qtype))
            continue
        if qtype not in TYPES:  # a type the tests cannot quantize (a refusal test): random blocks of its size
            per_block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            raw = np.random.default_rng(0).integers(0, 256, (t.shape[0], t.shape[1] // per_block * nbytes), np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(qtype))
            continue
        key = (os.path.join(folder, hf_name), qtype, t.shape[0])
        if key not in _quantized:  # stacked experts: each row of each expert a row of the matrix
            _quantized[key] = quantize(t.reshape(-1, t.shape[-1]), qtype).reshape(*t.shape[:-1], -1)
        w.add_tensor(name, _quantized[key], raw_dtype=gguf.GGMLQuantizationType(qtype))
    for key, value in (sampling or {}).items():
        name = f"general.sampling.{key}"
        w.add_int32(name, value) if isinstance(value, int) else w.add_float32(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


# Architectures whose norm weights convert_hf_to_gguf.py stores as 1 + w (Gemma's RMSNorm scales by 1 + w)
GEMMA_NORMS = ("gemma", "gemma2", "gemma3")


def hf_on_dequantized(hf: Any, path: str, arch: str) -> Any:
    """`hf` (an HF model of the file's config) holding the GGUF file's de-quantized weights, as the file's writer
    stored them undone: q/k rows back from llama.cpp's order where the converter permuted them, Gemma's norms less
    1. Returns `hf`."""
    import gguf
    import torch

    cfg = hf.config
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    state = {}

    def expert_stack(part: str, layer: str) -> torch.Tensor:
        t = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
        shape = tuple(reversed([int(d) for d in t.shape]))
        return torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape))

    def bias(part: str, layer: str) -> torch.Tensor:
        t = tensors[f"blk.{layer}.ffn_{part}_exps.bias"]
        return torch.from_numpy(np.asarray(t.data, np.float32).reshape(tuple(reversed([int(d) for d in t.shape]))))

    for name, param in hf.state_dict().items():
        parts = name.split(".")
        if arch == "gpt-oss" and ".mlp.experts." in name:  # x @ W orientation, gate and up interleaved
            kind = parts[-1]
            if kind in ("gate_up_proj", "gate_up_proj_bias"):
                gate, up = (
                    (expert_stack(p, parts[2]).transpose(1, 2) for p in ("gate", "up"))
                    if kind == "gate_up_proj"
                    else (bias(p, parts[2]) for p in ("gate", "up"))
                )
                both = torch.empty(*gate.shape[:-1], 2 * gate.shape[-1])
                both[..., 0::2], both[..., 1::2] = gate, up
                state[name] = both
            else:
                state[name] = (
                    expert_stack("down", parts[2]).transpose(1, 2) if kind == "down_proj" else bias("down", parts[2])
                )
            continue
        if arch == "gpt-oss" and ".mlp.router." in name:
            t = tensors[f"blk.{parts[2]}.ffn_gate_inp.{parts[-1]}"]
            state[name] = torch.from_numpy(np.asarray(t.data, np.float32).reshape(param.shape).copy())
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5's experts in memory: [E, 2I, H], [E, H, I]
            state[name] = torch.cat([expert_stack("gate", parts[2]), expert_stack("up", parts[2])], dim=1)
            continue
        if name.endswith("mlp.experts.down_proj"):
            state[name] = expert_stack("down", parts[2])
            continue
        gname = gguf_name(name, arch)
        if gname is None or gname not in tensors:
            continue
        t = tensors[gname]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(param.shape)
        kind = gname.split(".")[-2]  # blk.N.<kind>.weight
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(kind)
        if arch in _PERMUTED and heads:
            order = _permute(np.arange(w.shape[0]), heads)  # file row i holds HF row order[i]
            w = w[np.argsort(order)]
        if arch in GEMMA_NORMS and gname.endswith("norm.weight"):
            w = w - np.float32(1.0)
        state[name] = torch.from_numpy(w.copy())
    missing = set(hf.state_dict()) - set(state) - {"lm_head.weight"}
    assert not missing, missing
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    return hf


def check_against_dequantized(
    out: Any, ids: list[int], hf: Any, path: str, arch: str, label: str, mean_noise: float, near_tie: float
) -> None:
    """A GGUF run as stored (`out`: its RequestOutput of `ids` with prompt_logprobs=1) against HF transformers on
    the file's de-quantized weights (`hf`, an HF model of the file's config: hf_on_dequantized loads them into it),
    teacher-forced over the prompt: the prompt tokens' log-probabilities within `mean_noise` nat on average, top-1
    agreement >= 0.9, and every disagreement a near-tie of HF's own top two (within `near_tie`)."""
    import torch

    with torch.no_grad():
        logits = hf_on_dequantized(hf, path, arch)(torch.tensor([ids])).logits[0, :-1]
    ref = torch.log_softmax(logits.float(), dim=-1)  # row i: the distribution of token i + 1
    entries = out.prompt_logprobs[1:]
    noise = [abs(d[t].logprob - float(ref[i, t])) for i, (d, t) in enumerate(zip(entries, ids[1:], strict=True))]
    tops = [next(t for t, lp in d.items() if lp.rank == 1) for d in entries]
    swapped = [i for i, t in enumerate(tops) if t != int(ref[i].argmax())]
    margins = [float(ref[i].topk(2).values[0] - ref[i].topk(2).values[1]) for i in swapped]
    mean = sum(noise) / len(noise)
    agreement = 1 - len(swapped) / len(tops)
    print(
        f"\n{label} as stored vs HF on its de-quantized weights: mean |logprob difference| {mean:.4f}, "
        f"teacher-forced top-1 {agreement:.3f} (swapped tops within {max(margins, default=0):.3f} nat)"
    )
    assert mean <= mean_noise
    assert agreement >= 0.9 and all(m <= near_tie for m in margins), list(zip(swapped, margins))
