"""The tensor-parallel group of one worker, and how a model's heads and rows are split across its ranks.

Contract.
* `TensorParallelGroup(rank, world_size, group, shm)`: what a layer needs to shard itself and combine the shards:
  its rank and the group's size, `all_reduce` (sum, in place), `all_gather` (concatenate along a dimension) and
  `broadcast` (from rank 0; `broadcast_token_ids` for sampled tokens). With `world_size == 1` (the default,
  `TensorParallelGroup()`) every collective is the identity and nothing touches `torch.distributed`. Above one,
  `group` is the worker's torch.distributed process group (gloo on the CPU, nccl on CUDA) and `shm`, when given,
  a shared-memory all-reduce between the ranks of one machine (distributed/shm_allreduce.py) that float32 CPU
  sums, gathers (a sum of zero-padded parts) and token broadcasts (float32 below 2**24, added to zeros) go
  through instead of gloo.
* The loader hands the group to the model through `KernelDispatch.tp`; each layer keeps the one it was built
  with. Nothing here is module-level state: one process may hold several groups (tests build several models).
* `attention_shard(num_heads, num_kv_heads, world_size, rank)`: which query and KV heads a rank holds. With at least
  as many KV heads as ranks, each rank holds whole KV groups (a KV head and its query heads), as evenly as they go
  (9 heads in 3 groups on 2 ranks: 6 + 3). With fewer KV heads than ranks, each KV head is replicated on
  `world_size / num_kv_heads` ranks, which split its query heads. Any other split is a `ValueError` naming the
  sizes: `check_tensor_parallel` runs it for a model's config at startup.
* `even_shard(size, world_size, rank)`: a contiguous (first, count) range of `size` rows, the first ranks taking
  one more when it does not divide. `block_shard` (what `TensorParallelGroup.shard` gives linear layers) does the
  same over units of 256 rows where there are enough of them, so that row-parallel splits cut no quantized block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # imported where used: the CLI checks a model's split (check_tensor_parallel) before torch loads
    import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup (world_size > 1)
    shm: Any = None  # ShmAllReduce between the ranks of one machine, or None (gloo)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns it."""
        if self.world_size == 1:
            return x
        if self._shm_applies(x) and x.is_contiguous():
            self.shm.all_reduce(x)
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` (equal shapes) concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        import torch

        if self._shm_applies(x):
            # Through the shared-memory sum: each rank places its part in zeros, the sum is the concatenation (and
            # exact: x + 0 is x). Tens of microseconds where gloo's all_gather takes a millisecond or more.
            parts = torch.zeros((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            parts[self.rank].copy_(x)
            self.shm.all_reduce(parts)
            return torch.cat(parts.unbind(0), dim=dim)
        import torch.distributed as dist

        gathered = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(gathered, x.contiguous(), group=self.group)
        return torch.cat(gathered, dim=dim)

    def _shm_applies(self, x: torch.Tensor) -> bool:
        import torch

        return self.shm is not None and x.device.type == "cpu" and x.dtype == torch.float32

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place; returns it."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.broadcast(x, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return x

    def broadcast_token_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's token ids (a 1-D int64 CPU tensor, every value below 2**24) on every rank, in place. With the
        shared-memory sum they travel as float32 (exact below 2**24) added to the other ranks' zeros, in
        microseconds; else through `broadcast`."""
        if self.world_size == 1:
            return ids
        import torch

        if self.shm is None or ids.device.type != "cpu":
            return self.broadcast(ids)
        carrier = ids.to(torch.float32) if self.rank == 0 else torch.zeros(ids.shape, dtype=torch.float32)
        self.shm.all_reduce(carrier)
        ids.copy_(carrier.to(torch.int64))
        return ids

    def shard(self, size: int) -> Shard:
        """This rank's part of `size` rows of a linear layer: `block_shard`, so that a row-parallel split of a
        quantized weight's inputs falls on whole blocks and the weight runs as stored on every rank."""
        return block_shard(size, self.world_size, self.rank)


class Shard(NamedTuple):
    first: int
    count: int


class AttentionShard(NamedTuple):
    first_head: int  # first query head of this rank
    num_heads: int
    first_kv_head: int
    num_kv_heads: int


def even_shard(size: int, world_size: int, rank: int) -> Shard:
    """Rows [first, first + count) of `size` for `rank`: contiguous, the first `size % world_size` ranks one more."""
    base, extra = divmod(size, world_size)
    return Shard(rank * base + min(rank, extra), base + (rank < extra))


# Split points of linear layers' rows fall on multiples of this (a GGUF K-quant's super-block, so a whole number of
# any GGML type's blocks) where every rank still gets one: Qwen2.5-0.5B's 4,864 MLP columns split 2,560 + 2,304, not
# 2,432 + 2,432, and its Q4_K/Q6_K down projections then run as stored at TP=2 instead of de-quantized.
SHARD_UNIT = 256


def block_shard(size: int, world_size: int, rank: int, unit: int = SHARD_UNIT) -> Shard:
    """Rows [first, first + count) of `size` for `rank`: `even_shard` over whole units of `unit` rows (the last
    unit may be short) when there are at least `world_size` of them, else `even_shard` over rows."""
    units = -(-size // unit)
    if units < world_size:
        return even_shard(size, world_size, rank)
    part = even_shard(units, world_size, rank)
    first = part.first * unit
    return Shard(first, min(size, (part.first + part.count) * unit) - first)


def attention_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> AttentionShard:
    """The query and KV heads `rank` holds (see the module docstring); ValueError naming the sizes if none fits."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not form groups over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv = even_shard(num_kv_heads, world_size, rank)
        return AttentionShard(kv.first * group, kv.count * group, kv.first, kv.count)
    replicas, rest = divmod(world_size, num_kv_heads)
    if rest or group % replicas:
        raise ValueError(
            f"tensor_parallel_size {world_size} cannot split this model's attention: {num_heads} query heads over "
            f"{num_kv_heads} KV heads (with fewer KV heads than ranks, the size must be a multiple of the KV heads "
            f"and divide each KV head's {group} query heads evenly); choose a size at most {num_kv_heads}"
        )
    kv = rank // replicas
    per = group // replicas
    return AttentionShard(kv * group + (rank % replicas) * per, per, kv, 1)


def check_tensor_parallel(hf_config: Any, world_size: int) -> None:
    """ValueError naming the value if a model with this config cannot run on `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {world_size}")
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if world_size > heads:
        raise ValueError(
            f"tensor_parallel_size {world_size} is larger than the model's {heads} attention heads; use at most {heads}"
        )
    attention_shard(heads, kv_heads, world_size, 0)
