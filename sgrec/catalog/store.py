"""The item catalog in memory, held as columns: item token ids flat with offsets, id tokens one
array (-1: none), semantic IDs one [N, ND] array (rows without one: -1, `has_semantic` False),
attributes as columns (`attrs.py`), ids in one list with one index. `items` is a sequence of
`Item` views made on demand, so code that reads items one by one keeps working at 10^7 items.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import orjson

from sgrec.catalog.attrs import AttrBuilder, AttrTable, take_ragged
from sgrec.catalog.item import CatalogError, Item, UnknownItemError


FILTER_MASKS = 8  # attribute filters whose row masks are kept


class Catalog:
    def __init__(self, items: Iterable[Item]):
        """A catalog from Item objects (tests, small tools); loaders use `from_columns`."""
        items = list(items)
        nd = {len(it.semantic_id) for it in items if it.semantic_id is not None}
        if len(nd) > 1:
            raise CatalogError(f"items have semantic_id of different lengths {sorted(nd)}")
        width = nd.pop() if nd else 0
        attrs = AttrBuilder()
        meta = {}
        for n, it in enumerate(items):
            attrs.add(n, it.attrs)
            if it.meta:
                meta[n] = dict(it.meta)
        lens = np.array([len(it.token_ids) for it in items], dtype=np.int64)
        sem = np.full((len(items), width), -1, dtype=np.int32)
        for n, it in enumerate(items):
            if it.semantic_id is not None:
                sem[n] = it.semantic_id
        self._init(
            ids=[it.id for it in items],
            token_flat=np.fromiter((t for it in items for t in it.token_ids), dtype=np.int32, count=int(lens.sum())),
            token_ptr=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            id_tokens=np.array([-1 if it.id_token is None else it.id_token for it in items], dtype=np.int64),
            semantic_ids=sem if width else None,
            has_semantic=np.array([it.semantic_id is not None for it in items], dtype=bool),
            attrs=attrs.build(len(items)),
            meta=meta,
        )

    @classmethod
    def from_columns(cls, ids: list[str], token_flat: np.ndarray, token_ptr: np.ndarray, id_tokens: np.ndarray,
                     semantic_ids: np.ndarray | None, has_semantic: np.ndarray, attrs: AttrTable,
                     meta: dict[int, dict] | None = None, index: dict[str, int] | None = None) -> "Catalog":
        """`index` (id -> row), when the loader already built it."""
        self = cls.__new__(cls)
        self._init(ids, token_flat, token_ptr, id_tokens, semantic_ids, has_semantic, attrs, meta or {}, index)
        return self

    def _init(self, ids, token_flat, token_ptr, id_tokens, semantic_ids, has_semantic, attrs, meta,
              index=None) -> None:
        self.ids: list[str] = ids
        self.token_flat = np.asarray(token_flat, dtype=np.int32)
        self.token_ptr = np.asarray(token_ptr, dtype=np.int64)
        self.id_tokens = np.asarray(id_tokens, dtype=np.int64)
        self.has_semantic = np.asarray(has_semantic, dtype=bool)
        if semantic_ids is not None and not self.has_semantic.any():
            semantic_ids = None
        self.semantic_ids = None if semantic_ids is None else np.asarray(semantic_ids, dtype=np.int32)
        self.attrs = attrs
        self.meta = meta
        self.index: dict[str, int] = index if index is not None else dict(zip(ids, range(len(ids))))
        if len(self.index) != len(ids):
            seen: set[str] = set()
            dup = next(i for i in ids if i in seen or seen.add(i))
            raise CatalogError(f"duplicate item id {dup!r}")
        if len(ids) == 0:
            raise CatalogError("the item catalog has no items")
        self.semantic_id_len: int | None = None if self.semantic_ids is None else int(self.semantic_ids.shape[1])

    # ---- new catalogs from old (updates) --------------------------------------------------
    def take(self, rows) -> "Catalog":
        """A catalog of these rows, in this order (columns gathered, vectorised)."""
        rows = np.asarray(rows, dtype=np.int64)
        ptr, flat = take_ragged(self.token_ptr, self.token_flat, rows)
        new_row = {int(r): k for k, r in enumerate(rows.tolist())} if self.meta else {}
        meta = {new_row[r]: m for r, m in self.meta.items() if r in new_row}
        ids = self.ids
        return Catalog.from_columns([ids[r] for r in rows.tolist()], flat, ptr, self.id_tokens[rows],
                                    None if self.semantic_ids is None else self.semantic_ids[rows],
                                    self.has_semantic[rows], self.attrs.take(rows), meta)

    def concat(self, other: "Catalog") -> "Catalog":
        """This catalog's rows, then `other`'s. CatalogError when semantic IDs differ in length, an
        attribute's kind differs, or an id is in both."""
        self._check_nd(other)
        nd = self.semantic_id_len or other.semantic_id_len
        try:
            attrs = self.attrs.concat(other.attrs)
        except ValueError as e:
            raise CatalogError(str(e)) from None
        sem = None
        if nd:
            sem = np.full((len(self) + len(other), nd), -1, dtype=np.int32)
            for off, c in ((0, self), (len(self), other)):
                if c.semantic_ids is not None:
                    sem[off:off + len(c)] = c.semantic_ids
        index = dict(self.index)
        n = len(self)
        for k, i in enumerate(other.ids):
            if index.setdefault(i, n + k) != n + k:
                raise CatalogError(f"duplicate item id {i!r}")
        meta = {**self.meta, **{n + r: m for r, m in other.meta.items()}}
        return Catalog.from_columns(self.ids + other.ids, np.concatenate([self.token_flat, other.token_flat]),
                                    np.concatenate([self.token_ptr, other.token_ptr[1:] + self.token_ptr[-1]]),
                                    np.concatenate([self.id_tokens, other.id_tokens]), sem,
                                    np.concatenate([self.has_semantic, other.has_semantic]), attrs, meta, index)

    def _check_nd(self, other: "Catalog") -> None:
        """CatalogError when both catalogs have semantic IDs of different lengths."""
        if self.semantic_id_len and other.semantic_id_len and self.semantic_id_len != other.semantic_id_len:
            raise CatalogError(f"semantic_id has {other.semantic_id_len} tokens here but {self.semantic_id_len} "
                               "in the catalog")

    def token_ids(self, row: int) -> np.ndarray:
        """Row's item token ids (a view of the column)."""
        return self.token_flat[self.token_ptr[row] : self.token_ptr[row + 1]]

    def replace_rows(self, rows, other: "Catalog") -> "Catalog":
        """This catalog with rows[j] replaced by other's row j (the same ids, so the id list and
        index are shared with this catalog, which stays as it is)."""
        self._check_nd(other)
        rows = np.asarray(rows, dtype=np.int64)
        n = len(self)
        perm = np.arange(n, dtype=np.int64)
        perm[rows] = n + np.arange(len(rows), dtype=np.int64)  # row r of the result: self's or other's
        flat = np.concatenate([self.token_flat, other.token_flat])
        ptr = np.concatenate([self.token_ptr, other.token_ptr[1:] + self.token_ptr[-1]])
        token_ptr, token_flat = take_ragged(ptr, flat, perm)
        id_tokens = self.id_tokens.copy()
        id_tokens[rows] = other.id_tokens
        has = self.has_semantic.copy()
        has[rows] = other.has_semantic
        nd = self.semantic_id_len or other.semantic_id_len
        sem = None
        if nd:
            sem = np.full((n, nd), -1, dtype=np.int32) if self.semantic_ids is None else self.semantic_ids.copy()
            sem[rows] = -1 if other.semantic_ids is None else other.semantic_ids
        try:
            attrs = self.attrs.concat(other.attrs).take(perm)
        except ValueError as e:
            raise CatalogError(str(e)) from None
        meta = dict(self.meta)
        for j, r in enumerate(rows.tolist()):
            if j in other.meta:
                meta[r] = other.meta[j]
            else:
                meta.pop(r, None)
        return Catalog.from_columns(self.ids, token_flat, token_ptr, id_tokens, sem, has, attrs, meta, self.index)

    def same_paths(self, other: "Catalog") -> bool:
        """Whether both catalogs hold the same semantic IDs on the same rows (then one trie and its
        row map serve both)."""
        if len(self) != len(other) or not np.array_equal(self.has_semantic, other.has_semantic):
            return False
        if self.semantic_ids is None or other.semantic_ids is None:
            return self.semantic_ids is None and other.semantic_ids is None
        return self.semantic_ids.shape == other.semantic_ids.shape and bool(
            (self.semantic_ids[self.has_semantic] == other.semantic_ids[other.has_semantic]).all())

    # ---- lookups ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self.index

    @property
    def items(self) -> "ItemsView":
        return ItemsView(self)

    def item(self, row: int, full: bool = True) -> Item:
        """The Item view of catalog row `row` (full=False: without meta and attrs, cheaper)."""
        a, b = int(self.token_ptr[row]), int(self.token_ptr[row + 1])
        idt = int(self.id_tokens[row])
        sem = tuple(self.semantic_ids[row].tolist()) if self.has_semantic[row] else None
        return Item(self.ids[row], tuple(self.token_flat[a:b].tolist()), None if idt < 0 else idt, sem,
                    self.meta.get(row, {}) if full else {}, self.attrs.row(row) if full else {})

    def get(self, item_id: str) -> Item:
        return self.item(self.index[item_id])

    def rows(self, item_ids: Iterable[str]) -> list[int]:
        """Catalog rows of these ids, in order; UnknownItemError names every unknown one."""
        ids = list(item_ids)
        index = self.index
        out = [index.get(i, -1) if isinstance(i, str) else -1 for i in ids]
        if -1 in out:
            raise UnknownItemError([i for i, r in zip(ids, out) if r < 0])
        return out

    def lookup(self, item_ids: Iterable[str], full: bool = True) -> list[Item]:
        """The items for these ids, in order; UnknownItemError names every unknown one. full=False:
        tokens, id token and semantic ID only (no meta, no attrs)."""
        return [self.item(r, full) for r in self.rows(item_ids)]

    def token_len(self, row: int) -> int:
        return int(self.token_ptr[row + 1] - self.token_ptr[row])

    @property
    def max_item_len(self) -> int:
        return int(np.diff(self.token_ptr).max(initial=0))

    @property
    def total_tokens(self) -> int:
        return int(self.token_ptr[-1])

    def filter_mask(self, spec: dict) -> np.ndarray:
        """bool [N]: the rows passing an attribute filter (ValueError naming a bad predicate); the
        last FILTER_MASKS filters' masks are kept."""
        key = orjson.dumps(spec, option=orjson.OPT_SORT_KEYS) if isinstance(spec, dict) else b""
        masks = self.__dict__.setdefault("_masks", OrderedDict())
        if key in masks:
            masks.move_to_end(key)
            return masks[key]
        ok = self.attrs.evaluate(spec)
        masks[key] = ok
        while len(masks) > FILTER_MASKS:
            masks.popitem(last=False)
        return ok

    def semantic_rows(self) -> np.ndarray:
        """Rows that carry a semantic ID, ascending."""
        return np.flatnonzero(self.has_semantic)

    def nbytes(self) -> int:
        """Bytes of the array columns (ids and their index not counted)."""
        arrays = [self.token_flat, self.token_ptr, self.id_tokens, self.has_semantic]
        if self.semantic_ids is not None:
            arrays.append(self.semantic_ids)
        return sum(a.nbytes for a in arrays)


class ItemsView(Sequence):
    """The catalog's items in catalog order, each made on access."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def __len__(self) -> int:
        return len(self.catalog.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.catalog.item(r) for r in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.catalog.item(i)

    def __iter__(self):
        item = self.catalog.item
        return (item(r) for r in range(len(self)))
