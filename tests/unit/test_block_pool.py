"""BlockPool / FreeKVCacheBlockQueue: exact block ids, eviction order and invariant checking."""

from __future__ import annotations

import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


# ------------------------------------------------------------------ hashing


def test_hash_is_deterministic_and_chained() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))
    assert isinstance(a, bytes) and len(a) == 32
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    # Same tokens, different parent -> different hash.
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])
    # Extra keys (salt, LoRA id) separate otherwise equal blocks.
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != a
    assert hash_block_tokens(None, [1, 2, 3, 4], ("x",)) != hash_block_tokens(None, [1, 2, 3, 4], ("y",))


# -------------------------------------------------------------- free queue


def test_free_queue_ops() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    assert q.popleft() is blocks[0]
    assert ids(q.popleft_n(2)) == [1, 3]
    q.append(blocks[2])
    q.append_n([blocks[0], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [4, 2, 0, 1]
    with pytest.raises(ValueError):
        q.append(blocks[0])
    q.remove(blocks[1])  # the tail
    q.remove(blocks[4])  # the head
    assert ids(q.get_all_free_blocks()) == [2, 0] and q.num_free_blocks == 2
    with pytest.raises(ValueError):
        q.popleft_n(3)
    assert ids(q.popleft_n(2)) == [2, 0]
    with pytest.raises(ValueError):
        q.popleft()
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []


# -------------------------------------------------------------------- pool


def test_initial_state() -> None:
    pool = BlockPool(4, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    pool.check_invariants()


def test_allocate_free_reallocate_exact_ids() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_usage() == 0.75
    pool.check_invariants()

    # Freed in the given order (2, 0, 1) behind the never-used block 3.
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert free_ids(pool) == [3, 2, 0, 1]
    pool.check_invariants()

    again = pool.get_new_blocks(4)
    assert ids(again) == [3, 2, 0, 1]
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.check_invariants()


def test_get_new_blocks_too_many_changes_nothing() -> None:
    pool = BlockPool(3, enable_caching=True)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [2]
    pool.check_invariants()


def test_shared_block_freed_only_when_last_reference_drops() -> None:
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and free_ids(pool) == [1]
    pool.check_invariants()
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and free_ids(pool) == [1, 0]
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.free_blocks([b])


def test_cached_free_block_stays_hittable_then_lru_eviction_clears_hash() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2
    hashes = [h(0), h(1), h(2)]
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    assert [b.block_hash for b in blocks] == hashes
    pool.check_invariants()

    pool.free_blocks([blocks[1], blocks[0], blocks[2]])
    assert free_ids(pool) == [3, 1, 0, 2]
    # Free but still cached: a prefix hit finds it.
    assert pool.get_cached_block(h(0)) is blocks[0]
    pool.check_invariants()

    # First the never-cached block 3, then the least recently freed cached block (1) is evicted.
    new = pool.get_new_blocks(2)
    assert ids(new) == [3, 1]
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) is blocks[0]
    assert pool.get_cached_block(h(2)) is blocks[2]
    pool.check_invariants()


def test_touch_free_cached_block_removes_it_from_middle_of_queue() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(0), h(1), h(2)], 0, 3)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [3, 4, 0, 1, 2]

    hit = pool.get_cached_block(h(1))
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [3, 4, 0, 2]
    assert hit.block_hash == h(1)  # still cached while in use
    pool.check_invariants()

    # Touching an in-use block only bumps its count.
    pool.touch([hit])
    assert hit.ref_cnt == 2 and free_ids(pool) == [3, 4, 0, 2]
    pool.check_invariants()

    # Allocating everything else never evicts the in-use hit.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 0, 2]
    assert pool.get_cached_block(h(1)) is hit
    pool.check_invariants()


def test_cache_full_blocks_range_and_duplicate_keeps_existing() -> None:
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, [h(0), h(1), h(2)], 0, 2)  # only [0, 2)
    assert [b.block_hash for b in a] == [h(0), h(1), None]
    pool.cache_full_blocks(a, [h(0), h(1), h(2)], 2, 3)
    assert a[2].block_hash == h(2)

    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, [h(0), h(9)], 0, 2)
    # h(0) already maps to a[0]: the duplicate stays uncached; h(9) is new.
    assert b[0].block_hash is None and pool.get_cached_block(h(0)) is a[0]
    assert b[1].block_hash == h(9) and pool.get_cached_block(h(9)) is b[1]
    pool.check_invariants()

    # Freed duplicate goes back uncached; the mapping is unaffected.
    pool.free_blocks(b)
    pool.check_invariants()
    assert pool.get_cached_block(h(0)) is a[0]


def test_caching_disabled_records_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)], 0, 2)
    assert all(b.block_hash is None for b in blocks)
    assert pool.get_cached_block(h(0)) is None
    pool.check_invariants()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)], 0, 2)
    assert pool.reset_prefix_cache() is False  # blocks in use
    assert pool.get_cached_block(h(0)) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(0)) is None
    assert all(b.block_hash is None for b in pool.blocks)
    pool.check_invariants()


def test_invalid_pool_size() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)


# -------------------------------------------------- invariant violations


def _pool_with_state() -> tuple[BlockPool, list[KVCacheBlock]]:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)], 0, 2)
    pool.free_blocks([blocks[1]])
    pool.check_invariants()
    return pool, blocks


def test_invariant_in_use_block_in_queue() -> None:
    pool, blocks = _pool_with_state()
    blocks[1].ref_cnt = 1  # in the queue with a reference
    with pytest.raises(AssertionError, match="in use"):
        pool.check_invariants()


def test_invariant_free_block_not_in_queue() -> None:
    pool, blocks = _pool_with_state()
    blocks[0].ref_cnt = 0  # released without going back to the queue
    with pytest.raises(AssertionError, match="not in the free queue"):
        pool.check_invariants()


def test_invariant_negative_ref_cnt() -> None:
    pool, blocks = _pool_with_state()
    blocks[1].ref_cnt = -1
    with pytest.raises(AssertionError, match="negative"):
        pool.check_invariants()


def test_invariant_count_mismatch() -> None:
    pool, _ = _pool_with_state()
    pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="num_free_blocks"):
        pool.check_invariants()


def test_invariant_broken_back_link() -> None:
    pool, _ = _pool_with_state()
    free = pool.free_block_queue.get_all_free_blocks()
    free[1].prev_free = pool.free_block_queue.head
    with pytest.raises(AssertionError, match="back link"):
        pool.check_invariants()


def test_invariant_cycle() -> None:
    pool, _ = _pool_with_state()
    free = pool.free_block_queue.get_all_free_blocks()
    free[-1].next_free = free[0]
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariant_hash_map_points_at_wrong_block() -> None:
    pool, blocks = _pool_with_state()
    pool.cached_block_hash_to_block[h(0)] = blocks[1]
    with pytest.raises(AssertionError, match="hash"):
        pool.check_invariants()


def test_invariant_block_hash_not_in_map() -> None:
    pool, blocks = _pool_with_state()
    del pool.cached_block_hash_to_block[h(1)]
    with pytest.raises(AssertionError, match="hash map does not map"):
        pool.check_invariants()


def test_invariant_stale_map_entry() -> None:
    pool, blocks = _pool_with_state()
    blocks[0].block_hash = None  # hash cleared but the map still points at it
    with pytest.raises(AssertionError, match="different hash"):
        pool.check_invariants()
