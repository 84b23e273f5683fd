"""Encoder models: BERT (all-MiniLM, bge, e5 shapes) and RoBERTa / XLM-RoBERTa, as embedders and as cross-encoders.

Contract (an encoder's, beside the decoders' in llama.py):
  __init__(hf_config, dtype, kernels: KernelDispatch | None)
  is_encoder = True; no attention layers with a KV cache (`attention_layers()` is empty)
  forward(input_ids [T], plan: EncoderPlan (model/step_plan.py: positions, token types, the requests' token runs))
    -> the last layer's hidden states [T, hidden]; each request's tokens attend to all of its own tokens
    (bidirectional) and to no other request's; the plan's `poll`, when set, is called between two layers and twice
    within each (after the attention, between the MLP's two products): roughly every third of a layer's work
  classify(pooled [B, hidden]) -> logits [B, num_labels] (the *ForSequenceClassification heads)
  load_weights(iterable of (HF parameter name, tensor))

The layers are post-LN as in transformers: x = LN(x + O(attention(x))); x = LN(x + Down(act(Up(x)))). The linears
are the tensor-parallel ones (q/k/v merged, heads split across ranks; the native panels or oneDNN's packed weights),
the layer norms the native fused add-and-norm. RoBERTa's positions start after its padding index (padding_idx + 1).
BertModel checkpoints carry a pooler (tanh(dense(CLS))) that sentence-transformers' embeddings do not use: it is
loaded only by BertForSequenceClassification, whose head reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import Shard
from pagedllm.model.kernels import KernelDispatch, torch_dispatch
from pagedllm.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowKinds,
    RowParallelLinear,
)
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.step_plan import EncoderPlan

_PROMPT = RowKinds(False)  # an encoder's rows are all prompt tokens

# hidden_act -> the GELU form (torch's `approximate`); the up projection applies it (in oneDNN's GEMM epilogue).
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def _gelu_form(name: str) -> str:
    if name not in _GELU:
        supported = ", ".join(sorted(_GELU))
        raise ValueError(f"hidden_act {name!r} is not supported by the encoder models (supported: {supported})")
    return _GELU[name]


def encoder_attention(
    qkv: torch.Tensor, starts: list[int], heads: int, dim: int, scale: float, ops: Any = None
) -> torch.Tensor:
    """Bidirectional attention of each run of tokens [starts[i], starts[i + 1]) over its own keys. qkv: [T, 3 H D]
    (q | k | v per token) -> [T, H * D]. With the native ops of a SIMD build, one call for every run and head
    (csrc/cpu/attention.cpp: 2.3x torch's on MiniLM-sized steps with AVX-512); else torch's SDPA, one call a run
    (padding runs to a common length and masking cost more in gathers than they saved in calls)."""
    if ops is not None and ops.isa != "generic" and qkv.dtype == torch.float32 and qkv.is_contiguous():
        return ops.encoder_attention(qkv, torch.tensor(starts, dtype=torch.int64), heads, dim, scale)
    total = qkv.shape[0]
    out = torch.empty(total, heads * dim, dtype=qkv.dtype, device=qkv.device)
    for i in range(len(starts) - 1):
        a, b = starts[i], starts[i + 1]
        q, k, v = qkv[a:b].view(1, b - a, 3, heads, dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, scale=scale)
        out[a:b] = o[0].transpose(0, 1).reshape(b - a, heads * dim)
    return out


class BertLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelDispatch) -> None:
        super().__init__()
        ops, tp = kernels.cpu_for(dtype), kernels.tp
        hidden = config.hidden_size
        heads = config.num_attention_heads
        self.head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, True, dtype, ops, tp)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.scale = self.head_dim**-0.5
        heads_here = self.qkv_proj.heads  # this rank's heads: the output projection takes their columns
        o_rows = Shard(heads_here.first_head * self.head_dim, heads_here.num_heads * self.head_dim)
        self.o_proj = RowParallelLinear(hidden, hidden, True, dtype, ops, tp, o_rows)
        eps = float(config.layer_norm_eps)
        self.attn_norm = LayerNorm(hidden, eps, dtype, ops=ops)
        self.up_proj = ColumnParallelLinear(hidden, config.intermediate_size, True, dtype, ops, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, hidden, True, dtype, ops, tp)
        self.mlp_norm = LayerNorm(hidden, eps, dtype, ops=ops)
        self.gelu = _gelu_form(config.hidden_act)
        self.ops = ops

    def forward(self, x: torch.Tensor, starts: list[int], poll: Callable[[], None] | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x, _PROMPT)
        attn = encoder_attention(qkv, starts, self.num_heads, self.head_dim, self.scale, self.ops)
        a = self.o_proj(attn, _PROMPT)
        x, _ = self.attn_norm(a, x)  # LN(x + attention); a is a fresh tensor: the native form works in place
        if poll is not None:
            poll()
        up = self.up_proj.forward_gelu(x, _PROMPT, self.gelu)
        if poll is not None:
            poll()
        x, _ = self.mlp_norm(self.down_proj(up, _PROMPT), x)
        return x


class BertModel(nn.Module):
    """The encoder stack (embeddings, layers); an embedder as it stands (BertModel, XLMRobertaModel)."""

    is_encoder = True
    default_pooling_type = "CLS"
    prefix = "bert"  # the name task models give the stack in their checkpoints
    position_offset = 0  # RoBERTa: padding_idx + 1

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__()
        kernels = kernels or torch_dispatch()
        self.config = config
        if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ValueError(
                f"position_embedding_type {config.position_embedding_type!r} is not supported (absolute is)"
            )
        hidden = config.hidden_size
        self.word_embeddings = nn.Parameter(torch.empty(config.vocab_size, hidden, dtype=dtype), requires_grad=False)
        self.position_embeddings = nn.Parameter(
            torch.empty(config.max_position_embeddings, hidden, dtype=dtype), requires_grad=False
        )
        types = max(int(getattr(config, "type_vocab_size", 1) or 1), 1)
        self.token_type_embeddings = nn.Parameter(torch.zeros(types, hidden, dtype=dtype), requires_grad=False)
        ops = kernels.cpu_for(dtype)
        self.embed_norm = LayerNorm(hidden, float(config.layer_norm_eps), dtype, ops=ops)
        self.layers = nn.ModuleList(BertLayer(config, dtype, kernels) for _ in range(config.num_hidden_layers))

    def attention_layers(self) -> list[Any]:
        return []  # no KV cache

    def forward(self, input_ids: torch.Tensor, plan: EncoderPlan) -> torch.Tensor:
        x = F.embedding(input_ids, self.word_embeddings)
        x = x + F.embedding(plan.positions + self.position_offset, self.position_embeddings)
        types = self.token_type_embeddings
        one_type = plan.token_types is None or types.shape[0] == 1  # XLM-R has one type, whatever a tokenizer says
        x = x + (types[0] if one_type else F.embedding(plan.token_types, types))
        x = self.embed_norm(x.contiguous())
        for i, layer in enumerate(self.layers):
            if i and plan.poll is not None:
                plan.poll()
            x = layer(x, plan.starts, plan.poll)
        return x

    # ---- weights -------------------------------------------------------------------------------------------

    _RENAMES = (
        ("embeddings.word_embeddings.weight", "word_embeddings"),
        ("embeddings.position_embeddings.weight", "position_embeddings"),
        ("embeddings.token_type_embeddings.weight", "token_type_embeddings"),
        ("embeddings.LayerNorm.", "embed_norm."),
        ("encoder.layer.", "layers."),
        (".attention.output.dense.", ".o_proj."),
        (".attention.output.LayerNorm.", ".attn_norm."),
        (".intermediate.dense.", ".up_proj."),
        (".output.dense.", ".down_proj."),
        (".output.LayerNorm.", ".mlp_norm."),
    )
    _QKV = {".attention.self.query.": "q", ".attention.self.key.": "k", ".attention.self.value.": "v"}

    def checkpoint_name(self, name: str) -> str | None:
        """An HF checkpoint name as this model's parameter name; None for tensors it does not use."""
        for prefix in (f"{self.prefix}.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        name = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # TF-era LayerNorm names
        if name.startswith("pooler.") or name.endswith("position_ids"):
            return None
        for theirs, ours in self._RENAMES:
            name = name.replace(theirs, ours)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = {n: p for n, p in self.named_parameters() if not n.startswith("head.")}  # a head loads its own
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.checkpoint_name(hf_name)
            if name is None:
                continue
            shard = next((s for part, s in self._QKV.items() if part in name), None)
            if shard is not None:
                name = name.replace(next(p for p in self._QKV if p in name), ".qkv_proj.")
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if shard is not None:
                param.weight_loader(param, tensor.to(param.dtype), shard)  # type: ignore[attr-defined]
            elif loader is not None:
                loader(param, tensor.to(param.dtype))
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(name)
        missing = {n for n in set(params) - loaded if n != "token_type_embeddings"}
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {sorted(missing)[:8]}")
        return loaded


class RobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa: BERT's layers; positions count from padding_idx + 1, one token type."""

    prefix = "roberta"

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        self.position_offset = int(getattr(config, "pad_token_id", 1) or 0) + 1


class _ClassifierMixin:
    """A sequence-classification head over the stack's pooled (CLS) state; `num_labels` outputs."""

    default_pooling_type = "CLS"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        head: dict[str, torch.Tensor] = {}

        def body() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                short = name.removeprefix(f"{self.prefix}.")  # type: ignore[attr-defined]
                if short.startswith(("classifier.", "pooler.")):
                    head[short] = tensor
                else:
                    yield name, tensor

        loaded = super().load_weights(body())  # type: ignore[misc]
        params = dict(self.head.named_parameters())  # type: ignore[attr-defined]
        missing = set(params) - set(head)
        if missing:
            raise ValueError(f"checkpoint is missing the classification head's tensors: {sorted(missing)}")
        for name, param in params.items():
            if param.shape != head[name].shape:
                raise ValueError(f"{name}: shape {tuple(head[name].shape)} != parameter {tuple(param.shape)}")
            param.data.copy_(head[name])
        return loaded | {f"head.{n}" for n in params}


def _linear(inp: int, out: int, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(inp, out, dtype=dtype)
    layer.requires_grad_(False)
    return layer


class BertForSequenceClassification(_ClassifierMixin, BertModel):
    """BERT cross-encoder: logits = classifier(tanh(pooler.dense(CLS)))."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        hidden = config.hidden_size
        self.head = nn.ModuleDict(
            {
                "pooler": nn.ModuleDict({"dense": _linear(hidden, hidden, dtype)}),
                "classifier": _linear(hidden, config.num_labels, dtype),
            }
        )

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.head["classifier"](torch.tanh(self.head["pooler"]["dense"](pooled)))


class RobertaForSequenceClassification(_ClassifierMixin, RobertaModel):
    """RoBERTa / XLM-RoBERTa cross-encoder (bge-reranker): logits = out_proj(tanh(dense(CLS)))."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        hidden = config.hidden_size
        self.head = nn.ModuleDict(
            {
                "classifier": nn.ModuleDict(
                    {"dense": _linear(hidden, hidden, dtype), "out_proj": _linear(hidden, config.num_labels, dtype)}
                )
            }
        )

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        c = self.head["classifier"]
        return c["out_proj"](torch.tanh(c["dense"](pooled)))
