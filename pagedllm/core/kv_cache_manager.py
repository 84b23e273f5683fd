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
"""

from __future__ import annotations

from collections import Counter
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
    """Per-request block lists on top of a `BlockPool`, with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request_id -> the request's blocks, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its leading blocks have already been offered to the prefix cache, so
        # each step only hashes/caches the blocks that became full since the previous one.
        self.num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()

    # ---------------------------------------------------------------- lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks: (blocks, number of tokens they hold)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
            return [], 0
        # Stop one token short: at least the last token must be computed to produce logits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_block_hashes(request, max_hit_blocks)
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                # Hashes are chained, so nothing after the first miss can be a valid prefix hit.
                break
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        self._stats.requests += 1
        self._stats.queries += request.num_tokens
        self._stats.hits += num_hit_tokens
        return hit_blocks, num_hit_tokens

    # ------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_computed_tokens + num_new_computed_tokens + num_new_tokens tokens.

        Returns the newly allocated blocks (possibly empty), or None when the pool cannot supply them;
        in that case nothing has changed.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}"
            )
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        if new_computed_blocks:
            # Hit blocks go right after the blocks the request already holds, so those must be exactly
            # full of computed tokens, and the hit must be whole blocks.
            if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
                raise ValueError(
                    f"{len(new_computed_blocks)} computed blocks hold "
                    f"{len(new_computed_blocks) * self.block_size} tokens, not {num_new_computed_tokens}"
                )
            if len(req_blocks) * self.block_size != request.num_computed_tokens:
                raise ValueError(
                    f"request {request.request_id} holds {len(req_blocks)} blocks for "
                    f"{request.num_computed_tokens} computed tokens; cannot append prefix-cache hits"
                )

        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required_blocks = -(-total_tokens // self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(new_computed_blocks))
        # Touching a hit block that is free (ref 0, cached) takes it out of the free queue, so it
        # consumes a free block just like a new allocation does.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        # Touch the hits before allocating: otherwise get_new_blocks could evict a free hit block.
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        self.cache_blocks(request, total_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register in the prefix cache the request's blocks full of its first `num_tokens` tokens (those whose KV
        is, or is being, computed) that are not registered yet. Only tokens whose ids are known can be hashed:
        speculative drafts are not, so the blocks accepted drafts fill are registered after their verification,
        through this call, and so are those a request's last verification filled before it finished."""
        if not self.enable_caching:
            return
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_full_blocks = min(min(num_tokens, request.num_tokens) // self.block_size, len(req_blocks))
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks > num_cached:
            self._ensure_block_hashes(request, num_full_blocks)
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full_blocks)
            self.num_cached_blocks[request.request_id] = num_full_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `allocate_slots(request, num_new_tokens)` (no prefix hits) would take from the pool."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - held)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first. A no-op for a request holding nothing."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            # Reverse order: the free queue evicts from its head, and a request's tail blocks are the
            # least likely to be shared, so they should go first.
            self.block_pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------ accessors

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """A copy of the request's block list (empty for an unknown request)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_blocks_in_use(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.get_num_free_blocks()

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
        """Pool invariants, plus: each block's ref_cnt is the number of requests holding it."""
        self.block_pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, blocks in self.req_to_blocks.items():
            ids = [id(block) for block in blocks]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice"
            holders.update(ids)
        for block in self.block_pool.blocks:
            num_holders = holders[id(block)]
            assert block.ref_cnt == num_holders, (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {num_holders} requests hold it"
            )
        for request_id, num_cached in self.num_cached_blocks.items():
            assert num_cached <= len(self.req_to_blocks.get(request_id, ())), (
                f"request {request_id} has {num_cached} cached blocks but holds fewer"
            )

    # -------------------------------------------------------------- helpers

    def _ensure_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend request.block_hashes to cover its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        if len(hashes) >= num_blocks:
            return
        extra_keys = None if request.cache_salt is None else (request.cache_salt,)
        token_ids = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            block_tokens = token_ids[i * bs : (i + 1) * bs]
            # Only full blocks are hashed: a partial block's content is still changing.
            assert len(block_tokens) == bs, f"block {i} of request {request.request_id} is not full"
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(hash_block_tokens(parent, block_tokens, extra_keys))
