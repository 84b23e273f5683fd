"""Tensor-parallel group state seen by the layers: rank, world size and the all-reduce/all-gather they need.

With no process group initialised (the only mode today) the world size is 1 and the collectives are
identities, so the layers run unchanged on one device. Initialising `torch.distributed` with a world size
above one makes the same layers shard themselves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def get_tp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results across the tensor-parallel group (identity on one device)."""
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate shards along `dim` across the tensor-parallel group (identity on one device)."""
    world = get_tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
