"""KV cache manager: which blocks each request holds, prefix-cache lookups, and slot allocation.

Contract (the scheduler is the only caller; this module only calls `BlockPool`):
- `get_computed_blocks(request)` finds the longest run of cached full blocks matching the request's
  tokens, never covering the last token (its logits must be computed). It takes no references.
- `allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)` is atomic:
  it either returns the newly allocated blocks (after taking references on the hit blocks, appending them
  and the new blocks to the request, and registering every block that will be full once this step's
  tokens are computed in the prefix cache), or returns None and changes nothing.
- Blocks are cached as soon as they are allocated for tokens scheduled in this step, before the model has
  run. That is what lets a later request scheduled in the same step (e.g. the n>1 siblings of a prompt)
  hit them: the worker writes all of a step's KV for a layer before any attention in that layer reads it.
  Drafts are not tokens of the request yet: `cache_blocks` registers the blocks accepted drafts filled once
  the scheduler has their verification (rejected drafts' slots never are: they are written again first).
- `free(request)` releases the request's blocks tail first, so its last blocks are evicted before its
  first ones, which are the likeliest to be shared prefixes.
- Block hashes are computed lazily into `request.block_hashes` (chained; `(request.cache_salt,)` is mixed
  into every block's hash when a salt is set).
- KV cache groups (core/kv_cache_layout.py): a request holds one block list per group, every list indexed by
  block position, all from one pool; blocks, hits and new blocks travel as one list per group. A group with a
  sliding window keeps only the blocks its window can still see: before each allocation the blocks wholly behind
  the window of the request's next token become the pool's null block (freed, their cached content kept for
  prefix hits until evicted), and a prefix hit needs, in a window group, only the blocks within the window of
  the hit's end. A prefix is cached per group (a group's hash key carries the group's index), and a hit is the
  longest prefix every group can serve.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters accumulated since the last `make_prefix_cache_stats` call."""

    # Tokens looked up (the request's num_tokens; equal to its prompt length unless it was preempted).
    queries: int = 0
    # Of those, tokens found in the cache.
    hits: int = 0
    # Number of requests looked up.
    requests: int = 0
    # True if the prefix cache was reset in the interval (so a hit-rate drop is explainable).
    reset: bool = False


