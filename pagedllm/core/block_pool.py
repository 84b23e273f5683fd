"""Block pool: ownership, reference counts, LRU eviction and the prefix-cache hash map of KV blocks.

Contract:
- The pool owns `num_blocks` physical KV-cache blocks, ids 0..num_blocks-1, all usable, unless it was made with
  `null_block=True`: then block 0 is the null block, which stands in a window group's block list for the blocks
  its window no longer sees. It is never free, never cached, and counts neither as used nor as free.
- Every block is in exactly one state:
    * free-uncached: ref_cnt == 0, in the free queue, block_hash is None;
    * free-cached:   ref_cnt == 0, in the free queue, block_hash set and the hash map points at it
                     (its KV content is still valid, so a prefix-cache hit can revive it);
    * in use:        ref_cnt > 0, not in the free queue (block_hash set iff the hash map points at it).
- The free queue is in eviction order: `get_new_blocks` pops from the head, and a popped block that still
  carries a hash is evicted from the hash map first. `free_blocks` appends to the tail in the caller's
  order, so the caller decides which of its blocks are evicted first.
- A hash maps to at most one block; when a second block with the same content is offered for caching the
  existing mapping wins and the newcomer stays uncached.

This module knows nothing about requests; `KVCacheManager` is its only client. Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

# One shared encoder: msgspec encoders are reusable and thread-safe for encode().
_ENCODER = msgspec.msgpack.Encoder()


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> bytes:
    """Chained content hash of one full block.

    Chaining the parent's hash makes the hash identify the whole prefix up to and including this block,
    which is what the KV content depends on (causal attention), not just this block's tokens. `extra_keys`
    carries anything else the KV depends on (a cache salt, a LoRA adapter id, ...); it must be msgpack
    encodable. msgpack gives an unambiguous, deterministic encoding (unlike str() or pickle) and sha256
    makes accidental collisions, which would silently serve wrong KV, practically impossible.
    """
    payload = _ENCODER.encode((parent_hash, list(token_ids), extra_keys))
    return hashlib.sha256(payload).digest()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical KV-cache block. Identity matters (eq=False): two blocks are never interchangeable."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the pool's hash map (it holds a reusable full block).
    block_hash: bytes | None = None
    # Links of the free queue; both None while the block is not in the queue. Kept out of repr so that
    # printing a block does not walk the whole list.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    A deque would make `remove` O(n); a prefix-cache hit on a free cached block takes it out of the
    middle of the queue, so the links live in the blocks and removal is O(1). Sentinel head/tail nodes
    remove all empty-list special cases.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(block_id=-1)
        self.tail = KVCacheBlock(block_id=-1)
        self.num_free_blocks = 0
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block at the head (the next one to evict/reuse)."""
        if self.num_free_blocks == 0:
            raise ValueError("no free blocks")
        block = self.head.next_free
        assert block is not None and block is not self.tail
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Remove `block` from anywhere in the queue in O(1)."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to evict) first. O(n): for tests and debugging."""
        out = []
        node = self.head.next_free
        while node is not None and node is not self.tail:
            out.append(node)
            node = node.next_free
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        # Cleared links are how `append`/`remove` tell whether a block is queued.
        block.prev_free = None
        block.next_free = None
        self.num_free_blocks -= 1


