"""Radix prefix cache: exact-value unit tests and a hypothesis state machine for the accounting invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sgrec.mem.kv_pool import TokenAllocator
from sgrec.radix.eviction import EvictionPolicy, LRUPolicy, make_policy
from sgrec.radix.tree import RadixCache, TreeNode


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_cache(size: int = 64, **kw) -> tuple[RadixCache, TokenAllocator, FakeClock]:
    alloc, clock = TokenAllocator(size), FakeClock()
    return RadixCache(alloc, clock=clock, **kw), alloc, clock


def put(cache: RadixCache, alloc: TokenAllocator, key: list[int], extra_key: str | None = None) -> torch.Tensor:
    """Insert like a real caller: fresh slots, free the duplicates; return the slots now cached for key."""
    value = alloc.alloc(len(key))
    assert value is not None
    prefix = cache.insert(key, value, extra_key)
    alloc.free(value[:prefix])
    return value


def free_slots(alloc: TokenAllocator) -> list[int]:
    return torch.cat([alloc._free, *alloc._pending]).tolist()


def token_map(cache: RadixCache) -> dict[tuple, int]:
    """(extra_key, token prefix) -> KV slot of its last token, for every token in the tree."""
    out: dict[tuple, int] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        if node is not cache.root:
            for tok, slot in zip(node.key, node.value.tolist()):
                prefix = prefix + (tok,)
                out[(node.extra_key, prefix)] = slot
        stack.extend((c, prefix) for c in node.children.values())
    return out


def path_values(cache: RadixCache, node: TreeNode) -> torch.Tensor:
    parts = []
    while node is not cache.root:
        assert node.parent is not None, "node detached from the tree"
        parts.append(node.value)
        node = node.parent
    return torch.cat(parts[::-1]) if parts else torch.empty(0, dtype=torch.int64)


# ---- unit tests ------------------------------------------------------------------------------------

def test_match_after_insert():
    cache, alloc, _ = make_cache()
    v = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], v) == 0
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.indices.tolist() == v.tolist() and m.indices.dtype == torch.int64
    assert m.last_node.depth == 5 and m.last_node.key == [1, 2, 3, 4, 5]
    miss = cache.match_prefix([9, 1])
    assert miss.indices.numel() == 0 and miss.last_node is cache.root
    assert cache.total_size() == cache.evictable_size() == 5 and cache.protected_size() == 0
    cache.check_integrity()


def test_split_in_middle_of_edge():
    cache, alloc, _ = make_cache()
    v = put(cache, alloc, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.indices.tolist() == v[:3].tolist()
    assert m.last_node.key == [1, 2, 3] and m.last_node.depth == 3
    (tail,) = m.last_node.children.values()
    assert tail.key == [4, 5] and tail.value.tolist() == v[3:].tolist() and tail.depth == 5
    assert tail.parent is m.last_node and m.last_node.parent is cache.root
    assert cache.total_size() == 5
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == v.tolist()
    cache.check_integrity()


def test_split_keeps_lock_and_stats():
    cache, alloc, clock = make_cache()
    put(cache, alloc, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    assert cache.inc_lock_ref(node) == 4
    clock.t = 5.0
    m = cache.match_prefix([1, 2])
    assert m.last_node.lock_ref == 1 and node.lock_ref == 1
    assert m.last_node.access_count == node.access_count + 1
    assert m.last_node.last_access_time == 5.0 and node.last_access_time == 0.0
    assert m.last_node.creation_time == node.creation_time == 0.0
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.check_integrity()
    assert cache.dec_lock_ref(node) == 4 and cache.evictable_size() == 4


def test_insert_returns_prefix_len():
    cache, alloc, _ = make_cache()
    v1 = put(cache, alloc, [1, 2, 3, 4, 5])
    v2 = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 7, 8, 9], v2) == 3
    alloc.free(v2[:3])
    assert cache.match_prefix([1, 2, 3, 7, 8, 9]).indices.tolist() == v1[:3].tolist() + v2[3:].tolist()
    assert cache.total_size() == 8
    v3 = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], v3) == 4  # fully cached: nothing kept
    alloc.free(v3)
    assert cache.total_size() == 8
    assert sorted(cache.all_values().tolist() + free_slots(alloc)) == list(range(1, 65))
    cache.check_integrity()


def test_insert_rejects_length_mismatch():
    cache, alloc, _ = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], alloc.alloc(2))


def test_extra_key_separation():
    cache, alloc, _ = make_cache()
    v_none = put(cache, alloc, [1, 2, 3])
    v_a = put(cache, alloc, [1, 2, 3], extra_key="a")
    assert not set(v_none.tolist()) & set(v_a.tolist())
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == v_none.tolist()
    assert cache.match_prefix([1, 2, 3], extra_key="a").indices.tolist() == v_a.tolist()
    assert cache.match_prefix([1, 2, 3], extra_key="b").indices.numel() == 0
    assert set(cache.root.children) == {1, ("a", 1)}
    v = alloc.alloc(4)
    assert cache.insert([1, 2, 9, 9], v, extra_key="a") == 2
    split = cache.match_prefix([1, 2], extra_key="a").last_node
    assert split.extra_key == "a" and set(split.children) == {("a", 3), ("a", 9)}
    assert cache.total_size() == 8
    cache.check_integrity()


def test_lock_prevents_eviction():
    cache, alloc, _ = make_cache()
    v1 = put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [4, 5])
    node = cache.match_prefix([1, 2, 3]).last_node
    assert cache.inc_lock_ref(node) == 3
    assert cache.inc_lock_ref(node) == 0  # already protected
    assert (cache.evictable_size(), cache.protected_size()) == (2, 3)
    assert cache.evict(100) == 2
    assert cache.evict(100) == 0
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == v1.tolist()
    assert cache.dec_lock_ref(node) == 0 and cache.dec_lock_ref(node) == 3
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (3, 0)
    assert cache.evict(1) == 3
    assert alloc.available_size() == alloc.size
    cache.check_integrity()


def test_lru_order():
    cache, alloc, clock = make_cache()
    for t, key in enumerate([[1, 1], [2, 2], [3, 3]]):
        clock.t = float(t)
        put(cache, alloc, key)
    clock.t = 3.0
    cache.match_prefix([1, 1])
    assert cache.evict(2) == 2
    assert cache.match_prefix([2, 2]).indices.numel() == 0
    assert len(cache.match_prefix([1, 1]).indices) == 2 and len(cache.match_prefix([3, 3]).indices) == 2
    clock.t = 4.0
    cache.match_prefix([3, 3])
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 1]).indices.numel() == 0


def test_lru_ties_broken_by_access_order():
    cache, alloc, _ = make_cache()  # clock never advances
    put(cache, alloc, [1])
    put(cache, alloc, [2])
    put(cache, alloc, [3])
    cache.match_prefix([1])
    assert cache.evict(1) == 1 and set(cache.root.children) == {1, 3}
    assert cache.evict(1) == 1 and set(cache.root.children) == {1}


def test_parent_evictable_after_children():
    cache, alloc, _ = make_cache()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    parent = cache.match_prefix([1, 2]).last_node
    assert parent.key == [1, 2] and len(parent.children) == 2
    assert cache.evict(1) == 1 and len(parent.children) == 1
    assert cache.evict(1) == 1 and not parent.children
    assert cache.evict(1) == 2 and cache.total_size() == 0 and not cache.root.children
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    assert cache.evict(3) == 4  # both leaves, then their parent, in one call
    assert alloc.available_size() == alloc.size
    cache.check_integrity()


def test_reset_frees_everything():
    cache, alloc, _ = make_cache()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5])
    put(cache, alloc, [0, 1], extra_key="x")
    node = cache.match_prefix([1, 2, 5]).last_node
    cache.inc_lock_ref(node)
    cache.reset()
    assert alloc.available_size() == alloc.size
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert cache.all_values().numel() == 0 and not cache.root.children
    assert cache.dec_lock_ref(node) == 0  # locks were dropped with the tree
    cache.check_integrity()


def test_disable():
    alloc = TokenAllocator(16)
    cache = RadixCache(alloc, disable=True)
    v = alloc.alloc(3)
    assert cache.insert([1, 2, 3], v) == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.indices.numel() == 0 and m.last_node is cache.root
    assert cache.total_size() == 0 and cache.evict(10) == 0
    assert RadixCache(None, disable=True).match_prefix([1]).indices.numel() == 0


def test_depth_values():
    cache, alloc, _ = make_cache()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5])
    put(cache, alloc, [1, 2, 3, 4, 6, 7])
    assert cache.root.depth == 0
    depths = {tuple(n.key): n.depth for n in cache._nodes() if n is not cache.root}
    assert depths == {(1, 2): 2, (3, 4): 4, (5,): 3, (6, 7): 6}
    assert cache.match_prefix([1, 2, 3, 4, 6, 7]).last_node.depth == 6


def test_access_count_and_ids():
    cache, alloc, _ = make_cache()
    put(cache, alloc, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    assert node.access_count == 2  # insert + match
    cache.match_prefix([1])  # split: the new prefix node counts 3, the tail keeps 2
    assert node.parent.access_count == 3 and node.access_count == 2
    assert node.parent.id > node.id


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy) and make_policy("lru").name == "lru"
    p = LRUPolicy()
    assert make_policy(p) is p
    with pytest.raises(ValueError, match="lru"):
        make_policy("nope")


def test_custom_policy_plugs_in():
    class MRU(EvictionPolicy):
        name = "mru"

        def __init__(self) -> None:
            self.events: list[str] = []

        def priority(self, node: TreeNode) -> tuple:
            return (-node.access_tick,)

        def on_insert(self, node: TreeNode) -> None:
            self.events.append("insert")

        def on_evict(self, node: TreeNode) -> None:
            self.events.append("evict")

    policy = MRU()
    alloc = TokenAllocator(16)
    cache = RadixCache(alloc, policy=policy)
    put(cache, alloc, [1])
    put(cache, alloc, [2])
    cache.match_prefix([1])
    assert cache.evict(1) == 1 and 1 not in cache.root.children and 2 in cache.root.children
    assert policy.events == ["insert", "insert", "evict"]


# ---- property test ---------------------------------------------------------------------------------

SIZE = 40
seqs = st.lists(st.integers(0, 4), min_size=1, max_size=7)
extra_keys = st.sampled_from([None, None, "x"])


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.alloc = TokenAllocator(SIZE)
        self.cache = RadixCache(self.alloc, clock=self.clock)
        self.seen: list[tuple[list[int], str | None]] = []
        self.locks: list[tuple[TreeNode, str | None, tuple[int, ...], list[int]]] = []

    def _pick(self, data: st.DataObject) -> tuple[list[int], str | None]:
        if self.seen and data.draw(st.booleans()):
            return data.draw(st.sampled_from(self.seen))
        return data.draw(seqs), data.draw(extra_keys)

    @rule(seq=seqs, ek=extra_keys, dt=st.sampled_from([0.0, 1.0]))
    def insert(self, seq: list[int], ek: str | None, dt: float) -> None:
        self.clock.t += dt
        before = token_map(self.cache)
        if self.alloc.available_size() < len(seq):
            self.cache.evict(len(seq) - self.alloc.available_size())
            before = token_map(self.cache)
        value = self.alloc.alloc(len(seq))
        if value is None:  # the rest of the pool is locked
            return
        prefix = self.cache.insert(seq, value, ek)
        self.alloc.free(value[:prefix])
        self.seen.append((seq, ek))
        after = token_map(self.cache)
        assert all(after[k] == s for k, s in before.items())  # nothing moved or vanished
        assert len(after) - len(before) == len(seq) - prefix
        assert all((ek, tuple(seq[: i + 1])) in before for i in range(prefix))
        assert prefix == len(seq) or (ek, tuple(seq[: prefix + 1])) not in before
        got = self.cache.match_prefix(seq, ek).indices.tolist()
        assert got[prefix:] == value[prefix:].tolist() and len(got) == len(seq)

    @rule(data=st.data(), dt=st.sampled_from([0.0, 1.0]))
    def match(self, data: st.DataObject, dt: float) -> None:
        self.clock.t += dt
        seq, ek = self._pick(data)
        before = token_map(self.cache)
        m = self.cache.match_prefix(seq, ek)
        assert token_map(self.cache) == before  # a split changes nothing observable
        n = len(m.indices)
        assert m.last_node.depth == n
        assert m.indices.tolist() == [before[(ek, tuple(seq[: i + 1]))] for i in range(n)]
        assert n == len(seq) or (ek, tuple(seq[: n + 1])) not in before

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        seq, ek = self._pick(data)
        m = self.cache.match_prefix(seq, ek)
        if m.indices.numel() == 0:
            return
        protected = self.cache.protected_size()
        delta = self.cache.inc_lock_ref(m.last_node)
        assert self.cache.protected_size() == protected + delta
        self.locks.append((m.last_node, ek, tuple(seq[: len(m.indices)]), m.indices.tolist()))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))[0]
        evictable = self.cache.evictable_size()
        delta = self.cache.dec_lock_ref(node)
        assert self.cache.evictable_size() == evictable + delta

    @rule(n=st.integers(0, 24))
    def evict(self, n: int) -> None:
        before, evictable, avail = token_map(self.cache), self.cache.evictable_size(), self.alloc.available_size()
        freed = self.cache.evict(n)
        after = token_map(self.cache)
        assert (freed == evictable) if evictable < n else (n <= freed <= evictable)
        assert self.cache.evictable_size() == evictable - freed
        assert self.alloc.available_size() == avail + freed
        assert len(before) - len(after) == freed and all(before[k] == s for k, s in after.items())

    @invariant()
    def accounting_balances(self) -> None:
        c = self.cache
        assert c.evictable_size() + c.protected_size() == c.total_size() == len(c.all_values())
        c.check_integrity()
        slots = c.all_values().tolist() + free_slots(self.alloc)
        assert sorted(slots) == list(range(1, SIZE + 1))  # none lost, none doubled

    @invariant()
    def locked_paths_intact(self) -> None:
        tmap = token_map(self.cache)
        for node, ek, prefix, slots in self.locks:
            assert node.lock_ref > 0
            assert path_values(self.cache, node).tolist() == slots
            assert [tmap[(ek, prefix[: i + 1])] for i in range(len(prefix))] == slots

    def teardown(self) -> None:
        for node, *_ in reversed(self.locks):
            self.cache.dec_lock_ref(node)
        assert self.cache.protected_size() == 0
        self.cache.check_integrity()
        self.cache.reset()
        assert self.alloc.available_size() == self.alloc.size
        assert self.cache.total_size() == 0


RadixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixMachine = RadixMachine.TestCase


def test_make_room_evicts_only_what_is_missing_and_says_whether_it_fits():
    cache, alloc, _ = make_cache(size=16)
    put(cache, alloc, [1, 2, 3, 4, 5])
    put(cache, alloc, [7, 8, 9, 10, 11])
    assert alloc.available_size() == 6
    assert cache.make_room(6) and cache.total_size() == 10  # enough free: nothing evicted
    assert cache.make_room(8) and alloc.available_size() == 11 and cache.total_size() == 5  # one entry out
    m = cache.match_prefix([7, 8, 9, 10, 11])  # the least recently used went first
    assert m.indices.numel() == 5
    cache.inc_lock_ref(m.last_node)  # a locked entry is never evicted: 11 free, 12 asked
    assert not cache.make_room(12) and cache.total_size() == 5
    cache.dec_lock_ref(m.last_node)
    assert cache.make_room(16) and cache.total_size() == 0
