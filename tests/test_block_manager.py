"""The block pool and the one block manager: exact block ids, ref counts, hashes and free-queue order."""

import pytest

from hf_paged.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens
from hf_paged.core.kv_cache_manager import KVCacheManager


class Tokens:
    """A token source for cache_blocks: a fixed list."""

    def __init__(self, ids):
        self.ids = list(ids)

    def token_ids(self, start, end):
        return self.ids[start:end]


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_is_a_doubly_linked_list_with_middle_removal():
    q = FreeBlockQueue()
    blocks = [KVCacheBlock(i) for i in range(5)]
    for b in blocks:
        q.append(b)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert ids(q) == [2, 0, 1, 3, 4] and len(q) == 5
    assert q.popleft() is blocks[2]
    q.remove(blocks[4])
    q.remove(blocks[0])
    assert ids(q) == [1, 3] and len(q) == 2
    with pytest.raises(AssertionError, match="already queued"):
        q.append(blocks[1])


def test_pool_reuses_recently_freed_blocks_first_and_evicts_cached_ones_last():
    pool = BlockPool(6)
    assert pool.high_water == 0
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.high_water == 3  # the engine commits the pool's pages up to here before a step
    assert pool.cache_block(a[0], b"h0", [1, 2])
    pool.free_blocks(reversed(a))  # 2, 1 (no hash: to the head), 0 (cached: to the tail)
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 0]
    assert a[0].block_hash == b"h0" and pool.lookup(b"h0") is a[0]
    assert ids(pool.get_new_blocks(2)) == [1, 2] and pool.high_water == 3  # reuse does not raise it
    pool.free_blocks(pool.blocks[2:0:-1])
    b = pool.get_new_blocks(5)
    assert ids(b) == [1, 2, 3, 4, 5] and pool.lookup(b"h0") is a[0]  # the cached block survives
    assert pool.high_water == 6
    c = pool.get_new_blocks(1)
    assert ids(c) == [0] and c[0].block_hash is None and pool.lookup(b"h0") is None  # evicted last
    assert pool.num_evictions == 1
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks(c + c)
    pool.check_consistency(owned=[b.block_id for b in b])


def test_touch_revives_a_cached_free_block_from_the_middle_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[1], b"x", [7])
    pool.cache_block(blocks[2], b"y", [8])
    pool.free_blocks(blocks)
    assert pool.free_block_ids() == [3, 0, 1, 2]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and pool.free_block_ids() == [3, 0, 2]
    pool.touch([blocks[1]])  # a second holder: no queue change
    assert blocks[1].ref_cnt == 2
    pool.check_consistency(owned=[1, 1])


def test_hash_chain_depends_on_parent_tokens_and_extra_keys():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4]) and len(h1) == 16
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(hash_block_tokens(None, [9]), [5, 6])
    assert hash_block_tokens(None, [1], ("lora", 1)) != hash_block_tokens(None, [1])


def make_kv(num_blocks=10, block_size=4, **kw):
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, **kw)


