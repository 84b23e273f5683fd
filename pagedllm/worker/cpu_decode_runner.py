"""The fused one-token decoder on the CPU: a whole decoder stack in one native call per step.

Contract. `CpuDecodeRunner.create(model, ops)` returns a runner when the model can run fused (a model with a layer
description, model/layers/description.py, whose layers have what it names: every architecture of model/models/;
float32 activations, every linear with its panels, its
bf16 panels (`--dtype bfloat16`) or its quantized weight, every mixture-of-experts MLP on the native fused experts
kernel (csrc/cpu/moe.cpp, run inside the decoder's region), one rank or ranks sharing the native all-reduce), else
None. Once the KV cache is bound, `runner(input_ids, positions, slot_mapping, block_table, table_rows)` computes the
final hidden states [R, hidden] of a step's decoding requests: each one's decode token, or it and its draft tokens
(speculative decoding: consecutive positions), at most `max_rows` rows a call (the model runner makes as many calls
as a step's decoding rows need, whole requests in each); row r belongs to the request whose block table is row
table_rows[r] of block_table [G, B, W] in each of the G KV cache groups (its slots are slot_mapping [G, R]; a layer
reads its group's) and attends to its positions up to its own (or its window's part). It writes their keys and
values into every layer's cache, as the model's layer-by-layer forward does (which stays the path for the step's
other requests, long prompt chunks, and for every other model). Each of the R tokens is computed exactly as it would
be alone, so a request's decode tokens do not depend on what shares its steps. With `prompt=True` the rows are a
short prompt chunk of one request (where `runs_prompts()`: the model runner sends a chunk of up to 64 tokens when no
other request of its step has prompt tokens), computed bit for bit as the layer-by-layer path computes prompt
tokens: a prefix-cache hit's uncached tail costs 8.5 ms there instead of 11.1 on the default GGUF (Zen 5).

Why: a decode step of one request is bound by reading the weights, and one of a few requests by the products; in
both, dispatching some twelve ops per layer from Python (each a fork and join of the thread team) cost a large share
of the step: ~1.5 ms of a 9 ms lone decode step, ~15 ms of a 47 ms step of 16 requests on two Zen 3 cores
(bench/RESULTS.md). Every weight kind takes any number of rows at once (float32 panels in register blocks of rows
whose sums do not depend on the block, bf16 panels, quantized weights), each weight read from memory once a call;
`max_rows` (256) only bounds a call's scratch. The C++ side is pagedllm/csrc/cpu/decoder.cpp; it has the
hook points where tensor parallelism all-reduces the attention output projection and the MLP down projection.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.description import LayerDescription

_ACTS = {"silu": 0, "gelu_tanh": 1}  # csrc/cpu/kernels.h PagedllmDecoderAct


def _description(model: nn.Module) -> LayerDescription | None:
    """The model's layer description (model/layers/description.py), None where it has none."""
    return getattr(model, "description", None)


def _norms(model: nn.Module, layer: nn.Module) -> list[Any]:
    """The layer's four norm modules by role (None where it has none)."""
    return [None if n is None else getattr(layer, n) for n in model.description.norms]


def _linears(model: nn.Module, layer: nn.Module) -> list[Any]:
    """The layer's four linear layers (q|k|v, output, (gate|)up, down)."""
    return [_get(layer, path) for path in model.description.linears]


def _experts(layer: nn.Module) -> Any:
    """The layer's mixture-of-experts MLP (model/layers/moe.py), None for a dense one."""
    from pagedllm.model.layers.moe import MoEMLP

    mlp = getattr(layer, "mlp", None)
    return mlp if isinstance(mlp, MoEMLP) else None


MAX_ROWS = 256  # rows of one call (the model runner makes as many calls as a step needs)


def _get(module: nn.Module, path: str) -> Any:
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


