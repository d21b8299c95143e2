"""Pluggable eviction policies for the radix prefix cache.

A policy orders evictable leaves: `RadixCache.evict` pushes each candidate leaf into a min-heap
keyed by `(policy.priority(node), node.id)` and pops the lowest first. The `on_*` hooks let
stateful policies (e.g. LARU's online predictor) observe the tree; they must not mutate it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgrec.radix.tree import TreeNode


class EvictionPolicy(ABC):
    """Orders leaves for eviction; lower priority is evicted first."""

    name: str = "base"

    @abstractmethod
    def priority(self, node: TreeNode) -> tuple:
        """Sort key of an evictable leaf (lower = evicted first). Compared only within one evict()."""

    def on_access(self, node: TreeNode) -> None:
        """A match/insert touched `node` (its time, tick and count are already updated)."""

    def on_insert(self, node: TreeNode) -> None:
        """`node` was created: a new leaf from insert, or the prefix half of a split (which inherits
        the stats of the node it was cut from)."""

    def on_evict(self, node: TreeNode) -> None:
        """`node` was evicted and detached from the tree."""

    def on_reset(self) -> None:
        """The whole tree was dropped (RadixCache.reset)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used: oldest `last_access_time` first, the cache's access tick breaks ties."""

    name = "lru"

    def priority(self, node: TreeNode) -> tuple:
        return (node.last_access_time, node.access_tick)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name_or_policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from a registered name, or the given instance unchanged."""
    if isinstance(name_or_policy, EvictionPolicy):
        return name_or_policy
    cls = POLICIES.get(str(name_or_policy).lower())
    if cls is None:
        raise ValueError(f"unknown eviction policy {name_or_policy!r}; known: {', '.join(sorted(POLICIES))}")
    return cls()
