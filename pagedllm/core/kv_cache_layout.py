"""KV cache layout: which layers share a block table, and which cache tensor each layer writes.

Contract. `kv_cache_layout(windows)` takes each attention layer's sliding window (0: full attention), in layer
order, and returns a `KVCacheLayout`:
- `groups`: the KV cache groups, each a window (0: full) and the layers whose keys and values live in the group's
  blocks. A request holds one block list per group; every group's blocks come from one pool of block ids.
- `slots`: how many layers one block id stands for. Cache tensor j of a block id serves the j-th layer of whichever
  group holds it (`layer_group[l]`, `layer_slot[l]`); a group with fewer layers than `slots` leaves the rest unused.
A model without windows, or with one window for every layer, is one group of all its layers (a block id is every
layer's block, as before). A model that mixes full and window layers (Gemma 2/3, gpt-oss) gets groups of
`min(count of layers of a kind)` layers each, so that window groups can drop the blocks their window no longer sees
while full groups keep theirs (vLLM V1's hybrid allocator). The scheduler side needs only `windows` (one per group);
the worker needs the layer mapping. Plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    windows: tuple[int, ...]  # [num_groups] the group's sliding window; 0: full attention
    slots: int  # cache tensors per block id: the most layers any group has
    layer_group: tuple[int, ...]  # [num_layers] the group each layer's block table is
    layer_slot: tuple[int, ...]  # [num_layers] the cache tensor each layer reads and writes

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether any group drops blocks behind a window."""
        return any(self.windows)


def kv_cache_layout(windows: list[int] | tuple[int, ...], hybrid: bool = True) -> KVCacheLayout:
    """The layout for attention layers with these windows (0: full). `hybrid=False`: one group of every layer, full
    attention in its block accounting (the kernels still mask each layer's window)."""
    windows = [int(w) for w in windows]
    if any(w < 0 for w in windows):
        raise ValueError(f"sliding windows must be >= 0, got {windows}")
    n = len(windows)
    if n == 0:
        raise ValueError("a KV cache layout needs at least one attention layer")
    kinds: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    if not hybrid or len(kinds) == 1:
        window = windows[0] if hybrid else 0
        return KVCacheLayout((window,), n, (0,) * n, tuple(range(n)))
    size = min(len(layers) for layers in kinds.values())
    group_windows: list[int] = []
    layer_group = [0] * n
    layer_slot = [0] * n
    for w in sorted(kinds):  # full attention (0) first, then windows from the narrowest
        layers = kinds[w]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer] = len(group_windows)
                layer_slot[layer] = slot
            group_windows.append(w)
    return KVCacheLayout(tuple(group_windows), size, tuple(layer_group), tuple(layer_slot))


def blocks_for_tokens(window: int, num_tokens: int, chunk: int, block_size: int) -> int:
    """Most blocks one request of `num_tokens` tokens holds in a group with this window while prompt chunks of up to
    `chunk` tokens run (a chunk's keys are all written before the window drops the oldest)."""
    full = -(-num_tokens // block_size)
    if window == 0:
        return full
    return min(full, -(-(window - 1 + chunk) // block_size) + 1)
