"""Exact block ids and counts, in the manner of vLLM's block-pool tests."""

import pytest

from serve.memory.block_pool import BlockPool, BlockPoolError


def test_allocates_lowest_ids_first_and_accounts_exactly():
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert (pool.num_free, pool.num_used, pool.num_blocks) == (3, 5, 8)
    pool.free([1, 3])
    assert pool.allocate(3) == [1, 3, 5]
    assert pool.allocate(3) is None          # only 2 free: nothing is taken
    assert pool.num_free == 2
    pool.check_invariants()


def test_double_free_and_foreign_ids_are_rejected():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free([0])
    with pytest.raises(BlockPoolError):
        pool.free([9])


def test_chunks_grow_above_existing_ids_and_base_fills_first():
    pool = BlockPool(4, max_blocks=10)
    pool.allocate(2)
    chunk = pool.add_chunk("layer-7", 3)
    assert (chunk.start, chunk.end) == (4, 7)
    assert pool.num_blocks == 7 and pool.num_free == 5
    assert pool.allocate(3) == [2, 3, 4]     # base ids before chunk ids
    pool.add_chunk("layer-3", 2)
    assert pool.num_blocks == 9
    with pytest.raises(BlockPoolError, match="max_blocks"):
        pool.add_chunk("layer-9", 2)
    pool.check_invariants()


def test_chunks_leave_lifo_and_only_when_entirely_free():
    pool = BlockPool(2, max_blocks=8)
    pool.add_chunk("a", 2)                   # ids 2, 3
    pool.add_chunk("b", 2)                   # ids 4, 5
    held = pool.allocate(5)                  # 0..4: block 4 belongs to chunk b
    assert held == [0, 1, 2, 3, 4]
    with pytest.raises(BlockPoolError, match="LIFO"):
        pool.remove_chunk("a")
    with pytest.raises(BlockPoolError, match="in use"):
        pool.remove_chunk("b")
    assert not pool.chunk_is_free("b")
    pool.free([4])
    assert pool.remove_chunk("b").start == 4
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (4, 0, 4)
    pool.free([2, 3])
    pool.remove_chunk("a")
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (2, 0, 2)
    assert pool.allocate(1) is None
    with pytest.raises(BlockPoolError, match="base"):
        pool.remove_chunk("base")
    pool.check_invariants()


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(4, max_blocks=2)
    with pytest.raises(ValueError):
        BlockPool(4).add_chunk("x", 0)
