"""Request filters on the semantic-ID trie: which leaves (paths) a request may reach.

A request may exclude item ids, allow only some (include), and test attributes (a filter, see
`sgrec.catalog.attrs`). A leaf is allowed when one of its items passes all three; a node is allowed
when a leaf under it is. Beam search expands only allowed nodes (`sgrec.beam.trie.children_logp`
with the request's TrieFilter: an include list or attribute filter tests each valid child,
`positive`; exclusions strike just their blocked nodes under the live beams, `blocked_children`), so
no beam is spent on a subtree with nothing to return, and every kept beam reaches an allowed leaf.

Cost per request, never a pass over the catalog for exclusions: an exclusion list of E ids walks
its E paths up the ND levels, subtracting from per-node item counts (the trie's, or an attribute
filter's, cached per filter), and only nodes whose count reaches 0 are blocked: O(E * ND log E).
An include list of I ids marks its I paths' ancestors: O(I * ND log I). An attribute filter
evaluates over the catalog once (vectorised) and its per-node counts are cached (`FilterCache`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import orjson
import torch

from sgrec.beam.trie import SemanticIdTrie
from sgrec.catalog import Catalog

FILTER_CACHE_SIZE = 4  # attribute filters whose per-node counts are kept


def isin_sorted(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x in s, elementwise, for a sorted 1-D `s`."""
    if s.numel() == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    idx = torch.searchsorted(s, x).clamp_(max=s.numel() - 1)
    return s[idx] == x


