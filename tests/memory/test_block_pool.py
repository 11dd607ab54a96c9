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


def test_extents_grow_above_existing_ids_and_base_fills_first():
    pool = BlockPool(4, max_blocks=10)
    pool.allocate(2)
    extent = pool.add_extent("layer-7", 3)
    assert (extent.start, extent.end) == (4, 7)
    assert pool.num_blocks == 7 and pool.num_free == 5
    assert pool.allocate(3) == [2, 3, 4]     # base ids before extent ids
    pool.add_extent("layer-3", 2)
    assert pool.num_blocks == 9
    with pytest.raises(BlockPoolError, match="max_blocks"):
        pool.add_extent("layer-9", 2)
    pool.check_invariants()


def test_extents_leave_lifo_and_only_when_entirely_free():
    pool = BlockPool(2, max_blocks=8)
    pool.add_extent("a", 2)                   # ids 2, 3
    pool.add_extent("b", 2)                   # ids 4, 5
    held = pool.allocate(5)                  # 0..4: block 4 belongs to extent b
    assert held == [0, 1, 2, 3, 4]
    with pytest.raises(BlockPoolError, match="LIFO"):
        pool.remove_extent("a")
    with pytest.raises(BlockPoolError, match="in use"):
        pool.remove_extent("b")
    assert not pool.extent_is_free("b")
    pool.free([4])
    assert pool.remove_extent("b").start == 4
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (4, 0, 4)
    pool.free([2, 3])
    pool.remove_extent("a")
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (2, 0, 2)
    assert pool.allocate(1) is None
    with pytest.raises(BlockPoolError, match="base"):
        pool.remove_extent("base")
    pool.check_invariants()


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(4, max_blocks=2)
    with pytest.raises(ValueError):
        BlockPool(4).add_extent("x", 0)
