"""LoRA test helpers: adapters made by PEFT itself on a base folder, and PEFT's own greedy continuation as the
reference.

`make_peft_adapter(base, out, seed, rank=...)` writes a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors) whose A and B are random (signed, seeded) at a scale that changes the base model's tokens:
PEFT's default B is zero, which would make every adapter the base model.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_peft_models: dict[tuple[str, str], Any] = {}


def make_peft_adapter(
    base: str | Any,
    out: str | os.PathLike[str],
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = ALL_PROJECTIONS,
    rslora: bool = False,
    std: float = 0.05,
    rank_pattern: dict[str, int] | None = None,
) -> str:
    """A PEFT LoRA adapter of the HF model in `base` (a folder, or a loaded model, left untouched), saved under
    `out`; returns the folder. A and B are N(0, std) scaled by 1/sqrt(fan-in), so the adapter's product is of the
    order of the base weights' (it changes tokens)."""
    from peft import LoraConfig, get_peft_model

    out = os.fspath(out)
    if os.path.isfile(os.path.join(out, "adapter_config.json")):
        return out
    model = _base_model(base)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        use_rslora=rslora,
        rank_pattern=rank_pattern or {},
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            fan_in = param.shape[1]
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen) * (std * 4 / fan_in**0.5))
    peft_model.save_pretrained(out)
    return out


def _base_model(base: str | Any) -> Any:
    """A fresh float32 copy of `base` (a folder or a loaded model): PEFT injects its layers into the model it wraps."""
    if not isinstance(base, str):
        return copy.deepcopy(base)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )


def peft_model(base: str | Any, adapter: str) -> Any:
    """PEFT's model of `adapter` over `base` (a folder or a loaded model; float32, eager attention), cached."""
    from peft import PeftModel

    key = (base if isinstance(base, str) else str(id(base)), adapter)
    if key not in _peft_models:
        _peft_models[key] = PeftModel.from_pretrained(_base_model(base), adapter).eval()
    return _peft_models[key]


def peft_greedy(
    base: str | Any, adapter: str, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """PEFT's greedy continuation of each prompt (exactly max_new_tokens, EOS not stopping it)."""
    from transformers import GenerationConfig

    model = peft_model(base, adapter)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    model.base_model.model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_config)
            outs.append(seq[0, ids.shape[1] :].tolist())
    return outs