def test_prefix_hit_takes_full_blocks_and_partial_blocks_are_never_shared():
    kv = make_kv()
    prompt_a = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    assert kv.allocate_slots("a", 0, 10) == [0, 1, 2]
    kv.cache_blocks("a", Tokens(prompt_a), 10)
    assert [b.block_hash is not None for b in kv.tables["a"]] == [True, True, False]
    h0 = hash_block_tokens(None, prompt_a[:4])
    assert kv.hashes["a"] == [h0, hash_block_tokens(h0, prompt_a[4:8])]
    # b shares 9 tokens with a: both full blocks hit, a's partial block is not shared
    prompt_b = prompt_a[:9] + [999, 998]
    cached, hashes = kv.find_cached_prefix(prompt_b)
    assert ids(cached) == [0, 1] and hashes == kv.hashes["a"]
    assert kv.allocate_slots("b", 8, 3, cached, hashes) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3] and [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    # c shares 6 tokens: only the first block (a partial match of block 1 is a miss)
    cached, _ = kv.find_cached_prefix(prompt_a[:6] + [5, 5, 5])
    assert ids(cached) == [0]
    # a prompt that is exactly two cached blocks still leaves its last token to compute
    cached, _ = kv.find_cached_prefix(prompt_a[:8])
    assert ids(cached) == [0]
    kv.check_consistency()


def test_freed_prefix_stays_cached_and_is_evicted_least_recently_used_first():
    kv = make_kv(num_blocks=6)
    prompt = list(range(12))
    kv.allocate_slots("a", 0, 12)
    kv.cache_blocks("a", Tokens(prompt), 12)
    kv.free("a")  # tail first: 2, 1, 0 go to the tail of the queue in that order
    assert kv.pool.free_block_ids() == [3, 4, 5, 2, 1, 0] and kv.num_cached_free_blocks == 3
    cached, hashes = kv.find_cached_prefix(prompt + [7])
    assert ids(cached) == [0, 1, 2]
    kv.allocate_slots("b", 4, 1, [])  # 2 blocks from the never-used ones
    assert kv.get_block_ids("b") == [3, 4]
    kv.allocate_slots("c", 0, 8)  # 5, then the least recently freed cached block: 2 (the prefix's tail)
    assert kv.get_block_ids("c") == [5, 2] and kv.pool.lookup(hashes[2]) is None
    assert ids(kv.find_cached_prefix(prompt + [7])[0]) == [0, 1]
    kv.check_consistency()


def test_fork_shares_every_block_and_copy_on_write_copies_only_the_partial_one():
    kv = make_kv()
    kv.allocate_slots("a", 0, 10)  # blocks 0, 1, 2 (2 holds 2 tokens)
    kv.fork("a", "b")
    assert kv.get_block_ids("b") == [0, 1, 2] and [b.ref_cnt for b in kv.pool.blocks[:3]] == [2, 2, 2]
    assert kv.num_new_blocks_needed("b", 10, 1) == 1  # the copy
    assert kv.allocate_slots("b", 10, 1) == []
    assert kv.get_block_ids("b") == [0, 1, 3] and kv.take_copies() == [(2, 3)]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert kv.allocate_slots("a", 10, 1) == [] and kv.take_copies() == []  # the last holder writes in place
    assert kv.allocate_slots("a", 11, 2) == [4] and kv.get_block_ids("a") == [0, 1, 2, 4]
    kv.check_consistency()
    kv.free("a")
    kv.free("b")  # an aborted forked group gives every block back
    assert kv.num_free_blocks == 10
    kv.check_consistency()


def test_fork_with_unwritten_shared_block_replaces_it_without_a_copy():
    kv = make_kv()
    kv.allocate_slots("a", 0, 8, num_lookahead=2)  # blocks 0, 1 full; 2 reserved, nothing written in it
    kv.fork("a", "b")
    assert kv.allocate_slots("b", 8, 1) == [] and kv.get_block_ids("b") == [0, 1, 3]
    assert kv.take_copies() == []  # block 2 held no tokens: a fresh block, no copy


def test_truncate_drops_blocks_past_the_kept_tokens():
    kv = make_kv()
    kv.allocate_slots("a", 0, 11)  # 0, 1, 2
    kv.cache_blocks("a", Tokens(range(11)), 11)
    kv.truncate("a", 5)
    assert kv.get_block_ids("a") == [0, 1] and len(kv.hashes["a"]) == 1
    assert kv.pool.free_block_ids()[0] == 2  # a plain block: reused first
    kv.truncate("a", 4)
    assert kv.get_block_ids("a") == [0]
    kv.check_consistency()


def test_swap_out_and_in_move_whole_tables_between_pools():
    kv = make_kv(num_blocks=6, num_host_blocks=4)
    kv.allocate_slots("a", 0, 9)  # 0, 1, 2
    kv.fork("a", "b")
    assert kv.can_swap_out("b")
    assert kv.swap_out("b") == [(0, 0), (1, 1), (2, 2)]
    assert "b" not in kv.tables and [b.ref_cnt for b in kv.pool.blocks[:3]] == [1, 1, 1]
    assert not kv.can_swap_out("a")  # 3 blocks, 1 host block free
    kv.allocate_slots("c", 0, 12)  # 3, 4, 5: the pool is full
    assert kv.swap_in("b") is None and kv.host_tables["b"]  # nothing changes
    kv.free("c")
    assert kv.swap_in("b") == [(0, 3), (1, 4), (2, 5)]  # fresh device blocks, most recently freed first
    assert kv.get_block_ids("b") == [3, 4, 5] and kv.host_pool.num_free_blocks == 4
    kv.check_consistency()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 6


def test_reset_prefix_cache_forgets_every_hash_and_never_recaches_live_sequences():
    kv = make_kv()
    kv.allocate_slots("a", 0, 8)
    kv.cache_blocks("a", Tokens(range(8)), 8)
    kv.allocate_slots("b", 0, 8)
    kv.cache_blocks("b", Tokens(range(50, 58)), 8)
    kv.free("b")
    kv.reset_prefix_cache()
    assert not kv.pool.cached and all(b.block_hash is None for b in kv.pool.blocks)
    kv.allocate_slots("a", 8, 4)
    kv.cache_blocks("a", Tokens(range(12)), 12)
    assert not kv.pool.cached  # a's KV came from the old weights
    kv.check_consistency()


def test_growable_manager_grows_instead_of_failing():
    kv = KVCacheManager(0, 4, growable=True)
    assert kv.allocate_slots("a", 0, 9) == [0, 1, 2] and kv.num_blocks == 3
    assert kv.allocate_slots("b", 0, 1) == [3] and kv.num_blocks >= 4
    kv.check_consistency()


def test_truncate_to_a_partial_block_drops_its_stale_hash():
    kv = make_kv()
    old = list(range(8))
    kv.allocate_slots("a", 0, 8)
    kv.cache_blocks("a", Tokens(old), 8)
    kv.truncate("a", 6)  # block 1 keeps 2 of its 4 tokens and will be written again
    assert kv.pool.blocks[1].block_hash is None
    assert ids(kv.find_cached_prefix(old + [9])[0]) == [0]
    kv.check_consistency()


def test_lookahead_slots_are_made_private_too():
    kv = make_kv()
    kv.allocate_slots("p", 0, 5, num_lookahead=4)  # 0, 1, 2 (2 holds lookahead only)
    kv.fork("p", "c")
    assert kv.allocate_slots("p", 5, 1, num_lookahead=4) == []
    assert kv.get_block_ids("p") == [0, 3, 4] and kv.take_copies() == [(1, 3)]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    kv.check_consistency()
