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

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from sgrec.catalog import Catalog


class SemanticIdTrie:
    layered = False  # see sgrec.beam.layered.LayeredTrie

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
        V = vocab_size
        ptrs, maxc = [], []
        for d, uniq in enumerate(keys):
            counts = torch.bincount(uniq // V, minlength=1 if d == 0 else keys[d - 1].numel())
            ptr = torch.zeros(counts.numel() + 1, dtype=torch.int64)
            ptr[1:] = torch.cumsum(counts, 0)
            ptrs.append(ptr.numpy())
            maxc.append(int(counts.max()))
        # the leaf's item: the first row with that path
        n = row_leaf.numel()
        leaf_item = torch.full((keys[-1].numel(),), n, dtype=torch.int64)
        leaf_item.scatter_reduce_(0, row_leaf, torch.arange(n, dtype=torch.int64), reduce="amin")
        toks = [(k % V).numpy() for k in keys]
        self._assign([k.numpy() for k in keys], toks, ptrs, [c.numpy() for c in count], row_leaf.numpy(),
                     leaf_item.numpy(), [np.bincount(t, minlength=V) for t in toks], maxc, V, device)

    def _assign(self, keys, toks, ptrs, count, row_leaf, leaf_item, tok_count, max_children, vocab_size, device,
                same_tokens: "SemanticIdTrie | None" = None) -> None:
        """Sets the trie's arrays from host (numpy) ones: per depth d the sorted keys, tokens and
        item counts of the nodes at depth d + 1 and the CSR pointers of the nodes at depth d; each
        row's leaf; each leaf's first row; per depth how many nodes carry each token. A level whose
        tokens are `same_tokens`'s shares its token columns."""
        self.vocab_size = V = vocab_size
        self.depth = len(keys)
        self.device = torch.device(device)
        self.num_nodes = [1] + [k.size for k in keys]
        dev = self.device
        self.child_ptr = [torch.from_numpy(p).to(dev) for p in ptrs]  # [d]: [num_nodes[d] + 1]
        self.child_tok = [torch.from_numpy(t).to(dev) for t in toks]  # [d]: token of each node at depth d + 1
        self.child_key = [torch.from_numpy(k).to(dev) for k in keys]  # [d]: parent * V + token, ascending
        self.max_children = max_children
        self.row_leaf = torch.from_numpy(row_leaf)  # [rows]: the leaf (node at depth ND) of each row, on the CPU
        self.count = [torch.from_numpy(c) for c in count]  # [d]: items under each node at depth d
        self.leaf_item = torch.from_numpy(leaf_item).to(dev)  # the first row with each leaf's path
        self.num_duplicate_paths = row_leaf.size - keys[-1].size
        self._tok_count = tok_count
        # per depth d: the distinct tokens of the nodes at depth d + 1 (ascending), and each
        # vocabulary id's column among them: a beam step computes only these logits (`logit_columns`)
        self.level_tokens, self.level_col = level_columns(
            tok_count, V, dev, None if same_tokens is None else same_tokens._tok_count,
            None if same_tokens is None else (same_tokens.level_tokens, same_tokens.level_col))
        self._leaf_rows: tuple[np.ndarray, np.ndarray] | None = None
        self._host = (row_leaf, keys, count) if dev.type == "cpu" else None
        self._host_more = (toks, ptrs, leaf_item) if dev.type == "cpu" else None

    def arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """The host arrays every other one derives from, and the few numbers beside them: what
        `from_arrays` rebuilds the trie from (a CPU trie; sgrec.catalog.image shares them between ranks)."""
        row_leaf, keys, count = self.host_arrays()
        toks, ptrs, leaf_item = self._host_more
        out = {"row_leaf": row_leaf, "leaf_item": leaf_item}
        for d in range(self.depth):
            out.update({f"key{d}": keys[d], f"tok{d}": toks[d], f"ptr{d}": ptrs[d], f"tokcount{d}": self._tok_count[d]})
        out.update({f"count{d}": c for d, c in enumerate(count)})
        return out, {"depth": self.depth, "vocab_size": self.vocab_size, "max_children": self.max_children}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], info: dict, device="cpu") -> "SemanticIdTrie":
        """The trie `arrays()` described; the arrays are used as they are (read-only ones too: nothing
        writes into a trie's arrays, `updated` makes new ones)."""
        D = info["depth"]
        out = cls.__new__(cls)
        with warnings.catch_warnings():  # torch.from_numpy of a read-only map: shared, never written
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out._assign([arrays[f"key{d}"] for d in range(D)], [arrays[f"tok{d}"] for d in range(D)],
                        [arrays[f"ptr{d}"] for d in range(D)], [arrays[f"count{d}"] for d in range(D + 1)],
                        arrays["row_leaf"], arrays["leaf_item"], [arrays[f"tokcount{d}"] for d in range(D)],
                        list(info["max_children"]), info["vocab_size"], device)
        return out

    def updated(self, rows: np.ndarray, catalog: Catalog, removed_rows: np.ndarray, added_from: int
                ) -> tuple["SemanticIdTrie", np.ndarray]:
        """The trie of the catalog version after an update, from this trie (over catalog rows
        `rows`): `removed_rows` died, rows [added_from, catalog.num_rows) are new (`Applied`). Equal
        to `from_catalog(catalog)`, array for array, without sorting the catalog: per level, the
        nodes left without items are deleted and the new ones inserted (memmoves), node ids shift
        by searches over the few changed ones, and the per-parent and per-token counts change by
        what changed. This trie is left as it is."""
        V, D = self.vocab_size, self.depth
        host_leaf, host_key, host_count = self.host_arrays()
        toks0, ptrs0, leaf_item0 = self._host_more or (
            [t.cpu().numpy() for t in self.child_tok], [p.cpu().numpy() for p in self.child_ptr],
            self.leaf_item.cpu().numpy())
        pos = np.searchsorted(rows, removed_rows)
        pos = pos[(pos < len(rows)) & (rows[np.minimum(pos, len(rows) - 1)] == removed_rows)]  # removed trie rows
        new_sem = np.flatnonzero(catalog.has_semantic[added_from:]) + added_from
        paths = catalog.semantic_ids[new_sem].astype(np.int64) if new_sem.size else np.zeros((0, D), np.int64)
        if paths.size and (paths.min() < 0 or paths.max() >= V):
            raise ValueError(f"semantic id tokens must be in [0, {V})")
        new_rows = _splice(rows, pos, np.full(new_sem.size, len(rows) - pos.size), new_sem)
        if not new_rows.size:
            raise ValueError("the item catalog has no semantic_id; retrieval needs one per item")
        # items leaving each node: the removed rows' paths, leaf up to depth 1 (few nodes)
        gone_nodes, gone_count = [None] * (D + 1), [None] * (D + 1)
        node, cnt = np.unique(host_leaf[pos], return_counts=True)
        for d in range(D, 0, -1):
            gone_nodes[d], gone_count[d] = node, cnt
            node, inv = np.unique(host_key[d - 1][node] // V, return_inverse=True)
            cnt = np.bincount(inv, weights=cnt, minlength=node.size).astype(np.int64)
        keys, toks, ptrs, count, tok_count, maxc, at, dead_up, ins_up = update_levels(
            V, host_key, toks0, ptrs0, host_count, self._tok_count, gone_nodes, gone_count, paths, new_rows.size)
        none = np.zeros(0, dtype=np.int64)
        # rows: the removed ones out, leaf ids shifted as the leaves were, the new rows' leaves after
        leaf_new = _renumbering(dead_up, ins_up)
        row_leaf = np.concatenate([_shifted(_splice(host_leaf, pos, none, 0), *leaf_new), at])
        # each leaf's first row: a surviving leaf keeps its first old row (renumbered) unless that
        # row was removed (then found again below); a new row comes after every old one
        lost = host_leaf[pos]
        lost = np.unique(lost[leaf_item0[lost] == pos])
        lost = lost[~_isin_sorted(lost, dead_up)]  # and the leaf keeps other rows
        li = _shifted(_splice(leaf_item0, dead_up, none, 0), *_renumbering(pos, none))
        li = _splice(li, none, ins_up, new_rows.size)
        leaves, first = np.unique(at, return_index=True)
        np.minimum.at(li, leaves, first + (len(rows) - pos.size))
        if lost.size:  # leaves whose first row was removed and which keep other rows: look again
            lost = _shifted(lost, *leaf_new)
            hit = np.flatnonzero(_isin_sorted(row_leaf, lost))
            leaves, first = np.unique(row_leaf[hit], return_index=True)
            li[leaves] = hit[first]
        out = SemanticIdTrie.__new__(SemanticIdTrie)
        out._assign(keys, toks, ptrs, count, row_leaf, li, tok_count, maxc, V, self.device, same_tokens=self)
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

    def runs(self, depth: int, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(first position, number) of the children of nodes at `depth` (see child_at)."""
        ptr = self.child_ptr[depth]
        start = ptr[nodes]
        return start, ptr[nodes + 1] - start

    def child_at(self, depth: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, node id at depth + 1) of the children at positions `pos` of `runs(depth, ...)`;
        here a child's position is its id."""
        return self.child_tok[depth][pos], pos

    def leaf_items(self, leaves: torch.Tensor) -> torch.Tensor:
        """Each leaf's item: its first row (a trie row: `from_catalog`'s rows map it to the catalog's)."""
        return self.leaf_item[leaves]

    def leaf_count(self, leaves: np.ndarray) -> np.ndarray:
        """Rows (items) with each leaf's path."""
        return self.host_arrays()[2][self.depth][leaves]

    def node_count(self, depth: int, nodes: np.ndarray) -> np.ndarray:
        """Items under each node at `depth`."""
        return self.host_arrays()[2][depth][nodes]

    def path_nodes(self, rows: np.ndarray, catalog: Catalog | None = None) -> list[np.ndarray]:
        """Per depth 0..ND, the node of each of `rows` (trie rows) on its path."""
        row_leaf, keys, _ = self.host_arrays()
        out = [row_leaf[rows]]
        for d in range(self.depth, 0, -1):
            out.append(keys[d - 1][out[-1]] // self.vocab_size if d > 1 else np.zeros(len(rows), np.int64))
        return out[::-1]

    def filter_counts(self, ok: np.ndarray) -> list[torch.Tensor]:
        """Per depth 1..ND (index 0 unused), the items under each node among the rows where `ok`
        (bool per trie row) holds."""
        count = [torch.empty(0)] * (self.depth + 1)
        count[self.depth] = torch.bincount(self.row_leaf[torch.from_numpy(ok)], minlength=self.num_nodes[-1])
        for d in range(self.depth, 1, -1):
            count[d - 1] = torch.zeros(self.num_nodes[d - 1], dtype=torch.int64).index_add_(
                0, self.parents(d, self.child_key[d - 1].cpu()), count[d])
        return count

    def rows_of_leaf(self, leaf: int, catalog: Catalog | None = None) -> list[int]:
        """Every row with the leaf's path, ascending (the first is leaf_item's)."""
        return self.rows_of_leaves(np.array([leaf]), catalog)[1].tolist()

    def rows_of_leaves(self, leaves: np.ndarray, catalog: Catalog | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(leaf, row) of every row whose leaf is one of `leaves`, grouped by leaf (ascending), rows
        ascending within a leaf."""
        if self._leaf_rows is None:
            order = torch.argsort(self.row_leaf, stable=True).numpy()
            ptr = np.zeros(self.num_nodes[-1] + 1, dtype=np.int64)
            ptr[1:] = np.cumsum(self.host_arrays()[2][self.depth])
            self._leaf_rows = (order, ptr)
        order, ptr = self._leaf_rows
        leaves = np.unique(np.asarray(leaves, np.int64))
        lo, n = ptr[leaves], ptr[leaves + 1] - ptr[leaves]
        pos = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
        return np.repeat(leaves, n), order[pos]


def level_columns(tok_count: list[np.ndarray], V: int, dev, same_count: list[np.ndarray] | None = None,
                  same: tuple[list, list] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per level, the distinct tokens of its nodes (ascending) and each vocabulary id's column among
    them, from the per-token node counts; a level whose tokens are those of `same_count` shares
    `same`'s (level_tokens, level_col)."""
    tokens, cols = [], []
    for d, c in enumerate(tok_count):
        if same is not None and d < len(same_count) and np.array_equal(c > 0, same_count[d] > 0):
            t, col = same[0][d], same[1][d]  # the same tokens: shared
        else:
            t = torch.from_numpy(np.flatnonzero(c)).to(dev)
            col = torch.zeros(V, dtype=torch.int64, device=dev)
            col[t] = torch.arange(t.numel(), device=dev)
        tokens.append(t)
        cols.append(col)
    return tokens, cols


def update_levels(V: int, keys0: list, toks0: list, ptrs0: list, count0: list, tok_count0: list, gone_nodes: list,
                  gone_count: list, paths: np.ndarray, total: int) -> tuple:
    """Levels 1..L (L = len(keys0)) of a trie after an update, from the old ones: per level d < L
    the sorted node keys, tokens and CSR pointers (keys0[d], toks0[d], ptrs0[d]: nodes at depth
    d + 1, parents at depth d), per depth the item counts (count0[0..L]) and per level the tokens'
    node counts (tok_count0). gone_nodes[d], gone_count[d] (d = 1..L): the old nodes at depth d that
    lose items and how many; paths: the new rows' semantic ids (first L columns read); total: the
    items after. Per level the nodes left without items are deleted and the new ones inserted
    (memmoves), node ids shift by searches over the few changed ones. Returns (keys, toks, ptrs,
    count, tok_count, max_children, the new rows' nodes at depth L, the dead old ids at depth L,
    the new nodes' places among its survivors)."""
    keys, toks, ptrs, count, tok_count, maxc = [], [], [], [np.array([total], np.int64)], [], []
    dead_up = ins_up = np.zeros(0, np.int64)  # the level above: dead old ids; new nodes' places among survivors
    at = np.zeros(len(paths), dtype=np.int64)  # the new rows' nodes at the level above (new ids)
    for d in range(len(keys0)):
        K, T, C = keys0[d], toks0[d], count0[d + 1]
        g, gc = gone_nodes[d + 1], gone_count[d + 1]
        left = C[g] - gc
        dead = g[left == 0]  # old ids of nodes with no item left (ascending)
        if dead_up.size or ins_up.size:  # renumbered as their parents were
            p = K // V  # ascending: the table is read in order
            K = K + V * (_shifted(p, *_renumbering(dead_up, ins_up)) - p)
            K[dead] = -1  # a dead node's parent may be dead (no new number): take the key before it
            np.maximum.accumulate(K, out=K)  # so K stays sorted for the searches
        want = at * V + paths[:, d]
        fresh = np.unique(want)
        idx = np.minimum(np.searchsorted(K, fresh), K.size - 1)  # among the old nodes, dead ones too
        hit = (K[idx] == fresh) & ~_isin_sorted(idx, dead)
        fresh, idx = fresh[~hit], np.searchsorted(K, fresh[~hit])
        ins = idx - np.searchsorted(dead, idx)  # new nodes' places among the survivors
        survivors = g[left > 0]
        K, T, C = _splice(K, dead, ins, fresh), _splice(T, dead, ins, fresh % V), _splice(C, dead, ins, 0)
        if C is count0[d + 1]:
            C = C.copy()
        t = survivors - np.searchsorted(dead, survivors)
        C[t + np.searchsorted(ins, t, side="right")] = left[left > 0]
        at = np.searchsorted(K, want)
        np.add.at(C, at, 1)
        # per-parent child counts: less the dead children of surviving parents, renumbered, plus the new
        per = np.diff(ptrs0[d])
        parent = keys0[d][dead] // V
        np.subtract.at(per, parent[~_isin_sorted(parent, dead_up)], 1)
        per = _splice(per, dead_up, ins_up, 0)
        np.add.at(per, fresh // V, 1)
        ptr = np.zeros(per.size + 1, dtype=np.int64)
        np.cumsum(per, out=ptr[1:])
        tc = tok_count0[d].copy()
        np.subtract.at(tc, keys0[d][dead] % V, 1)
        np.add.at(tc, fresh % V, 1)
        keys.append(K)
        toks.append(T)
        ptrs.append(ptr)
        count.append(C)
        tok_count.append(tc)
        maxc.append(int(per.max()))
        dead_up, ins_up = dead, ins
    return keys, toks, ptrs, count, tok_count, maxc, at, dead_up, ins_up


def _splice(a: np.ndarray, dead: np.ndarray, ins: np.ndarray, vals) -> np.ndarray:
    """np.insert(np.delete(a, dead), ins, vals) as one copy of the runs between the few changes
    (dead: ascending indices of a; ins: ascending places among the survivors)."""
    if not dead.size and not ins.size:
        return a
    if (dead.size + ins.size) * 256 > a.size:  # many changes for the size: numpy's own passes
        return np.insert(np.delete(a, dead), ins, vals)
    out = np.empty(a.size - dead.size + ins.size, dtype=a.dtype)
    vals = np.broadcast_to(np.asarray(vals, dtype=a.dtype), ins.shape)
    bounds = [-1, *dead.tolist(), a.size]
    places = ins.tolist()
    o = t = j = 0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        s0 = lo + 1
        while True:
            while j < len(places) and places[j] == t:  # new entries before survivor t
                out[o] = vals[j]
                o, j = o + 1, j + 1
            stop = hi if j == len(places) else min(hi, s0 + places[j] - t)
            if stop <= s0:
                break
            out[o : o + stop - s0] = a[s0:stop]
            o, t, s0 = o + stop - s0, t + stop - s0, stop
    return out


def _renumbering(dead: np.ndarray, ins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New id - old id of the ids left after deleting `dead` (ascending) and inserting new ids
    before the survivors at places `ins` (np.insert's positions), as a step function (breaks,
    steps) for `_shifted`: steps[j] for ids in [breaks[j - 1], breaks[j]), steps[0] below breaks[0]."""
    # it steps where a dead id ends and where survivor t (a new entry's place) starts
    first_after = ins + np.searchsorted(dead - np.arange(dead.size), ins, side="right")  # old id of survivor t
    breaks = np.unique(np.concatenate([dead + 1, first_after]))
    at = np.concatenate([[0], breaks])
    q = at - np.searchsorted(dead, at)
    return breaks, q + np.searchsorted(ins, q, side="right") - at


def _shifted(x: np.ndarray, breaks: np.ndarray, steps: np.ndarray, bucket_bits: int = 8) -> np.ndarray:
    """x + the step function (breaks, steps) at x (x >= 0), for a large unordered x and few steps:
    each x reads a small per-bucket table of the step, and only the x in the few buckets that hold
    a break are searched (a search per x, or a table as large as the ids, costs several times more)."""
    if not breaks.size:
        return x + steps[0]
    bound = max(int(x.max(initial=0)), int(breaks[-1])) + 1
    starts = np.arange((bound >> bucket_bits) + 1, dtype=np.int64) << bucket_bits
    first = np.searchsorted(breaks, starts, side="right")
    mixed = first != np.searchsorted(breaks, starts + (1 << bucket_bits) - 1, side="right")
    flag = np.int64(1) << 52  # a bucket with a break inside: larger than any id plus step
    out = np.take(np.where(mixed, flag, steps[first]), x >> bucket_bits)
    out += x
    fix = np.flatnonzero(out >= flag >> 1)
    out[fix] = x[fix] + steps[np.searchsorted(breaks, x[fix], side="right")]
    return out


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
    start, count = trie.runs(depth, nodes)
    C = int(count.max())
    col = torch.arange(C, device=nodes.device)
    valid = col[None, :] < count[:, None]
    pos = torch.where(valid, start[:, None] + col[None, :], start[:, None])  # pads: the first child (masked)
    toks, kids = trie.child_at(depth, pos)  # node ids at depth + 1
    vals = logits.gather(1, trie.level_col[depth][toks] if restricted else toks).float()
    if filt is not None:
        k = filt.positive(depth + 1, kids)
        if k is not None:
            valid &= k
        blocked = filt.blocked_children(depth + 1, nodes)
        if blocked is not None:  # each blocked child's column in its parent's row
            rows, bnodes = blocked
            if trie.layered:  # a leaf's id is its slot: found among the row's children
                r, c = torch.nonzero(kids[rows] == bnodes[:, None], as_tuple=True)
                valid[rows[r], c] = False
            else:  # a child's id is its position
                valid[rows, bnodes - start[rows]] = False
    vals.masked_fill_(~valid, float("-inf"))
    return torch.log_softmax(vals, dim=-1), toks
