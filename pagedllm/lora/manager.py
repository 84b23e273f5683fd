"""The worker's adapters: kept in memory (least recently used evicted) and placed in the step's slots.

Contract. `LoRAManager(model, config)` gives every linear of the model's decoder layers (the four its layer
description names: q|k|v, output, (gate|)up, down) a `LoRASlots` (lora/layers.py) of `max_loras` slots, and maps
each checkpoint module name an adapter may target (`model.layers.3.self_attn.q_proj`, after the model's
`hf_renames`) to its linear and part. `add(lora_request)` loads an adapter (PEFT folder or llama.cpp GGUF file) into
memory, checking each module's name and shapes against the model (ValueError naming the module); at most
`max_cpu_loras` stay loaded, the least recently used other than the step's dropped (and reloaded from their path when
a request names them again). `prepare(lora_ids)` takes the adapter id of each row of the step's layer-by-layer forward
(0: none), puts the adapters in slots (evicting the least recently used slot no row of this step needs; the scheduler
never sends more than `max_loras` adapters in one step) and sets the shared `LoRAMapping`. Tensor parallelism: a
column-parallel layer's B and a row-parallel layer's A are cut as the layer's own weight is (its weight_loader does
the cutting), the other factor is whole on every rank.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.lora.adapter import LoRAAdapter, load_adapter
from pagedllm.lora.gguf_adapter import load_gguf_adapter
from pagedllm.lora.layers import LoRAMapping, LoRASlots
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class _Target:
    linear: Any  # model/layers/linear.py LinearBase
    part: int  # which of the linear's merged matrices
    shard: Any  # the shard id its weight_loader takes (None: none)
    row_parallel: bool


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        from pagedllm.model.layers.linear import (
            LinearBase,
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )

        self.config = config
        self.model = model
        self.device = next(model.parameters()).device
        self.mapping = LoRAMapping()
        self.targets: dict[str, _Target] = {}
        self.renames: tuple[tuple[str, str], ...] = tuple(getattr(model, "hf_renames", ()))
        description = getattr(model, "description", None)
        layers = getattr(getattr(model, "model", None), "layers", None)
        if description is None or layers is None:
            raise ValueError(f"LoRA adapters are not supported for {type(model).__name__}")
        stacked = getattr(model, "stacked_params", ())
        self.linears: list[Any] = []
        # The fused decoder reads the adapters in int8 beside quantized base weights (as llama.cpp runs a Q8_0
        # adapter), in bf16 beside bf16 ones, else in float32 (lora/layers.py).
        modules = list(model.modules())
        if any(getattr(m, "qweight", None) is not None for m in modules):
            fused_dtype = torch.int8
        elif any(getattr(m, "bf16_panels", None) is not None for m in modules):
            fused_dtype = torch.bfloat16
        else:
            fused_dtype = torch.float32
        for i, layer in enumerate(layers):
            for path in description.linears:
                try:
                    linear = layer.get_submodule(path)
                except AttributeError:
                    continue
                if not isinstance(linear, LinearBase):
                    continue  # e.g. a mixture-of-experts MLP: its experts take no adapter
                prefix, _, leaf = f"model.layers.{i}.{path}".rpartition(".")
                if isinstance(linear, QKVParallelLinear):
                    d = linear.head_dim
                    sizes = [linear.num_heads * d, linear.num_kv_heads * d, linear.num_kv_heads * d]
                elif isinstance(linear, MergedColumnParallelLinear):
                    sizes = [linear.tp.shard(size).count for size in linear.output_sizes]
                else:
                    sizes = [linear.output_size]
                parts = [(part, shard) for merged, part, shard in stacked if merged == leaf]
                if len(parts) != len(sizes):
                    parts = [(leaf, None)]
                    sizes = [linear.output_size]
                for index, (name, shard) in enumerate(parts):
                    row = isinstance(linear, RowParallelLinear)
                    self.targets[f"{prefix}.{name}"] = _Target(linear, index, shard, row)
                linear.lora = LoRASlots(
                    linear.input_size,
                    sizes,
                    config.max_loras,
                    config.max_lora_rank,
                    self.mapping,
                    fused_dtype=fused_dtype if linear.weight.device.type == "cpu" else torch.float32,
                    device=linear.weight.device,
                )
                self.linears.append(linear)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # in memory, least recently used first
        self.requests: dict[int, LoRARequest] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free_slots = list(range(config.max_loras))

    # ---- adapters in memory ------------------------------------------------------------------------------

    def add(self, request: LoRARequest) -> bool:
        """Load `request`'s adapter (a no-op when it is loaded); ValueError naming what does not fit."""
        lid = request.lora_int_id
        if lid in self.adapters:
            self.adapters.move_to_end(lid)
            return False
        path, rank = request.lora_path, self.config.max_lora_rank
        if path.endswith(".gguf") and os.path.isfile(path):  # llama.cpp's format: q/k rows by the model's heads
            config = getattr(self.model, "config", None)
            adapter = load_gguf_adapter(path, request.lora_name, lid, rank, hf_config=config)
        else:
            adapter = load_adapter(path, request.lora_name, lid, rank)
        placed = {name: self._place(request.lora_name, name, module) for name, module in adapter.modules.items()}
        adapter.placed = placed  # type: ignore[attr-defined]
        self.adapters[lid] = adapter
        self.requests[lid] = request
        self._evict_memory(keep=set(self.slot_of) | {lid})
        logger.info(
            "LoRA adapter %r (id %d, rank %d, %d modules) loaded from %s",
            request.lora_name, lid, adapter.rank, len(adapter.modules), request.lora_path,
        )  # fmt: skip
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (its slot too); False when it was not loaded."""
        self.requests.pop(lora_id, None)
        found = self.adapters.pop(lora_id, None) is not None
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for linear in self.linears:
                linear.lora.clear(slot)
            self.free_slots.append(slot)
        return found

    def list(self) -> list[int]:
        return list(self.adapters)

    def _evict_memory(self, keep: set[int]) -> None:
        limit = self.config.max_cpu_loras
        for lid in list(self.adapters):
            if len(self.adapters) <= limit:
                break
            if lid not in keep:
                self.adapters.pop(lid)
                logger.info("LoRA adapter id %d dropped from memory (--max-cpu-loras %d)", lid, limit)

    def _place(self, adapter: str, name: str, module: Any) -> tuple[_Target, torch.Tensor, torch.Tensor]:
        """Where module `name` goes, and its A and B as this rank holds them."""
        ours = f"{name}."
        for theirs, mine in self.renames:
            ours = ours.replace(theirs, mine)
        target = self.targets.get(ours[:-1])
        if target is None:
            raise ValueError(
                f"LoRA adapter {adapter!r}: module {name!r} is not a linear layer adapters can target in this model "
                "(the attention's q/k/v/o and the MLP's gate/up/down projections of each layer)"
            )
        linear = target.linear
        a, b = module.a, module.b
        r = a.shape[0]
        if target.row_parallel:
            local = nn.Parameter(torch.zeros(r, linear.input_size), requires_grad=False)
            try:
                linear.weight_loader(local, a)
            except (RuntimeError, ValueError, IndexError) as e:
                raise ValueError(f"LoRA adapter {adapter!r}: {name!r} A {tuple(a.shape)} does not fit ({e})") from None
            a = local.data
            if b.shape[0] != linear.output_size:
                raise ValueError(
                    f"LoRA adapter {adapter!r}: {name!r} B {tuple(b.shape)} does not fit (the layer gives "
                    f"{linear.output_size})"
                )
        else:
            if a.shape[1] != linear.input_size:
                raise ValueError(
                    f"LoRA adapter {adapter!r}: {name!r} A {tuple(a.shape)} does not fit (the layer takes "
                    f"{linear.input_size})"
                )
            local = nn.Parameter(torch.zeros(linear.output_size, r), requires_grad=False)
            try:
                if target.shard is None:
                    linear.weight_loader(local, b)
                else:
                    linear.weight_loader(local, b, target.shard)
            except (RuntimeError, ValueError, IndexError) as e:
                raise ValueError(f"LoRA adapter {adapter!r}: {name!r} B {tuple(b.shape)} does not fit ({e})") from None
            first = linear.lora.part_offsets[target.part]
            b = local.data[first : first + linear.lora.part_sizes[target.part]]
        return target, a.contiguous(), b.contiguous()

    # ---- the step's slots --------------------------------------------------------------------------------

    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Put the step's adapters (ids; 0 is none) in slots; their slots by id."""
        needed = {int(i) for i in lora_ids if i}
        if len(needed) > self.config.max_loras:
            raise ValueError(f"a step with {len(needed)} adapters, above --max-loras {self.config.max_loras}")
        for lid in needed:
            slot = self.slot_of.get(lid)
            if slot is None:
                slot = self._take_slot(needed)
                self._fill(slot, lid)
                self.slot_of[lid] = slot
            self.slot_of.move_to_end(lid)
        return {lid: self.slot_of[lid] for lid in needed}

    def row_slots(self, lora_ids: np.ndarray) -> np.ndarray:
        """int32 slot of each row (by its adapter id; -1: none), the adapters already active."""
        out = np.full(len(lora_ids), -1, dtype=np.int32)
        for lid, slot in self.slot_of.items():
            out[lora_ids == lid] = slot
        return out

    def prepare(self, lora_ids: np.ndarray) -> None:
        """Set the mapping of the layer path's rows (their adapter ids, 0: none) to slots."""
        mapping = self.mapping
        mapping.slots = []
        for lid, slot in self.activate(set(np.unique(lora_ids).tolist())).items():
            rows = torch.from_numpy(np.flatnonzero(lora_ids == lid)).to(self.device)
            mapping.slots.append((slot, rows))

    def _take_slot(self, needed: set[int]) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        for lid, slot in self.slot_of.items():  # least recently used first
            if lid not in needed:
                del self.slot_of[lid]
                return slot
        raise RuntimeError("no LoRA slot free")  # the scheduler keeps a step within max_loras

    def _fill(self, slot: int, lid: int) -> None:
        adapter = self.adapters.get(lid)
        if adapter is None:  # dropped from memory since: read it again
            request = self.requests.get(lid)
            if request is None:
                raise RuntimeError(f"LoRA adapter id {lid} was never added")
            self.add(request)
            adapter = self.adapters[lid]
        self.adapters.move_to_end(lid)
        pairs: dict[Any, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for target, a, b in adapter.placed.values():  # type: ignore[attr-defined]
            pairs.setdefault(target.linear, {})[target.part] = (a, b)
        for linear in self.linears:
            if linear in pairs:
                linear.lora.assign(slot, pairs[linear])
            else:
                linear.lora.clear(slot)
