"""The declarative description of a model's decoder layer: what the fused native decoder runs, and what each model's
layer-by-layer forward computes.

Contract. A model class's `layer_description(config)` (a classmethod; LlamaForCausalLM's default reads the class
attributes below) returns one `LayerDescription` for all its layers. Both paths that run a layer read it and nothing
else about a layer's structure: the layer path's one `DecoderLayer` (model/layers/decoder.py), whose forward follows
the order below for every architecture, and worker/cpu_decode_runner.py, which runs decode steps of a model whose
description it accepts in one native call per step (csrc/cpu/decoder.cpp). The per-layer facts that live on the
modules themselves stay there (a layer's sliding window and soft-cap on its Attention, its rotary table and so
partial or no rotary, which biases exist). The tiny-model tests check both paths against transformers on every
architecture, and against each other.

The order of operations it describes, for one layer with input residual stream x:
    h = norm1(x)                       (norms[0]; None: h = x)
    a = o_proj(attention(qkv_proj(h)))  (q/k norms per head or over the whole projection, before rotary)
    sequential: x = x + post_attn(a) * m;  h = norm2(x)   (norms[2], norms[1]; m = residual_multiplier)
    parallel:   the MLP reads the same h, and x = (x + a * m) + mlp * m at the end
    u = mlp(h): gated act(gate) * up, or plain act(up); then down_proj
    x = x + post_mlp(u) * m            (norms[3])
"""

from __future__ import annotations

from dataclasses import dataclass

NORM_KINDS = ("rms", "layer")
MLP_KINDS = ("gated", "plain", "moe")
ACTS = ("silu", "gelu_tanh")
QK_NORMS = (None, "head", "full")


@dataclass(frozen=True)
class LayerDescription:
    # The norms' kind: RMSNorm, or LayerNorm with a bias ("layer"); the final norm is of the same kind.
    norm: str = "rms"
    # The layer's norm modules by role (attribute names on the layer): before attention, before the MLP, after
    # attention, after the MLP (None: none there).
    norms: tuple[str | None, str | None, str | None, str | None] = (
        "input_layernorm",
        "post_attention_layernorm",
        None,
        None,
    )
    # The four linear layers (attribute paths from the layer): q|k|v, output, (gate|)up, down.
    linears: tuple[str, str, str, str] = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    mlp: str = "gated"  # gated: act(gate) * up; plain: act(up); moe: experts where the model has them (layers/moe.py)
    act: str = "silu"  # the MLP's activation (GELU with the tanh approximation: "gelu_tanh")
    qk_norm: str | None = None  # RMSNorm of queries and keys: per head, or over the whole projection ("full")
    parallel: bool = False  # attention and MLP from the same normed input, both added to the residual stream
    residual_multiplier: float = 1.0  # each layer output times this as it joins the residual stream (Granite)

    def __post_init__(self) -> None:
        for value, allowed, name in (
            (self.norm, NORM_KINDS, "norm"),
            (self.mlp, MLP_KINDS, "mlp"),
            (self.act, ACTS, "act"),
            (self.qk_norm, QK_NORMS, "qk_norm"),
        ):
            if value not in allowed:
                raise ValueError(f"layer description: {name} must be one of {allowed}, got {value!r}")
        if self.parallel and self.norms[1:] != (None, None, None):
            raise ValueError("layer description: parallel attention and MLP share norm1 and have no other norms")
        if self.residual_multiplier != 1.0 and self.norms[2:] != (None, None):
            raise ValueError("layer description: a residual multiplier with post norms is not described")
