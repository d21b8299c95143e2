"""Item attributes held as columns, and the request filters that test them.

An attribute's values are all of one kind across the catalog: a string, a number, a bool, or a
list of strings ("strs"). An item may lack an attribute (or give null). Columns:

    str   codes int32 [N] (-1: absent) into `values`
    num   float64 [N] and `present` bool [N]
    bool  int8 [N] (-1: absent, 0, 1)
    strs  CSR: ptr int64 [N + 1], codes int32 [total] into `values`

A filter is `{attr: {op: value, ...}, ...}`, every predicate ANDed (a bare value is equality:
`{"genre": "drama"}` is `{"genre": {"eq": "drama"}}`, as MongoDB-style metadata filters read it):
`eq` (for a string list: contains), `in` / `not_in` (a list; for a string list: any / none in
common), `gt` `gte` `lt` `lte` (numbers). An item without the attribute fails `eq`, `in` and the
ranges and passes `not_in`. `evaluate` answers a bool [N] over the catalog, vectorised.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from sgrec.catalog.grow import Buf

KINDS = ("str", "num", "bool", "strs")
RANGE_OPS = {"gt": np.greater, "gte": np.greater_equal, "lt": np.less, "lte": np.less_equal}
OPS = ("eq", "in", "not_in", *RANGE_OPS)


_EXACT_KIND = {str: "str", int: "num", bool: "bool"}  # kind_of's answer for values of exactly these types


def kind_of(value) -> str | None:
    """The attribute kind of a value (None for null); ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not np.isfinite(value):
            raise ValueError("must be a finite number")
        return "num"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "strs"
    raise ValueError("must be a string, a number, a bool or a list of strings")


