"""Valid semantic-ID paths (xGR §6.1): a level-by-level trie over the catalog's semantic ids, and
the constrained log-probabilities that keep beam search on it.

Nodes at depth d are the distinct d-token prefixes of the catalog's paths, numbered in
lexicographic order (depth 0 is the root, node 0). Each depth keeps its children in CSR form,
grouped by parent and sorted by token, so a beam's valid next tokens are one contiguous run.

Constraining (`children_logp`): each beam's logits are gathered at its valid children only, one
row of at most C columns (C: the most children of any live beam), padding -inf, and normalised
over them. That is log_softmax(logits + mask) with an additive -inf mask over the vocabulary
(an invalid token has probability exactly 0), computed on n x C entries instead of n x vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sgrec.catalog import Catalog


class SemanticIdTrie:
    def __init__(self, paths: Sequence[Sequence[int]] | torch.Tensor, vocab_size: int,
                 device: str | torch.device = "cpu"):
        """paths[i] is the semantic id of leaf candidate i (all the same length ND >= 1). When several
        rows share a path, the path's item is the first such row."""
        p = torch.as_tensor(paths, dtype=torch.int64).cpu()
        if p.dim() != 2 or p.shape[0] == 0 or p.shape[1] == 0:
            raise ValueError("SemanticIdTrie needs a non-empty [num_items, ND] list of paths")
        if int(p.min()) < 0 or int(p.max()) >= vocab_size:
            raise ValueError(f"semantic id tokens must be in [0, {vocab_size})")
        V = vocab_size
        parent_of_row = torch.zeros(p.shape[0], dtype=torch.int64)  # node at depth d of each row
        keys: list[torch.Tensor] = []  # [d]: parent * V + token of each node at depth d + 1, ascending
        for d in range(p.shape[1]):
            key = parent_of_row * V + p[:, d]  # ascending key order == lexicographic prefix order
            uniq, parent_of_row = torch.unique(key, sorted=True, return_inverse=True)
            keys.append(uniq)
        # count[d][node]: rows (items) under each node at depth d (filters subtract from these)
        count = [torch.empty(0)] * (len(keys) + 1)
        count[-1] = torch.bincount(parent_of_row, minlength=keys[-1].numel())
        for d in range(len(keys) - 1, -1, -1):
            count[d] = torch.zeros(1 if d == 0 else keys[d - 1].numel(), dtype=torch.int64).index_add_(
                0, keys[d] // V, count[d + 1])
        self._build(keys, count, parent_of_row, vocab_size, device)

    def _build(self, keys: list[torch.Tensor], count: list[torch.Tensor], row_leaf: torch.Tensor, vocab_size: int,
               device) -> None:
        """The trie from its levels' sorted node keys, per-node item counts and each row's leaf
        (host tensors); every other array derives from these."""
        self.vocab_size = V = vocab_size
        self.depth = len(keys)
        self.device = torch.device(device)
        self.num_nodes = [1] + [k.numel() for k in keys]
        self.child_ptr: list[torch.Tensor] = []  # [d]: [num_nodes[d] + 1]
        self.child_tok: list[torch.Tensor] = []  # [d]: token of each node at depth d + 1
        self.child_key: list[torch.Tensor] = []  # [d]: parent * V + token, ascending
        self.max_children: list[int] = []
        for d, uniq in enumerate(keys):
            counts = torch.bincount(uniq // V, minlength=self.num_nodes[d])
            ptr = torch.zeros(self.num_nodes[d] + 1, dtype=torch.int64)
            ptr[1:] = torch.cumsum(counts, 0)
            self.child_ptr.append(ptr.to(self.device))
            self.child_tok.append((uniq % V).to(self.device))
            self.child_key.append(uniq.to(self.device))
            self.max_children.append(int(counts.max()))
        self.row_leaf = row_leaf  # [rows]: the leaf (node at depth ND) of each row, on the CPU
        self.count = count
        # the leaf's item: the first row with that path
        n = row_leaf.numel()
        leaf_item = torch.full((self.num_nodes[-1],), n, dtype=torch.int64)
        leaf_item.scatter_reduce_(0, row_leaf, torch.arange(n, dtype=torch.int64), reduce="amin")
        self.leaf_item = leaf_item.to(self.device)
        self.num_duplicate_paths = n - self.num_nodes[-1]
        # per depth d: the distinct tokens of the nodes at depth d + 1 (ascending), and each
        # vocabulary id's column among them: a beam step computes only these logits (`logit_columns`)
        self.level_tokens = [torch.bincount(t, minlength=V).nonzero().flatten() for t in self.child_tok]  # O(N)
        self.level_col = []
        for toks in self.level_tokens:
            col = torch.zeros(V, dtype=torch.int64, device=self.device)
            col[toks] = torch.arange(toks.numel(), device=self.device)
            self.level_col.append(col)
        self._leaf_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._host: tuple | None = None

    def updated(self, rows: np.ndarray, catalog: Catalog, removed_rows: np.ndarray, added_from: int
                ) -> tuple["SemanticIdTrie", np.ndarray]:
        """The trie of the catalog version after an update, from this trie (over catalog rows
        `rows`): `removed_rows` died, rows [added_from, catalog.num_rows) are new (`Applied`). Equal
        to `from_catalog(catalog)`, array for array, without sorting the catalog: each level's
        surviving keys are renumbered and the new ones inserted (O(N) copies, O(k log N) searches).
        This trie is left as it is."""
        V, D = self.vocab_size, self.depth
        host_leaf, host_key, host_count = self.host_arrays()
        pos = np.searchsorted(rows, removed_rows)
        pos = pos[(pos < len(rows)) & (rows[np.minimum(pos, len(rows) - 1)] == removed_rows)]
        keep = np.ones(len(rows), dtype=bool)
        keep[pos] = False
        new_sem = np.flatnonzero(catalog.has_semantic[added_from:]) + added_from
        paths = catalog.semantic_ids[new_sem].astype(np.int64) if new_sem.size else np.zeros((0, D), np.int64)
        if paths.size and (paths.min() < 0 or paths.max() >= V):
            raise ValueError(f"semantic id tokens must be in [0, {V})")
        new_rows = np.concatenate([rows[keep], new_sem])
        if not new_rows.size:
            raise ValueError("the item catalog has no semantic_id; retrieval needs one per item")
        # counts after the removals: each removed row's path, leaf up to depth 1
        count = [c.copy() for c in host_count]
        node = host_leaf[pos]
        for d in range(D, 0, -1):
            np.subtract.at(count[d], node, 1)
            node = host_key[d - 1][node] // V
        count[0] = np.array([new_rows.size], dtype=np.int64)
        keys, remap = [], np.zeros(1, dtype=np.int64)  # remap: old node id -> new, at the level above
        at = np.zeros(len(new_sem), dtype=np.int64)  # the new rows' nodes at the level above
        for d in range(D):
            old, c = host_key[d], count[d + 1]
            live = c > 0
            kept = old[live]
            kept = remap[kept // V] * V + kept % V  # a live node's parent is live; renumbering keeps order
            want = at * V + paths[:, d]
            fresh = np.unique(want)
            fresh = fresh[~_isin_sorted(fresh, kept)]
            merged = np.insert(kept, np.searchsorted(kept, fresh), fresh)
            moved = np.arange(kept.size, dtype=np.int64) + np.searchsorted(fresh, kept)  # kept node -> its new id
            remap = np.full(old.size, -1, dtype=np.int64)
            remap[live] = moved
            cnt = np.zeros(merged.size, dtype=np.int64)
            cnt[moved] = c[live]
            at = np.searchsorted(merged, want)
            np.add.at(cnt, at, 1)
            keys.append(merged)
            count[d + 1] = cnt
        row_leaf = np.concatenate([remap[host_leaf[keep]], at])
        out = SemanticIdTrie.__new__(SemanticIdTrie)
        out._build([torch.from_numpy(k) for k in keys], [torch.from_numpy(c) for c in count],
                   torch.from_numpy(row_leaf), V, self.device)
        return out, new_rows

    @classmethod
    def from_catalog(cls, catalog: Catalog, vocab_size: int, device: str | torch.device = "cpu"
                     ) -> tuple["SemanticIdTrie", np.ndarray]:
        """The trie over the catalog items that carry a semantic_id, and the catalog row of each
        trie row, ascending (so `catalog.ids[rows[trie.leaf_item[leaf]]]` is a leaf's item)."""
        rows = catalog.semantic_rows()
        if not rows.size:
            raise ValueError("the item catalog has no semantic_id; retrieval needs one per item")
        return cls(torch.from_numpy(catalog.semantic_ids[rows]), vocab_size, device), rows

    def parents(self, depth: int, keys: torch.Tensor) -> torch.Tensor:
        """Parent node ids (at depth - 1) of nodes at `depth` given by their child keys
        (child_key[depth - 1][node])."""
        return keys // self.vocab_size

    def host_arrays(self) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """numpy views (host) of row_leaf, child_key per depth and count per depth, for per-request
        filter arithmetic on few nodes."""
        if self._host is None:
            self._host = (self.row_leaf.numpy(), [k.cpu().numpy() for k in self.child_key],
                          [c.numpy() for c in self.count])
        return self._host

    @property
    def max_beams(self) -> int:
        """The most beams that can be alive after any step but the last (a bound on useful BW)."""
        return max(self.num_nodes[1:-1], default=0)

    def children(self, depth: int, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sparse valid-children lists of beams at trie `depth` (their node ids): flat (row, token,
        child node id at depth + 1) triples, row = the beam's position in `nodes`, grouped by row,
        tokens ascending."""
        ptr = self.child_ptr[depth]
        start = ptr[nodes]
        counts = ptr[nodes + 1] - start
        rows = torch.repeat_interleave(torch.arange(nodes.numel(), device=nodes.device), counts)
        offsets = torch.cumsum(counts, 0) - counts
        pos = torch.repeat_interleave(start - offsets, counts) + torch.arange(rows.numel(), device=nodes.device)
        return rows, self.child_tok[depth][pos], pos

    def child_nodes(self, depth: int, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Node ids at depth + 1 of (parent node, token) pairs; raises if a pair is not a trie edge."""
        keys = self.child_key[depth]
        want = nodes * self.vocab_size + tokens
        idx = torch.searchsorted(keys, want).clamp_(max=keys.numel() - 1)
        if not torch.equal(keys[idx], want):
            raise RuntimeError("beam search left the valid semantic-id paths")
        return idx

    def logit_columns(self, depth: int) -> torch.Tensor | None:
        """The vocabulary ids whose logits a step at trie `depth` needs: every token of a node at
        depth + 1 (children_logp reads no other); None when they are over half the vocabulary
        (then the whole output layer costs about as much as gathering its rows)."""
        toks = self.level_tokens[depth]
        return toks if 2 * toks.numel() <= self.vocab_size else None

    def leaf_items(self, leaves: torch.Tensor) -> torch.Tensor:
        return self.leaf_item[leaves]

    def rows_of_leaf(self, leaf: int) -> list[int]:
        """Every row with the leaf's path, ascending (the first is leaf_item's)."""
        if self._leaf_rows is None:
            order = torch.argsort(self.row_leaf, stable=True)
            ptr = torch.zeros(self.num_nodes[-1] + 1, dtype=torch.int64)
            ptr[1:] = torch.cumsum(self.count[self.depth], 0)
            self._leaf_rows = (order, ptr)
        order, ptr = self._leaf_rows
        return order[int(ptr[leaf]) : int(ptr[leaf + 1])].tolist()


def _isin_sorted(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x in s, elementwise, for a sorted `s`."""
    if not s.size:
        return np.zeros(x.shape, dtype=bool)
    i = np.minimum(np.searchsorted(s, x), s.size - 1)
    return s[i] == x


def children_logp(logits: torch.Tensor, trie: SemanticIdTrie, depth: int, nodes: torch.Tensor, filt=None,
                  restricted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each beam's log-probabilities over its valid children only: (logp [n, C], tokens [n, C]),
    C = the most children any of the beams has, column j = the beam's j-th child in token order,
    padding and filtered-out children -inf. Equal to log_softmax(logits + mask) over the vocabulary
    restricted to the valid children (an invalid token's probability is exactly 0 either way), but
    touches n x C entries instead of writing and undoing a [n, vocab] mask. `filt` (a request's
    sgrec.beam.filters.TrieFilter) removes children with no allowed leaf: an include list or
    attribute filter by testing each child, exclusions by striking just their blocked nodes
    (nodes: ascending, as beams are kept in path order). `restricted`: logits holds only the
    columns trie.logit_columns(depth), in that order."""
    ptr = trie.child_ptr[depth]
    start = ptr[nodes]
    count = ptr[nodes + 1] - start
    C = int(count.max())
    col = torch.arange(C, device=nodes.device)
    valid = col[None, :] < count[:, None]
    pos = torch.minimum(start[:, None] + col[None, :], ptr[-1] - 1)  # node ids at depth + 1 (clamped pads)
    toks = trie.child_tok[depth][pos]
    vals = logits.gather(1, trie.level_col[depth][toks] if restricted else toks).float()
    if filt is not None:
        k = filt.positive(depth + 1, pos)
        if k is not None:
            valid &= k
        blocked = filt.blocked_children(depth + 1, nodes)
        if blocked is not None:
            rows, bnodes = blocked
            valid[rows, bnodes - start[rows]] = False
    vals.masked_fill_(~valid, float("-inf"))
    return torch.log_softmax(vals, dim=-1), toks
