"""A LoRA adapter's weights, read from PEFT's format.

Contract. `load_adapter(path, max_rank)` reads a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`)
into a `LoRAAdapter`: for each adapted module, by its HF name (`model.layers.3.self_attn.q_proj`), A [r, in] and
B [out, r] in float32 with the adapter's scaling folded into B (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA;
`rank_pattern` and `alpha_pattern` per module as PEFT matches them). What it cannot run is a ValueError naming it: a
missing folder or file, a rank above `max_rank`, DoRA, trained biases, `modules_to_save`, embedding or head adapters.
Which modules of the base model an adapter may touch is the model's business (manager.py).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass
class LoRAModule:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], times the adapter's scaling

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    lora_id: int
    path: str
    rank: int  # the largest of its modules' ranks
    modules: dict[str, LoRAModule] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())

    def add(self, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Module `module`'s pair: A [r, in], B [out, r] with the scaling already in it."""
        self.modules[module] = LoRAModule(a.contiguous(), b.contiguous())
        self.rank = max(self.rank, a.shape[0])


def check_pair(adapter: str, module: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], max_rank: int) -> int:
    """The rank of a module's A and B shapes; ValueError unless they are [r, in] and [out, r] with r <= max_rank."""
    r = a_shape[0]
    if len(a_shape) != 2 or len(b_shape) != 2 or b_shape[1] != r:
        raise ValueError(
            f"LoRA adapter {adapter!r}: module {module!r} has A {tuple(a_shape)} and B {tuple(b_shape)}, "
            "not [r, in] and [out, r]"
        )
    if r > max_rank:
        raise ValueError(f"LoRA adapter {adapter!r}: rank {r} of {module!r} is above --max-lora-rank {max_rank}")
    return r


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module whose name ends with it (as a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def load_adapter(path: str, name: str, lora_id: int, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` (a PEFT folder); ValueError naming what is wrong or unsupported. (A llama.cpp LoRA
    GGUF file: gguf_adapter.py.)"""
    config_file = os.path.join(path, PEFT_CONFIG)
    if not os.path.isfile(config_file):
        raise ValueError(f"LoRA adapter {name!r}: no {PEFT_CONFIG} in {path!r} (a PEFT adapter folder is expected)")
    with open(config_file, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA adapter {name!r}: {config_file} is not valid JSON ({e})") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported (LORA is)")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']} (fully trained copies of base "
            "modules) are not supported"
        )
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {name!r}: fan_in_fan_out (Conv1D-style weights) is not supported")
    tensors = _read_weights(path, name)
    r_default = int(config.get("r", 8))
    alpha_default = float(config.get("lora_alpha", r_default))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a linear layer")
        pairs.setdefault(m["module"], {})[m["which"]] = tensor
    adapter = LoRAAdapter(name, lora_id, path, 0)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} has lora_{next(iter(ab))} only")
        a, b = ab["A"].float(), ab["B"].float()
        r = check_pair(name, module, tuple(a.shape), tuple(b.shape), max_rank)
        expected = int(_pattern_value(rank_pattern, module, r_default))
        alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
        if expected != r:
            raise ValueError(f"LoRA adapter {name!r}: {module!r} has rank {r} where its config says {expected}")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        adapter.add(module, a, b * scale)
    if not adapter.modules:
        raise ValueError(f"LoRA adapter {name!r}: {path!r} holds no LoRA weights")
    return adapter


def _read_weights(path: str, name: str) -> dict[str, torch.Tensor]:
    for file in PEFT_WEIGHTS:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            continue
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(full)
        return torch.load(full, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {name!r}: no {' or '.join(PEFT_WEIGHTS)} in {path!r}")
