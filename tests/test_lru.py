"""The bounded LRU every cache and store uses: against a plain list model, bounds by
count and bytes, the newest entry kept or refused, hit and miss counts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.lru import LRU

OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "peek", "pop", "touch"]),
        st.integers(0, 7),
        st.integers(0, 9),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=OPS,
    max_items=st.one_of(st.none(), st.integers(1, 5)),
    max_bytes=st.one_of(st.none(), st.integers(0, 20)),
    keep_newest=st.booleans(),
)
def test_matches_a_list_model(ops, max_items, max_bytes, keep_newest) -> None:
    lru: LRU[int, int] = LRU(max_items, max_bytes, size=lambda v: v, keep_newest=keep_newest)
    model: list[tuple[int, int]] = []  # least recently used first
    hits = misses = 0

    def over() -> bool:
        n, b = len(model), sum(v for _, v in model)
        return (max_items is not None and n > max_items) or (
            max_bytes is not None and b > max_bytes
        )

    for op, key, value in ops:
        found = next((v for k, v in model if k == key), None)
        if op == "put":
            evicted = lru.put(key, value)
            expect = []
            if keep_newest or max_bytes is None or value <= max_bytes:
                model = [(k, v) for k, v in model if k != key] + [(key, value)]
                while over() and (len(model) > 1 or not keep_newest):
                    expect.append(model.pop(0))
            assert evicted == expect
        elif op == "get":
            assert lru.get(key) == found
            hits += found is not None
            misses += found is None
            if found is not None:
                model = [(k, v) for k, v in model if k != key] + [(key, found)]
        elif op == "peek":
            assert lru.get(key, touch=False, count=False) == found
        elif op == "pop":
            assert lru.pop(key) == found
            model = [(k, v) for k, v in model if k != key]
        else:
            assert lru.touch(key) == (found is not None)
            if found is not None:
                model = [(k, v) for k, v in model if k != key] + [(key, found)]
        assert lru.keys() == [k for k, _ in model]
        assert lru.values() == [v for _, v in model]
        assert lru.nbytes == sum(v for _, v in model)
        assert len(lru) == len(model)
        assert (lru.hits, lru.misses) == (hits, misses)
        if not keep_newest or len(model) > 1:
            assert not over()


def test_newest_entry_larger_than_the_bound() -> None:
    store: LRU[str, bytes] = LRU(max_items=4, max_bytes=10, size=len, keep_newest=True)
    store.put("a", b"12345")
    assert store.put("big", b"x" * 30) == [("a", b"12345")]
    assert store.keys() == ["big"] and store.nbytes == 30  # still served
    assert store.put("b", b"1") == [("big", b"x" * 30)]
    cache: LRU[str, bytes] = LRU(max_bytes=10, size=len)
    cache.put("a", b"12345")
    assert cache.put("big", b"x" * 30) == []
    assert cache.keys() == ["a"] and cache.nbytes == 5  # refused, nothing evicted


def test_evict_to_a_smaller_bound_and_clear() -> None:
    lru: LRU[int, int] = LRU(max_bytes=100, size=lambda v: v)
    for k in range(5):
        lru.put(k, 10)
    lru.touch(0)
    assert lru.evict(max_bytes=25) == [(1, 10), (2, 10), (3, 10)]
    assert lru.keys() == [4, 0] and lru.nbytes == 20
    lru.clear()
    assert len(lru) == 0 and lru.nbytes == 0 and 0 not in lru
