"""Radix prefix cache over token-granular KV slots (SGLang's RadixCache contract).

Each edge holds token ids (`key`) and their KV slots (`value`). `extra_key` namespaces the tree:
sequences with different extra keys (None included) never share nodes.

NOTE invariants: evictable_size_ + protected_size_ == tokens in the tree; a node with lock_ref > 0
is never evicted; a parent's lock_ref >= the sum of its children's; every slot in the tree is
distinct and owned by the tree until evicted or reset.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sgrec.mem.kv_pool import TokenAllocator
from sgrec.radix.hicache import HiCache
from sgrec.radix.eviction import EvictionPolicy, is_evictable, make_policy
from sgrec.radix.node import TreeNode, child_key


WHOLE_KEY_MARK = 1 << 62  # a whole key's first entry is at least this: never a token id


def whole_key(tokens: Sequence[int]) -> list[int]:
    """The key under which a sequence is cached when it is reusable only whole (an encoder's input:
    every token's KV depends on all of them): a 62-bit digest of the sequence, then the sequence.
    Two different sequences share no prefix in the tree (but with the digest's collision chance,
    2^-62), so a match is a hit only when it covers the whole key; the digest's slot holds no KV."""
    digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8).digest()
    return [WHOLE_KEY_MARK | (int.from_bytes(digest, "little") & (WHOLE_KEY_MARK - 1)), *map(int, tokens)]


def _as_list(key: Sequence[int] | torch.Tensor) -> list[int]:
    return key.tolist() if isinstance(key, torch.Tensor) else [int(t) for t in key]


