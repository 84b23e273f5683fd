"""Llama-family decoder (Llama 2/3, SmolLM2), composed from the parallel-ready layers.

Also the base of Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), which differ only in the
switches below. Every layer gets its kernels from the dispatch object it is built with. Contract of every model
class:
  __init__(hf_config, dtype, kernels: KernelDispatch | None (None: plain torch))
  forward(input_ids [T], plan: StepPlan (model/step_plan.py: positions, attention metadata, row kinds))
    -> hidden states [T, hidden]
  compute_logits(hidden [N, hidden], rows: RowKinds of those N rows) -> [N, vocab]
  load_weights(iterable of (HF parameter name, tensor))
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import Shard
from pagedllm.model.kernels import KernelDispatch, torch_dispatch
from pagedllm.model.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.decoder import DecoderLayer
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowKinds,
    RowParallelLinear,
    default_weight_loader,
)
from pagedllm.model.layers.norm import RMSNorm, make_norm
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.step_plan import StepPlan

# An expert's projection as checkpoints name it (Mixtral's w1/w3/w2 renamed by its hf_renames), and all experts'
# stacked as transformers 5 holds them in memory.
_EXPERT = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<index>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
_EXPERTS = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<part>gate_up_proj|down_proj)$")


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict) from either the top level or `rope_parameters` (transformers 5)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    kind = params.get("rope_type") or params.get("type") or "default"
    return float(theta), (params if kind != "default" else None)


def served_len(config: Any) -> int | None:
    """The engine's max_model_len, which the loader sets on the config it builds a model from (rotary tables and the
    longrope and dynamic scalings depend on it); None for a model built outside the engine."""
    return getattr(config, "max_model_len", None)


def layer_window(config: Any, layer: int) -> int | None:
    """The sliding window of decoder layer `layer` (None: full attention), as transformers reads the config: none
    where `use_sliding_window` is false (Qwen2, SmolLM3); else `layer_types` where the config has them
    ("sliding_attention" layers take `sliding_window`), else `sliding_window` on every layer (Mistral)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return int(window) if types[layer] == "sliding_attention" else None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        bias: bool,
        qk_norm: str | None,
        kernels: KernelDispatch,
        sliding_window: int | None = None,
        o_bias: bool | None = None,
        rotary_dim: int | None = None,
        rope: tuple[float, dict[str, Any] | None] | None = None,
    ) -> None:
        """`qk_norm`: RMSNorm of queries and keys before rotary, per head ("head") or over the whole projection
        ("full", OLMo 2), or none. `rotary_dim`: rotary embedding over the first rotary_dim of each head (None: all
        of it). `rope`: (base, scaling) of this layer's rotary embedding (None: the config's, `rope_settings`)."""
        super().__init__()
        ops, tp = kernels.cpu_for(dtype), kernels.tp
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv, bias, dtype, ops, tp)
        heads = self.qkv_proj.heads  # this rank's query and KV heads
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        # Llama's attention_bias also puts a bias on o_proj; Qwen2's q/k/v biases do not. Its input rows are the
        # attention output of this rank's query heads.
        if o_bias is None:  # the config's attention_bias (Starcoder2 and Phi say it themselves)
            o_bias = bool(getattr(config, "attention_bias", False))
        o_rows = Shard(heads.first_head * self.head_dim, heads.num_heads * self.head_dim)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, o_bias, dtype, ops, tp, o_rows)
        theta, scaling = rope_settings(config) if rope is None else rope
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, theta, scaling, rotary_dim, ops, served_len(config)
        )
        scale = self.head_dim**-0.5
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, scale, kernels.attention, sliding_window
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        eps = config.rms_norm_eps if qk_norm else 0.0
        self.qk_norm = qk_norm
        if qk_norm not in (None, "head", "full"):
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {qk_norm!r}")
        q_width, k_width = (self.q_size, self.kv_size) if qk_norm == "full" else (self.head_dim, self.head_dim)
        # on the native ops, the fused decoder's arithmetic (q and k as rows of head_dim, or whole)
        self.q_norm = RMSNorm(q_width, eps, dtype, ops) if qk_norm else None
        self.k_norm = RMSNorm(k_width, eps, dtype, ops) if qk_norm else None
        self.clip_qkv: float | None = None  # OLMoE: normed q, k and v clamped to +-clip_qkv (full q/k norms only)

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        n, positions = x.shape[0], plan.positions
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x, plan.rows)
        if self.qk_norm == "full":  # each of q and k normalised whole (every head at once)
            q = self.q_norm(qkv[:, : hq * d].contiguous()).view(n, hq, d)
            k = self.k_norm(qkv[:, hq * d : (hq + hkv) * d].contiguous()).view(n, hkv, d)
            qkv = qkv.view(n, hq + 2 * hkv, d)
            if self.clip_qkv is not None:
                c = self.clip_qkv
                q, k = q.clamp_(-c, c), k.clamp_(-c, c)
                qkv[:, hq + hkv :].clamp_(-c, c)
            qk = torch.cat([q, k], dim=1)
        else:
            qkv = qkv.view(n, hq + 2 * hkv, d)
            qk = None
            if self.qk_norm == "head":  # each head a row
                q = self.q_norm(qkv[:, :hq].reshape(n * hq, d)).view(n, hq, d)
                k = self.k_norm(qkv[:, hq : hq + hkv].reshape(n * hkv, d)).view(n, hkv, d)
                qk = torch.cat([q, k], dim=1)
        v = qkv[:, hq + hkv :]
        if qk is not None:
            if not self.rotary_emb.rotate_heads_(positions, qk, hq + hkv):
                qk = self.rotary_emb.rotate(positions, qk)
        elif self.rotary_emb.rotate_heads_(positions, qkv, hq + hkv):
            qk = qkv[:, : hq + hkv]  # rotated in place
        else:
            # Queries and keys rotate in one call: they sit side by side in the fused projection.
            qk = self.rotary_emb.rotate(positions, qkv[:, : hq + hkv])
        return self.o_proj(self.attn(qk[:, :hq], qk[:, hq:], v, plan.attn_metadata), plan.rows)


