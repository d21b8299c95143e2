"""The item catalog in memory, held as columns: item token ids flat with offsets, id tokens one
array (-1: none), semantic IDs one [N, ND] array (rows without one: -1, `has_semantic` False),
attributes as columns (`attrs.py`), ids as one byte column with a hashed index (`ids.py`: no Python
object per item). `items` is a sequence of
`Item` views made on demand, so code that reads items one by one keeps working at 10^7 items.

Versions share storage: `appended` makes the next version by marking rows dead and
appending the batch's rows to the columns in place (grow.py), so it costs what changed. A
version's rows are `num_rows`, some of them dead (a deleted item, or an item's row before it was
replaced); `len()` counts live items, `index` maps an id to its live row, `items` and
`live_rows()` skip dead rows, and `filter_mask` / `semantic_rows` never pass one. `ids[row]`
names a row's item, dead or alive. Rows keep their number in every later version.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import orjson

from sgrec.catalog.attrs import AttrBuilder, AttrTable, take_ragged
from sgrec.catalog.grow import Buf, set_bits, unpack
from sgrec.catalog.ids import DuplicateIdError, IdColumn, IdIndex
from sgrec.catalog.item import CatalogError, Item, UnknownItemError


FILTER_MASKS = 8  # attribute filters whose row masks are kept
PRIOR = "prior"  # the number attribute that orders the items sharing a semantic ID (path_order)


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
    def from_columns(cls, ids: "Sequence[str] | IdColumn", token_flat: np.ndarray, token_ptr: np.ndarray,
                     id_tokens: np.ndarray, semantic_ids: np.ndarray | None, has_semantic: np.ndarray,
                     attrs: AttrTable, meta: dict[int, dict] | None = None) -> "Catalog":
        self = cls.__new__(cls)
        self._init(ids, token_flat, token_ptr, id_tokens, semantic_ids, has_semantic, attrs, meta or {})
        return self

    @classmethod
    def from_storage(cls, ids: IdColumn, index: IdIndex, cols: dict[str, np.ndarray], attrs: AttrTable,
                     meta: dict[int, dict], live_tokens: int, bufs: dict[str, Buf]) -> "Catalog":
        """A first version over storage later versions append to (`bufs`, viewed by `cols`), with its
        index already built: what `image.load` maps (no copy, no check: the image was written from a
        catalog that passed them)."""
        self = cls.__new__(cls)
        self.ids = ids
        self.token_flat, self.token_ptr, self.id_tokens = cols["token_flat"], cols["token_ptr"], cols["id_tokens"]
        self.has_semantic, self.semantic_ids = cols["has_semantic"], cols.get("semantic_ids")
        self.attrs, self.meta = attrs, meta
        self.semantic_id_len = None if self.semantic_ids is None else int(self.semantic_ids.shape[1])
        n = len(ids)
        self._version(index, n, None, n, live_tokens, bufs)
        return self

    def _init(self, ids, token_flat, token_ptr, id_tokens, semantic_ids, has_semantic, attrs, meta) -> None:
        self.ids = ids = IdColumn.of(ids)
        self.token_flat = np.asarray(token_flat, dtype=np.int32)
        self.token_ptr = np.asarray(token_ptr, dtype=np.int64)
        self.id_tokens = np.asarray(id_tokens, dtype=np.int64)
        self.has_semantic = np.asarray(has_semantic, dtype=bool)
        if semantic_ids is not None and not self.has_semantic.any():
            semantic_ids = None
        self.semantic_ids = None if semantic_ids is None else np.asarray(semantic_ids, dtype=np.int32)
        self.attrs = attrs
        self.meta = meta
        if len(ids) == 0:
            raise CatalogError("the item catalog has no items")
        try:
            rows = IdIndex.build(ids)
        except DuplicateIdError as e:
            raise CatalogError(str(e)) from None
        self.semantic_id_len: int | None = None if self.semantic_ids is None else int(self.semantic_ids.shape[1])
        self._version(rows, len(ids), None, len(ids), int(self.token_ptr[-1]), None)

    def _version(self, rows: IdIndex, num_rows: int, dead, live: int, live_tokens: int, bufs) -> None:
        self._rows = rows  # id -> row, or the id's rows ascending (replaced): shared by the versions
        self.num_rows = num_rows
        self._dead = dead  # packed bits over num_rows (None: every row live)
        self._live = live
        self._live_tokens = live_tokens
        self._bufs = bufs  # column -> Buf once a version was appended (shared storage)
        self.index = RowIndex(rows, num_rows, dead, live)

    # ---- new catalogs from old (updates) --------------------------------------------------
    def take(self, rows) -> "Catalog":
        """A catalog of these rows, in this order (columns gathered, vectorised)."""
        rows = np.asarray(rows, dtype=np.int64)
        ptr, flat = take_ragged(self.token_ptr, self.token_flat, rows)
        new_row = {int(r): k for k, r in enumerate(rows.tolist())} if self.meta else {}  # rows < num_rows
        meta = {new_row[r]: m for r, m in self.meta.items() if r in new_row}
        return Catalog.from_columns(IdColumn(*take_ragged(self.ids.ptr, self.ids.flat, rows)[::-1]), flat, ptr,
                                    self.id_tokens[rows],
                                    None if self.semantic_ids is None else self.semantic_ids[rows],
                                    self.has_semantic[rows], self.attrs.take(rows), meta)

    def with_semantic_ids(self, semantic_ids: np.ndarray, has: np.ndarray | None = None) -> "Catalog":
        """The live rows with these semantic IDs (int [live rows, ND], one per live row in order;
        `has`: which rows have one, default all)."""
        base = self.compacted()
        return Catalog.from_columns(base.ids, base.token_flat, base.token_ptr, base.id_tokens, semantic_ids,
                                    np.ones(len(base), dtype=bool) if has is None else has, base.attrs, base.meta)

    def concat(self, other: "Catalog") -> "Catalog":
        """This catalog's live rows, then `other`'s, copied. CatalogError when semantic IDs differ in
        length, an attribute's kind differs, or an id is in both."""
        self, other = self.compacted(), other.compacted()
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
        n = len(self)
        meta = {**self.meta, **{n + r: m for r, m in other.meta.items()}}
        a, b = self.ids, other.ids
        ids = IdColumn(np.concatenate([a.flat, b.flat]), np.concatenate([a.ptr, b.ptr[1:] + a.ptr[-1]]))
        return Catalog.from_columns(ids, np.concatenate([self.token_flat, other.token_flat]),
                                    np.concatenate([self.token_ptr, other.token_ptr[1:] + self.token_ptr[-1]]),
                                    np.concatenate([self.id_tokens, other.id_tokens]), sem,
                                    np.concatenate([self.has_semantic, other.has_semantic]), attrs, meta)

    def _check_nd(self, other: "Catalog") -> None:
        """CatalogError when both catalogs have semantic IDs of different lengths."""
        if self.semantic_id_len and other.semantic_id_len and self.semantic_id_len != other.semantic_id_len:
            raise CatalogError(f"semantic_id has {other.semantic_id_len} tokens here but {self.semantic_id_len} "
                               "in the catalog")

    def token_ids(self, row: int) -> np.ndarray:
        """Row's item token ids (a view of the column)."""
        return self.token_flat[self.token_ptr[row] : self.token_ptr[row + 1]]

    def appended(self, batch: "Catalog | None", dead_rows) -> "Catalog":
        """The next version: this one with `dead_rows` (live rows) dead, then batch's items (if
        any) as new rows. batch's ids must not be live here outside dead_rows. This version is left as it is.
        Costs O(len(batch) + len(dead_rows)), plus num_rows / 8 bytes of dead bits, when this is
        the newest version of its storage; from an older version (a branch) the storage is
        copied once. CatalogError when batch does not fit (semantic-ID length, attribute kinds)."""
        batch = _NO_ROWS if batch is None else batch.compacted()
        self._check_nd(batch)
        try:
            self.attrs.check_kinds(batch.attrs)
        except ValueError as e:
            raise CatalogError(str(e)) from None
        if self._bufs is None:  # the first version appended to: storage of its own (one copy)
            return self.with_room().appended(None if batch is _NO_ROWS else batch, dead_rows)
        n, k, nd = self.num_rows, len(batch), self.semantic_id_len or batch.semantic_id_len
        rows, meta = self._rows, self.meta
        bufs = dict(self._bufs)
        if nd and "semantic_ids" not in bufs:  # the first item with a semantic ID: O(N), once
            bufs["semantic_ids"] = Buf.of(np.full((n, nd), -1, dtype=np.int32))
        if rows.top != n:  # a branch (the index's changes and meta are shared only along one line of versions)
            rows = rows.branch(n)
            meta = {r: m for r, m in meta.items() if r < n}
        sem = batch.semantic_ids if batch.semantic_ids is not None else np.full((k, nd or 0), -1, np.int32)
        m, mi = int(self.token_ptr[n]), int(self.ids.ptr[n])
        more = {"token_flat": batch.token_flat, "token_ptr": batch.token_ptr[1:] + m, "id_tokens": batch.id_tokens,
                "has_semantic": batch.has_semantic, "semantic_ids": sem,
                "id_flat": batch.ids.flat, "id_ptr": batch.ids.ptr[1:] + mi}
        size = {"token_flat": m, "token_ptr": n + 1, "id_flat": mi, "id_ptr": n + 1}
        cols = {}
        for name, buf in bufs.items():
            at = size.get(name, n)
            bufs[name] = buf.append(at, more[name])
            cols[name] = bufs[name].view(at + len(more[name]))
        attrs = self.attrs.append(batch.attrs)
        # rows are written; now name them (a version older than this one reads no row >= its num_rows)
        rows.top = n + k
        for r, mt in batch.meta.items():
            meta[n + r] = mt
        for j, i in enumerate(batch.ids):
            old = rows.get(i)
            rows[i] = n + j if old is None else (old, n + j) if type(old) is int else (*old, n + j)
        dead_rows = np.asarray(dead_rows, dtype=np.int64)
        dead = set_bits(self._dead, n, n + k, dead_rows) if dead_rows.size or self._dead is not None else None
        gone = int((self.token_ptr[dead_rows + 1] - self.token_ptr[dead_rows]).sum()) if dead_rows.size else 0
        out = Catalog.__new__(Catalog)
        out.ids, out.meta, out.attrs = IdColumn(cols["id_flat"], cols["id_ptr"]), meta, attrs
        out.token_flat, out.token_ptr, out.id_tokens = cols["token_flat"], cols["token_ptr"], cols["id_tokens"]
        out.has_semantic, out.semantic_ids = cols["has_semantic"], cols.get("semantic_ids")
        out.semantic_id_len = nd or None
        out._version(rows, n + k, dead, self._live - len(dead_rows) + k,
                     self._live_tokens - gone + int(batch.token_ptr[-1]), bufs)
        return out

    def with_room(self, spare: float = 0.5) -> "Catalog":
        """This version with its columns moved into storage that later versions append to in
        place (`appended`), with room for `spare` times its rows more (address space: untouched
        room is not resident). One copy of the columns (ids included), once (at start-up), so that no
        update pays it; the ids' index and meta are shared, not copied."""
        if self._bufs is not None:
            return self
        out = Catalog.__new__(Catalog)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_masks"})
        bufs = {}
        for name in ("token_flat", "token_ptr", "id_tokens", "has_semantic", "semantic_ids"):
            arr = getattr(self, name)
            if arr is not None:
                bufs[name] = Buf.roomy(arr, spare)
                setattr(out, name, bufs[name].view(len(arr)))
        for name, arr in (("id_flat", self.ids.flat), ("id_ptr", self.ids.ptr)):
            bufs[name] = Buf.roomy(arr, spare)
        out.ids = IdColumn(bufs["id_flat"].view(len(self.ids.flat)), bufs["id_ptr"].view(len(self.ids.ptr)))
        if self._rows.ids is self.ids:  # the index reads its rows' bytes from the moved column (same bytes)
            self._rows.ids = out.ids
        out.attrs = AttrTable(self.attrs.n, {k: c.with_room(spare) for k, c in self.attrs.columns.items()})
        out._bufs = bufs
        return out

    def compacted(self) -> "Catalog":
        """This version with its live rows only, renumbered from 0 (itself when it has no dead row
        and owns its storage's every row): what a file or a from-scratch build holds."""
        if self._dead is None:
            return self
        return self.take(self.live_rows())

    def live_rows(self) -> np.ndarray:
        """Rows of live items, ascending. Made on each call, not kept: its callers are few and once per
        use (start-up's placement, a compaction, a walk over the items), and a kept copy would cost 8
        bytes an item in every version and every DP rank (76 MiB at 10^7 items)."""
        return np.arange(self.num_rows, dtype=np.int64) if self._dead is None else np.flatnonzero(self.alive_mask())

    def alive_mask(self) -> np.ndarray:
        """bool [num_rows]: live rows."""
        return ~unpack(self._dead, self.num_rows)

    def alive(self, rows: np.ndarray) -> np.ndarray:
        """bool per row of `rows` (rows of this version): is it live. Reads only those rows' bits."""
        rows = np.asarray(rows, dtype=np.int64)
        if self._dead is None:
            return np.ones(rows.shape, dtype=bool)
        return (self._dead[rows >> 3] >> (rows & 7).astype(np.uint8) & 1) == 0

    # ---- lookups ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._live

    def __contains__(self, item_id: str) -> bool:
        return self.index.get(item_id) is not None

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
        out = self.index.get_many(ids)
        if None in out:
            raise UnknownItemError([i for i, r in zip(ids, out) if r is None])
        return out

    def lookup(self, item_ids: Iterable[str], full: bool = True) -> list[Item]:
        """The items for these ids, in order; UnknownItemError names every unknown one. full=False:
        tokens, id token and semantic ID only (no meta, no attrs)."""
        return [self.item(r, full) for r in self.rows(item_ids)]

    def token_len(self, row: int) -> int:
        return int(self.token_ptr[row + 1] - self.token_ptr[row])

    @property
    def max_item_len(self) -> int:
        """The most tokens of an item (dead rows counted: a bound)."""
        return int(np.diff(self.token_ptr).max(initial=0))

    @property
    def total_tokens(self) -> int:
        """Tokens of the live items."""
        return self._live_tokens

    def filter_mask(self, spec: dict) -> np.ndarray:
        """bool [N]: the rows passing an attribute filter (ValueError naming a bad predicate); the
        last FILTER_MASKS filters' masks are kept."""
        key = orjson.dumps(spec, option=orjson.OPT_SORT_KEYS) if isinstance(spec, dict) else b""
        masks = self.__dict__.setdefault("_masks", OrderedDict())
        if key in masks:
            masks.move_to_end(key)
            return masks[key]
        ok = self.attrs.evaluate(spec)
        if self._dead is not None:
            ok &= self.alive_mask()
        masks[key] = ok
        while len(masks) > FILTER_MASKS:
            masks.popitem(last=False)
        return ok

    def path_order(self, rows: Sequence[int]) -> list[int]:
        """Rows that share one semantic ID in the order retrieve returns them: a larger `prior` (a
        number attribute) first, rows without one after those with one, then by id."""
        col = self.attrs.columns.get(PRIOR)
        ids = self.ids
        if col is None or col.kind != "num":
            return sorted(rows, key=lambda r: ids[r])
        return sorted(rows, key=lambda r: (0, -float(col.data[r]), ids[r]) if col.present[r] else (1, 0.0, ids[r]))

    def semantic_rows(self) -> np.ndarray:
        """Live rows that carry a semantic ID, ascending."""
        return np.flatnonzero(self.has_semantic if self._dead is None else self.has_semantic & self.alive_mask())

    def nbytes(self) -> int:
        """Bytes of the array columns (ids and their index not counted)."""
        arrays = [self.token_flat, self.token_ptr, self.id_tokens, self.has_semantic]
        if self.semantic_ids is not None:
            arrays.append(self.semantic_ids)
        return sum(a.nbytes for a in arrays)


