"""Checkpoint -> model: safetensors folders and GGUF files feed the same HF-named tensors to `load_weights`.

GGUF tensors of a type the native kernels run (pagedllm.model.quant.NATIVE_TYPES), and float16 and bfloat16 matrices,
reach the layers as stored, as `QuantTensor`s, when the model config says so (`quantization == "gguf"`, the default
for a .gguf file) and the native ops are there; a matrix of any other type is then a ValueError naming the tensor
and its type (never a silent float32 copy). Without the native ops, or with `quantization="none"`, every tensor is
de-quantized by the `gguf` package to float32 (through the weight cache, weight_cache.py) and cast to the compute
dtype, which the loader logs. llama.cpp stores Llama query/key weights with the rows of each head interleaved for
its rotary layout; they are un-permuted here back to the HF layout (rotate-half), which the model's rotary embedding
expects: whole rows move, so a quantized tensor is un-permuted exactly.
"""

from __future__ import annotations

import copy
import glob
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.model.gguf_file import open_gguf, release_gguf_readers
from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.linear import prepare_for_inference
from pagedllm.model.layers.rotary import forget_tables
from pagedllm.model.quant import F16, F32, HALF_TYPES, NATIVE_TYPES, QuantTensor, type_name
from pagedllm.model.registry import get_model_class
from pagedllm.model.weight_cache import gguf_weights

logger = logging.getLogger(__name__)

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",  # LayerNorm models (StableLM, Starcoder2, Phi-2)
    "output.weight": "lm_head.weight",
    "output.bias": "lm_head.bias",  # Phi-2's head
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
# A MoE layer's experts, stacked in one tensor [experts, rows, cols] (numpy order): the loader yields each expert's
# slice under the name its checkpoint gives it (model/layers/moe.py), as it does for older Mixtral files that store
# one tensor per expert (blk.N.ffn_gate.E.weight).
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Where an architecture's layer names differ: Gemma's norms around attention and the MLP (llama.cpp's ffn_norm is
# its pre-feedforward norm there, not Llama's post-attention one), OLMo 2's post norms, the MLPs without a gate, and
# the fused q/k/v (phi2 may store it; phi3 does) and gate/up (phi3's ffn_up) that the model splits at load.
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_ARCH_LAYER_NAMES = {
    "gemma3": _GEMMA_NORMS,
    "gemma2": _GEMMA_NORMS,
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "starcoder2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    "phi2": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # gpt-oss: its post_attention_norm is the norm before the experts (Llama's ffn_norm), not a post norm
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
}
# Architectures whose q/k rows llama.cpp's converter permutes for its interleaved rotary (LlamaModel and its
# subclasses); the others (OLMo 2, StableLM, Starcoder2, Phi) keep HF's rotate-half rows.
GGUF_PERMUTED_QK = ("llama", "mistral", "granite", "smollm3")
# Architectures whose norm weights llama.cpp's converter stores as 1 + w (Gemma's RMSNorm scales by 1 + w): the loader
# gives the model w, as the HF checkpoint holds it.
_GGUF_NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """llama.cpp tensor name -> HF name (of `arch`'s layers, where they differ from Llama's); None for tensors the
    model does not use (e.g. rope_freqs)."""
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    m = _GGUF_EXPERT_RE.fullmatch(name)
    if m:
        return f"model.layers.{m.group(1)}.mlp.experts.{m.group(3)}.{m.group(2)}_proj.weight"
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _GGUF_EXPERTS and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.mlp.experts.{{}}.{_GGUF_EXPERTS[m.group(2)]}.weight"  # {}: each expert
    if m and m.group(2) in _GGUF_EXPERTS:  # gpt-oss's expert biases, [E, I] or [E, H]: all experts at once
        return f"model.layers.{m.group(1)}.mlp.experts.{_GGUF_EXPERTS[m.group(2)]}_bias"
    if m and m.group(2) == "attn_sinks":  # gpt-oss's sinks: a parameter of the attention, no .weight
        return f"model.layers.{m.group(1)}.self_attn.sinks"
    names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch or "", {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k weights (and biases)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _require_runs_as_stored(name: str, qtype: int) -> None:
    """ValueError for a GGUF matrix of a type no kernel runs as stored (the model must be loaded de-quantized)."""
    if qtype not in (*NATIVE_TYPES, *HALF_TYPES):
        raise ValueError(
            f"GGUF tensor {name!r} is {type_name(qtype)}, which pagedllm does not run as stored (it runs "
            f"{', '.join(type_name(q) for q in NATIVE_TYPES)}, F16, BF16 and F32); load the model with "
            "quantization='none' (--quantization none) to de-quantize it to the model's dtype"
        )


def _expert_slices(
    t: Any, name: str, shape: tuple[int, ...], qtype: int, keep_quantized: bool, dequantized: set[str]
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """Each expert's [rows, cols] of a stacked GGUF expert tensor: a QuantTensor view of the mapped file where the
    layers keep it as stored, else float32."""
    import warnings

    import gguf

    if len(shape) != 3:
        raise ValueError(f"GGUF tensor {t.name!r}: experts must be stacked [experts, rows, cols], got {shape}")
    experts, rows, cols = shape
    if keep_quantized and qtype != F32:
        _require_runs_as_stored(t.name, qtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(experts, rows, -1))
        for e in range(experts):
            yield name.format(e), QuantTensor(qtype, data[e], (rows, cols))
        return
    if qtype not in (int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.F16)):
        dequantized.add(type_name(qtype))
    for e in range(experts):  # one expert at a time: the whole stack in float32 may be many GB
        raw = np.asarray(t.data).reshape(experts, -1)[e]
        w = np.asarray(gguf.quants.dequantize(raw, t.tensor_type), dtype=np.float32).reshape(rows, cols)
        yield name.format(e), torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))