def _match_len(edge: list[int], key: list[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


@dataclass
class MatchResult:
    indices: torch.Tensor  # int64 KV slots of the matched prefix (empty if none)
    last_node: TreeNode  # deepest matched node (root if nothing matched)


class RadixCache:
    """Prefix tree of token ids -> KV slots with lock counting and policy-ordered leaf eviction."""

    def __init__(self, allocator: TokenAllocator | None, policy: str | EvictionPolicy = "lru",
                 disable: bool = False, clock: Callable[[], float] = time.monotonic, hicache: HiCache | None = None,
                 states=None):
        """states: the StatePool (sgrec.mem.memory) whose slots nodes may carry (attach_state), for
        families with per-request state; None for the dense decoder."""
        self.allocator = allocator
        self.states = states
        self.hicache = hicache  # the tiers below the pool (--enable-hierarchical-cache), or None
        self.policy = make_policy(policy)
        self.disable = disable
        self.clock = clock
        self.device = allocator.device if allocator is not None else torch.device("cpu")
        self._tick = 0
        self.reset()

    # ---- queries -------------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached prefix of `key` in the `extra_key` namespace. Splits the node the match ends
        inside, and touches (time, tick, count, policy.on_access) every matched node."""
        if self.disable:
            return MatchResult(self._empty(), self.root)
        key = _as_list(key)
        node, i, parts = self._walk(key, extra_key, self.clock())
        if self.hicache is not None and i < len(key):
            node = self._load_back(key, extra_key, node, i, parts)
        return MatchResult(torch.cat(parts) if parts else self._empty(), node)

    def match_snapshot(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """match_prefix cut back to the deepest matched node that carries a state (a family whose
        prefixes are reusable only where a state was kept): that node's KV and the node (the root
        when no matched node has one)."""
        res = self.match_prefix(key, extra_key)
        node, n = res.last_node, res.indices.numel()
        while node is not self.root and node.state is None:
            n -= len(node.key)
            node = node.parent
        if self.hicache is not None and self.hicache.states is not None:
            back = self._load_snapshot(_as_list(key), extra_key, res, n)
            if back is not None:
                return back
        return MatchResult(res.indices[:n], node)

    def _load_snapshot(self, key: list[int], extra_key: str | None, res: MatchResult, floor: int
                       ) -> MatchResult | None:
        """A deeper snapshot than the pool's (past depth `floor`) from the host tier: its tail's KV
        into fresh slots past the pool's match, its state into a fresh state slot on the node that
        ends there. The match up to it, or None (no such snapshot, or no room for it now)."""
        have = res.indices.numel()
        plan = self.hicache.plan_snapshot(key, extra_key, have, floor)
        if plan is None:
            return None
        d, snap = plan
        fresh = max(0, d - have)
        self.inc_lock_ref(res.last_node)  # making room must not evict the part matched
        try:
            room = self.make_room(fresh, 1)
        finally:
            self.dec_lock_ref(res.last_node)
        if not room:
            return None
        slots = self.allocator.alloc(fresh) if fresh else None
        state = self.states.alloc(1)
        self.hicache.load_snapshot(slots, state, snap)
        if fresh:
            self.insert(key[:d], torch.cat([res.indices.to(slots.device), slots]), extra_key)
        out = self.match_prefix(key[:d], extra_key)
        self.attach_state(out.last_node, state)
        return out

    def _load_back(self, key: list[int], extra_key: str | None, node: TreeNode, i: int,
                   parts: list[torch.Tensor]) -> TreeNode:
        """Extends a match that ends at node (depth i) with the host tier's pages: they are copied
        into fresh slots and inserted below node. Returns the deepest matched node (parts grows)."""
        plan = self.hicache.plan_load(key, extra_key, i)
        if plan is None:
            return node
        end = plan.end
        self.inc_lock_ref(node)  # making room must not evict the part already matched
        try:
            room = self.make_room(end - i)
        finally:
            self.dec_lock_ref(node)
        if not room:
            return node
        slots = self.allocator.alloc(end - i)
        self.hicache.load(slots, plan)
        self.insert(key[:end], torch.cat([*parts, slots]), extra_key)
        new = node.children[child_key(extra_key, key[i])]
        parts.append(new.value)
        return new

    def peek_prefix_len(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Length of the cached prefix of `key`, read without touching the tree (no access-time
        update, no split), so a scheduler may ask often without disturbing the eviction order."""
        if self.disable:
            return 0
        node, i, key = self.root, 0, _as_list(key)
        while i < len(key):
            child = node.children.get(child_key(extra_key, key[i]))
            if child is None:
                break
            m = _match_len(child.key, key, i)
            i += m
            if m < len(child.key):
                break
            node = child
        return i

    def _walk(self, key: list[int], extra_key: str | None, now: float) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follows key from the root, splitting the last edge where the match ends inside it and
        touching every node on the way; returns (deepest node, tokens matched, their slot runs)."""
        node, i, parts = self.root, 0, []
        while i < len(key):
            child = node.children.get(child_key(extra_key, key[i]))
            if child is None:
                break
            m = _match_len(child.key, key, i)
            if m < len(child.key):
                child = self._split(child, m)
            self._touch(child, now)
            parts.append(child.value)
            node, i = child, i + m
        return node, i, parts

    def insert_owned(self, key: Sequence[int], value: torch.Tensor, extra_key: str | None, owned_from: int) -> int:
        """Hands a sequence's KV to the tree: value[:owned_from] are the tree's slots already (a
        match), the rest the caller's. The caller's slots of tokens the tree held already (cached
        meanwhile by another request) go back to the allocator, the others are the tree's now.
        Returns insert's count of tokens cached before."""
        prefix = self.insert(key, value, extra_key)
        self.allocator.free(value[owned_from:prefix])
        return prefix

    def hand_off(self, key: Sequence[int], value: torch.Tensor, extra_key: str | None, owned_from: int,
                 lock: TreeNode | None = None) -> MatchResult:
        """insert_owned, then the match of the whole key: the tree's slots for it and its deepest
        node. `lock`: the node the caller holds locked; the lock moves to that deepest node."""
        self.insert_owned(key, value, extra_key, owned_from)
        res = self.match_prefix(key, extra_key)
        if lock is not None:
            self.inc_lock_ref(res.last_node)
            self.dec_lock_ref(lock)
        return res

    def insert(self, key: Sequence[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Insert key -> value; return how many leading tokens were already cached. The tree keeps
        only value[returned:]; the caller still owns value[:returned] (free the ones not shared
        with the tree). With disable=True nothing is stored, 0 is returned and the caller keeps all."""
        if self.disable:
            return 0
        key = _as_list(key)
        if len(value) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} slots")
        now = self.clock()
        node, i, _ = self._walk(key, extra_key, now)
        if i < len(key):
            new = TreeNode(node, key[i:], value[i:].to(torch.int64).clone(), extra_key, now)
            node.children[child_key(extra_key, key[i])] = new
            self._tick += 1
            new.access_tick, new.access_count = self._tick, 1
            self.evictable_size_ += len(new.key)
            self.policy.on_insert(new)
            self.policy.on_update(node)
            if self.hicache is not None:
                self.hicache.on_insert(new)
        return i

    # ---- eviction and locks --------------------------------------------------------------------
    def make_room(self, n: int, states: int = 0) -> bool:
        """Evicts what it must (and can) so that the allocator has n free slots and the state pool
        `states` free state slots (one budget for both: a request is admitted only if both fit);
        whether it has them."""
        short = n - self.allocator.available_size()
        if short > 0:
            self.evict(short)
        if states:
            short = states - self.states.available_size()
            if short > 0:
                self.evict_states(short)
            if self.states.available_size() < states:
                return False
        return self.allocator.available_size() >= n

    # ---- per-request states on nodes (families with recurrent layers) --------------------------------
    def attach_state(self, node: TreeNode, slot: torch.Tensor) -> None:
        """The tree takes a state slot: the state after node's last token (replacing one it had)."""
        if node.state is not None:
            self.states.free(node.state)
            self.state_count -= 1
        node.state = slot
        self.state_count += 1

    def lock_state(self, node: TreeNode) -> None:
        node.state_lock_ref += 1

    def unlock_state(self, node: TreeNode) -> None:
        if node.state_lock_ref <= 0:
            raise RuntimeError(f"unlock_state on an unlocked state of {node!r}")
        node.state_lock_ref -= 1

    def evict_states(self, n: int) -> int:
        """Frees up to n unlocked states. The eviction policy picks first: its victims (evictable
        leaves in its order: recency for lru, predictions for laru, fpb and hf) go whole, KV and
        snapshot, until n states are free. A family with states resumes a prefix only from a
        snapshot, so a leaf's KV is of no use once its snapshot is gone, and a leaf without one is
        of none already. Then snapshots on inner nodes (the prefixes of their children's) go, least
        recently used first, their KV kept. Returns how many were freed."""
        freed = 0
        while freed < n and self.policy.indexed and not self.disable:
            node = self._victim()
            if node is None:
                break
            freed += node.state is not None
            self._delete_leaf(node)
        if freed < n:
            held = sorted((node.access_tick, node.id, node) for node in self._nodes()
                          if node.state is not None and node.state_lock_ref == 0)
            for _, _, node in held[: n - freed]:
                if self.hicache is not None:  # down a tier instead of gone
                    self.hicache.save_snapshot(node)
                self._drop_state(node)
                freed += 1
        return freed

    def evictable_states(self) -> int:
        """States evict_states could free now (unlocked)."""
        return sum(node.state is not None and node.state_lock_ref == 0 for node in self._nodes())

    def _drop_state(self, node: TreeNode) -> None:
        if node.state is not None:
            self.states.free(node.state)
            node.state = None
            self.state_count -= 1

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves in policy order until >= num_tokens tokens are freed or nothing is
        evictable; a parent left childless and unlocked becomes a candidate. Returns tokens freed.
        An indexed policy names each victim itself (`policy.victim()`); any other policy is asked
        for `priority(node)` of every evictable leaf and the lowest goes first."""
        if self.disable or num_tokens <= 0:
            return 0
        if self.policy.indexed:
            freed = 0
            while freed < num_tokens:
                node = self._victim()
                if node is None:
                    break
                freed += self._delete_leaf(node)
            return freed
        heap = [(self.policy.priority(n), n.id, n) for n in self._nodes() if is_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            freed += self._delete_leaf(node)
            if is_evictable(parent):
                heapq.heappush(heap, (self.policy.priority(parent), parent.id, parent))
        return freed

    def _victim(self) -> TreeNode | None:
        """An indexed policy's next victim, checked: an unlocked leaf whose state (if any) is not
        locked either (a state is locked only under a KV lock); None when nothing is evictable."""
        node = self.policy.victim()
        if node is not None and (not is_evictable(node) or node.state_lock_ref):
            raise RuntimeError(f"policy {self.policy.name} chose a non-evictable node {node!r}")
        return node

    def evict_branch(self, node: TreeNode) -> int:
        """Frees `node` and then each ancestor left childless, while they are unlocked: the part of
        the tree only this path uses (e.g. one user's prefix). Returns the tokens freed."""
        freed = 0
        while is_evictable(node):
            parent = node.parent
            freed += self._delete_leaf(node)
            node = parent
        return freed

    def _delete_leaf(self, node: TreeNode) -> int:
        parent = node.parent
        assert parent is not None
        if self.hicache is not None:  # down a tier instead of gone
            self.hicache.on_evict(node)
        del parent.children[child_key(node.extra_key, node.key[0])]
        self._free(node.value)
        self._drop_state(node)
        self.evictable_size_ -= len(node.key)
        node.parent = None
        self.policy.on_evict(node)
        self.policy.on_update(parent)
        return len(node.key)

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock node..root (root excluded). Returns how many tokens became protected."""
        if self._detached(node):
            return 0
        delta = 0
        while node is not self.root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta += len(node.key)
                self.policy.on_update(node)
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one inc_lock_ref(node). Returns how many tokens became evictable. A node dropped by
        reset() is ignored (returns 0)."""
        if self._detached(node):
            return 0
        delta = 0
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
                self.policy.on_update(node)
            node = node.parent
        return delta

    # ---- accounting ----------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        return self.evictable_size_ + self.protected_size_

    def reset(self) -> None:
        """Free every slot in the tree and empty it; locks are dropped (old nodes become detached)."""
        if getattr(self, "root", None) is not None:
            for node in list(self._nodes()):
                if node is not self.root:
                    self._free(node.value)
                self._drop_state(node)
                node.parent, node.children, node.lock_ref = None, {}, 0
            self.policy.on_reset()
            if self.hicache is not None:
                self.hicache.reset()
        self.root = TreeNode(now=self.clock())
        self.root.lock_ref = 1  # never evictable, never counted
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.state_count = 0

    def all_values(self) -> torch.Tensor:
        vals = [n.value for n in self._nodes() if n is not self.root]
        return torch.cat(vals) if vals else self._empty()

    def check_integrity(self) -> None:
        """Recompute the counters and structure by a walk; raise RuntimeError on any mismatch."""
        evictable = protected = 0
        for node in self._nodes():
            for ck, child in node.children.items():
                if child.parent is not node or not child.key or ck != child_key(child.extra_key, child.key[0]):
                    raise RuntimeError(f"bad child link {ck!r} -> {child!r}")
                if node is not self.root and child.extra_key != node.extra_key:
                    raise RuntimeError(f"extra_key changes below {node!r}")
            if node is self.root:
                continue
            if node.value is None or len(node.value) != len(node.key):
                raise RuntimeError(f"value/key length mismatch in {node!r}")
            if node.depth != node.parent.depth + len(node.key):
                raise RuntimeError(f"bad depth in {node!r}")
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
                raise RuntimeError(f"lock_ref below children's in {node!r}")
            if node.lock_ref == 0:
                evictable += len(node.key)
            elif node.lock_ref > 0:
                protected += len(node.key)
            else:
                raise RuntimeError(f"negative lock_ref in {node!r}")
        if (evictable, protected) != (self.evictable_size_, self.protected_size_):
            raise RuntimeError(f"counters (evictable={self.evictable_size_}, protected={self.protected_size_}) "
                               f"!= walk (evictable={evictable}, protected={protected})")
        vals = self.all_values()
        if len(torch.unique(vals)) != len(vals):
            raise RuntimeError("a KV slot appears twice in the tree")
        states = [n.state for n in self._nodes() if n.state is not None]
        if len(states) != self.state_count:
            raise RuntimeError(f"state_count {self.state_count} != {len(states)} states on nodes")
        self.policy.check_integrity(self)

    # ---- internals -----------------------------------------------------------------------------
    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _touch(self, node: TreeNode, now: float) -> None:
        self._tick += 1
        node.last_access_time, node.access_tick = now, self._tick
        node.access_count += 1
        self.policy.on_access(node)
        if self.hicache is not None:
            self.hicache.on_hit(node)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut child's edge after m tokens; the new prefix node inherits lock_ref, times and counts.
        NOTE: as in SGLang (which stamps the whole node before splitting it), the tail counts as used
        for recency: it gets a fresh access_tick, while its time and count stay as they were."""
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key)
        new = TreeNode(parent, child.key[:m], child.value[:m], child.extra_key)
        new.lock_ref, new.access_count, new.access_tick = child.lock_ref, child.access_count, child.access_tick
        new.last_access_time, new.creation_time = child.last_access_time, child.creation_time
        parent.children[child_key(child.extra_key, child.key[0])] = new
        child.key, child.value, child.parent = child.key[m:], child.value[m:], new
        new.children[child_key(child.extra_key, child.key[0])] = child
        self._tick += 1
        child.access_tick = self._tick
        self.policy.on_split(new, child)
        return new

    def _detached(self, node: TreeNode) -> bool:
        return node.parent is None and node is not self.root

    def _free(self, value: torch.Tensor | None) -> None:
        if self.allocator is not None and value is not None:
            self.allocator.free(value)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)