def take_ragged(ptr: np.ndarray, flat: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a ragged array (CSR: `flat[ptr[r]:ptr[r + 1]]` is row r), in the order of `rows`:
    (new ptr, new flat), vectorised."""
    rows = np.asarray(rows, dtype=np.int64)
    lens = ptr[rows + 1] - ptr[rows]
    new_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=new_ptr[1:])
    idx = np.arange(int(new_ptr[-1]), dtype=np.int64) + np.repeat(ptr[rows] - new_ptr[:-1], lens)
    return new_ptr, flat[idx]


@dataclass
class AttrColumn:
    kind: str
    n: int
    data: np.ndarray  # str: codes; num: values; bool: int8; strs: codes (flat)
    present: np.ndarray | None = None  # num
    ptr: np.ndarray | None = None  # strs
    values: list[str] = field(default_factory=list)  # str / strs vocabulary (append-only, shared by versions)
    _code: dict[str, int] | None = None
    _flat_rows: np.ndarray | None = None
    _bufs: dict | None = None  # part -> Buf: the storage later versions append to (grow.py)

    def code(self, s: str) -> int:
        if self._code is None:
            self._code = {v: i for i, v in enumerate(self.values)}
        return self._code.get(s, -1)

    def value(self, row: int):
        """The attribute of one row (None: absent)."""
        if self.kind == "str":
            c = int(self.data[row])
            return None if c < 0 else self.values[c]
        if self.kind == "num":
            if not self.present[row]:
                return None
            v = float(self.data[row])
            return int(v) if v.is_integer() and abs(v) < 2**53 else v
        if self.kind == "bool":
            b = int(self.data[row])
            return None if b < 0 else bool(b)
        if not self.present[row]:
            return None
        return [self.values[c] for c in self.data[int(self.ptr[row]) : int(self.ptr[row + 1])]]

    def flat_rows(self) -> np.ndarray:
        if self._flat_rows is None:
            self._flat_rows = np.repeat(np.arange(self.n, dtype=np.int64), np.diff(self.ptr))
        return self._flat_rows

    # ---- predicates -------------------------------------------------------------------------
    def isin(self, wanted: list) -> np.ndarray:
        """Rows whose value is (str/num/bool) or holds (strs) one of `wanted`."""
        if self.kind in ("str", "strs"):
            codes = np.array([c for c in (self.code(w) for w in wanted) if c >= 0], dtype=np.int32)
            if self.kind == "str":
                return np.isin(self.data, codes)
            out = np.zeros(self.n, dtype=bool)
            out[self.flat_rows()[np.isin(self.data, codes)]] = True
            return out
        if self.kind == "num":
            return np.isin(self.data, np.array(wanted, dtype=np.float64)) & self.present
        return np.isin(self.data, np.array([int(w) for w in wanted], dtype=np.int8))

    def range(self, op: str, bound: float) -> np.ndarray:
        return RANGE_OPS[op](self.data, bound) & self.present

    # ---- new columns from old (catalog updates) ---------------------------------------------
    @classmethod
    def absent(cls, kind: str, n: int) -> "AttrColumn":
        """A column of `kind` over n rows that no row has."""
        if kind == "num":
            return cls("num", n, np.zeros(n, np.float64), present=np.zeros(n, bool))
        if kind == "strs":
            return cls("strs", n, np.zeros(0, np.int32), present=np.zeros(n, bool), ptr=np.zeros(n + 1, np.int64))
        return cls(kind, n, np.full(n, -1, np.int32 if kind == "str" else np.int8))

    def take(self, rows: np.ndarray) -> "AttrColumn":
        """The column of these rows, in this order (the vocabulary kept as it is)."""
        n = len(rows)
        if self.kind == "strs":
            ptr, flat = take_ragged(self.ptr, self.data, rows)
            return AttrColumn("strs", n, flat, present=self.present[rows], ptr=ptr, values=self.values)
        present = None if self.present is None else self.present[rows]
        return AttrColumn(self.kind, n, self.data[rows], present=present, values=self.values)

    def with_room(self, spare: float) -> "AttrColumn":
        """This column in storage that `append` extends in place (Catalog.with_room)."""
        if self._bufs is not None:
            return self
        bufs = {p: Buf.roomy(getattr(self, p), spare) for p in ("data", "present", "ptr") if getattr(self, p) is not None}
        views = {p: b.view(b.used) for p, b in bufs.items()}
        values = list(self.values)
        return AttrColumn(self.kind, self.n, views["data"], present=views.get("present"), ptr=views.get("ptr"),
                          values=values, _code={v: i for i, v in enumerate(values)}, _bufs=bufs)

    def append(self, other: "AttrColumn") -> "AttrColumn":
        """This column's rows, then `other`'s (of the same kind), as a new column that shares this
        one's storage (grow.py: O(len(other)) when this column is the newest of its storage).
        other's strings are coded in the storage's vocabulary, new strings appended to it."""
        if self._bufs is None:  # the first append: storage (and a vocabulary) of this column's own
            return self.with_room(0.5).append(other)
        n, k = self.n, other.n
        values, code, bufs = self.values, self._code, self._bufs
        more = {"data": other.data, "present": other.present}
        if self.kind in ("str", "strs"):
            remap = []
            for v in other.values:
                c = code.get(v)
                if c is None:
                    c = code[v] = len(values)
                    values.append(v)
                remap.append(c)
            remap = np.array(remap or [0], dtype=np.int32)
            more["data"] = np.where(other.data >= 0, remap[np.maximum(other.data, 0)], -1).astype(np.int32)
        size = {"data": n, "present": n}
        if self.kind == "strs":
            more["ptr"] = other.ptr[1:] + self.ptr[-1]
            size = {"data": int(self.ptr[-1]), "present": n, "ptr": n + 1}
        out = {part: buf.append(size[part], more[part]) for part, buf in bufs.items()}
        views = {part: out[part].view(size[part] + len(more[part])) for part in out}
        return AttrColumn(self.kind, n + k, views["data"], present=views.get("present"), ptr=views.get("ptr"),
                          values=values, _code=code, _bufs=out)

    def concat(self, other: "AttrColumn") -> "AttrColumn":
        """This column's rows, then `other`'s (of the same kind); other's strings recoded into this
        column's vocabulary, new strings appended to it."""
        n = self.n + other.n
        if self.kind in ("str", "strs"):
            values = list(self.values)
            code = {v: i for i, v in enumerate(values)}
            remap = np.array([code.setdefault(v, len(code)) for v in other.values] or [0], dtype=np.int32)
            values = list(code)
            theirs = np.where(other.data >= 0, remap[np.maximum(other.data, 0)], -1).astype(np.int32)
            if self.kind == "str":
                return AttrColumn("str", n, np.concatenate([self.data, theirs]), values=values)
            ptr = np.concatenate([self.ptr, other.ptr[1:] + self.ptr[-1]])
            return AttrColumn("strs", n, np.concatenate([self.data, theirs]),
                              present=np.concatenate([self.present, other.present]), ptr=ptr, values=values)
        present = None if self.present is None else np.concatenate([self.present, other.present])
        return AttrColumn(self.kind, n, np.concatenate([self.data, other.data]), present=present)


class AttrTable:
    """The catalog's attribute columns (name -> AttrColumn) over N rows."""

    def __init__(self, n: int, columns: dict[str, AttrColumn] | None = None):
        self.n = n
        self.columns = columns or {}

    def row(self, i: int) -> dict:
        out = {}
        for name, col in self.columns.items():
            v = col.value(i)
            if v is not None:
                out[name] = v
        return out

    def check(self, spec) -> list[tuple[str, str, object]]:
        """The (attribute, op, value) predicates of a request filter; ValueError naming the field
        (`filter.<attr>.<op>`) for anything malformed or for an attribute no item has."""
        if not isinstance(spec, dict):
            raise ValueError("filter must be an object: {attribute: {op: value}}")
        out = []
        for name, pred in spec.items():
            where = f"filter.{name}"
            col = self.columns.get(name)
            if col is None:
                raise ValueError(f"{where}: no catalog item has the attribute {name!r}")
            if kind_of_or_none(pred) in ("str", "num", "bool"):
                pred = {"eq": pred}  # a bare value: equality
            if not isinstance(pred, dict):  # {} has no predicate: every item passes, as an empty AND
                raise ValueError(f"{where} must be a string, a number, a bool (equality) or an object of "
                                 f"predicates ({', '.join(OPS)})")
            for op, v in pred.items():
                out.append((name, op, _check_pred(f"{where}.{op}", col, op, v)))
        return out

    def present_rows(self) -> np.ndarray:
        """bool [N]: rows that have at least one attribute."""
        out = np.zeros(self.n, dtype=bool)
        for col in self.columns.values():
            out |= col.present if col.present is not None else col.data >= 0
        return out

    def take(self, rows: np.ndarray) -> "AttrTable":
        return AttrTable(len(rows), {name: col.take(rows) for name, col in self.columns.items()})

    def check_kinds(self, other: "AttrTable") -> None:
        """ValueError naming an attribute that `other` holds as another kind than this table."""
        for name, b in other.columns.items():
            a = self.columns.get(name)
            if a is not None and a.kind != b.kind:
                raise ValueError(f"attrs.{name} is {b.kind} here but {a.kind} in the catalog; one kind per attribute")

    def _joined(self, other: "AttrTable", join) -> "AttrTable":
        self.check_kinds(other)
        cols = {}
        for name in [*self.columns, *(k for k in other.columns if k not in self.columns)]:
            a, b = self.columns.get(name), other.columns.get(name)
            a = a if a is not None else AttrColumn.absent(b.kind, self.n)  # a new attribute: O(N), once
            b = b if b is not None else AttrColumn.absent(a.kind, other.n)
            cols[name] = join(a, b)
        return AttrTable(self.n + other.n, cols)

    def concat(self, other: "AttrTable") -> "AttrTable":
        """This table's rows, then `other`'s, copied; ValueError naming an attribute whose kinds differ."""
        return self._joined(other, AttrColumn.concat)

    def append(self, other: "AttrTable") -> "AttrTable":
        """concat, sharing this table's storage (AttrColumn.append); check_kinds first."""
        return self._joined(other, AttrColumn.append)

    def evaluate(self, spec) -> np.ndarray:
        """bool [N]: the rows that pass every predicate of the filter (checked first)."""
        ok = np.ones(self.n, dtype=bool)
        for name, op, v in self.check(spec):
            col = self.columns[name]
            if op == "eq":
                ok &= col.isin([v])
            elif op == "in":
                ok &= col.isin(v)
            elif op == "not_in":
                ok &= ~col.isin(v)
            else:
                ok &= col.range(op, float(v))
        return ok


def _check_pred(where: str, col: AttrColumn, op: str, v):
    want = {"str": "a string", "strs": "a string", "num": "a number", "bool": "a bool"}[col.kind]

    def scalar_ok(x) -> bool:
        k = kind_of_or_none(x)
        return k in ("str", "num", "bool") and (k == col.kind or (col.kind == "strs" and k == "str"))

    if op not in OPS:
        raise ValueError(f"{where}: unknown predicate {op!r}; use one of {', '.join(OPS)}")
    if op == "eq":
        if not scalar_ok(v):
            raise ValueError(f"{where} must be {want} (the attribute is {col.kind})")
        return v
    if op in ("in", "not_in"):
        if not isinstance(v, list) or not all(scalar_ok(x) for x in v):
            raise ValueError(f"{where} must be a list of {want.split(' ', 1)[1]}s (the attribute is {col.kind})")
        return v
    if col.kind != "num":
        raise ValueError(f"{where}: a range needs a numeric attribute; {where.split('.')[1]!r} is {col.kind}")
    if kind_of_or_none(v) != "num":
        raise ValueError(f"{where} must be a number")
    return v


def kind_of_or_none(x) -> str | None:
    try:
        return kind_of(x)
    except ValueError:
        return None


class _Growing:
    """One attribute's values as they arrive: rows and values in C arrays (no Python object per
    value: a 10^7-item catalog's attributes stay a few bytes per value while loading). While every
    row from 0 on has a value, the rows are only counted (`dense`), and a column whose every row has
    one becomes its values' own array, uncopied."""

    def __init__(self, kind: str):
        self.kind = kind
        self.rows: array | None = None  # None: rows 0 .. dense - 1, each with a value
        self.dense = 0
        self.data = array({"num": "d", "bool": "b", "str": "i", "strs": "i"}[kind])
        self.lens = array("q") if kind == "strs" else None
        self.code: dict[str, int] = {}

        self.add = {"str": self._add_str, "strs": self._add_strs}.get(kind, self._add_value)  # one call per value

    def _row(self, row: int) -> None:
        if self.rows is None:
            if row == self.dense:
                self.dense += 1
                return
            self._spread()
        self.rows.append(row)

    def _spread(self) -> None:
        """From counted rows to listed ones (a row without a value came)."""
        self.rows = array("q")
        self.rows.frombytes(np.arange(self.dense, dtype=np.int64).tobytes())

    def add_rows(self, rows: np.ndarray) -> None:
        """Many rows at once (ascending, after those before)."""
        if self.rows is None:
            if len(rows) == 0 or (rows[0] == self.dense and rows[-1] == self.dense + len(rows) - 1):
                self.dense += len(rows)  # ascending and distinct: the first and last say it is a run
                return
            self._spread()
        self.rows.frombytes(np.ascontiguousarray(rows, dtype=np.int64).tobytes())

    def _add_str(self, row: int, v: str) -> None:
        self._row(row)
        self.data.append(self.code.setdefault(v, len(self.code)))

    def _add_strs(self, row: int, v: list[str]) -> None:
        self._row(row)
        self.lens.append(len(v))
        self.data.extend(self.code.setdefault(x, len(self.code)) for x in v)

    def _add_value(self, row: int, v) -> None:
        self._row(row)
        self.data.append(v)

    def column(self, n: int) -> AttrColumn:
        every = self.rows is None and self.dense == n  # every row has a value
        if self.rows is None:
            rows = np.arange(self.dense, dtype=np.int64)
        else:
            rows = np.frombuffer(self.rows, dtype=np.int64) if self.rows else np.zeros(0, np.int64)
        vals = np.frombuffer(self.data, dtype=self.data.typecode) if self.data else \
            np.zeros(0, {"d": np.float64, "b": np.int8, "i": np.int32}[self.data.typecode])
        values = list(self.code)  # code order: first seen
        if self.kind == "num":
            if every:
                return AttrColumn("num", n, vals, present=np.ones(n, dtype=bool))
            data, present = np.zeros(n, dtype=np.float64), np.zeros(n, dtype=bool)
            data[rows], present[rows] = vals, True
            return AttrColumn("num", n, data, present=present)
        if self.kind in ("bool", "str"):
            if every:
                data = vals
            else:  # scattered into the column, -1 where absent
                data = np.full(n, -1, dtype=vals.dtype)
                data[rows] = vals
            if self.kind == "bool":
                return AttrColumn("bool", n, data)
            return AttrColumn("str", n, data, values=values, _code=self.code)
        lens = np.zeros(n, dtype=np.int64)
        lens[rows] = np.frombuffer(self.lens, dtype=np.int64) if self.lens else np.zeros(0, np.int64)
        ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=ptr[1:])
        present = np.zeros(n, dtype=bool)
        present[rows] = True
        if not np.all(np.diff(rows) > 0):  # rows arrive ascending from every loader; keep it so
            raise ValueError("attribute rows must be added in ascending order")
        return AttrColumn("strs", n, vals, present=present, ptr=ptr, values=values, _code=self.code)