def iterate_gguf(
    path: str, hf_config, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, tensor) of a GGUF file: float32, or with `keep_quantized` a QuantTensor (a view of the mapped file)
    for every tensor of a native type."""
    import warnings

    import gguf

    reader = open_gguf(path)
    arch = reader.fields["general.architecture"].contents()
    n_head = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_head
    dequantized: set[str] = set()
    halves: set[str] = set()
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name, arch)
        if name is None:
            continue
        heads = None
        if arch in GGUF_PERMUTED_QK:
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                heads = n_head
            elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                heads = n_kv
        shape = tuple(reversed([int(d) for d in t.shape]))  # numpy order: [rows (out), cols (in)]
        qtype = int(t.tensor_type)
        if "{}" in name:  # stacked experts [E, rows, cols]: each expert's matrix under its own name
            yield from _expert_slices(t, name, shape, qtype, keep_quantized, dequantized)
            continue
        as_stored = keep_quantized and len(shape) == 2 and qtype != F32  # a matrix the layers keep as stored
        if as_stored:
            _require_runs_as_stored(t.name, qtype)
        if as_stored:
            if qtype == F16:
                halves.add(t.name)
            with warnings.catch_warnings():  # the mapping is read-only; the layers copy what they keep
                warnings.simplefilter("ignore", UserWarning)
                # the file's bytes [rows, row bytes] (the reader gives F16 tensors as float16 elements)
                data = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(shape[0], -1))
            q = QuantTensor(qtype, data, shape)
            if heads is not None:
                q = q.index_rows(unpermute_rotary(np.arange(shape[0]), heads))
            yield name, q
            continue
        if qtype not in (int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.F16)):
            dequantized.add(type_name(qtype))
        # dequantize gives the logical shape in numpy order: [rows (out), cols (in)]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if heads is not None:
            w = unpermute_rotary(w, heads)
        if arch in _GGUF_NORM_PLUS_ONE and name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        # dequantize may return a read-only view of the mapped file; torch needs a writable array.
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    if keep_quantized and dequantized:
        kinds = ", ".join(sorted(dequantized))
        logger.info("GGUF tensors of type %s have no native kernel: de-quantized to float32 at load", kinds)
    if halves:
        logger.info(
            "%d F16 weight(s) (e.g. %s): linear layers run them on bf16 panels (rounded to bfloat16); "
            "embedding tables keep them as stored (a tied one reads the head's bf16 panels)",
            len(halves),
            min(halves),
        )


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {folder!r}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_model(
    model_config: ModelConfig, device: torch.device | str = "cpu", kernels: KernelDispatch | None = None
) -> nn.Module:
    """Build the model class for the architecture with the kernels of `kernels` (None: plain torch) and load its
    weights onto `device`."""
    start = time.perf_counter()
    cls = get_model_class(model_config.architecture)
    # The model reads the engine's max_model_len from its config (models/llama.py served_len: the rotary tables'
    # length, longrope's factors, the dynamic NTK base); a copy carries it, the ModelConfig's own stays as read.
    hf_config = copy.copy(model_config.hf_config)
    hf_config.max_model_len = model_config.max_model_len
    with torch.device(device):
        try:
            model = cls(hf_config, dtype=model_config.torch_dtype, kernels=kernels)
        finally:
            forget_tables()  # its layers shared their rotary tables; the next model computes its own
    path = model_config.model
    if path.endswith(".gguf"):
        native = kernels is not None and kernels.cpu_for(model_config.torch_dtype) is not None
        keep = model_config.quantization == "gguf" and native
        if model_config.quantization == "gguf" and not keep:
            logger.warning(
                "GGUF weights run as stored only with the native CPU kernels in float32 activations: "
                "de-quantizing %s to %s",
                os.path.basename(path),
                model_config.dtype,
            )
        if keep:
            logger.info("weight cache: off (the GGUF's quantized tensors run as stored)")
            weights = iterate_gguf(path, model_config.hf_config, keep_quantized=True)
        elif model_config.hf_overrides:  # the conversion reads the config (head counts): cached for it, not the file
            logger.info("weight cache: off (--hf-overrides)")
            weights = iterate_gguf(path, model_config.hf_config)
        else:
            weights = gguf_weights(path, lambda: iterate_gguf(path, model_config.hf_config))
    else:
        weights = iterate_safetensors(path)
    model.load_weights((name, t.to(device)) for name, t in weights)
    loaded = time.perf_counter()
    prepare_for_inference(model, bf16=kernels is not None and kernels.bf16_weights)
    if path.endswith(".gguf"):
        release_gguf_readers()  # the layers hold their own copies now: the file's mapping and metadata can go
    logger.info("startup: weights %.2f s, packing %.2f s", loaded - start, time.perf_counter() - loaded)
    return model.eval()


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor lives in (an opaque oneDNN tensor: its own data)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(t), t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of memory the model's weights hold, each allocation counted once: its parameters and every packed copy
    of them (oneDNN's, the native float32 or bf16 panels, which share huge-page arenas, and the quantized
    matrices)."""
    storages: dict[int, int] = {}
    quant: dict[int, int] = {}
    for t in model.parameters():
        if t.numel():
            key, size = _storage_key(t)
            storages[key] = size
    for module in model.modules():
        for name in ("packed_weight", "panels", "bf16_panels"):
            t = getattr(module, name, None)
            t = getattr(t, "data", t)  # Panels(data, out_features)
            if isinstance(t, torch.Tensor) and t.numel():
                key, size = _storage_key(t)
                storages[key] = size
        q = getattr(module, "qweight", None)
        if q is not None:
            quant[id(q)] = q.nbytes
        quant[id(module)] = getattr(module, "expert_nbytes", 0)  # a MoE layer's experts (model/layers/moe.py)
    return sum(storages.values()) + sum(quant.values())


def weight_bytes_per_token(model: nn.Module) -> int:
    """Weight bytes one decode token reads: every linear layer's and the LM head's, in the form the few-row path
    runs (quantized as stored, else the float32 or bf16 panels or the plain weight), and the norms; of a MoE layer
    the router and top_k experts' worth of its experts' bytes (a token reads only the experts it is routed to)."""
    from pagedllm.model.layers.embedding import ParallelLMHead
    from pagedllm.model.layers.linear import LinearBase
    from pagedllm.model.layers.norm import RMSNorm

    total = 0
    for module in model.modules():
        q = getattr(module, "qweight", None)
        panels = getattr(module, "panels", None) or getattr(module, "bf16_panels", None)
        if isinstance(module, (LinearBase, ParallelLMHead)):
            if q is not None:
                total += q.nbytes
            elif panels is not None:
                total += panels.data.numel() * panels.data.element_size()
            else:
                total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, RMSNorm):
            total += module.weight.numel() * module.weight.element_size()
        experts = getattr(module, "expert_nbytes", 0)
        if experts:
            total += experts * module.top_k // module.num_experts
    return total
