"""Item ids as arrays: no Python object per item.

A list of 10^7 id strings and a dict from them to rows cost about 1.3 GiB per catalog (two thirds
of a 10^7-item catalog's memory), and neither can be shared between the DP ranks of a server.
Here the ids are one UTF-8 byte column with offsets (`IdColumn`, the catalog's token columns'
layout), and the id -> row index is the ids' 64-bit FNV-1a hashes, sorted, with each hash's row
(`IdIndex`): a lookup hashes the id, finds its hash by binary search and compares the row's bytes
(hashes may collide; rows with the same hash are all checked). Ids added or replaced after the
index was built sit in a dict beside it (what updates change: O(k)).

FNV-1a is computed the same way in numpy for many ids (`fnv1a_many`, a pass per byte position over
the ids still that long) and in Python for one (`fnv1a`); both are independent of the process
(unlike `hash()`), so an index built in one process serves another.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1
_CHUNK = 1 << 18  # ids hashed per numpy pass group (bounded temporaries)


def fnv1a(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & _MASK
    return h


def fnv1a_many(flat: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """uint64 FNV-1a of each byte string flat[ptr[i]:ptr[i + 1]]; work O(total bytes)."""
    n = len(ptr) - 1
    out = np.full(n, FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(FNV_PRIME)
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        start, lens = ptr[lo:hi], np.diff(ptr[lo : hi + 1])
        h = out[lo:hi]
        live = np.flatnonzero(lens > 0)
        j = 0
        while live.size:
            hv = h[live]
            hv ^= flat[start[live] + j]
            hv *= prime  # wraps modulo 2^64, as the Python form's mask
            h[live] = hv
            j += 1
            live = live[lens[live] > j]
    return out


def encode(ids: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
    """(flat uint8, ptr int64) of the ids' UTF-8 bytes."""
    return _pack([i.encode() for i in ids])


def _pack(enc: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(enc) + 1, dtype=np.int64)
    if enc:
        np.cumsum(np.fromiter(map(len, enc), dtype=np.int64, count=len(enc)), out=ptr[1:])
    return np.frombuffer(b"".join(enc), dtype=np.uint8), ptr


class IdColumn(Sequence):
    """Row -> id string over (flat, ptr) arrays: ids[row] decodes that row's bytes."""

    __slots__ = ("flat", "ptr")

    def __init__(self, flat: np.ndarray, ptr: np.ndarray):
        self.flat, self.ptr = flat, ptr

    @classmethod
    def of(cls, ids) -> "IdColumn":
        return ids if isinstance(ids, IdColumn) else cls(*encode(ids))

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def raw(self, row: int) -> bytes:
        return self.flat[self.ptr[row] : self.ptr[row + 1]].tobytes()

    def __getitem__(self, row):
        if isinstance(row, slice):
            return [self[r] for r in range(*row.indices(len(self)))]
        if row < 0:
            row += len(self)
        if not 0 <= row < len(self):
            raise IndexError(row)
        return self.raw(row).decode()

    def __iter__(self):
        data, ptr = self.flat.tobytes(), self.ptr.tolist()
        return (data[a:b].decode() for a, b in zip(ptr[:-1], ptr[1:]))

    def __repr__(self) -> str:
        return f"IdColumn({len(self)} ids)"


class DuplicateIdError(ValueError):
    def __init__(self, item_id: str):
        super().__init__(f"duplicate item id {item_id!r}")
        self.item_id = item_id


class IdIndex:
    """id -> row, or an id's rows ascending (an id replaced by updates has several), over an
    IdColumn: the base rows [0, base) by their sorted hashes, later changes in a dict. Shared along
    one line of catalog versions (`Catalog.appended`); `top` is the newest version's row count."""

    __slots__ = ("ids", "hashes", "rows", "base", "changed", "top")

    def __init__(self, ids: IdColumn, hashes: np.ndarray, rows: np.ndarray, changed: dict | None = None,
                 top: int | None = None):
        self.ids, self.hashes, self.rows = ids, hashes, rows
        self.base = len(rows)
        self.changed: dict[str, int | tuple] = changed if changed is not None else {}
        self.top = self.base if top is None else top

    @classmethod
    def build(cls, ids: IdColumn) -> "IdIndex":
        """The index of ids[0:len(ids)]; DuplicateIdError naming an id that is there twice."""
        h = fnv1a_many(ids.flat, ids.ptr)
        order = np.argsort(h, kind="stable")
        hs = h[order]
        for k in np.flatnonzero(hs[1:] == hs[:-1]).tolist():  # equal hashes: equal ids, or (rarely) a collision
            b = int(order[k + 1])
            raw = ids.raw(b)
            for r in order[int(np.searchsorted(hs, hs[k])) : k + 1].tolist():
                if ids.raw(r) == raw:
                    raise DuplicateIdError(ids[b])
        return cls(ids, hs, order.astype(np.int64))

    def _base_row(self, raw: bytes, h: int) -> int | None:
        hs = self.hashes
        i = int(np.searchsorted(hs, np.uint64(h)))
        while i < hs.size and int(hs[i]) == h:
            r = int(self.rows[i])
            if self.ids.raw(r) == raw:
                return r
            i += 1
        return None

    def get(self, item_id, default=None):
        if type(item_id) is not str:
            return default
        v = self.changed.get(item_id)
        if v is not None:
            return v
        raw = item_id.encode()
        r = self._base_row(raw, fnv1a(raw))
        return default if r is None else r

    def get_many(self, item_ids: Sequence[str]) -> list:
        """[get(i) for i in item_ids] (None for unknown), the hashes computed in numpy."""
        out = [None] * len(item_ids)
        look = []
        changed = self.changed
        for k, i in enumerate(item_ids):
            if type(i) is not str:
                continue
            v = changed.get(i)
            if v is not None:
                out[k] = v
            else:
                look.append(k)
        if not look:
            return out
        raws = [item_ids[k].encode() for k in look]
        hs = fnv1a_many(*_pack(raws))
        pos = np.minimum(np.searchsorted(self.hashes, hs), max(self.hashes.size - 1, 0))
        if self.hashes.size:
            hit = self.hashes[pos] == hs
            cand = self.rows[pos]
            for j in np.flatnonzero(hit).tolist():
                raw, r = raws[j], int(cand[j])
                out[look[j]] = r if self.ids.raw(r) == raw else self._base_row(raw, int(hs[j]))
        return out

    def __setitem__(self, item_id: str, v) -> None:
        self.changed[item_id] = v

    def __iter__(self):
        """Every id with a row (base ids first, in row order)."""
        changed = self.changed
        for _, i in zip(range(self.base), self.ids):
            if i not in changed:
                yield i
        yield from changed

    def branch(self, n: int) -> "IdIndex":
        """The index of the first n rows, for a version appended to from an older one (`top` > n):
        the base shared, the changes below n kept."""
        assert n >= self.base, "versions only add rows to the catalog they were loaded as"
        changed = {}
        for i, v in self.changed.items():
            if type(v) is int:
                if v < n:
                    changed[i] = v
            else:
                kept = tuple(r for r in v if r < n)
                if kept:
                    changed[i] = kept[0] if len(kept) == 1 else kept
        return IdIndex(self.ids, self.hashes, self.rows, changed, n)
