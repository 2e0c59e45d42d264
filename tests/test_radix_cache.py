import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mmserve.cache.no_prefix_cache import NoPrefixCache
from mmserve.cache.page_allocator import PageAllocator
from mmserve.cache.radix_cache import InsertResult, MatchResult, RadixCache


def toks(s: str) -> list[int]:
    return [ord(c) for c in s]


class Recorder:
    """free_pages callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, pages: list[int]) -> None:
        self.calls.append(list(pages))

    @property
    def freed(self) -> list[int]:
        return [p for call in self.calls for p in call]


def make(page_size: int = 1, **kw) -> tuple[RadixCache, Recorder]:
    rec = Recorder()
    return RadixCache(page_size, rec, **kw), rec


# ---------------------------------------------------------------- unit tests


def test_insert_then_match_full_and_partial():
    c, rec = make()
    assert c.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert c.total_size() == 4 and c.num_pages() == 4 and c.node_count() == 1

    r = c.match_prefix([1, 2, 3, 4])
    assert (r.length, r.pages) == (4, [10, 11, 12, 13])
    assert r.last_node.key == [1, 2, 3, 4]
    r = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert (r.length, r.pages) == (4, [10, 11, 12, 13])
    r = c.match_prefix([1, 2, 9])
    assert (r.length, r.pages) == (2, [10, 11])
    assert r.last_node.key == [1, 2]  # split so last_node covers exactly the match
    r = c.match_prefix([7, 1])
    assert (r.length, r.pages) == (0, [])
    assert r.last_node is c.root
    assert c.match_prefix([]).length == 0
    assert rec.calls == []
    assert c.total_size() == 4 and c.num_pages() == 4 and c.node_count() == 2


def test_node_splitting_abcd_abxy():
    c, _ = make()
    assert c.insert(toks("abcd"), [0, 1, 2, 3]) == 0
    assert c.node_count() == 1
    assert c.insert(toks("abxy"), [4, 5, 6, 7]) == 2
    assert c.node_count() == 3  # "ab" -> {"cd", "xy"}
    assert c.total_size() == 6
    (ab,) = c.root.children.values()
    assert ab.key == toks("ab") and ab.pages == [0, 1]
    assert sorted(n.key for n in ab.children.values()) == [toks("cd"), toks("xy")]
    assert c.match_prefix(toks("abcd")).length == 4
    assert c.match_prefix(toks("abxy")).pages == [0, 1, 6, 7]
    assert c.match_prefix(toks("abz")).length == 2
    assert c.match_prefix(toks("abz")).last_node is ab
    assert c.match_prefix(toks("ax")).length == 1
    assert c.node_count() == 4  # "ab" split into "a" + "b"


def test_insert_return_value_and_page_ownership():
    c, rec = make()
    assert c.insert(toks("abcd"), [10, 11, 12, 13]) == 0
    ret = c.insert(toks("abxy"), [20, 21, 22, 23])
    assert ret == 2
    # The tree kept its own pages for "ab" and took only the new suffix's pages.
    assert c.match_prefix(toks("abxy")).pages == [10, 11, 22, 23]
    assert c.num_pages() == 6
    # Already fully present: returns the whole length, takes nothing.
    assert c.insert(toks("abcd"), [30, 31, 32, 33]) == 4
    assert c.insert(toks("ab"), [40, 41]) == 2
    assert c.num_pages() == 6
    # A key that is a strict extension of a cached one.
    assert c.insert(toks("abcdef"), [50, 51, 52, 53, 54, 55]) == 4
    assert c.match_prefix(toks("abcdef")).pages == [10, 11, 12, 13, 54, 55]
    assert c.total_size() == 8
    assert rec.calls == []  # insert never frees caller pages


def test_insert_validates_lengths():
    c, _ = make(4)
    with pytest.raises(ValueError):
        c.insert(list(range(10)), [0, 1])
    with pytest.raises(ValueError):
        c.insert(list(range(8)), [0])
    with pytest.raises(ValueError):
        c.insert(list(range(8)), [0, 1, 2])
    assert c.insert([], []) == 0
    assert c.total_size() == 0 and c.node_count() == 0


def test_page_size_4_alignment():
    c, _ = make(4)
    key = list(range(10))
    aligned = key[: len(key) // 4 * 4]
    assert aligned == list(range(8))
    assert c.insert(aligned, [7, 9]) == 0
    assert c.total_size() == 8 and c.num_pages() == 2

    # Shares 6 tokens: only the first full page counts.
    r = c.match_prefix([0, 1, 2, 3, 4, 5, 99, 99, 99])
    assert (r.length, r.pages) == (4, [7])
    assert r.last_node.key == [0, 1, 2, 3]
    assert c.node_count() == 2  # split at the page boundary
    # Trailing partial page of the query is ignored.
    assert c.match_prefix(list(range(7))).length == 4
    assert c.match_prefix(list(range(10))).length == 8
    assert c.match_prefix([0, 1, 2]).length == 0
    assert c.match_prefix([0, 1, 2, 9]).length == 0  # partially matching first page
    # Children are keyed by whole pages.
    assert set(c.root.children) == {(0, 1, 2, 3)}
    # Insert a sibling that diverges inside the second page.
    assert c.insert([0, 1, 2, 3, 4, 5, 8, 8], [1, 2]) == 4
    assert c.match_prefix([0, 1, 2, 3, 4, 5, 8, 8]).pages == [7, 2]
    assert c.match_prefix(list(range(8))).pages == [7, 9]
    assert c.total_size() == 12 and c.num_pages() == 3 and c.node_count() == 3


def test_negative_image_token_ids():
    c, _ = make(2)
    img = [-(2**62), -(2**62) + 1, -5, -6]
    assert c.insert([1, 2, *img], [0, 1, 2]) == 0
    assert c.match_prefix([1, 2, *img, 3, 4]).pages == [0, 1, 2]
    assert c.match_prefix([1, 2, -(2**62), 0]).length == 2


def test_non_list_keys():
    c, _ = make(2)
    c.insert(tuple(range(6)), (3, 4, 5))
    assert c.match_prefix(tuple(range(6))).pages == [3, 4, 5]
    assert c.match_prefix(torch.arange(5)).pages == [3, 4]
    assert c.insert(torch.arange(4), torch.tensor([8, 9])) == 4


@pytest.mark.parametrize("page_size", [1, 2, 4, 8])
@pytest.mark.parametrize("diverge", [1, 63, 64, 65, 130, 299])
def test_long_edges_find_exact_divergence(page_size, diverge):
    c, _ = make(page_size)
    n = 304  # multiple of every page size here
    key = list(range(n))
    c.insert(key, list(range(n // page_size)))
    query = key[:diverge] + [-1] + key[diverge + 1 :]
    want = diverge // page_size * page_size
    r = c.match_prefix(query)
    assert r.length == want
    assert r.pages == list(range(want // page_size))
    assert c.match_prefix(key[: n - 1]).length == (n - 1) // page_size * page_size
    assert c.total_size() == n


def test_lock_prevents_eviction():
    c, rec = make()
    c.insert([1, 2, 3, 4], [0, 1, 2, 3])
    r = c.match_prefix([1, 2, 3, 4])
    c.inc_lock_ref(r.last_node)
    assert (c.evictable_size(), c.protected_size(), c.total_size()) == (0, 4, 4)
    assert c.evict(100) == 0
    assert rec.calls == []
    with pytest.raises(ValueError):
        c.reset()
    c.dec_lock_ref(r.last_node)
    assert (c.evictable_size(), c.protected_size()) == (4, 0)
    with pytest.raises(ValueError):
        c.dec_lock_ref(r.last_node)
    assert c.evict(100) == 4
    assert rec.calls == [[0, 1, 2, 3]]


def test_lock_covers_ancestors_only():
    c, rec = make()
    c.insert(toks("abcd"), [0, 1, 2, 3])
    c.insert(toks("abxy"), [4, 5, 6, 7])
    r = c.match_prefix(toks("abcd"))
    c.inc_lock_ref(r.last_node)
    c.inc_lock_ref(r.last_node)
    assert (c.evictable_size(), c.protected_size()) == (2, 4)  # "xy" unlocked
    assert c.evict(100) == 2
    assert rec.calls == [[6, 7]]
    c.dec_lock_ref(r.last_node)
    assert c.evict(100) == 0  # still one lock left
    c.dec_lock_ref(r.last_node)
    assert c.evict(100) == 4
    assert rec.freed == [6, 7, 2, 3, 0, 1]  # leaf "cd" before its parent "ab"


def test_split_of_locked_node_keeps_sizes():
    c, _ = make()
    c.insert(toks("abcd"), [0, 1, 2, 3])
    r = c.match_prefix(toks("abcd"))
    c.inc_lock_ref(r.last_node)
    assert c.match_prefix(toks("ab")).length == 2  # splits the locked node
    assert c.node_count() == 2
    assert (c.evictable_size(), c.protected_size()) == (0, 4)
    c.dec_lock_ref(r.last_node)
    assert (c.evictable_size(), c.protected_size()) == (4, 0)


def test_lru_older_leaf_evicted_first():
    c, rec = make()
    c.insert([1, 1], [0, 1])  # t=1
    c.insert([2, 2], [2, 3])  # t=2
    c.insert([3, 3], [4, 5])  # t=3
    c.match_prefix([1, 1])  # t=4: [1,1] is now the newest
    assert c.evict(1) == 2  # whole node, so 2 tokens
    assert rec.calls == [[2, 3]]
    assert c.evict(3) == 4
    assert rec.calls[1] == [4, 5, 0, 1]
    assert c.total_size() == 0 and c.node_count() == 0
    assert c.evict(1) == 0


def test_partial_match_refreshes_only_the_matched_part():
    c, rec = make()
    c.insert(toks("abcd"), [0, 1, 2, 3])  # t=1
    c.insert([9], [9])  # t=2
    c.match_prefix(toks("abzz"))  # t=3: splits; "ab" refreshed, "cd" keeps t=1
    assert c.evict(1) == 2
    assert rec.calls == [[2, 3]]


def test_lru_uses_clock():
    now = [0.0]
    c, rec = make(clock=lambda: now[0])
    for i, t in enumerate([5.0, 1.0, 3.0]):
        now[0] = t
        c.insert([i], [i])
    assert c.evict(2) == 2
    assert rec.calls == [[1, 2]]


def test_evicting_leaf_exposes_parent():
    c, rec = make()
    c.insert([9], [90])  # t=1, oldest
    c.insert(toks("abcd"), [0, 1, 2, 3])  # t=2
    c.insert(toks("abxy"), [4, 5, 6, 7])  # t=3; "ab" (t=3) -> "cd" (t=2), "xy" (t=3)
    c.insert([8], [80])  # t=4
    assert c.node_count() == 5
    # [9] t=1, "cd" t=2, then "xy" and its exposed parent "ab" (t=3) before [8] (t=4).
    assert c.evict(7) == 7
    assert rec.calls == [[90, 2, 3, 6, 7, 0, 1]]
    assert c.node_count() == 1
    assert c.match_prefix([8]).pages == [80]
    assert c.match_prefix(toks("ab")).length == 0


def test_evict_returns_tokens_and_frees_pages_page_size_2():
    c, rec = make(2)
    c.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    c.insert([1, 2, 7, 7], [20, 21])  # keeps 10 for [1,2]; caller frees 20
    assert c.evict(1) == 4  # oldest leaf [3,4,5,6]
    assert rec.calls == [[11, 12]]
    assert c.evictable_size() == 4 and c.num_pages() == 2
    assert c.evict(0) == 0 and c.evict(-3) == 0
    assert c.evict(10) == 4
    assert rec.calls == [[11, 12], [21, 10]]
    assert c.total_size() == 0 and c.num_pages() == 0


def test_disabled_cache():
    rec = Recorder()
    c = NoPrefixCache(2, rec)  # what make_tree builds when the radix cache is disabled
    assert c.insert([1, 2, 3, 4], [5, 6]) == 0
    assert rec.calls == [[5, 6]]  # nothing cached; the pages are released at once
    r = c.match_prefix([1, 2, 3, 4])
    assert isinstance(r, MatchResult)
    assert (r.length, r.pages, r.last_node) == (0, [], c.root)
    c.inc_lock_ref(r.last_node)
    c.dec_lock_ref(r.last_node)
    assert c.evict(10) == 0
    assert (c.total_size(), c.node_count(), c.num_pages()) == (0, 0, 0)
    with pytest.raises(ValueError):
        c.insert([1, 2, 3], [5])


def test_reset():
    c, rec = make()
    c.insert(toks("abcd"), [0, 1, 2, 3])
    c.insert(toks("abxy"), [4, 5, 6, 7])
    old = c.match_prefix(toks("abcd")).last_node
    miss = c.match_prefix(toks("zz")).last_node
    assert miss is c.root
    c.inc_lock_ref(miss)  # a lock on the root pins nothing, so reset is allowed
    c.reset()
    c.dec_lock_ref(miss)  # and the root stays valid across reset
    assert len(rec.calls) == 1 and sorted(rec.calls[0]) == [0, 1, 2, 3, 6, 7]
    assert (c.total_size(), c.evictable_size(), c.protected_size()) == (0, 0, 0)
    assert c.node_count() == 0 and c.num_pages() == 0
    assert c.match_prefix(toks("abcd")).length == 0
    with pytest.raises(ValueError):
        c.inc_lock_ref(old)  # stale node from before reset
    assert c.evict(10) == 0
    c.reset()  # empty reset frees nothing
    assert len(rec.calls) == 1
    assert c.insert(toks("ab"), [8, 9]) == 0
    assert c.match_prefix(toks("abc")).pages == [8, 9]


def test_invalid_page_size():
    with pytest.raises(ValueError):
        RadixCache(0, lambda pages: None)


# ---------------------------------------------------------------- property-based test

ALPHABET = [0, 1, 2, 3, -1, -(2**62)]
token_lists = st.lists(st.sampled_from(ALPHABET), max_size=12)
NUM_PAGES = 512  # 40 steps * <= 12 pages per insert never exhausts it


class RadixMachine(RuleBasedStateMachine):
    """RadixCache vs. a brute-force model.

    The model maps every cached page-aligned prefix (tuple of tokens up to and including a page) to
    the page id holding that page's KV, plus that prefix's last access time. Locks are lists of
    locked prefixes; a cached prefix is locked iff it is a prefix of some held lock.
    """

    keys = Bundle("keys")

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.P = page_size
        self.alloc = PageAllocator(NUM_PAGES)
        self.freed_log: list[int] = []
        self.now = 0
        self.tree = RadixCache(page_size, self._free, clock=lambda: self.now)
        self.model: dict[tuple[int, ...], int] = {}
        self.times: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[object, tuple[int, ...]]] = []

    def _free(self, pages):
        self.freed_log.extend(pages)
        self.alloc.free(pages)

    # -- brute force helpers (independent of the tree's code)

    def _prefixes(self, key):
        return [tuple(key[:j]) for j in range(self.P, len(key) - len(key) % self.P + 1, self.P)]

    def _cached_len(self, key):
        n = 0
        for p in self._prefixes(key):
            if p not in self.model:
                break
            n = len(p)
        return n

    def _locked(self):
        return {p for _, k in self.locks for p in self._prefixes(k)}

    def _model_leaves(self):
        P = self.P
        parents = {p[:-P] for p in self.model}
        return [p for p in self.model if p not in parents]

    def _walk(self):
        """Tree contents as {prefix: page}, checking structural invariants on the way."""
        P = self.P
        out: dict[tuple[int, ...], int] = {}
        nodes = []
        stack = [(self.tree.root, ())]
        while stack:
            node, prefix = stack.pop()
            for ck, child in node.children.items():
                assert child.parent is node
                assert len(child.key) > 0 and len(child.key) % P == 0
                assert len(child.pages) * P == len(child.key)
                assert ck == (child.key[0] if P == 1 else tuple(child.key[:P]))
                assert child.lock_ref <= node.lock_ref or node is self.tree.root
                full = prefix + tuple(child.key)
                for k, page in enumerate(child.pages):
                    out[full[: len(prefix) + (k + 1) * P]] = page
                nodes.append((child, prefix, full))
                stack.append((child, full))
        return out, nodes

    # -- rules

    def _insert(self, key):
        P = self.P
        key = key[: len(key) // P * P]
        expect = self._cached_len(key)
        pages = self.alloc.alloc(len(key) // P)
        assert pages is not None
        self.now += 1
        ret = self.tree.insert(key, pages)
        assert ret == expect
        self.alloc.free(pages[: ret // P])  # the caller's duplicates
        for k, p in enumerate(self._prefixes(key)):
            if len(p) > ret:
                self.model[p] = pages[k]
            self.times[p] = self.now
        return key

    @rule(target=keys, key=token_lists)
    def insert(self, key):
        return self._insert(key)

    @rule(target=keys, base=keys, cut=st.integers(0, 12), suffix=token_lists)
    def insert_derived(self, base, cut, suffix):
        return self._insert(base[:cut] + suffix)

    def _match(self, key):
        expect = self._cached_len(key)
        self.now += 1
        r = self.tree.match_prefix(key)
        assert r.length == expect
        assert r.pages == [self.model[p] for p in self._prefixes(key[:expect])]
        for p in self._prefixes(key[:expect]):
            self.times[p] = self.now
        if expect == 0:
            assert r.last_node is self.tree.root
        else:
            assert r.last_node.key == list(key[expect - len(r.last_node.key) : expect])
        return r

    @rule(key=token_lists)
    def match(self, key):
        self._match(key)

    @rule(key=keys)
    def match_inserted(self, key):
        self._match(key)  # refreshes whole cached paths, exercising LRU reordering

    @rule(base=keys, cut=st.integers(0, 12), suffix=token_lists, lock=st.booleans())
    def match_derived(self, base, cut, suffix, lock):
        key = base[:cut] + suffix
        r = self._match(key)
        if lock:
            self.tree.inc_lock_ref(r.last_node)
            self.locks.append((r.last_node, tuple(key[: r.length])))

    @rule(key=keys)
    def lock(self, key):
        r = self._match(key)
        self.tree.inc_lock_ref(r.last_node)
        self.locks.append((r.last_node, tuple(key[: r.length])))

    @precondition(lambda self: self.locks)
    @rule(idx=st.integers(0, 1000))
    def unlock(self, idx):
        node, _ = self.locks.pop(idx % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(n=st.integers(-1, 12))
    def evict(self, n):
        before = dict(self.model)
        locked = self._locked()
        self.freed_log.clear()
        ret = self.tree.evict(n)
        after, _ = self._walk()
        assert set(after) <= set(before)
        evicted = set(before) - set(after)
        assert ret == len(evicted) * self.P
        assert not evicted & locked
        assert sorted(self.freed_log) == sorted(before[p] for p in evicted)
        self.model = after
        unlocked_leaves = [p for p in self._model_leaves() if p not in locked]
        if n <= 0:
            assert ret == 0
        elif ret < n:
            assert unlocked_leaves == []  # stopped only because nothing was evictable
        # LRU: nothing evicted is newer than a leaf that stayed evictable.
        if evicted and unlocked_leaves:
            assert max(self.times[p] for p in evicted) <= min(
                self.times[p] for p in unlocked_leaves
            )
        for p in evicted:
            del self.times[p]

    @rule()
    def reset_if_unlocked(self):
        if any(k for _, k in self.locks):  # locks on the root (empty match) don't count
            with pytest.raises(ValueError):
                self.tree.reset()
            return
        pages = sorted(self.model.values())
        self.freed_log.clear()
        self.tree.reset()
        assert sorted(self.freed_log) == pages
        self.model.clear()
        self.times.clear()

    # -- invariants

    @invariant()
    def tree_matches_model(self):
        if not hasattr(self, "tree"):
            return
        P = self.P
        tree = self.tree
        walked, nodes = self._walk()
        assert walked == self.model
        assert tree.node_count() == len(nodes)
        locked = self._locked()
        assert locked <= set(self.model)  # locked prefixes are never evicted
        assert tree.total_size() == len(self.model) * P
        assert tree.protected_size() == len(locked) * P
        assert tree.evictable_size() == (len(self.model) - len(locked)) * P
        assert tree.evictable_size() + tree.protected_size() == tree.total_size()
        assert tree.num_pages() == len(self.model)
        assert len(set(self.model.values())) == len(self.model)  # no page shared
        # No leak / double free: the test holds no pages outside the tree between steps.
        assert tree.num_pages() + self.alloc.num_free == self.alloc.num_pages
        for node, prefix, full in nodes:
            n_locks = sum(1 for _, k in self.locks if k[: len(full)] == full)
            assert node.lock_ref == n_locks
            # Pages of one node are always touched together; their time is the node's.
            ends = range(len(prefix) + P, len(full) + 1, P)
            assert {self.times[full[:e]] for e in ends} == {node.last_access}

    def teardown(self):
        if not hasattr(self, "tree"):
            return
        while self.locks:
            node, _ = self.locks.pop()
            self.tree.dec_lock_ref(node)
        assert self.tree.protected_size() == 0
        self.tree.reset()
        assert self.alloc.num_free == NUM_PAGES


RadixMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_radix_state_machine = RadixMachine.TestCase


def test_insert_prefix_returns_the_node_a_match_would_find():
    c, rec = make(2)
    first = c.insert_prefix([1, 2, 3, 4], [10, 11])
    assert (first.cached, first.length, first.pages) == (0, 4, [10, 11])
    done = c.insert_prefix([1, 2, 3, 4, 5, 6], [20, 21, 22])  # 20, 21 duplicate 10, 11
    assert (done.cached, done.length, done.pages) == (4, 6, [10, 11, 22])
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.last_node is done.last_node and m.pages == done.pages
    mid = c.insert_prefix([1, 2], [30])  # ends inside an edge: split there
    assert (mid.cached, mid.length, mid.pages) == (2, 2, [10])
    assert mid.last_node is c.match_prefix([1, 2]).last_node
    assert c.insert_prefix([], []) == InsertResult(0, 0, [], c.root)
    assert rec.calls == [] and c.reuses_prefixes
    rec = Recorder()
    off = NoPrefixCache(2, rec)
    assert off.insert_prefix([1, 2], [5]) == InsertResult(0, 0, [], off.root)
    assert rec.calls == [] and not off.reuses_prefixes  # the caller keeps its pages
    with pytest.raises(ValueError):
        c.insert_prefix([1, 2, 3], [5])


def test_no_prefix_cache_has_the_interface_and_holds_nothing():
    public = {n for n in dir(RadixCache) if not n.startswith("_")}
    assert not public - set(dir(NoPrefixCache))
    rec = Recorder()
    c = NoPrefixCache(2, rec)
    assert not c.reuses_prefixes
    r = c.match_prefix([1, 2, 3, 4])
    assert (r.length, r.pages, r.last_node) == (0, [], c.root)
    assert c.insert_prefix([1, 2, 3, 4], [5, 6]) == InsertResult(0, 0, [], c.root)
    assert rec.calls == []  # the caller keeps (and frees) its pages
    assert c.insert([1, 2, 3, 4], [5, 6]) == 0 and rec.calls == [[5, 6]]  # freed at once
    c.inc_lock_ref(r.last_node)
    c.dec_lock_ref(r.last_node)
    assert c.evict(10) == 0
    sizes = (c.evictable_size(), c.protected_size(), c.total_size(), c.num_pages())
    assert sizes == (0, 0, 0, 0) and c.node_count() == 0
    assert list(c.iter_pages()) == [] and c.page_keys(c.root) == []
    assert c.last_page_key(c.root) == c.root_key
    c.reset()
    with pytest.raises(ValueError):
        c.insert([1, 2, 3], [5])
    with pytest.raises(ValueError):
        c.insert_prefix([1, 2], [5, 6])
    with pytest.raises(ValueError):
        NoPrefixCache(0, rec)