class KVCacheManager:
    """Per-request block lists (one per KV cache group) on top of a `BlockPool`, with prefix caching."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, windows: tuple[int, ...] = (0,)
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not windows or any(w < 0 for w in windows):
            raise ValueError(f"windows must be one per group, each >= 0, got {windows}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(int(w) for w in windows)
        self.num_groups = len(self.windows)
        self.block_pool = BlockPool(num_blocks, enable_caching, null_block=any(self.windows))
        self.null_block = self.block_pool.null_block
        # request_id -> the request's blocks per group, in token order (the null block where a window dropped one).
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        # request_id -> how many of its leading blocks have already been offered to the prefix cache, so
        # each step only hashes/caches the blocks that became full since the previous one.
        self.num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()

    def empty(self) -> list[list[KVCacheBlock]]:
        """No blocks: one empty list per group."""
        return [[] for _ in self.windows]

    # ---------------------------------------------------------------- lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Longest cached prefix of full blocks every group can serve: (blocks per group, number of tokens)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
            return self.empty(), 0
        # Stop one token short: at least the last token must be computed to produce logits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_block_hashes(request, max_hit_blocks)
        hashes = request.block_hashes[:max_hit_blocks]
        n = max_hit_blocks
        settled = False
        while not settled:  # a group's hit bounds the others'; full groups' hits hold for any shorter length
            settled = True
            for g, window in enumerate(self.windows):
                m = self._group_hit(g, window, hashes, n)
                if m < n:
                    n, settled = m, self.num_groups == 1  # one group: its own hit needs no second look
        hits = self.empty()
        for g, window in enumerate(self.windows):
            lo = self._first_needed(window, n * self.block_size)
            assert self.null_block is not None or lo == 0
            hits[g] = [self.null_block] * lo + [self._cached(g, hashes[j]) for j in range(lo, n)]  # type: ignore
        num_hit_tokens = n * self.block_size
        self._stats.requests += 1
        self._stats.queries += request.num_tokens
        self._stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def _group_hit(self, group: int, window: int, hashes: list[bytes], n: int) -> int:
        """The most blocks m <= n of a prefix hit group `group` can serve: the blocks the token after them sees."""
        if window == 0:  # full attention: the cached prefix (hashes are chained: nothing after a miss can hit)
            m = 0
            while m < n and self._cached(group, hashes[m]) is not None:
                m += 1
            return m
        m = n
        while m > 0:
            lo = self._first_needed(window, m * self.block_size)
            j = m - 1
            while j >= lo and self._cached(group, hashes[j]) is not None:
                j -= 1
            if j < lo:
                return m
            m = j  # a hit must end before the missing block
        return 0

    def _first_needed(self, window: int, position: int) -> int:
        """The first block a token at `position` sees in a group with this window (0 for full attention)."""
        return 0 if window == 0 else max(0, position - window + 1) // self.block_size

    def _cached(self, group: int, block_hash: bytes) -> KVCacheBlock | None:
        return self.block_pool.get_cached_block(_group_key(group, block_hash))

    # ------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
    ) -> list[list[KVCacheBlock]] | None:
        """Make room for num_computed_tokens + num_new_computed_tokens + num_new_tokens tokens.

        Returns the newly allocated blocks of each group (possibly empty), or None when the pool cannot supply
        them; then nothing has changed but that blocks behind a window were dropped (as they would be anyway).
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}"
            )
        new_computed_blocks = new_computed_blocks or self.empty()
        if len(new_computed_blocks) != self.num_groups:
            raise ValueError(f"{len(new_computed_blocks)} lists of computed blocks for {self.num_groups} groups")
        req_blocks = self.req_to_blocks.get(request.request_id) or self.empty()
        num_hit_blocks = len(new_computed_blocks[0])
        if num_hit_blocks:
            # Hit blocks go right after the blocks the request already holds, so those must be exactly
            # full of computed tokens, and the hit must be whole blocks.
            if num_new_computed_tokens != num_hit_blocks * self.block_size:
                raise ValueError(
                    f"{num_hit_blocks} computed blocks hold "
                    f"{num_hit_blocks * self.block_size} tokens, not {num_new_computed_tokens}"
                )
            if len(req_blocks[0]) * self.block_size != request.num_computed_tokens:
                raise ValueError(
                    f"request {request.request_id} holds {len(req_blocks[0])} blocks for "
                    f"{request.num_computed_tokens} computed tokens; cannot append prefix-cache hits"
                )
        if request.request_id in self.req_to_blocks:
            self._drop_unseen_blocks(request, request.num_computed_tokens + num_new_computed_tokens)

        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required_blocks = -(-total_tokens // self.block_size)
        counts = [
            max(0, num_required_blocks - len(held) - len(hits)) for held, hits in zip(req_blocks, new_computed_blocks)
        ]
        # Touching a hit block that is free (ref 0, cached) takes it out of the free queue, so it
        # consumes a free block just like a new allocation does.
        num_free_hits = sum(1 for hits in new_computed_blocks for block in hits if block.ref_cnt == 0)
        if sum(counts) + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        # Touch the hits before allocating: otherwise get_new_blocks could evict a free hit block.
        new_blocks = self.empty()
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        for g, hits in enumerate(new_computed_blocks):
            if hits:
                self.block_pool.touch(hits)
                req_blocks[g].extend(hits)
        for g, count in enumerate(counts):
            new_blocks[g] = self.block_pool.get_new_blocks(count)
            req_blocks[g].extend(new_blocks[g])

        self.cache_blocks(request, total_tokens)
        return new_blocks

    def _drop_unseen_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """In each window group, free the request's blocks its next token (at `num_computed_tokens`) no longer
        sees, putting the null block in their place; blocks behind it were dropped before. Tail first, as `free`."""
        null = self.null_block
        for g, window in enumerate(self.windows):
            if window == 0:
                continue
            blocks = self.req_to_blocks[request.request_id][g]
            lo = min(self._first_needed(window, num_computed_tokens), len(blocks))
            dropped = []
            for j in range(lo - 1, -1, -1):
                if blocks[j] is null:
                    break
                dropped.append(blocks[j])
                blocks[j] = null  # type: ignore[assignment]
            if dropped:
                self.block_pool.free_blocks(dropped)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register in the prefix cache the request's blocks full of its first `num_tokens` tokens (those whose KV
        is, or is being, computed) that are not registered yet. Only tokens whose ids are known can be hashed:
        speculative drafts are not, so the blocks accepted drafts fill are registered after their verification,
        through this call, and so are those a request's last verification filled before it finished."""
        if not self.enable_caching:
            return
        req_blocks = self.req_to_blocks.get(request.request_id)
        if not req_blocks:
            return
        num_full_blocks = min(min(num_tokens, request.num_tokens) // self.block_size, len(req_blocks[0]))
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks > num_cached:
            self._ensure_block_hashes(request, num_full_blocks)
            for g, blocks in enumerate(req_blocks):
                keys = _GroupKeys(request.block_hashes, g) if g else request.block_hashes
                self.block_pool.cache_full_blocks(blocks, keys, num_cached, num_full_blocks)
            self.num_cached_blocks[request.request_id] = num_full_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `allocate_slots(request, num_new_tokens)` (no prefix hits) would take from the pool, at most."""
        held = self.req_to_blocks.get(request.request_id) or self.empty()
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return sum(max(0, need - len(blocks)) for blocks in held)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first. A no-op for a request holding nothing."""
        groups = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        for blocks in groups or ():
            # Reverse order: the free queue evicts from its head, and a request's tail blocks are the
            # least likely to be shared, so they should go first.
            self.block_pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------ accessors

    def get_blocks(self, request_id: str, group: int = 0) -> list[KVCacheBlock]:
        """A copy of the request's block list in a group (empty for an unknown request)."""
        groups = self.req_to_blocks.get(request_id)
        return list(groups[group]) if groups else []

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        return [block.block_id for block in self.get_blocks(request_id, group)]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids, one list per group (the null block's id where a window dropped a block)."""
        groups = self.req_to_blocks.get(request_id) or self.empty()
        return [[block.block_id for block in blocks] for blocks in groups]

    def get_group_keys(self, request: Request, group: int) -> Sequence[bytes]:
        """The prefix-cache keys of the request's hashed blocks in a group."""
        return _GroupKeys(request.block_hashes, group) if group else request.block_hashes

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks of the pool the request holds (the null block not counted)."""
        groups = self.req_to_blocks.get(request_id) or ()
        return sum(1 for blocks in groups for block in blocks if block is not self.null_block)

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_blocks_in_use(self) -> int:
        return self.block_pool.num_usable_blocks - self.block_pool.get_num_free_blocks()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the previous call; resets them."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content; False (and no change) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._stats.reset = True
        return True

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's ref_cnt is the number of requests holding it, every group's list is
        as long as the others', and a window group holds the null block only behind its live blocks."""
        self.block_pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, groups in self.req_to_blocks.items():
            assert len(groups) == self.num_groups, f"request {request_id} has {len(groups)} block lists"
            assert len({len(blocks) for blocks in groups}) == 1, f"request {request_id}'s groups differ in length"
            for g, blocks in enumerate(groups):
                live = [b for b in blocks if b is not self.null_block]
                assert blocks[len(blocks) - len(live) :] == live, f"request {request_id} group {g}: null after live"
                assert self.windows[g] or len(live) == len(blocks), f"request {request_id}: null in a full group"
                ids = [id(block) for block in live]
                assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice"
                holders.update(ids)
        for block in self.block_pool.blocks:
            if block is self.null_block:
                assert block.ref_cnt == 1 and block.block_hash is None, "the null block is held once, uncached"
                continue
            num_holders = holders[id(block)]
            assert block.ref_cnt == num_holders, (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {num_holders} requests hold it"
            )
        for request_id, num_cached in self.num_cached_blocks.items():
            assert num_cached <= len(self.get_blocks(request_id)), (
                f"request {request_id} has {num_cached} cached blocks but holds fewer"
            )

    # -------------------------------------------------------------- helpers

    def _ensure_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend request.block_hashes to cover its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        if len(hashes) >= num_blocks:
            return
        # An adapter changes every token's KV: a request's blocks are keyed by its adapter's id.
        keys = tuple(k for k in (request.cache_salt, request.lora_id and ("lora", request.lora_id)) if k)
        extra_keys = keys or None
        token_ids = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            block_tokens = token_ids[i * bs : (i + 1) * bs]
            # Only full blocks are hashed: a partial block's content is still changing.
            assert len(block_tokens) == bs, f"block {i} of request {request.request_id} is not full"
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(hash_block_tokens(parent, block_tokens, extra_keys))


class _GroupKeys(Sequence[bytes]):
    """A request's block hashes as group `group`'s prefix-cache keys, computed as they are read."""

    def __init__(self, hashes: list[bytes], group: int) -> None:
        self.hashes, self.group = hashes, group

    def __len__(self) -> int:
        return len(self.hashes)

    def __getitem__(self, i):  # type: ignore[override]
        return _group_key(self.group, self.hashes[i])


def _group_key(group: int, block_hash: bytes) -> bytes:
    """The prefix-cache key of a block of group `group` (group 0's is the block hash itself)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