class AttrBuilder:
    """Collects attributes row by row (`add`, rows ascending), then `build()` makes the columns."""

    def __init__(self):
        self.cols: dict[str, _Growing] = {}

    def add(self, row: int, attrs) -> None:
        if not isinstance(attrs, dict):
            raise ValueError("'attrs' must be a flat object")
        for name, v in attrs.items():
            k = _EXACT_KIND.get(type(v))  # the common types without kind_of's checks (10^7-item loads)
            if k is None:
                try:
                    k = kind_of(v)
                except ValueError as e:
                    raise ValueError(f"attrs.{name} {e}") from None
                if k is None:
                    continue
            col = self.cols.get(name)
            if col is None:
                col = self.cols[name] = _Growing(k)
            elif col.kind != k:
                raise ValueError(f"attrs.{name} is {k} here but {col.kind} in earlier items; one kind per attribute")
            col.add(row, v)

    def add_column(self, name: str, kind: str, rows: np.ndarray, data: np.ndarray, vocab: list[str] | None = None,
                   lens: np.ndarray | None = None) -> None:
        """One attribute's values for many rows at once (rows ascending, after the rows added to it
        before): num float64 values, bool 0 / 1, str codes into `vocab`, strs flat codes into `vocab`
        and each row's count (`lens`). A columnar source's path (Parquet): no Python object a value."""
        col = self.cols.get(name)
        if col is None:
            col = self.cols[name] = _Growing(kind)
        elif col.kind != kind:
            raise ValueError(f"attrs.{name} is {kind} here but {col.kind} in earlier items; one kind per attribute")
        col.add_rows(rows)
        if vocab is not None:
            remap = np.array([col.code.setdefault(v, len(col.code)) for v in vocab], dtype=np.int32)
            data = remap[np.asarray(data, dtype=np.int64)] if len(data) else np.zeros(0, np.int32)
        dtype = {"num": np.float64, "bool": np.int8, "str": np.int32, "strs": np.int32}[kind]
        col.data.frombytes(np.ascontiguousarray(data, dtype=dtype).tobytes())
        if lens is not None:
            col.lens.frombytes(np.ascontiguousarray(lens, dtype=np.int64).tobytes())

    def build(self, n: int) -> AttrTable:
        return AttrTable(n, {name: g.column(n) for name, g in self.cols.items()})