@dataclass
class TrieFilter:
    """One request's allowed nodes. Index d of each list is trie depth d (1..ND; 0 unused)."""

    depth: int
    allowed: list[torch.Tensor | None]  # sorted node ids: only these are allowed (include lists)
    blocked: list[torch.Tensor | None]  # sorted node ids with no allowed leaf left (exclusions)
    dense: list[torch.Tensor | None]  # bool per node (an attribute filter's nodes with an allowed leaf)
    leaves: int  # allowed leaves: the most distinct paths the request can get
    items: int  # allowed items (several may share a leaf): the most the request can get
    row_allowed: object = None  # trie row -> bool, for picking a shared leaf's allowed items
    ignored_exclusions: int = 0
    blocked_parent: list[torch.Tensor | None] | None = None  # parent node id (depth - 1) of each blocked node

    def keep(self, depth: int, nodes: torch.Tensor) -> torch.Tensor:
        """bool per node id at `depth`: does an allowed leaf lie under it."""
        k = self.positive(depth, nodes)
        k = torch.ones(nodes.shape, dtype=torch.bool, device=nodes.device) if k is None else k
        if self.blocked[depth] is not None:
            k &= ~isin_sorted(nodes, self.blocked[depth].to(nodes.device))
        return k

    def positive(self, depth: int, nodes: torch.Tensor) -> torch.Tensor | None:
        """keep() without the exclusions (None: an include list or attribute filter leaves them all)."""
        if self.dense[depth] is None and self.allowed[depth] is None:
            return None
        k = torch.ones(nodes.shape, dtype=torch.bool, device=nodes.device)
        if self.dense[depth] is not None:
            k &= self.dense[depth].to(nodes.device)[nodes]
        if self.allowed[depth] is not None:
            k &= isin_sorted(nodes, self.allowed[depth].to(nodes.device))
        return k

    def blocked_children(self, depth: int, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The blocked nodes at `depth` whose parent is one of `parents` (node ids at depth - 1,
        ascending, as beams are kept in path order): (row in `parents`, node id). O(blocked x
        log beams), never a pass over the beams' children."""
        b = self.blocked[depth]
        if b is None or not b.numel():
            return None
        bp = self.blocked_parent[depth].to(parents.device)
        idx = torch.searchsorted(parents, bp).clamp_(max=parents.numel() - 1)
        hit = parents[idx] == bp
        return idx[hit], b.to(parents.device)[hit]


class FilterCache:
    """Per attribute filter (by its canonical JSON): the trie rows that pass and the per-node counts."""

    def __init__(self, size: int = FILTER_CACHE_SIZE):
        self.size = size
        self.entries: OrderedDict[bytes, tuple] = OrderedDict()

    def get(self, catalog: Catalog, trie: SemanticIdTrie, trie_rows: np.ndarray | None, spec: dict):
        """(bool per trie row: passes the filter, items under each node per depth, count > 0 per depth,
        how many leaves pass); trie_rows None: the trie's rows are the catalog's (a LayeredTrie)."""
        key = orjson.dumps(spec, option=orjson.OPT_SORT_KEYS)
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            return hit
        ok = catalog.filter_mask(spec)
        if trie_rows is not None:
            ok = ok[trie_rows]  # per trie row
        count = trie.filter_counts(ok)
        dense = [None] + [c > 0 for c in count[1:]]
        hit = (ok, count, dense, int(dense[trie.depth].sum()))  # the allowed leaves, counted once
        self.entries[key] = hit
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return hit


def trie_rows_of(trie_rows: np.ndarray | None, catalog_rows: list[int], catalog_size: int,
                 trie: SemanticIdTrie | None = None) -> np.ndarray:
    """Trie rows of catalog rows, unique (negative rows and rows without a semantic ID left out);
    catalog_size: the catalog's rows (num_rows, dead ones counted). trie_rows None: the trie's rows
    are the catalog's (`trie`, a LayeredTrie, says which have a semantic ID)."""
    r = np.unique(np.asarray(catalog_rows, dtype=np.int64))
    r = r[r >= 0]
    if trie_rows is None:
        return r[trie.leaf_of_rows(r) >= 0] if r.size else r
    if not r.size or len(trie_rows) == catalog_size:  # every item has a semantic ID: the same rows
        return r
    idx = np.searchsorted(trie_rows, r).clip(max=len(trie_rows) - 1)
    return idx[trie_rows[idx] == r]


def build_filter(trie: SemanticIdTrie, trie_rows: np.ndarray, catalog: Catalog, cache: FilterCache,
                 exclude: list[str] | None = None, include: list[str] | None = None,
                 attr_filter: dict | None = None) -> TrieFilter | None:
    """The request's TrieFilter (None when it filters nothing). UnknownItemError names include ids
    not in the catalog; ValueError names a bad attribute filter; unknown exclude ids are counted."""
    if not exclude and include is None and not attr_filter:
        return None
    D = trie.depth
    ok = count = None
    dense: list[torch.Tensor | None] = [None] * (D + 1)
    if attr_filter:
        ok, count, dense, allowed_leaves = cache.get(catalog, trie, trie_rows, attr_filter)
    ignored = 0
    ex = np.zeros(0, dtype=np.int64)
    if exclude:
        rows = catalog.index.get_many(exclude)  # the ids hashed together
        if None in rows:  # distinct ids no longer in the catalog
            ignored = len({i for i, r in zip(exclude, rows) if r is None})
            rows = [r for r in rows if r is not None]
        ex = trie_rows_of(trie_rows, rows, catalog.num_rows, trie)
    none: list[torch.Tensor | None] = [None] * (D + 1)
    if include is not None:
        inc = trie_rows_of(trie_rows, catalog.rows(include), catalog.num_rows, trie)
        if ok is not None:
            inc = inc[ok[inc]]
        inc = np.setdiff1d(inc, ex, assume_unique=True)
        on_path = trie.path_nodes(inc, catalog)
        allowed = [None] + [torch.from_numpy(np.unique(on_path[d])) for d in range(1, D + 1)]
        allowed_set = set(inc.tolist())
        return TrieFilter(D, allowed, list(none), list(none), int(allowed[D].numel()), int(inc.size),
                          row_allowed=allowed_set.__contains__, ignored_exclusions=ignored)
    if ok is not None:
        ex = ex[ok[ex]]  # exclusions the filter already removed change nothing
    blocked, blocked_parent = list(none), list(none)
    # numpy, not torch: a few dozen small ops, each ~1 us here against ~5-10 us as torch ops
    on_path = trie.path_nodes(ex, catalog)
    for d in range(D, 0, -1):
        nodes, first, dec = np.unique(on_path[d], return_index=True, return_counts=True)
        parent = on_path[d - 1][first]
        hit = (trie.node_count(d, nodes) if count is None else count[d].numpy()[nodes]) == dec
        blocked[d], blocked_parent[d] = torch.from_numpy(nodes[hit]), torch.from_numpy(parent[hit])
    leaves = (int(trie.num_nodes[D]) if count is None else allowed_leaves) - int(blocked[D].numel())
    items = (num_trie_items(trie) if count is None else int(count[D].sum())) - int(ex.size)
    ex_set: set[int] = set()

    def row_allowed(r: int) -> bool:  # only called when paths repeat, to pick a leaf's items
        if not ex_set and ex.size:
            ex_set.update(ex.tolist())
        return r not in ex_set and (ok is None or bool(ok[r]))

    return TrieFilter(D, list(none), blocked, list(dense), leaves, items, row_allowed, ignored, blocked_parent)


def num_trie_items(trie: SemanticIdTrie) -> int:
    """The items on the trie's paths (several may share one)."""
    return int(trie.num_nodes[-1]) + int(trie.num_duplicate_paths)