class _NoRows:
    """An empty batch for `Catalog.appended` (a catalog cannot be empty)."""

    ids = IdColumn(np.zeros(0, np.uint8), np.zeros(1, np.int64))
    meta: dict = {}
    semantic_ids = semantic_id_len = None
    token_flat = np.zeros(0, np.int32)
    token_ptr = np.zeros(1, np.int64)
    id_tokens = np.zeros(0, np.int64)
    has_semantic = np.zeros(0, bool)
    attrs = AttrTable(0)

    def __len__(self) -> int:
        return 0


_NO_ROWS = _NoRows()


class ItemsView(Sequence):
    """The catalog's live items in row order, each made on access."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.rows = catalog.live_rows()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.catalog.item(int(r)) for r in self.rows[i]]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.catalog.item(int(self.rows[i]))

    def __iter__(self):
        item = self.catalog.item
        return (item(r) for r in self.rows.tolist())


class RowIndex(Mapping):
    """One version's id -> live row, over the id -> row(s) index its line of versions shares: an id's
    row here is its newest row below num_rows, when that row is live here."""

    __slots__ = ("_rows", "_n", "_dead", "_live")

    def __init__(self, rows: IdIndex, n: int, dead, live: int):
        self._rows, self._n, self._dead, self._live = rows, n, dead, live

    def get(self, item_id, default=None):
        return self._live_row(self._rows.get(item_id), default)

    def get_many(self, item_ids) -> list:
        """[get(i) for i in item_ids], the ids hashed together (None for unknown ones)."""
        live = self._live_row
        return [live(v, None) for v in self._rows.get_many(item_ids)]

    def _live_row(self, v, default):
        if v is None:
            return default
        if type(v) is not int:
            v = next((r for r in reversed(v) if r < self._n), self._n)
        if v >= self._n or (self._dead is not None and self._dead[v >> 3] >> (v & 7) & 1):
            return default
        return v

    def __getitem__(self, item_id) -> int:
        r = self.get(item_id)
        if r is None:
            raise KeyError(item_id)
        return r

    def __contains__(self, item_id) -> bool:
        return self.get(item_id) is not None

    def __len__(self) -> int:
        return self._live

    def __iter__(self):
        get = self.get
        return (i for i in self._rows if get(i) is not None)