class BlockPool:
    """All KV blocks, their free queue and the prefix-cache map `block hash -> block`."""

    def __init__(self, num_blocks: int, enable_caching: bool, null_block: bool = False) -> None:
        if num_blocks <= int(null_block):
            raise ValueError(f"num_blocks must be positive, got {num_blocks - int(null_block)}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        # The null block (block 0) is held forever by the pool itself: one reference, never in the free queue.
        self.null_block: KVCacheBlock | None = self.blocks[0] if null_block else None
        if self.null_block is not None:
            self.null_block.ref_cnt = 1
        # Initially in id order, so a fresh pool hands out 0, 1, 2, ... (1, 2, ... with a null block)
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[int(null_block) :])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all of them but the null block."""
        return self.num_blocks - (self.null_block is not None)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their cached content."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {self.free_block_queue.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            # The block is about to be overwritten: its old content must no longer be findable.
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free cached block leaves the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue tail in the given order.

        Cached blocks keep their hash while free, so they can still be hit until they are evicted.
        """
        released = []
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def cache_full_blocks(
        self,
        request_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks [num_cached_blocks, num_full_blocks) of a request under their hashes."""
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if num_full_blocks > len(request_blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"cannot cache {num_full_blocks} blocks: request has {len(request_blocks)} blocks and "
                f"{len(block_hashes)} hashes"
            )
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = request_blocks[i], block_hashes[i]
            if block is self.null_block:  # a window group's block the window no longer sees: nothing to keep
                continue
            if block.block_hash is not None:
                # A prefix-cache hit the request took over: already registered under this same hash.
                assert block.block_hash == block_hash, f"block {block.block_id} cached under another hash"
                continue
            if block_hash in self.cached_block_hash_to_block:
                # Same content computed twice (two requests scheduled before either was cached). Keeping
                # the existing mapping keeps one block per hash; the duplicate is freed uncached.
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free), in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content. Refused (False) while any block is in use, since a running
        request's blocks must stay consistent with what other requests may have hit."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def check_invariants(self) -> None:
        """Assert the state machine in the module docstring holds. O(num_blocks): for tests/debugging."""
        queue = self.free_block_queue
        # Walk forward from the head, checking back links; the step bound catches cycles.
        queued: list[KVCacheBlock] = []
        prev, node = queue.head, queue.head.next_free
        for _ in range(self.num_blocks + 1):
            assert node is not None, f"free queue broken: node after {prev.block_id} has no next link"
            assert node.prev_free is prev, (
                f"free queue back link broken at block {node.block_id}: prev is "
                f"{None if node.prev_free is None else node.prev_free.block_id}, expected {prev.block_id}"
            )
            if node is queue.tail:
                break
            queued.append(node)
            prev, node = node, node.next_free
        else:
            raise AssertionError("free queue does not reach its tail (cycle or too many nodes)")
        assert queue.head.prev_free is None and queue.tail.next_free is None, "sentinel has outer link"
        assert len(queued) == queue.num_free_blocks, (
            f"free queue holds {len(queued)} blocks but num_free_blocks is {queue.num_free_blocks}"
        )
        queued_ids = {id(b) for b in queued}
        assert len(queued_ids) == len(queued), "a block appears twice in the free queue"
        own_ids = {id(b) for b in self.blocks}
        assert queued_ids <= own_ids, "free queue holds a block that is not in this pool"

        for block in self.blocks:
            bid = block.block_id
            assert block.ref_cnt >= 0, f"block {bid} has negative ref_cnt {block.ref_cnt}"
            in_queue = id(block) in queued_ids
            if block.ref_cnt == 0:
                assert in_queue, f"block {bid} has ref_cnt 0 but is not in the free queue"
            else:
                assert not in_queue, f"block {bid} is in use (ref_cnt {block.ref_cnt}) but in the free queue"
                assert block.prev_free is None and block.next_free is None, (
                    f"block {bid} is in use but has free-queue links"
                )
            if block.block_hash is not None:
                assert self.enable_caching, f"block {bid} carries a hash with caching disabled"
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"block {bid} carries a hash that the hash map does not map to it"
                )

        for block_hash, block in self.cached_block_hash_to_block.items():
            assert id(block) in own_ids, f"hash map points at block {block.block_id} not in this pool"
            assert block.block_hash == block_hash, (
                f"hash map entry points at block {block.block_id}, which carries a different hash"
            )

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        mapped = self.cached_block_hash_to_block.pop(block.block_hash, None)
        assert mapped is block, f"block {block.block_id} carried a hash mapped to another block"
        block.block_hash = None
