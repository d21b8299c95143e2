"""A node of the radix prefix cache, and the keys that both the tree and its eviction policies read.

Its own module so that `tree.py` (which calls the policies) and `eviction.py` (whose policies key
nodes by `start_key`) both import it, and neither imports the other.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

_node_ids = itertools.count()


def child_key(extra_key: str | None, token: int) -> Any:
    return token if extra_key is None else (extra_key, token)


def start_key(node: TreeNode) -> int:
    """Identity of what a node caches, independent of how the tree is split: a hash of its
    extra_key and the token path from the root through the node's first token. The same content
    re-inserted after an eviction gets the same key (O(depth))."""
    parts = [node.key[:1]]
    p = node.parent
    while p is not None and p.parent is not None:
        parts.append(p.key)
        p = p.parent
    return hash((node.extra_key, tuple(itertools.chain.from_iterable(reversed(parts)))))


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "extra_key", "lock_ref", "last_access_time",
                 "access_count", "access_tick", "creation_time", "depth", "id", "state", "state_lock_ref")

    def __init__(self, parent: TreeNode | None = None, key: list[int] | None = None,
                 value: torch.Tensor | None = None, extra_key: str | None = None, now: float = 0.0):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key if key is not None else []
        self.value = value
        self.extra_key = extra_key
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.access_count = 0
        self.access_tick = 0  # the cache's tick at the last touch; totally orders accesses
        self.depth = (parent.depth if parent is not None else 0) + len(self.key)
        self.id = next(_node_ids)
        # a family's per-request state after this node's last token (a StatePool slot, the tree's
        # own), or None; its lock is apart from the KV's: a state may go while the KV stays
        self.state: torch.Tensor | None = None
        self.state_lock_ref = 0

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, key={self.key}, extra_key={self.extra_key!r}, depth={self.depth}, "
                f"lock_ref={self.lock_ref}, children={len(self.children)})")
