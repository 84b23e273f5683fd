"""Phi-3 (Phi3ForCausalLM: Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini, and GGUF `phi3` files): the Llama decoder
as transformers' modeling_phi3 computes it, stored differently:
* q/k/v in one fused `qkv_proj` (rows [q | k | v]) and gate/up in one fused `gate_up_proj` (rows [gate | up], the
  SiLU gate first), split at load into the shards of the merged parameters (LlamaForCausalLM.unfuse), so that each
  tensor-parallel rank takes its own heads and its own rows of the gate and of the up projection;
* rotary over the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75);
* rope scaling `longrope` (Phi-3-128k, Phi-3.5, Phi-4-mini): short or long per-frequency factors and an attention
  factor on cos and sin. The factors are chosen once, by the engine's max_model_len against
  original_max_position_embeddings, as vLLM does (transformers switches by the current sequence length): see
  pagedllm/model/layers/rotary.py;
* the config's `sliding_window`, where set, on every layer (as transformers; Phi-3-mini-4k's 2047).
RMSNorm and a SiLU-gated MLP as Llama's: the fused decoder runs these layers.
"""

from __future__ import annotations

from pagedllm.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass  # LlamaModel reads its partial rotary, LlamaForCausalLM.unfuse splits its fused projections
