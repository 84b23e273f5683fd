"""KVCacheManager: prefix hits, atomic allocation, free order and eviction, with exact block ids."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt: list[int], **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(**params), eos_token_id=None)


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def schedule_prompt(m: KVCacheManager, req: Request) -> list[int] | None:
    """What the scheduler does for a waiting request: look up, allocate the rest, mark all computed."""
    hits, num_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    if new is None:
        return None
    req.num_computed_tokens = req.num_tokens
    m.check_invariants()
    return [b.block_id for b in new[0]]


def decode_one(m: KVCacheManager, req: Request, token: int) -> list[int] | None:
    """One decode step: the sampled token is appended, then its KV slot is allocated and computed."""
    req.append_output_token_ids([token])
    new = m.allocate_slots(req, 1)
    if new is None:
        return None
    req.num_computed_tokens += 1
    m.check_invariants()
    return [b.block_id for b in new[0]]


def test_fresh_request_allocates_in_id_order() -> None:
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(10))
    assert m.get_computed_blocks(a) == ([[]], 0)
    assert schedule_prompt(m, a) == [0, 1, 2]
    assert m.get_block_ids("a") == [0, 1, 2]
    assert [b.block_id for b in m.get_blocks("a")] == [0, 1, 2]
    assert m.num_blocks_in_use() == 3
    assert m.usage == pytest.approx(3 / 8)
    # Two full blocks were hashed lazily; the partial third is not.
    assert len(a.block_hashes) == 2
    assert [b.block_hash is not None for b in m.get_blocks("a")] == [True, True, False]


def test_prefix_hit_shares_exact_blocks() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    assert schedule_prompt(m, a) == [0, 1, 2]

    # Same first 2 blocks (8 tokens), different tail.
    b = make_request("b", list(range(8)) + [100, 101, 102])
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits[0]] == [0, 1] and num_hit == 8
    # Lookup takes no reference.
    assert [blk.ref_cnt for blk in hits[0]] == [1, 1]
    new = m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)
    assert [blk.block_id for blk in new[0]] == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in m.get_blocks("a")] == [2, 2, 1]
    m.check_invariants()


def test_same_step_sharing_before_compute() -> None:
    """n>1: the second sibling hits blocks the first was allocated in this same step."""
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(9))
    a, b = make_request("a", prompt), make_request("b", prompt)
    hits, num_hit = m.get_computed_blocks(a)
    assert m.allocate_slots(a, 9 - num_hit, num_hit, hits) is not None
    # a.num_computed_tokens is still 0: nothing has run yet.
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits[0]] == [0, 1] and num_hit == 8
    new = m.allocate_slots(b, 9 - num_hit, num_hit, hits)
    assert [blk.block_id for blk in new[0]] == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in m.block_pool.blocks[:4]] == [2, 2, 1, 1]
    m.check_invariants()


def test_hit_never_covers_last_token() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(8))  # exactly 2 full blocks
    a = make_request("a", prompt)
    assert schedule_prompt(m, a) == [0, 1]
    assert all(blk.block_hash is not None for blk in m.get_blocks("a"))

    b = make_request("b", prompt)
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits[0]] == [0] and num_hit == 4
    # Block 1 is recomputed into a fresh block, which stays an uncached duplicate.
    new = m.allocate_slots(b, 4, 4, hits)
    assert [blk.block_id for blk in new[0]] == [2]
    assert m.block_pool.blocks[2].block_hash is None
    assert m.block_pool.get_cached_block(b.block_hashes[1]) is m.block_pool.blocks[1]
    m.check_invariants()

    # A one-token prompt can never hit.
    c = make_request("c", [0])
    assert m.get_computed_blocks(c) == ([[]], 0)


def test_cache_salt_separates() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(9)))
    a.cache_salt = "tenant-1"
    schedule_prompt(m, a)

    b = make_request("b", list(range(9)))
    assert m.get_computed_blocks(b) == ([[]], 0)
    c = make_request("c", list(range(9)))
    c.cache_salt = "tenant-2"
    assert m.get_computed_blocks(c) == ([[]], 0)
    d = make_request("d", list(range(9)))
    d.cache_salt = "tenant-1"
    hits, num_hit = m.get_computed_blocks(d)
    assert [blk.block_id for blk in hits[0]] == [0, 1] and num_hit == 8


def test_allocate_none_leaves_everything_unchanged() -> None:
    m = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(12)))
    assert schedule_prompt(m, a) == [0, 1, 2]
    m.free(a)
    assert free_ids(m) == [3, 4, 2, 1, 0]

    # Needs 2 hits (blocks 0, 1, both free and cached) + 3 new = 5 free blocks, but c holds one.
    c = make_request("c", [50, 51])
    assert schedule_prompt(m, c) == [3]
    b = make_request("b", list(range(8)) + list(range(200, 212)))
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits[0]] == [0, 1]
    before = (free_ids(m), [(blk.ref_cnt, blk.block_hash) for blk in m.block_pool.blocks])
    hashes_before = list(b.block_hashes)
    assert m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is None
    assert (free_ids(m), [(blk.ref_cnt, blk.block_hash) for blk in m.block_pool.blocks]) == before
    assert m.get_blocks("b") == [] and "b" not in m.req_to_blocks
    assert b.block_hashes == hashes_before
    m.check_invariants()

    # The same request fits once c leaves: 4 free + c's block.
    m.free(c)
    new = m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)
    assert [blk.block_id for blk in new[0]] == [4, 2, 3]
    assert m.get_block_ids("b") == [0, 1, 4, 2, 3]
    m.check_invariants()


def test_free_hits_count_as_consumed_free_blocks() -> None:
    """Block 0 is a free hit: 3 new + 1 revived > 3 free, although the 3 new alone would fit."""
    m = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule_prompt(m, a)
    m.free(a)
    b = make_request("b", list(range(4)) + list(range(100, 112)))  # 16 tokens: hit 1 + need 3 new
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits[0]] == [0]
    assert m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is None
    m.check_invariants()
    assert m.num_blocks_in_use() == 0


def test_free_order_tail_first() -> None:
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(10)))
    assert schedule_prompt(m, a) == [0, 1, 2]
    m.free(a)
    assert free_ids(m) == [3, 4, 5, 2, 1, 0]
    assert m.get_blocks("a") == []
    m.check_invariants()
    m.free(a)  # unknown now: no-op
    m.free(make_request("never", [1]))
    m.check_invariants()


def test_hit_on_free_cached_block_after_owner_finished() -> None:
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(10)))
    schedule_prompt(m, a)
    m.free(a)
    assert m.num_blocks_in_use() == 0

    b = make_request("b", list(range(10)))
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits[0]] == [0, 1] and num_hit == 8
    new = m.allocate_slots(b, 2, 8, hits)
    # The hits left the middle/tail of the queue; the new block comes from the head.
    assert [blk.block_id for blk in new[0]] == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert free_ids(m) == [4, 5, 2]
    assert [blk.ref_cnt for blk in m.get_blocks("b")] == [1, 1, 1]
    m.check_invariants()


def test_least_recently_freed_cached_block_evicted_first() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(0, 5)))  # blocks 0 (cached, full), 1 (partial)
    b = make_request("b", list(range(100, 105)))  # blocks 2 (cached), 3
    assert schedule_prompt(m, a) == [0, 1]
    assert schedule_prompt(m, b) == [2, 3]
    m.free(a)
    m.free(b)
    assert free_ids(m) == [1, 0, 3, 2]

    # 3 new blocks: evicts partial 1, then a's cached block 0, then partial 3; b's block 2 survives.
    c = make_request("c", list(range(200, 212)))
    assert m.get_computed_blocks(c) == ([[]], 0)
    assert schedule_prompt(m, c) == [1, 0, 3]
    assert m.block_pool.get_cached_block(a.block_hashes[0]) is None
    assert m.block_pool.blocks[0].block_hash is not None  # now holds c's first block
    assert m.block_pool.get_cached_block(b.block_hashes[0]) is m.block_pool.blocks[2]

    a2 = make_request("a2", list(range(0, 5)))
    assert m.get_computed_blocks(a2) == ([[]], 0)
    b2 = make_request("b2", list(range(100, 105)))
    hits, _ = m.get_computed_blocks(b2)
    assert [blk.block_id for blk in hits[0]] == [2]
    m.check_invariants()


def test_prefix_cache_stats() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    schedule_prompt(m, a)
    b = make_request("b", list(range(10)))
    schedule_prompt(m, b)
    stats = m.make_prefix_cache_stats()
    assert stats == PrefixCacheStats(queries=20, hits=8, requests=2, reset=False)
    assert m.make_prefix_cache_stats() == PrefixCacheStats()

    m.free(a)
    assert m.reset_prefix_cache() is False  # b still holds blocks
    m.free(b)
    assert m.reset_prefix_cache() is True
    stats = m.make_prefix_cache_stats()
    assert stats.reset and stats.queries == 0
    c = make_request("c", list(range(10)))
    assert m.get_computed_blocks(c) == ([[]], 0)
    assert m.make_prefix_cache_stats() == PrefixCacheStats(queries=10, hits=0, requests=1)


def test_prompt_logprobs_disables_hits() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    schedule_prompt(m, a)
    b = make_request("b", list(range(10)), prompt_logprobs=1)
    assert m.get_computed_blocks(b) == ([[]], 0)
    assert m.make_prefix_cache_stats().requests == 1  # b's lookup is not counted
    assert schedule_prompt(m, b) == [3, 4, 5]
    m.check_invariants()


def test_caching_disabled() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(10)))
    assert schedule_prompt(m, a) == [0, 1, 2]
    assert a.block_hashes == []
    b = make_request("b", list(range(10)))
    assert m.get_computed_blocks(b) == ([[]], 0)
    assert m.make_prefix_cache_stats() == PrefixCacheStats()
    m.check_invariants()


def test_decode_growth_allocates_exactly_at_block_boundary() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(6)))
    assert schedule_prompt(m, a) == [0, 1]
    # Tokens 7 and 8 fill block 1 (positions 6, 7).
    assert decode_one(m, a, 1000) == []
    assert m.get_blocks("a")[1].block_hash is None
    assert decode_one(m, a, 1001) == []
    # Block 1 is now full (its last token is being computed this step) and gets cached.
    assert len(a.block_hashes) == 2
    assert m.get_blocks("a")[1].block_hash == a.block_hashes[1]
    # Position 8 is the first of a new block.
    assert decode_one(m, a, 1002) == [2]
    assert m.get_block_ids("a") == [0, 1, 2]
    for t in range(3):
        assert decode_one(m, a, 2000 + t) == []
    assert decode_one(m, a, 3000) == [3]
    assert m.get_block_ids("a") == [0, 1, 2, 3]

    # Output tokens are part of the cacheable prefix.
    b = make_request("b", list(range(6)) + [1000, 1001, 1002, 2000, 2000])
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits[0]] == [0, 1] and num_hit == 8


def test_chunked_prefill_caches_only_scheduled_blocks() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(14)))
    assert [blk.block_id for blk in m.allocate_slots(a, 6)[0]] == [0, 1]
    # Only block 0 is full within the first 6 tokens.
    assert len(a.block_hashes) == 1
    assert [blk.block_hash is not None for blk in m.get_blocks("a")] == [True, False]
    a.num_computed_tokens = 6
    assert [blk.block_id for blk in m.allocate_slots(a, 6)[0]] == [2]
    a.num_computed_tokens = 12
    assert [blk.block_hash is not None for blk in m.get_blocks("a")] == [True, True, True]
    assert [blk.block_id for blk in m.allocate_slots(a, 2)[0]] == [3]
    m.check_invariants()


def test_preempt_and_resume_hits_own_blocks() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(6)))
    schedule_prompt(m, a)
    decode_one(m, a, 7)
    decode_one(m, a, 8)
    decode_one(m, a, 9)  # 9 tokens: blocks 0, 1 full, 2 partial
    m.free(a)  # preempted
    a.num_computed_tokens = 0
    hits, num_hit = m.get_computed_blocks(a)
    assert [blk.block_id for blk in hits[0]] == [0, 1] and num_hit == 8
    new = m.allocate_slots(a, a.num_tokens - num_hit, num_hit, hits)
    assert [blk.block_id for blk in new[0]] == [3]
    assert m.get_block_ids("a") == [0, 1, 3]
    m.check_invariants()


def test_allocate_slots_rejects_inconsistent_hits() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    schedule_prompt(m, a)
    b = make_request("b", list(range(10)))
    hits, num_hit = m.get_computed_blocks(b)
    with pytest.raises(ValueError):
        m.allocate_slots(b, 2, num_hit - 1, hits)
    with pytest.raises(ValueError):
        m.allocate_slots(b, -1)
    m.check_invariants()


def test_check_invariants_detects_ref_count_mismatch() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(5)))
    schedule_prompt(m, a)
    m.get_blocks("a")[0].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref_cnt 2"):
        m.check_invariants()


@pytest.mark.parametrize("windows", [(0,), (6,), (0, 6), (0, 9, 9)], ids=["full", "window", "hybrid", "hybrid3"])
@pytest.mark.parametrize("seed", range(5))
def test_random_schedule_keeps_invariants(seed: int, windows: tuple[int, ...]) -> None:
    """Scheduler-like random walk: admit with prefix hits, chunked prefill, decode, preempt, finish. With KV cache
    groups (a window, full and window groups), every key a computed token attends to (its window's, in a window
    group) is in a block the request holds, written with that token, whatever was dropped, hit or evicted."""
    import random

    rng = random.Random(seed)
    num_blocks = 10 * len(windows)
    m = KVCacheManager(num_blocks=num_blocks, block_size=BS, windows=windows)
    null = m.null_block
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    waiting: list[Request] = []
    running: list[Request] = []
    # Simulated KV: block id -> token written at each slot, so hits can be checked against real content.
    kv: dict[int, list[int | None]] = {i: [None] * BS for i in range(num_blocks)}

    def compute(req: Request, start: int, n: int) -> None:
        tokens = req.all_token_ids
        for g, window in enumerate(windows):
            blocks = m.get_blocks(req.request_id, g)
            for pos in range(start, start + n):
                assert blocks[pos // BS] is not null
                kv[blocks[pos // BS].block_id][pos % BS] = tokens[pos]
            for pos in range(start, start + n):  # what attention reads
                for seen in range(0 if window == 0 else max(0, pos - window + 1), pos):
                    block = blocks[seen // BS]
                    assert block is not null, f"group {g}: token {pos} sees {seen}, dropped"
                    assert kv[block.block_id][seen % BS] == tokens[seen]
        req.num_computed_tokens = start + n

    for step in range(300):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            waiting.append(make_request(f"r{step}", prompt))
        # Running requests: finish a chunked prefill or decode one token.
        for req in list(running):
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids([rng.randrange(50)])
            n = min(req.num_tokens - req.num_computed_tokens, rng.randrange(1, 9))
            if m.allocate_slots(req, n) is None:
                # Preempt: release everything and start over later.
                m.free(req)
                req.num_computed_tokens = 0
                running.remove(req)
                waiting.append(req)
            else:
                compute(req, req.num_computed_tokens, n)
            m.check_invariants()
        # Admit waiting requests while they fit.
        while waiting:
            req = waiting[0]
            hits, num_hit = m.get_computed_blocks(req)
            assert num_hit < req.num_tokens and len(hits) == len(windows)
            for g, group_hits in enumerate(hits):
                assert len(group_hits) * BS == num_hit
                keys = m.get_group_keys(req, g) if g else req.block_hashes
                for i, blk in enumerate(group_hits):
                    if blk is null:
                        assert windows[g] and (i + 1) * BS <= num_hit - windows[g] + 1
                        continue
                    assert blk.block_hash == keys[i]
                    assert kv[blk.block_id] == req.all_token_ids[i * BS : (i + 1) * BS]
            n = min(req.num_tokens - num_hit, rng.randrange(1, 9))
            if m.allocate_slots(req, n, num_hit, hits) is None:
                m.check_invariants()
                break
            compute(req, num_hit, n)
            running.append(waiting.pop(0))
            m.check_invariants()
        for req in list(running):
            if req.num_output_tokens > rng.randrange(2, 12):
                m.free(req)
                running.remove(req)
                m.check_invariants()
        held = {id(b) for r in running for g in range(len(windows)) for b in m.get_blocks(r.request_id, g)}
        held.discard(id(null))
        assert m.num_blocks_in_use() == len(held)
    for req in running:
        m.free(req)
    m.check_invariants()
    assert m.num_blocks_in_use() == 0 and m.usage == 0.0


def test_window_group_drops_blocks_behind_its_window() -> None:
    """Groups (full, window 6) with 4-token blocks: a 20-token request holds 5 blocks in the full group and, in the
    window group, only those its next token sees; the dropped ones stay cached, in the free queue."""
    m = KVCacheManager(num_blocks=16, block_size=BS, windows=(0, 6))
    assert m.null_block is not None and m.null_block.block_id == 0
    a = make_request("a", range(18))
    hits, num_hit = m.get_computed_blocks(a)
    assert num_hit == 0 and hits == [[], []]
    new = m.allocate_slots(a, 18, 0, hits)
    assert [len(g) for g in new] == [5, 5]  # the whole prompt's keys are written before any is dropped
    a.num_computed_tokens = 18
    a.append_output_token_ids([99])
    assert m.allocate_slots(a, 1) == [[], []]
    # The token at 18 sees 13..18: blocks 3 (12..15) and 4 (16..19); 0..2 dropped.
    window_blocks = m.get_blocks("a", 1)
    assert window_blocks[:3] == [m.null_block] * 3 and m.null_block not in window_blocks[3:]
    assert m.num_held_blocks("a") == 5 + 2
    assert m.num_blocks_in_use() == 7 and m.usage == pytest.approx(7 / 15)
    m.check_invariants()
    dropped = [b for b in m.block_pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
    assert len(dropped) == 3  # still cached (the full blocks 0..2 of the window group)
    m.free(a)
    m.check_invariants()
    assert m.num_blocks_in_use() == 0


def test_window_group_hit_needs_only_the_window() -> None:
    """A second request with the same 21 tokens hits all 5 full blocks: the full group has them all, the window
    group those the token at 20 sees (3 and 4); the dropped ones become the null block. Once block 4 of the window
    group is evicted, the hit shrinks to what both groups can serve."""
    m = KVCacheManager(num_blocks=16, block_size=BS, windows=(0, 6))
    prompt = list(range(21))
    a = make_request("a", prompt)
    assert m.allocate_slots(a, 21) is not None
    a.num_computed_tokens = 21
    m.free(a)
    b = make_request("b", prompt)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 20
    assert hits[0] == [m._cached(0, h) for h in b.block_hashes[:5]]
    assert hits[1][:3] == [m.null_block] * 3 and None not in hits[1][3:]
    assert m.allocate_slots(b, 1, num_hit, hits) is not None
    m.check_invariants()
    m.free(b)
    # Evict the window group's block 4: a hit must now end where the window group can serve it.
    m.block_pool._evict(m._cached(1, b.block_hashes[4]))
    c = make_request("c", prompt)
    hits, num_hit = m.get_computed_blocks(c)
    # 16 tokens: the token at 16 sees 11..16 (blocks 2 and 3), both cached in the window group.
    assert num_hit == 16 and hits[1][:2] == [m.null_block] * 2
    assert m.allocate_slots(c, 5, num_hit, hits) is not None
    m.check_invariants()
