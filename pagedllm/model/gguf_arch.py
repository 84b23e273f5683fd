"""What a GGUF file's per-architecture metadata means as transformers config fields, for the architectures whose
llama.cpp hyper-parameters go beyond Llama's (config_loader.gguf_to_hf_config applies these on top of the common
ones). Each entry reads what llama.cpp's convert_hf_to_gguf.py writes for that architecture, and where llama.cpp
fixes a hyper-parameter in code rather than in the file (src/llama-model.cpp), the same value:
  granite     `granite.attention.scale`, `.embedding_scale`, `.residual_scale`, `.logit_scale` (the converter's
              names for attention_multiplier, embedding_multiplier, residual_multiplier, logits_scaling; absent: 1,
              and the attention scale 1/sqrt(head size))
  smollm3     no metadata for its layers without rope: llama.cpp's n_no_rope_layer_step = 4 (every fourth layer)
  olmo2       RMSNorm eps only (q/k norms over the whole projection are in the tensors)
  stablelm    `.attention.layer_norm_epsilon`, `.rope.dimension_count` (partial rotary), `.use_parallel_residual`
              (absent: parallel where the layers have no ffn_norm, as llama.cpp builds them); q/k/v biases where the
              file has them
  starcoder2  `.attention.layer_norm_epsilon`; biases where the file has them; no sliding window (llama.cpp runs
              none for starcoder2)
  phi2        `.attention.layer_norm_epsilon`, `.rope.dimension_count`; GELU(tanh) MLP, biases everywhere
  phi3        `.rope.dimension_count` (Phi-4-mini's partial rotary); LongRoPE where the file holds the
              rope_factors_long / rope_factors_short tensors (their values come with the metadata, see
              config_loader), over `.rope.scaling.original_context_length` with `.rope.scaling.attn_factor`; no
              sliding window (llama.cpp disables Phi-3's, as its converter may write none)
An architecture without an entry takes the common fields only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Get = Callable[..., Any]  # get(key without the "<arch>." prefix, default=None)


def _partial_rotary(get: Get, head_dim: int) -> dict[str, Any]:
    rot = get("rope.dimension_count")
    return {"partial_rotary_factor": int(rot) / head_dim} if rot and int(rot) != head_dim else {}


def _layer_norm_eps(get: Get) -> float:
    return float(get("attention.layer_norm_epsilon", 1e-5))


def _granite(get: Get, names: set[str], fields: dict[str, Any]) -> dict[str, Any]:
    return dict(
        attention_multiplier=float(get("attention.scale", 0.0)),  # 0: 1/sqrt(head size)
        embedding_multiplier=float(get("embedding_scale", 1.0)),
        residual_multiplier=float(get("residual_scale", 1.0)),
        logits_scaling=float(get("logit_scale", 1.0)),
    )


def _smollm3(get: Get, names: set[str], fields: dict[str, Any]) -> dict[str, Any]:
    layers = fields["num_hidden_layers"]
    return dict(no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)], use_sliding_window=False)


def _stablelm(get: Get, names: set[str], fields: dict[str, Any]) -> dict[str, Any]:
    parallel = get("use_parallel_residual")
    return dict(
        layer_norm_eps=_layer_norm_eps(get),
        use_parallel_residual=bool("blk.0.ffn_norm.weight" not in names if parallel is None else parallel),
        use_qkv_bias="blk.0.attn_q.bias" in names,
        qk_layernorm="blk.0.attn_q_norm.weight" in names,
        hidden_act="silu",
        **_partial_rotary(get, fields["head_dim"]),
    )


def _starcoder2(get: Get, names: set[str], fields: dict[str, Any]) -> dict[str, Any]:
    return dict(
        norm_epsilon=_layer_norm_eps(get),
        use_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        hidden_act="gelu_pytorch_tanh",
        sliding_window=None,
        **_partial_rotary(get, fields["head_dim"]),
    )


def _phi2(get: Get, names: set[str], fields: dict[str, Any]) -> dict[str, Any]:
    return dict(layer_norm_eps=_layer_norm_eps(get), hidden_act="gelu_new", **_partial_rotary(get, fields["head_dim"]))


def _phi3(get: Get, names: set[str], fields: dict[str, Any]) -> dict[str, Any]:
    return dict(hidden_act="silu", sliding_window=None, **_partial_rotary(get, fields["head_dim"]))


def phi3_rope(get: Get, factors: dict[str, list[float]] | None, rope: dict[str, Any]) -> dict[str, Any]:
    """A phi3 file's rope dict: LongRoPE where it holds both factor tensors, else `rope` as it is."""
    if not factors or "long" not in factors or "short" not in factors:
        return rope
    out = dict(rope, rope_type="longrope", long_factor=factors["long"], short_factor=factors["short"])
    out["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    if get("rope.scaling.attn_factor") is not None:
        out["attention_factor"] = float(get("rope.scaling.attn_factor"))
    return out


ARCH_FIELDS: dict[str, Callable[[Get, set[str], dict[str, Any]], dict[str, Any]]] = {
    "granite": _granite,
    "smollm3": _smollm3,
    "stablelm": _stablelm,
    "starcoder2": _starcoder2,
    "phi2": _phi2,
    "phi3": _phi3,
}
