"""The semantic-ID trie of a live catalog as versions that cost what an update changed.

`SemanticIdTrie` numbers every level's nodes densely in path order, so one new leaf renumbers the
leaves after it and every row's leaf: an update rewrites the leaf level whole (about 0.5 GiB at
10^7 items). Here only the levels above the leaves stay dense and are updated as there
(`update_levels`: about a tenth of the nodes at 10^7 with 1,024 codes). The leaf level is
layered, as log-structured stores are:

- a leaf is a *slot* that keeps its id for good: the slots of the base (the leaves in path order
  when the trie was built or last compacted) and the slots made since, numbered after them;
- each parent's children are a *run* of (token, slot) entries in path order, one contiguous range
  of an arena: the base's runs (position = slot, so only their tokens are stored), then the runs
  that updates wrote (the tail). An update writes a new run for each parent whose children
  changed and points that parent at it; the runs of the versions before stay as they were;
- per-slot item counts and first rows are the base's arrays with a sorted list of the slots
  changed since the base laid over them; each catalog row's slot is the base's array for the rows
  it had and a tail for the rows added since.

So an update costs its k rows (the runs of their parents, the changed slots) plus the dense upper
levels and the per-parent run pointers (O(parents)), and versions share the base and the tails'
storage. Once what was written since the base passes a fraction of it, a background thread
compacts the version (`compacted`: the current leaves in path order become a new base, O(leaves)),
and once it is done the updates made meanwhile are replayed on it, a few per update (`updated`),
so no update waits for the O(leaves) pass.

A leaf's id is its slot, not its place in path order; readers go through `runs` / `child_at` (the
beam step), `leaf_items` (catalog rows, not trie rows: there is no row map to rebuild), `leaf_count`,
`path_nodes` and `filter_counts` (filters). On a device (`from_catalog(..., device)`: a GPU, or the
Triton trie step anywhere) the beam step's arrays live there: the dense upper levels and the
level columns, uploaded per version where they changed, and the leaf level as `DeviceLeaves`
(sgrec.beam.device_leaves), which a version extends by what its update wrote. `dense()` is the
equal `SemanticIdTrie`, which the tests compare with one built from scratch.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from sgrec.beam.device_leaves import DeviceLeaves
from sgrec.beam.trie import SemanticIdTrie, _isin_sorted, _renumbering, _shifted, _splice, level_columns, update_levels
from sgrec.catalog import Catalog
from sgrec.catalog.grow import Buf

COMPACT_FRACTION = 0.02  # compact once the entries written since the base pass this fraction of its leaves
COMPACT_MIN = 1 << 16  # ... and this many
CATCH_UP = 4  # updates replayed on a finished compaction per update (see LayeredTrie.updated)
compactor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trie-compact")  # see LayeredTrie.updated
logger = logging.getLogger(__name__)

# a base's arrays (shared by every version on it), and each version's own
_BASE_ARRAYS = ("base_tok", "base_count", "base_item", "dup_slot", "dup_ptr", "dup_rows", "row_leaf_base")
_ARRAYS = ("run_start", "run_len", "tail_slot", "tail_tok", "ov_slot", "ov_count", "ov_item", "row_leaf_tail",
           *_BASE_ARRAYS)


def _dup_index(row_leaf: np.ndarray, count: np.ndarray) -> dict[str, np.ndarray]:
    """The base's rows of each base slot that has more than one (a repeated path), as CSR: dup_slot
    (ascending), dup_ptr, dup_rows (ascending per slot). A slot with one base row has it as its
    base_item. One pass over the rows, when a base is made."""
    many = np.append(count > 1, False)  # [-1]: rows without a leaf
    slot = np.flatnonzero(many)
    rows = np.flatnonzero(many[row_leaf]) if slot.size else slot
    rows = rows[np.argsort(row_leaf[rows], kind="stable")]
    ptr = np.searchsorted(row_leaf[rows], np.append(slot, np.iinfo(np.int64).max))
    return {"dup_slot": slot, "dup_ptr": ptr.astype(np.int64), "dup_rows": rows}


def _fresh(a: np.ndarray, old: np.ndarray) -> np.ndarray:
    """`a`, or a copy where it is `old` (a version's arrays are never written once made)."""
    return a.copy() if a is old else a


def _ranges(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The positions start[i] .. start[i] + length[i] - 1, for each i in order."""
    total = int(length.sum())
    offset = np.repeat(start - (np.cumsum(length) - length), length)
    return offset + np.arange(total, dtype=np.int64)


class LayeredTrie:
    """A catalog version's valid-path trie: dense upper levels, a layered leaf level (module doc)."""

    layered = True
    # the dense levels' readers, as SemanticIdTrie has them (this trie's upper levels are its arrays)
    max_beams = SemanticIdTrie.max_beams
    logit_columns = SemanticIdTrie.logit_columns

    @classmethod
    def from_catalog(cls, catalog: Catalog, vocab_size: int, device=None) -> tuple["LayeredTrie", None]:
        """The trie over the catalog's items that carry a semantic id (no row map: leaf_items gives
        catalog rows); device: where the beam step reads it (module doc; None: the host only)."""
        dense, rows = SemanticIdTrie.from_catalog(catalog, vocab_size)
        return cls.from_dense(dense, rows, catalog.num_rows, device), None

    @classmethod
    def from_dense(cls, t: SemanticIdTrie, rows: np.ndarray, num_rows: int, device=None) -> "LayeredTrie":
        """The trie equal to `t` (a CPU SemanticIdTrie over catalog rows `rows` of a catalog of
        num_rows rows), its leaves the base."""
        D = t.depth
        row_leaf, keys, count = t.host_arrays()
        toks, ptrs, leaf_item = t._host_more
        rl = np.full(num_rows, -1, np.int64)
        rl[rows] = row_leaf
        ptr = ptrs[D - 1]
        none = np.zeros(0, np.int64)
        out = cls.__new__(cls)
        out._set(t.vocab_size, keys[: D - 1], toks[: D - 1], ptrs[: D - 1], count[:D], t._tok_count,
                 t.max_children[: D - 1], dict(
                     run_start=ptr[:-1], run_len=np.diff(ptr), base_tok=toks[D - 1], base_count=count[D],
                     base_item=np.asarray(rows, np.int64)[leaf_item], tail_slot=none, tail_tok=none, ov_slot=none,
                     ov_count=none, ov_item=none, row_leaf_base=rl, row_leaf_tail=none, **_dup_index(rl, count[D])),
                 num_slots=t.num_nodes[-1], num_leaves=t.num_nodes[-1], device=device)
        out.leaves = None if device is None else DeviceLeaves.of(out, device)
        return out

    def _set(self, V: int, keys: list, toks: list, ptrs: list, count: list, tok_count: list, max_children: list,
             arrays: dict[str, np.ndarray], num_slots: int, num_leaves: int,
             same_tokens: "LayeredTrie | None" = None, device=None) -> None:
        """device: where the beam step's arrays live (None: the host's, read as numpy); a level's
        arrays that are `same_tokens`'s (the version before) share its device copies."""
        self.vocab_size, self.depth = V, len(keys) + 1
        self.device = torch.device("cpu" if device is None else device)
        self.keys, self.toks, self.ptrs, self.count, self.tok_count = keys, toks, ptrs, count, tok_count
        for name in _ARRAYS:
            setattr(self, name, arrays[name])
        self.B = self.base_tok.size  # base slots, = base arena positions
        self.R0 = self.row_leaf_base.size  # the rows the base's row map covers
        self.num_rows = self.R0 + self.row_leaf_tail.size
        self.num_slots, self.num_leaves = num_slots, num_leaves
        if same_tokens is not None and same_tokens.base_tok is self.base_tok:
            self.base_id = same_tokens.base_id  # a version on the same base
        else:
            self.base_id = uuid.uuid4().hex  # a new base (from_arrays names the one it maps)
        self._bufs = None  # the tails' growing storage (`updated`), where this version made them
        self._job = None  # a compaction under way: (its future, its result caught up so far, the updates left)
        self.leaves: DeviceLeaves | None = None  # the leaf level on self.device (device given; set by the maker)
        self.background = True  # compact on the `compactor` thread (else in `updated`)
        self.max_children = [*max_children, int(self.run_len.max())]
        self.num_nodes = [1, *(k.size for k in keys), num_leaves]
        self.num_duplicate_paths = int(count[0][0]) - num_leaves
        with warnings.catch_warnings():  # torch.from_numpy of a read-only map (shared between ranks): never written
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy
            same = same_tokens if same_tokens is not None and same_tokens.device == self.device else None

            def put(arrays: list, name: str, mine: str) -> list[torch.Tensor]:  # a level's copy: shared if unchanged
                old = getattr(same, name, [])
                return [getattr(same, mine)[d] if d < len(old) and a is old[d] else t(a).to(self.device)
                        for d, a in enumerate(arrays)]

            self.child_ptr = put(ptrs, "ptrs", "child_ptr")  # the upper levels only: the leaf level is runs
            self.child_tok = put(toks, "toks", "child_tok")
            self.child_key = put(keys, "keys", "child_key")
            self._run = (t(self.run_start), t(self.run_len))
            self.level_tokens, self.level_col = level_columns(
                tok_count, V, self.device, None if same is None else same.tok_count,
                None if same is None else (same.level_tokens, same.level_col))

    # ---- readers ----------------------------------------------------------------------------
    def runs(self, depth: int, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(first position, number) of the children of nodes at `depth`, for child_at."""
        if depth < self.depth - 1:  # a dense level
            return SemanticIdTrie.runs(self, depth, nodes)
        if self.leaves is not None:
            return self.leaves.runs(nodes)
        return self._run[0][nodes], self._run[1][nodes]

    def child_at(self, depth: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, node id) of the children at positions `pos` of `runs(depth, ...)`; at the leaf
        level the id is the slot."""
        if depth < self.depth - 1:
            return SemanticIdTrie.child_at(self, depth, pos)
        if self.leaves is not None:
            return self.leaves.child_at(pos)
        toks, kids = self._arena(pos.numpy())  # numpy: a few small ops, each ~1 us against ~5 us as torch ops
        return torch.from_numpy(toks), torch.from_numpy(kids)

    def _arena(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """child_at of the leaf level, in numpy."""
        if not self.tail_tok.size:
            return self.base_tok[pos], pos
        in_base = pos < self.B
        t = np.clip(pos - self.B, 0, self.tail_tok.size - 1)
        return (np.where(in_base, self.base_tok[np.minimum(pos, self.B - 1)], self.tail_tok[t]),
                np.where(in_base, pos, self.tail_slot[t]))

    def child_nodes(self, depth: int, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Node ids at depth + 1 of (parent node, token) pairs; raises if a pair is not a trie edge."""
        if depth < self.depth - 1:
            return SemanticIdTrie.child_nodes(self, depth, nodes, tokens)
        kids = self._find(nodes.cpu().numpy(), tokens.cpu().numpy())
        if (kids < 0).any():
            raise RuntimeError("beam search left the valid semantic-id paths")
        return torch.from_numpy(kids).to(nodes.device)

    def _slot_values(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(items, first row) of each slot: the base's, or the overlay's where it changed."""
        slots = np.asarray(slots, np.int64)
        cnt = self.base_count[np.minimum(slots, self.B - 1)]
        item = self.base_item[np.minimum(slots, self.B - 1)]
        if self.ov_slot.size:
            i = np.minimum(np.searchsorted(self.ov_slot, slots), self.ov_slot.size - 1)
            hit = self.ov_slot[i] == slots
            cnt, item = np.where(hit, self.ov_count[i], cnt), np.where(hit, self.ov_item[i], item)
        return cnt, item

    def leaf_items(self, leaves: torch.Tensor) -> torch.Tensor:
        """Each leaf's item: its first catalog row."""
        return torch.from_numpy(self._slot_values(leaves.cpu().numpy())[1])

    def leaf_count(self, leaves: np.ndarray) -> np.ndarray:
        return self._slot_values(leaves)[0]

    def node_count(self, depth: int, nodes: np.ndarray) -> np.ndarray:
        return self.leaf_count(nodes) if depth == self.depth else self.count[depth][nodes]

    def leaf_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The slot of each catalog row (-1: no semantic id; a dead row's may be stale)."""
        rows = np.asarray(rows, np.int64)
        out = self.row_leaf_base[np.minimum(rows, max(self.R0 - 1, 0))] if self.R0 else np.full(rows.size, -1)
        late = rows >= self.R0
        if late.any():
            out = np.where(late, self.row_leaf_tail[np.clip(rows - self.R0, 0, max(self.row_leaf_tail.size - 1, 0))]
                           if self.row_leaf_tail.size else -1, out)
        return out

    def _walk(self, paths: np.ndarray) -> list[np.ndarray]:
        """Per depth 0..ND-1, the upper node of each path's prefix (-1 where the path leaves the trie)."""
        node = np.zeros(len(paths), np.int64)
        out = [node]
        for d in range(self.depth - 1):
            K = self.keys[d]
            want = node * self.vocab_size + paths[:, d]
            order = np.argsort(want)  # sorted needles: numpy's search starts each where the last ended
            idx = np.empty_like(want)
            idx[order] = np.minimum(np.searchsorted(K, want[order]), K.size - 1)
            node = np.where((node >= 0) & (K[idx] == want), idx, -1)
            out.append(node)
        return out

    def _find(self, parents: np.ndarray, toks: np.ndarray) -> np.ndarray:
        """The live slot of each (parent at depth ND-1, token), -1 where there is none."""
        out = np.full(parents.size, -1, np.int64)
        have = np.flatnonzero(parents >= 0)
        if not have.size:
            return out
        start, length = self.run_start[parents[have]], self.run_len[parents[have]]
        col = np.arange(int(length.max()))
        valid = col[None, :] < length[:, None]
        tok, slot = self._arena(np.where(valid, start[:, None] + col[None, :], start[:, None]))
        hit = valid & (tok == toks[have, None])
        found = hit.any(1)
        out[have[found]] = slot[found, hit[found].argmax(1)]
        return out

    def path_nodes(self, rows: np.ndarray, catalog: Catalog) -> list[np.ndarray]:
        """Per depth 0..ND, the node of each of `rows` (live catalog rows with a semantic id)."""
        rows = np.asarray(rows, np.int64)
        paths = catalog.semantic_ids[rows].astype(np.int64).reshape(rows.size, self.depth)
        return [*self._walk(paths), self.leaf_of_rows(rows)]

    def filter_counts(self, ok: np.ndarray) -> list[torch.Tensor]:
        """Per depth 1..ND (0 unused), the items under each node among the catalog rows where `ok`
        (bool per catalog row, False on dead rows: Catalog.filter_mask's) holds; the leaf level's
        indexed by slot."""
        D = self.depth
        n = min(ok.size, self.num_rows)
        leaf = self.leaf_of_rows(np.flatnonzero(ok[:n]))
        count = [np.zeros(0)] * (D + 1)
        count[D] = np.bincount(leaf[leaf >= 0], minlength=self.num_slots)
        pos = _ranges(self.run_start, self.run_len)
        parent = np.repeat(np.arange(self.run_len.size), self.run_len)
        count[D - 1] = np.bincount(parent, weights=count[D][self._arena(pos)[1]], minlength=self.run_len.size)
        count[D - 1] = count[D - 1].astype(np.int64)
        for d in range(D - 1, 1, -1):
            count[d - 1] = np.bincount(self.keys[d - 1] // self.vocab_size, weights=count[d],
                                       minlength=self.keys[d - 2].size).astype(np.int64)
        return [torch.from_numpy(c) if i else torch.empty(0) for i, c in enumerate(count)]

    def rows_of_leaf(self, leaf: int, catalog: Catalog) -> list[int]:
        """Every live catalog row with the leaf's path, ascending (the first is leaf_items')."""
        return self.rows_of_leaves(np.array([leaf]), catalog)[1].tolist()

    def rows_of_leaves(self, leaves: np.ndarray, catalog: Catalog) -> tuple[np.ndarray, np.ndarray]:
        """(leaf, row) of every live catalog row whose leaf is one of `leaves`, grouped by leaf
        (ascending), rows ascending within a leaf: one pass over the tail for all of them."""
        slot, rows = self._live_rows_of(np.asarray(leaves, np.int64), self.row_leaf_tail, catalog)
        order = np.argsort(slot, kind="stable")
        return slot[order], rows[order]

    def _live_rows_of(self, slots: np.ndarray, row_leaf_tail: np.ndarray, catalog: Catalog
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(slot, row) of every live row of `catalog` whose slot is one of `slots`, rows ascending:
        the base's rows of each slot (dup_* or base_item), then the rows since (a pass over
        row_leaf_tail, which compaction keeps short). O(their rows + the tail), never the catalog's."""
        slots = np.unique(slots)
        base = slots[slots < self.B]
        i = np.minimum(np.searchsorted(self.dup_slot, base), max(self.dup_slot.size - 1, 0))
        many = (self.dup_slot[i] == base) if self.dup_slot.size else np.zeros(base.size, bool)
        lo, hi = self.dup_ptr[i[many]], self.dup_ptr[i[many] + 1]
        late = np.flatnonzero(_isin_sorted(row_leaf_tail, slots))
        slot = np.concatenate([base[~many], np.repeat(base[many], hi - lo), row_leaf_tail[late]])
        rows = np.concatenate([self.base_item[base[~many]], self.dup_rows[_ranges(lo, hi - lo)], late + self.R0])
        order = np.argsort(rows, kind="stable")
        slot, rows = slot[order], rows[order]
        alive = catalog.alive(rows)
        return slot[alive], rows[alive]

    # ---- versions ---------------------------------------------------------------------------
    def updated(self, rows, catalog: Catalog, removed_rows: np.ndarray, added_from: int
                ) -> tuple["LayeredTrie", None]:
        """The trie of the catalog version after an update (`Applied`: removed_rows died, rows
        [added_from, catalog.num_rows) are new), from this one (left as it is), at the cost of what
        changed (`rows`: unused, a LayeredTrie has no row map).

        Compaction: once the entries written since the base pass COMPACT_FRACTION of it, the new
        version is compacted on a background thread (`compactor`), and the versions made from it
        meanwhile record their updates. Once the compacted trie is ready, each update replays up
        to CATCH_UP of the recorded ones on it besides its own (the log shrinks by CATCH_UP - 1 per
        update), and the update that replays the last serves it: no update waits for an
        O(catalog) pass or replays a long log. A trie whose arrays are shared between ranks
        (`from_arrays`) compacts in place instead: the next rank to make a version may be another
        process."""
        update = (catalog, np.asarray(removed_rows, np.int64), added_from)
        out = self._apply(*update)
        if self._job is None:
            return out._compacting(), None
        future, partial, log = self._job
        log = (*log, update)
        if partial is None and future.done():
            try:
                partial = future.result()
            except Exception as e:  # noqa: BLE001 - a failed compaction: go on with the tails, try again
                logger.warning("trie compaction failed (%s); starting another", e)
                return out._compacting(), None
        if partial is not None:  # catching up, a few updates at a time: no update replays them all
            for u in log[:CATCH_UP]:
                partial = partial._apply(*u)
            log = log[CATCH_UP:]
            if not log:
                return partial, None  # equal to out, on the new base
        out._job = (future, partial, log)
        return out, None

    def _compacting(self) -> "LayeredTrie":
        """This new version, compacted (in place) or with its compaction started when past the threshold."""
        if self.written > max(COMPACT_MIN, COMPACT_FRACTION * self.B):
            if not self.background:
                return self.compacted()
            self._job = (compactor.submit(self.compacted), None, ())
        return self

    @property
    def written(self) -> int:
        """Entries written since the base: the tails and the changed slots."""
        return self.tail_tok.size + self.ov_slot.size + self.row_leaf_tail.size

    def _apply(self, catalog: Catalog, removed_rows: np.ndarray, added_from: int) -> "LayeredTrie":
        """`updated`'s new version, without compaction."""
        V, D = self.vocab_size, self.depth
        if added_from != self.num_rows:
            raise ValueError(f"an update from row {added_from} of a trie over {self.num_rows} rows")
        removed_rows = np.asarray(removed_rows, np.int64)
        rem_slot = self.leaf_of_rows(removed_rows)
        rem = removed_rows[rem_slot >= 0]
        rem_slot = rem_slot[rem_slot >= 0]
        new_sem = np.flatnonzero(catalog.has_semantic[added_from:]) + added_from
        paths = catalog.semantic_ids[new_sem].astype(np.int64).reshape(new_sem.size, D)
        if paths.size and (paths.min() < 0 or paths.max() >= V):
            raise ValueError(f"semantic id tokens must be in [0, {V})")
        total = int(self.count[0][0]) - rem.size + new_sem.size
        if total <= 0:
            raise ValueError("the item catalog has no semantic_id; retrieval needs one per item")
        rem_paths = catalog.semantic_ids[rem].astype(np.int64).reshape(rem.size, D)
        rem_nodes = self._walk(rem_paths)  # live rows: every prefix is found
        gone_nodes, gone_count = [None] * D, [None] * D
        for d in range(1, D):
            gone_nodes[d], gone_count[d] = np.unique(rem_nodes[d], return_counts=True)
        keys, toks, ptrs, count, tok_count, maxc, at, dead_up, ins_up = update_levels(
            V, self.keys, self.toks, self.ptrs, self.count, self.tok_count, gone_nodes, gone_count, paths, total)
        new_old = self._walk(paths)[D - 1]  # each new row's parent in this version (-1: a new one)
        new_old[_isin_sorted(new_old, dead_up)] = -1  # emptied by the removals and made again: a new node
        found = self._find(new_old, paths[:, D - 1])  # ... and its live leaf (-1: a new one)
        # leaves: the old ones whose rows change, and the new ones (distinct new paths, in path order)
        dec_slot, rep, dec = np.unique(rem_slot, return_index=True, return_counts=True)
        isnew = np.flatnonzero(found < 0)
        inc_slot, inc = np.unique(found[found >= 0], return_counts=True)
        fresh, first, inv = np.unique(at[isnew] * V + paths[isnew, D - 1], return_index=True, return_inverse=True)
        fresh_slot = self.num_slots + np.arange(fresh.size, dtype=np.int64)
        row_slot = found.copy()
        row_slot[isnew] = fresh_slot[inv.reshape(-1)]
        changed = np.union1d(dec_slot, inc_slot)
        cnt, item = self._slot_values(changed)
        cnt = cnt.copy()
        cnt[np.searchsorted(changed, dec_slot)] -= dec
        cnt[np.searchsorted(changed, inc_slot)] += inc
        dead = changed[cnt == 0]
        # runs: every parent whose children changed gets a new one, (token, slot) in token order
        dpos = rep[np.searchsorted(dec_slot, dead)]  # a removed row under each dead leaf
        dparent = rem_nodes[D - 1][dpos]
        alive = ~_isin_sorted(dparent, dead_up)
        renum = _renumbering(dead_up, ins_up)
        q_new = np.concatenate([_shifted(dparent[alive], *renum), fresh // V])
        q_old = np.concatenate([dparent[alive], new_old[isnew[first]]])
        q_new, uq = np.unique(q_new, return_index=True)
        q_old = q_old[uq]
        had = q_old >= 0
        lengths = self.run_len[q_old[had]]
        tok, slot = self._arena(_ranges(self.run_start[q_old[had]], lengths))
        owner = np.repeat(q_new[had], lengths)
        keep = ~_isin_sorted(slot, dead)
        owner = np.concatenate([owner[keep], fresh // V])
        tok, slot = np.concatenate([tok[keep], fresh % V]), np.concatenate([slot[keep], fresh_slot])
        order = np.lexsort((tok, owner))
        owner, tok, slot = owner[order], tok[order], slot[order]
        run_start, run_len = (_fresh(_splice(a, dead_up, ins_up, 0), a) for a in (self.run_start, self.run_len))
        uo, ofirst, olen = np.unique(owner, return_index=True, return_counts=True)
        run_start[uo] = self.B + self.tail_tok.size + ofirst
        run_len[uo] = olen
        tc = self.tok_count[D - 1].copy()
        np.subtract.at(tc, rem_paths[dpos, D - 1], 1)
        np.add.at(tc, fresh % V, 1)
        # each changed slot's count and first row (a new leaf's: its first new row; an old leaf
        # whose first row died: the first live row left, looked up below)
        # the tails grow in place (Buf: the versions before view only their own length)
        more = np.full(catalog.num_rows - added_from, -1, np.int64)
        more[new_sem - added_from] = row_slot
        bufs = self._bufs or tuple(Buf.of(a) for a in (self.tail_slot, self.tail_tok, self.row_leaf_tail))
        bufs = (bufs[0].append(self.tail_slot.size, slot), bufs[1].append(self.tail_tok.size, tok),
                bufs[2].append(self.row_leaf_tail.size, more))
        tail_slot, tail_tok = bufs[0].view(self.tail_slot.size + slot.size), bufs[1].view(self.tail_tok.size + tok.size)
        row_leaf_tail = bufs[2].view(self.row_leaf_tail.size + more.size)
        lost = (cnt > 0) & np.isin(item, rem)
        if lost.any():
            slots, rows = self._live_rows_of(changed[lost], row_leaf_tail, catalog)
            s, f = np.unique(slots, return_index=True)
            item[np.searchsorted(changed, s)] = rows[f]
        ch = np.concatenate([changed, fresh_slot])
        ch_cnt = np.concatenate([cnt, np.bincount(inv.reshape(-1), minlength=fresh.size)])
        ch_item = np.concatenate([item, new_sem[isnew[first]]])
        stay = ~np.isin(self.ov_slot, ch, assume_unique=True)
        ov_slot = np.concatenate([self.ov_slot[stay], ch])
        o = np.argsort(ov_slot, kind="stable")
        out = LayeredTrie.__new__(LayeredTrie)
        out._set(V, keys, toks, ptrs, count, [*tok_count, tc], maxc, dict(
            run_start=run_start, run_len=run_len, base_tok=self.base_tok, base_count=self.base_count,
            base_item=self.base_item, dup_slot=self.dup_slot, dup_ptr=self.dup_ptr, dup_rows=self.dup_rows,
            tail_slot=tail_slot, tail_tok=tail_tok, ov_slot=ov_slot[o],
            ov_count=np.concatenate([self.ov_count[stay], ch_cnt])[o],
            ov_item=np.concatenate([self.ov_item[stay], ch_item])[o], row_leaf_base=self.row_leaf_base,
            row_leaf_tail=row_leaf_tail), self.num_slots + fresh.size, self.num_leaves - dead.size + fresh.size,
            same_tokens=self, device=self.device)
        out._bufs, out.background = bufs, self.background
        if self.leaves is not None:  # the new entries after this version's, the changed runs over its pointers
            out.leaves = self.leaves.extended(out, tok, slot, None if dead_up.size or ins_up.size else uo)
        return out

    def compacted(self) -> "LayeredTrie":
        """The same trie with the current leaves, in path order, as its base (slots renumbered); its
        leaf level uploaded to the device where this one has one."""
        out = self._compact()
        if self.leaves is not None:
            out.leaves = DeviceLeaves.of(out, self.device)
        return out

    def _compact(self) -> "LayeredTrie":
        """compacted, on the host only."""
        pos = _ranges(self.run_start, self.run_len)
        tok, slot = self._arena(pos)
        cnt, item = self._slot_values(slot)
        remap = np.full(self.num_slots + 1, -1, np.int64)  # [-1]: rows without a leaf stay -1
        remap[slot] = np.arange(slot.size, dtype=np.int64)
        rl = remap[np.concatenate([self.row_leaf_base, self.row_leaf_tail])]
        none = np.zeros(0, np.int64)
        out = LayeredTrie.__new__(LayeredTrie)
        out._set(self.vocab_size, self.keys, self.toks, self.ptrs, self.count, self.tok_count,
                 self.max_children[:-1], dict(
                     run_start=np.cumsum(self.run_len) - self.run_len, run_len=self.run_len, base_tok=tok,
                     base_count=cnt, base_item=item, tail_slot=none, tail_tok=none, ov_slot=none, ov_count=none,
                     ov_item=none, row_leaf_base=rl, row_leaf_tail=none, **_dup_index(rl, cnt)), slot.size,
                 slot.size, same_tokens=self, device=self.device)
        out.background = self.background
        return out

    def dense(self, catalog: Catalog) -> tuple[SemanticIdTrie, np.ndarray]:
        """The equal SemanticIdTrie and its row map (what `SemanticIdTrie.from_catalog(catalog)` gives)."""
        c = self._compact()
        D, V = self.depth, self.vocab_size
        rows = catalog.semantic_rows()
        parent = np.repeat(np.arange(c.run_len.size, dtype=np.int64), c.run_len)
        ptr = np.concatenate([[0], np.cumsum(c.run_len)])
        out = SemanticIdTrie.__new__(SemanticIdTrie)
        out._assign([*c.keys, parent * V + c.base_tok], [*c.toks, c.base_tok], [*c.ptrs, ptr],
                    [*c.count, c.base_count], c.row_leaf_base[rows], np.searchsorted(rows, c.base_item),
                    c.tok_count, c.max_children, V, "cpu")
        return out, rows

    # ---- one copy for every DP rank (sgrec.catalog.image.shared) ------------------------------
    def arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """This version's own arrays (O(parents + tails): not the base's, see base_arrays) and the
        numbers beside them, info["base"] naming the base; from_arrays takes both."""
        out = {name: getattr(self, name) for name in _ARRAYS if name not in _BASE_ARRAYS}
        for d in range(self.depth - 1):
            out.update({f"key{d}": self.keys[d], f"tok{d}": self.toks[d], f"ptr{d}": self.ptrs[d]})
        out.update({f"count{d}": c for d, c in enumerate(self.count)})
        out.update({f"tokcount{d}": c for d, c in enumerate(self.tok_count)})
        return out, {"layered": True, "base": self.base_id, "depth": self.depth, "vocab_size": self.vocab_size,
                     "max_children": self.max_children[:-1], "num_slots": self.num_slots,
                     "num_leaves": self.num_leaves}

    def base_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """The base's arrays (O(leaves + rows)), the same for every version on it (base_id)."""
        return {name: getattr(self, name) for name in _BASE_ARRAYS}, {}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], info: dict) -> "LayeredTrie":
        """The trie of arrays() and base_arrays() (one dict) and arrays()'s info."""
        D = info["depth"]
        out = cls.__new__(cls)
        out._set(info["vocab_size"], [arrays[f"key{d}"] for d in range(D - 1)],
                 [arrays[f"tok{d}"] for d in range(D - 1)], [arrays[f"ptr{d}"] for d in range(D - 1)],
                 [arrays[f"count{d}"] for d in range(D)], [arrays[f"tokcount{d}"] for d in range(D)],
                 list(info["max_children"]), {name: arrays[name] for name in _ARRAYS}, info["num_slots"],
                 info["num_leaves"])
        out.background, out.base_id = False, info["base"]  # see updated
        return out
