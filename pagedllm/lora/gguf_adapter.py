"""A LoRA adapter's weights, read from llama.cpp's LoRA adapter GGUF (as convert_lora_to_gguf.py writes it).

Contract. `load_gguf_adapter(path, name, lora_id, max_rank, hf_config=None)` reads the file into the same
`LoRAAdapter` as a PEFT folder gives (adapter.py): for each adapted module, by its HF name
(`model.layers.3.self_attn.q_proj`), A [r, in] and B [out, r] in float32 with the scaling folded into B. The file
must say `general.type` = "adapter" and `adapter.type` = "lora"; its tensors are pairs `blk.N.<name>.weight.lora_a`
(numpy [r, in]) / `.lora_b` ([out, r]) of any type the `gguf` package de-quantizes (F32, F16, BF16, Q8_0, ...),
named as the base model's GGUF tensors are (mapped to HF names by the base loader's own map, model/loader.py). The
scaling is llama.cpp's (llama-adapter.h `get_scale`): `adapter.lora.alpha` / r of each pair, and 1 where the alpha is
missing or 0.

llama.cpp's converter stores the q and k rows of the architectures whose base GGUF the loader un-permutes (Llama and
its converter subclasses, loader.GGUF_PERMUTED_QK) interleaved for its rotary layout, in an adapter too: lora_b of
attn_q / attn_k is permuted as the base weight is, lora_a is not. That B is un-permuted here as the loader un-permutes
the base weights, by the base model's head counts, which the adapter file does not hold: `hf_config` (the base model's
transformers config: num_attention_heads, num_key_value_heads, model_type) gives them. Whether the rows were permuted
is read from the file's `general.architecture` (the architecture the converter wrote it for; `hf_config.model_type`
where the file names none).

What it cannot run is a ValueError naming it: a file that is not a GGUF, not an adapter or not a LoRA, an activated
LoRA (aLoRA invocation tokens), a tensor that is not a LoRA A/B, a lora_a or lora_b without its pair, shapes that
are not [r, in] and [out, r], a rank above `max_rank`, embedding or head adapters (token_embd, output), tensors of
other than a decoder layer's linear, a type the `gguf` package does not de-quantize. Norm weights that
mergekit-extract-lora adds to an adapter (`*_norm.weight`) are skipped with a warning, as llama.cpp skips them.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch

from pagedllm.lora.adapter import LoRAAdapter, check_pair
from pagedllm.model.loader import GGUF_PERMUTED_QK, gguf_to_hf_name, unpermute_rotary

logger = logging.getLogger(__name__)

_PAIR = re.compile(r"^(?P<base>.+)\.lora_(?P<which>[ab])$")
_EMBEDDING_OR_HEAD = ("token_embd.weight", "output.weight")


def load_gguf_adapter(
    path: str, name: str, lora_id: int, max_rank: int, *, hf_config: Any | None = None
) -> LoRAAdapter:
    """The llama.cpp LoRA adapter GGUF at `path`; ValueError naming what is wrong or unsupported."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises what its parsing meets (bad magic, truncated file, ...)
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a readable GGUF file ({e})") from None

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    general_type = field("general.type")
    if general_type != "adapter":
        raise ValueError(
            f"LoRA adapter {name!r}: {path!r} is not an adapter GGUF (general.type is {general_type!r}, not "
            "'adapter'; a model GGUF is not an adapter)"
        )
    adapter_type = field(gguf.Keys.Adapter.TYPE)
    if adapter_type != "lora":
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a LoRA adapter (adapter.type is {adapter_type!r})")
    if field(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS) is not None:
        raise ValueError(f"LoRA adapter {name!r}: activated LoRA (aLoRA invocation tokens) is not supported")
    alpha = float(field(gguf.Keys.Adapter.LORA_ALPHA) or 0.0)
    arch = field("general.architecture") or getattr(hf_config, "model_type", None)

    pairs: dict[str, dict[str, Any]] = {}
    for t in reader.tensors:
        m = _PAIR.match(t.name)
        if m is None:
            if t.name.endswith("_norm.weight"):
                logger.warning("LoRA adapter %r: norm weight %s skipped (llama.cpp skips them too)", name, t.name)
                continue
            raise ValueError(f"LoRA adapter {name!r}: tensor {t.name!r} is not a LoRA lora_a/lora_b weight")
        pairs.setdefault(m["base"], {})[m["which"]] = t

    adapter = LoRAAdapter(name, lora_id, path, 0)
    for base, ab in sorted(pairs.items()):
        if set(ab) != {"a", "b"}:
            raise ValueError(f"LoRA adapter {name!r}: tensor {base!r} has lora_{next(iter(ab))} only")
        module = _module_name(name, base, arch)
        a, b = _matrix(name, ab["a"]), _matrix(name, ab["b"])
        r = check_pair(name, module, a.shape, b.shape, max_rank)
        if arch in GGUF_PERMUTED_QK and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            b = _unpermute(name, module, b, hf_config, arch)
        scale = alpha / r if alpha else 1.0  # llama.cpp: alpha ? alpha / rank : 1
        adapter.add(module, torch.from_numpy(a), torch.from_numpy(b * np.float32(scale)))
    if not adapter.modules:
        raise ValueError(f"LoRA adapter {name!r}: {path!r} holds no LoRA weights")
    return adapter


def _module_name(adapter: str, base: str, arch: str | None) -> str:
    """The HF module name of GGUF tensor `base` (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj`)."""
    if base in _EMBEDDING_OR_HEAD:
        raise ValueError(
            f"LoRA adapter {adapter!r}: tensor {base!r} adapts the token embedding or the head; embedding/head "
            "adapters are not supported"
        )
    hf = gguf_to_hf_name(base, arch)
    if hf is None or not hf.startswith("model.layers.") or not hf.endswith(".weight") or ".experts" in hf:
        raise ValueError(
            f"LoRA adapter {adapter!r}: tensor {base!r} is not a linear layer adapters can target (the attention's "
            "q/k/v/o and the MLP's gate/up/down projections of each layer)"
        )
    return hf[: -len(".weight")]


def _matrix(adapter: str, t: Any) -> np.ndarray:
    """A GGUF tensor as a float32 numpy matrix of its logical shape (numpy order), writable and C-contiguous."""
    import gguf

    shape = tuple(reversed([int(d) for d in t.shape]))
    if len(shape) != 2:
        raise ValueError(f"LoRA adapter {adapter!r}: tensor {t.name!r} has shape {shape}, not a matrix")
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        raise ValueError(f"LoRA adapter {adapter!r}: tensor {t.name!r} is {kind}, which cannot be read") from None
    return np.array(np.asarray(w, dtype=np.float32).reshape(shape), dtype=np.float32, order="C", copy=True)


def _unpermute(adapter: str, module: str, b: np.ndarray, hf_config: Any | None, arch: str) -> np.ndarray:
    """B of q_proj / k_proj back from llama.cpp's rotary row order, by the base model's head counts."""
    if hf_config is None or getattr(hf_config, "num_attention_heads", None) is None:
        raise ValueError(
            f"LoRA adapter {adapter!r}: {module!r} holds {arch} q/k rows in llama.cpp's rotary order; un-permuting "
            "them needs the base model's head counts (hf_config)"
        )
    heads = int(hf_config.num_attention_heads)
    if module.endswith("k_proj"):
        heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if b.shape[0] % (2 * heads):
        raise ValueError(
            f"LoRA adapter {adapter!r}: {module!r} B {b.shape} does not fit the base model's {heads} heads"
        )
    return np.ascontiguousarray(unpermute_rotary(b, heads))