class CpuDecodeRunner:
    def __init__(
        self, model: nn.Module, ops: Any, tp: TensorParallelGroup | None = None, prompt_int8: bool = False
    ) -> None:
        self.model = model
        self.ops = ops
        self.tp = tp or TensorParallelGroup()
        self.prompt_int8 = prompt_int8  # prompt rows take int8 inputs, as the layer path's (PAGEDLLM_PROMPT_INT8)
        self._plan: tuple[Any, Any] | None = None  # (layer 0's kv_cache, the native DecodeModel) once built
        self.max_rows = MAX_ROWS

    @classmethod
    def create(
        cls, model: nn.Module, ops: Any, tp: TensorParallelGroup | None = None, prompt_int8: bool = False
    ) -> CpuDecodeRunner | None:
        """A runner for `model`, or None where the fused path does not apply. With tensor parallelism (`tp` above
        one rank) it applies when the ranks share a native all-reduce (the shared-memory one), whose C hook the
        decoder calls after the output and down projections. `prompt_int8`: the model runner gives prompt rows int8
        inputs on quantized weights (PAGEDLLM_PROMPT_INT8=1), which the prompt chunks here then do too."""
        tp = tp or TensorParallelGroup()
        if ops is None or not cls._applies(model, tp.world_size):
            return None
        if tp.world_size > 1 and tp.shm is None:
            return None
        return cls(model, ops, tp, prompt_int8)

    @staticmethod
    def _applies(model: nn.Module, world_size: int = 1) -> bool:
        """Whether the model describes its layers (a LayerDescription) and every layer has what the description
        names, in forms the native decoder reads: each linear as panels, bf16 panels or quantized, split as the
        ranks are; float32 rotary tables and norms of one eps (LayerNorm's with biases, where it says "layer")."""
        desc = _description(model)
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if desc is None or inner is None or not layers or getattr(inner, "norm", None) is None:
            return False
        if desc.qk_norm == "full" and world_size > 1:
            return False  # a norm over every head would need the ranks' sums
        eps = inner.norm.eps
        layer_norm = desc.norm == "layer"
        for layer in layers:
            attn = _get(layer, "self_attn")
            experts = _experts(layer)
            if experts is not None and experts.native is None:
                return False  # experts without the native kernel (not packed for it)
            for j, lin in enumerate(_linears(model, layer)):
                if experts is not None and j >= 2:
                    continue  # the experts replace gate|up and down
                forms = ("panels", "bf16_panels", "qweight")  # float32 panels, bf16 panels, quantized
                runs = lin is not None and any(getattr(lin, f, None) is not None for f in forms)
                if not runs or getattr(lin, "tp_size", 1) != world_size:
                    return False
            rope = _get(layer, "self_attn.rotary_emb")
            if rope is None or rope.cos_sin_cache.dtype != torch.float32:
                return False
            roles = _norms(model, layer)
            if any(name is not None and norm is None for name, norm in zip(desc.norms, roles)):
                return False
            qk = [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
            if (desc.qk_norm is None) != (not qk):
                return False
            for n in [*roles[:2], inner.norm]:  # the norms of the description's kind
                if n is not None and (getattr(n, "bias", None) is not None) != layer_norm:
                    return False
            norms = [n for n in roles if n is not None] + qk + [inner.norm]
            if any(n.eps != eps or n.weight.dtype != torch.float32 for n in norms):
                return False
        return True

    def runs_prompts(self) -> bool:
        """Whether a request's short prompt chunk may run here (`prompt=True`) as the layer path would compute it:
        one rank, every linear quantized and wholly packed, and prompt rows on int8 inputs (`prompt_int8`) or a CPU with
        AVX512-BF16 (the de-quantized bf16 panels prompt rows take in the layer path), here without the layer path's
        dozen dispatches a layer. Not where the layer path's arithmetic differs from the decoder's: a bias on the
        output or down projection (added after the products there, inside them here). Limited to the layers checked
        bit for bit against the layer path on prompt rows (tests/engine/test_quantized.py): RMSNorm, gated and
        sequential, without q/k norms."""
        if self.tp.world_size != 1 or not (self.prompt_int8 or self.ops.bf16_native()):
            return False
        desc = self.model.description
        if desc != LayerDescription(norms=desc.norms, act=desc.act, qk_norm=desc.qk_norm):
            return False  # RMSNorm, gated, sequential layers only
        for layer in self.model.model.layers:
            attn = layer.self_attn
            if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
                return False
            if attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
                return False
            for lin in _linears(self.model, layer):
                q = getattr(lin, "qweight", None)
                if q is None or q.packed_rows != q.out_features:
                    return False
        return True

    def _layer_weights(self) -> list[torch.Tensor]:
        """Sixteen tensors per layer (see csrc/cpu/bindings.cpp, DecodeModel): the linear weights as panels or bf16
        panels (empty where the layer is quantized), an empty tensor for an absent bias, norm or norm bias."""
        none = torch.empty(0)
        weights: list[torch.Tensor] = []
        for layer in self.model.model.layers:
            attn = layer.self_attn
            qkv, o, gate_up, down = _linears(self.model, layer)

            def bias(lin: Any) -> torch.Tensor:
                return none if lin is None or lin.bias is None else lin.bias

            def norm(n: Any) -> torch.Tensor:
                return none if n is None else n.weight

            def norm_bias(n: Any) -> torch.Tensor:
                return none if n is None or getattr(n, "bias", None) is None else n.bias

            def panels(lin: Any) -> torch.Tensor:
                if lin is None:  # the experts' (a MoE layer)
                    return none
                if getattr(lin, "bf16_panels", None) is not None:
                    return lin.bf16_panels.data
                return none if lin.panels is None else lin.panels.data

            norm1, norm2, post_attn, post_mlp = _norms(self.model, layer)
            weights += [
                norm(norm1), panels(qkv), bias(qkv), norm(attn.q_norm), norm(attn.k_norm), panels(o), bias(o),
                norm(norm2), panels(gate_up), bias(gate_up), panels(down), bias(down), norm(post_attn), norm(post_mlp),
                norm_bias(norm1), norm_bias(norm2),
            ]  # fmt: skip
        return weights

    def _quant_weights(self) -> list[Any]:
        """Four entries per layer (qkv, o, gate_up, down): the layer's QuantMatrix, or None for its panels."""
        return [
            getattr(lin, "qweight", None) for layer in self.model.model.layers for lin in _linears(self.model, layer)
        ]

    def _lora_tensors(self) -> list[torch.Tensor]:
        """With LoRA slots on the linears (--enable-lora): (a, b, widths, a_scale, b_scale) per linear of each layer,
        the slots' copies the fused decoder reads (lora/layers.py; empty tensors where a linear has none); else
        nothing."""
        none = torch.empty(0)
        out: list[torch.Tensor] = []
        for layer in self.model.model.layers:
            for lin in _linears(self.model, layer):
                s = getattr(lin, "lora", None)
                out += [none] * 5 if s is None else [s.fa, s.fb, s.widths, s.fa_scale, s.fb_scale]
        return out if any(t.numel() for t in out) else []

    def _decoder(self) -> Any:
        """The native DecodeModel, built once per KV cache allocation (it holds the caches' pointers)."""
        layers = self.model.model.layers
        cache = layers[0].self_attn.attn.kv_cache
        assert cache is not None, "the KV cache is not bound"
        if self._plan is None or self._plan[0] is not cache:
            attns = [layer.self_attn for layer in layers]
            desc = self.model.description
            norm_bias = getattr(self.model.model.norm, "bias", None)
            norm_bias = torch.empty(0) if norm_bias is None else norm_bias
            decoder = self.ops.decode_model(
                self._layer_weights(), [a.attn.kv_cache[0] for a in attns],
                [a.attn.kv_cache[1] for a in attns], [a.rotary_emb.cos_sin_cache for a in attns], attns[0].attn.scale,
                self.model.model.norm.eps, self.model.model.norm.weight, *self._all_reduce_hook(),
                self._quant_weights(), [a.attn.sliding_window for a in attns],
                _ACTS[desc.act], [a.attn.kv_group for a in attns], [a.attn.logit_softcap for a in attns],
                [int(desc.norm == "layer"), int(desc.mlp == "plain"), int(desc.parallel), int(desc.qk_norm == "full")],
                desc.residual_multiplier, norm_bias,
                [None if _experts(layer) is None else _experts(layer).native for layer in layers],
                [getattr(a, "clip_qkv", None) or 0.0 for a in attns],
                [torch.empty(0) if a.attn.sinks is None else a.attn.sinks.detach() for a in attns],
                self._lora_tensors(),
            )  # fmt: skip
            self._plan = (cache, decoder)
        return self._plan[1]

    def _all_reduce_hook(self) -> tuple[int, int]:
        return self.tp.shm.hook() if self.tp.world_size > 1 else (0, 0)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        table_rows: torch.Tensor,
        prompt: bool = False,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions, table_rows [R]; slot_mapping [G, R]; block_table [G, B, blocks] (int64, G KV cache
        groups) -> hidden [R, hidden].
        A request's rows are consecutive (its context is then read once for all of them). prompt: the rows are
        consecutive prompt tokens of one request (`runs_prompts` says where that applies), computed bit for bit as
        the layer-by-layer path computes prompt tokens. lora_slots: int32 [R], each row's LoRA adapter slot (-1:
        none; lora/manager.py), or None."""
        decoder = self._decoder()
        x = self.model.model.embed(input_ids).contiguous()  # as the model's forward (Gemma's scale included)
        decoder(x, positions, slot_mapping, block_table, table_rows, prompt, lora_slots, self.prompt_int8)
        if self.tp.world_size > 1:
            self.tp.shm.check()  # a failed sum inside the decoder (a peer gone) cannot raise there
        return x
