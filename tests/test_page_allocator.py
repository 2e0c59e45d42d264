import pytest

from mmserve.cache.page_allocator import PageAllocator


def test_alloc_free_num_free():
    a = PageAllocator(8)
    assert a.num_pages == 8
    assert a.num_free == 8
    p = a.alloc(3)
    assert p == [0, 1, 2]
    assert a.num_free == 5
    q = a.alloc(5)
    assert sorted(q) == [3, 4, 5, 6, 7]
    assert a.num_free == 0
    a.free([1, 2])
    assert a.num_free == 2
    assert sorted(a.alloc(2)) == [1, 2]
    assert a.num_free == 0


def test_alloc_zero_returns_empty_list():
    a = PageAllocator(2)
    assert a.alloc(0) == []
    assert a.num_free == 2
    a.alloc(2)
    assert a.alloc(0) == []


def test_alloc_beyond_free_returns_none_and_takes_nothing():
    a = PageAllocator(4)
    assert a.alloc(5) is None
    assert a.num_free == 4
    a.alloc(3)
    assert a.alloc(2) is None
    assert a.num_free == 1
    assert a.alloc(1) == [3]


def test_alloc_negative_raises():
    with pytest.raises(ValueError):
        PageAllocator(4).alloc(-1)


def test_double_free_raises():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free([p[0]])
    with pytest.raises(ValueError, match="double free"):
        a.free([3])  # never allocated
    assert a.num_free == 4


def test_duplicate_within_one_call_raises_and_frees_nothing():
    a = PageAllocator(4)
    a.alloc(4)
    with pytest.raises(ValueError, match="double free"):
        a.free([0, 1, 0])
    assert a.num_free == 0
    a.free([0, 1])  # still allocated, so this works
    assert a.num_free == 2


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_out_of_range_raises(bad):
    a = PageAllocator(4)
    a.alloc(4)
    with pytest.raises(ValueError, match="out of range"):
        a.free([2, bad])
    assert a.num_free == 0  # all-or-nothing: page 2 not freed


def test_free_accepts_generic_iterables():
    a = PageAllocator(4)
    a.alloc(4)
    a.free(range(2))
    a.free(iter([3]))
    assert a.num_free == 3
    assert a.alloc(4) is None
    assert sorted(a.alloc(3)) == [0, 1, 3]


def test_reset():
    a = PageAllocator(5)
    a.alloc(4)
    a.reset()
    assert a.num_free == 5
    assert a.alloc(5) == [0, 1, 2, 3, 4]
    a.reset()
    a.free([])  # empty free is fine
    with pytest.raises(ValueError):
        a.free([0])  # free after reset


def test_negative_num_pages_raises():
    with pytest.raises(ValueError):
        PageAllocator(-1)
    assert PageAllocator(0).alloc(1) is None
