"""Gemma 2 (Gemma2ForCausalLM, and GGUF `gemma2` files): Gemma 3's layers without q/k norms, with soft-capping.

What differs from Gemma 3, as transformers' modeling_gemma2 computes it:
* no per-head q/k RMSNorm;
* attention-logit soft-capping: each scaled score s becomes cap * tanh(s / cap) before the mask and the softmax
  (`attn_logit_softcapping`, 50 in the released models), in every attention kernel (native decode, prefill, the
  fused decoder, the torch backend);
* final-logit soft-capping (`final_logit_softcapping`, 30), as Gemma 3's optional one;
* local (sliding-window, 4096) and global layers alternating, the even-numbered ones local (`layer_types`), one rope
  (base `rope_theta`, 10,000) for both kinds;
* the attention scale query_pre_attn_scalar ** -0.5 (256 for 2B and 9B; hidden / heads = 144 for 27B).
The rest (norms of (1 + w) around attention and the MLP, scaled embeddings, the GELU(tanh) gate, a tied head) and
the fused decoder's description are Gemma 3's.
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.models.gemma3 import Gemma3ForCausalLM, Gemma3Model


def gemma2_layer_types(config: Any) -> list[str]:
    """The config's `layer_types`, else transformers' default for Gemma 2: even layers local, odd ones global."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(config.num_hidden_layers)]


class Gemma2Model(Gemma3Model):
    @staticmethod
    def rope(config: Any, kind: str) -> tuple[float, dict[str, Any] | None]:
        """One rope for local and global layers: `rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling`."""
        p = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        p.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        kind_of_scaling = p.get("rope_type") or p.get("type") or "default"
        return float(p["rope_theta"]), (p if kind_of_scaling != "default" else None)

    @staticmethod
    def layer_types(config: Any) -> list[str]:
        return gemma2_layer_types(config)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    qk_norm = False
    model_cls = Gemma2Model