class LlamaMLP(nn.Module):
    """gate|up -> act(gate) * up -> down: SiLU (Llama) or GELU(tanh) (Gemma), as the layer description says."""

    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelDispatch, act: str = "silu") -> None:
        super().__init__()
        ops, tp = kernels.cpu_for(dtype), kernels.tp
        inter = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, dtype, ops, tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, dtype, ops, tp)
        self.act = SiluAndMul(ops) if act == "silu" else GeluTanhAndMul(ops)

    def forward(self, x: torch.Tensor, rows: RowKinds) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, rows)), rows)


def share_rotary_tables(layers: Iterable[nn.Module]) -> None:
    """Layers whose rotary tables are equal hold one copy ([max_position, rot] floats, 2 MiB for SmolLM2; Gemma 3's
    local and global layers keep one each)."""
    tables: list[torch.Tensor] = []
    for layer in layers:
        rope = layer.self_attn.rotary_emb
        same = next((t for t in tables if torch.equal(t, rope.cos_sin_cache)), None)
        if same is None:
            tables.append(rope.cos_sin_cache)
        else:
            rope.cos_sin_cache = same


class LlamaModel(nn.Module):
    """The decoder stack of every architecture: the embeddings (times `embed_scale` in float32 where set), the
    layers (model/layers/decoder.py: each runs as the model's layer description says), the final norm. An
    architecture's stack subclasses it and overrides what its layers are built from: `build_attention`,
    `build_mlp`, `norm_eps`, `rotary_dim`. Layers with equal rotary tables share one copy."""

    embed_scale: float | None = None  # embeddings times this (Gemma's sqrt(hidden)); None: as looked up
    display_name: str | None = None  # the architecture as errors name it (None: the class's name)

    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        super().__init__()
        if desc.qk_norm == "full" and kernels.tp.world_size > 1:  # OLMo 2, OLMoE
            raise ValueError(
                f"{self.display_name or type(self).__name__} runs on one rank only: its query/key norms span every "
                "head (tensor_parallel_size must be 1)"
            )
        ops = kernels.cpu_for(dtype)
        hidden, eps = config.hidden_size, self.norm_eps(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, dtype, kernels.tp, ops)
        layers = []
        for i in range(config.num_hidden_layers):
            norms = {n: make_norm(desc.norm, hidden, eps, dtype, ops) for n in desc.norms if n is not None}
            attn = self.build_attention(config, dtype, bias, desc, kernels, i)
            layers.append(DecoderLayer(desc, attn, self.build_mlp(config, dtype, desc, kernels, i), norms))
        self.layers = nn.ModuleList(layers)
        share_rotary_tables(self.layers)
        self.norm = make_norm(desc.norm, hidden, eps, dtype, ops)

    def norm_eps(self, config: Any) -> float:
        """The eps of every norm of the stack (the config's name for it differs by architecture)."""
        return float(config.rms_norm_eps)

    def rotary_dim(self, config: Any) -> int:
        """The rotary dims of each head: the first `partial_rotary_factor` of it (Phi, Phi-3, StableLM; the config's
        top level, or its rope parameters as transformers 5 writes them), else all of it."""
        params = getattr(config, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return int(head_dim * float(factor))

    def build_attention(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        """Layer `index`'s attention (Llama's: q/k/v biases where `bias`, its window, the description's q/k norm)."""
        window = layer_window(config, index)
        rot = self.rotary_dim(config)
        return LlamaAttention(config, dtype, bias, desc.qk_norm, kernels, window, rotary_dim=rot)

    def build_mlp(
        self, config: Any, dtype: torch.dtype, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        """Layer `index`'s MLP: the gated MLP of the description's activation (a plain one or experts are the
        stack's own: layernorm_family.py, the MoE models)."""
        if desc.mlp != "gated":
            raise ValueError(f"{type(self).__name__} builds gated MLPs; its description says {desc.mlp!r}")
        return LlamaMLP(config, dtype, kernels, desc.act)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings, times `embed_scale` where set (a float32 tensor, as transformers multiplies)."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, plan)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    attention_bias = False
    qk_norm = False
    model_cls: type[nn.Module] = LlamaModel  # the decoder stack (a subclass's own, e.g. Gemma 3's)
    # What layer_description says of Llama-shaped layers (model/layers/description.py): the norms by role (before
    # attention, before the MLP, after attention, after the MLP) and the gate's activation.
    decoder_norms: tuple[str | None, str | None, str | None, str | None] = LayerDescription().norms
    decoder_act = "silu"
    hf_renames: tuple[tuple[str, str], ...] = ()  # checkpoint name parts -> ours (e.g. Phi's ".dense." -> ".o_proj.")
    # HF checkpoint names -> (our merged parameter, shard id)
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__()
        kernels = kernels or torch_dispatch()
        self.config = config
        bias = self.attention_bias or bool(getattr(config, "attention_bias", False))
        # One description of the layers for the layer path (model/layers/decoder.py) and the fused decoder
        # (worker/cpu_decode_runner.py).
        self.description = self.layer_description(config)
        self.model = self.model_cls(config, dtype, bias, self.description, kernels)
        self.model.description = self.description
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, kernels.cpu_for(dtype), kernels.tp)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        """The decoder layer as model/layers/description.py describes it (Llama's: RMSNorm before attention and the
        MLP, a gated MLP, q/k norms per head where the class has them)."""
        return LayerDescription(norms=cls.decoder_norms, act=cls.decoder_act, qk_norm="head" if cls.qk_norm else None)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        return self.model(input_ids, plan)

    def compute_logits(self, hidden: torch.Tensor, rows: RowKinds) -> torch.Tensor:
        """The logits of `hidden`'s rows; `rows`: their kinds (a quantized head takes generated rows as int8)."""
        return self.lm_head.compute_logits(hidden, rows)

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An HF checkpoint tensor as this model's parameter holds it (a subclass's hook; as is here)."""
        return tensor

    def unfuse(self, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """A fused checkpoint tensor as the HF tensors it stacks, so that each reaches its shard of the merged
        parameter (and each rank its rows of that shard): `self_attn.qkv_proj` (Phi-3; a GGUF file's attn_qkv) as
        q_proj, k_proj, v_proj, and `mlp.gate_up_proj` (Phi-3; a phi3 file's fused ffn_up) as gate_proj, up_proj, rows
        [q | k | v] and [gate | up], weights and biases alike, float or still quantized (whole rows). Any other tensor
        as it is."""
        if ".self_attn.qkv_proj." in name:
            cfg = self.config
            heads = cfg.num_attention_heads
            kv = getattr(cfg, "num_key_value_heads", None) or heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            fused, parts = ".self_attn.qkv_proj.", {".self_attn.q_proj.": heads, ".self_attn.k_proj.": kv}
            parts = {k: n * head_dim for k, n in parts.items()} | {".self_attn.v_proj.": kv * head_dim}
        elif ".mlp.gate_up_proj." in name:
            half = tensor.shape[0] // 2
            fused, parts = ".mlp.gate_up_proj.", {".mlp.gate_proj.": half, ".mlp.up_proj.": half}
        else:
            yield name, tensor
            return
        if tensor.shape[0] != sum(parts.values()):
            raise ValueError(f"fused tensor {name!r} has {tensor.shape[0]} rows, not {sum(parts.values())}")
        start = 0
        for part, rows in parts.items():
            yield name.replace(fused, part), tensor.narrow(0, start, rows)
            start += rows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors through each parameter's weight_loader; returns the parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for fused_name, fused in weights:
            for theirs, ours in self.hf_renames:
                fused_name = fused_name.replace(theirs, ours)
            self._load_one(params, loaded, self.unfuse(fused_name, fused))
        missing = set(params) - loaded
        if self.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {sorted(missing)[:8]}")
        return loaded

    def _load_one(self, params: dict[str, nn.Parameter], loaded: set[str], tensors: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named tensors (one checkpoint tensor, unfused) into `params`, adding the names loaded."""
        for name, tensor in tensors:
            tensor = self.convert_weight(name, tensor)
            if "rotary_emb.inv_freq" in name:
                continue
            expert = _EXPERT.match(name) or _EXPERTS.match(name)
            if expert is not None:  # one expert's projection, or all experts' (layers/moe.py)
                prefix, index, part = expert["prefix"], expert.groupdict().get("index"), expert["part"]
                target = f"{prefix}.{'w2' if part == 'down_proj' else 'w13'}_weight"
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                param = params[target]
                param.weight_loader(param, tensor, None if index is None else int(index), part)  # None: all
                loaded.add(target)
                continue
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            for merged, part, shard in self.stacked_params:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{merged}.")
                    if target not in params:
                        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                    param = params[target]
                    param.weight_loader(param, tensor.to(param.dtype), shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor.to(param.dtype))
                loaded.add(name)
