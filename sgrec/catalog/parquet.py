"""The item catalog as a Parquet file (Spark, BigQuery and pandas exports), read with pyarrow one row
group at a time straight into the catalog's columns.

Columns, named as the JSON Lines keys (`jsonl.py`): `id` (string, required), `token_ids` (a list of
integers) or `text` (a string, tokenized at load): exactly one of them a row, `id_token` (an integer,
or a string the tokenizer maps to one token), `semantic_id` (a list of integers, the same length on
every row that has one), `attrs` (a struct of attributes: strings, numbers, booleans, lists of
strings) and `meta` (a JSON object as a string: the item's other fields). Without an `attrs` column
the remaining columns are the attributes; with one, they are the items' other fields (`meta`), as a
JSON Lines item's other keys. Null is absent, as in JSON Lines. A column of the wrong type is an
error naming it; a bad row, an error naming the row and its item.

Rows whose tokens are `token_ids` are read without a Python object per token: the lists' offsets and
values are the catalog's own columns. `write` gives the form `load` reads back as the same catalog
(`python -m sgrec.catalog convert IN OUT.parquet`).
"""

from __future__ import annotations

from array import array

import numpy as np
import orjson

from sgrec.catalog.attrs import AttrBuilder
from sgrec.catalog.ids import IdColumn
from sgrec.catalog.item import CatalogError, check_token_ids
from sgrec.catalog.jsonl import _encode_text
from sgrec.catalog.store import Catalog
from sgrec.catalog.sid import MissingCode

MAGIC = b"PAR1"
BATCH = 1 << 16  # rows decoded at a time (a row group streams in batches: arrow's memory stays a batch's)
KNOWN = ("id", "text", "token_ids", "id_token", "semantic_id", "attrs", "meta")


def is_parquet(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _arrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CatalogError("a Parquet item catalog needs pyarrow (pip install 'sgrec[parquet]')") from None
    return pa, pq


def _check_schema(pa, schema, path: str) -> None:
    """A CatalogError naming the first known column whose type is not the one it must have."""
    types = pa.types

    def ints(t) -> bool:
        return (types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t)) and types.is_integer(t.value_type)

    want = {"id": (types.is_string, "a string"), "text": (types.is_string, "a string"),
            "token_ids": (ints, "a list of integers"), "semantic_id": (ints, "a list of integers"),
            "id_token": (lambda t: types.is_integer(t) or types.is_string(t), "an integer or a string"),
            "attrs": (types.is_struct, "a struct of attributes"), "meta": (types.is_string, "a JSON object as a string")}
    if "id" not in schema.names:
        raise CatalogError(f"{path}: no 'id' column (columns: {', '.join(schema.names)})")
    if "text" not in schema.names and "token_ids" not in schema.names:
        raise CatalogError(f"{path}: no 'token_ids' or 'text' column")
    for name in schema.names:
        if name in want:
            ok, what = want[name]
            t = schema.field(name).type
            if not ok(t) and not (name in ("id", "text", "meta") and types.is_large_string(t)):
                raise CatalogError(f"{path}: column {name!r} is {t}, it must be {what}")


def _append(buf: array, values: np.ndarray) -> None:
    """values appended to a growing C array of their item size (no Python object a value)."""
    buf.frombytes(np.ascontiguousarray(values, dtype={"i": np.int32, "q": np.int64, "b": np.int8}[buf.typecode])
                  .tobytes())


class _Columns:
    """The catalog's columns, grown a batch of rows at a time in C arrays (viewed, not copied, at the end)."""

    def __init__(self, path: str, tokenizer, vocab_size: int | None, sid_tokens=None):
        self.path, self.tokenizer, self.vocab_size, self.sid = path, tokenizer, vocab_size, sid_tokens
        self.id_data, self.id_ptr = bytearray(), array("q", [0])
        self.tok_flat, self.tok_ptr = array("i"), array("q", [0])
        self.id_tokens, self.sem, self.has = array("q"), array("i"), array("b")
        self.nd: int | None = None
        self.attrs = AttrBuilder()
        self.meta: dict[int, dict] = {}
        self.rows = 0

    def fail(self, ids, i: int, what: str):
        raise CatalogError(f"{self.path}: row {self.rows + i} (item {ids[i].as_py()!r}): {what}")

    def add(self, table, attr_names: list[str], meta_names: list[str]) -> None:
        pa = _arrow()[0]
        n = table.num_rows
        ids = _whole(table.column("id")).cast(pa.large_string())
        if ids.null_count:
            raise CatalogError(f"{self.path}: row {self.rows + _first(ids.is_null())}: 'id' is null")
        offs = np.frombuffer(ids.buffers()[1], np.int64, n + 1, ids.offset * 8)
        if (np.diff(offs) == 0).any():
            raise CatalogError(f"{self.path}: row {self.rows + int(np.flatnonzero(np.diff(offs) == 0)[0])}: "
                               f"'id' must be a non-empty string")
        _append(self.id_ptr, offs[1:] - offs[0] + len(self.id_data))
        self.id_data += memoryview(ids.buffers()[2])[offs[0]:offs[-1]]
        self._tokens(table, ids)
        self._id_tokens(table, ids)
        self._semantic(table, ids)
        if "attrs" in table.column_names:  # a null struct: every field null
            struct = _whole(table.column("attrs"))
            for f, child in zip(struct.type, struct.flatten()):
                self._attr(f.name, child)
        for name in attr_names:
            self._attr(name, _whole(table.column(name)))
        self._meta(table, meta_names, ids)
        self.rows += n

    def _tokens(self, table, ids) -> None:
        n = table.num_rows
        has_ids = "token_ids" in table.column_names
        toks = _whole(table.column("token_ids")) if has_ids else None
        text = _whole(table.column("text")) if "text" in table.column_names else None
        tok_valid = toks.is_valid().to_numpy(False) if toks is not None else np.zeros(n, bool)
        text_valid = text.is_valid().to_numpy(False) if text is not None else np.zeros(n, bool)
        if (tok_valid == text_valid).any():
            self.fail(ids, int(np.flatnonzero(tok_valid == text_valid)[0]), "give exactly one of 'text' and 'token_ids'")
        if tok_valid.all():  # every row by token ids: the list's own offsets and values
            offs, vals = _list_parts(toks)
            if (np.diff(offs) == 0).any():
                self.fail(ids, int(np.flatnonzero(np.diff(offs) == 0)[0]), "'token_ids' must be a non-empty list")
            self._range(vals, offs, ids, "token_ids")
            _append(self.tok_ptr, offs[1:] + self.tok_ptr[-1])
            _append(self.tok_flat, vals)
            return
        lists = toks.to_pylist() if toks is not None else [None] * n
        texts = text.to_pylist()
        rows = []
        for i in range(n):
            if lists[i] is not None:
                try:
                    if not lists[i] or any(t is None for t in lists[i]):
                        raise ValueError("'token_ids' must be a non-empty list of token ids")
                    rows.append(check_token_ids(lists[i], "'token_ids'", self.vocab_size))
                except ValueError as e:
                    self.fail(ids, i, str(e))
            else:
                try:
                    rows.append(_encode_text(texts[i], ids[i].as_py(), self.tokenizer))
                except ValueError as e:
                    raise CatalogError(f"{self.path}: row {self.rows + i}: {e}") from None
        _append(self.tok_ptr, np.cumsum([len(r) for r in rows]) + self.tok_ptr[-1])
        _append(self.tok_flat, np.fromiter((t for r in rows for t in r), np.int32))

    def _range(self, vals: np.ndarray, offs: np.ndarray, ids, name: str) -> None:
        bad = np.flatnonzero((vals < 0) | ((vals >= self.vocab_size) if self.vocab_size else False))
        if bad.size:
            i = int(np.searchsorted(offs, bad[0], side="right")) - 1
            self.fail(ids, i, f"'{name}' holds {int(vals[bad[0]])}, not a token id in [0, {self.vocab_size})")

    def _id_tokens(self, table, ids) -> None:
        n = table.num_rows
        if "id_token" not in table.column_names:
            _append(self.id_tokens, np.full(n, -1, np.int64))
            return
        col = _whole(table.column("id_token"))
        valid = col.is_valid().to_numpy(False)
        if _arrow()[0].types.is_integer(col.type):
            out = col.fill_null(-1).to_numpy().astype(np.int64)
            bad = np.flatnonzero(valid & ((out < 0) | ((out >= self.vocab_size) if self.vocab_size else False)))
            if bad.size:
                self.fail(ids, int(bad[0]), f"'id_token' {int(out[bad[0]])} is not a token id in [0, {self.vocab_size})")
        else:
            out = np.full(n, -1, np.int64)
            for i, s in enumerate(col.to_pylist()):
                if s is not None:
                    got = self.tokenizer.encode(s, add_special_tokens=False) if self.tokenizer is not None else None
                    if got is None or len(got) != 1:
                        self.fail(ids, i, f"id_token {s!r} is not one token" + ("" if self.tokenizer else
                                                                                  " (a string needs a tokenizer)"))
                    try:
                        out[i] = check_token_ids(got, "'id_token'", self.vocab_size)[0]
                    except ValueError as e:
                        self.fail(ids, i, str(e))
        _append(self.id_tokens, out)

    def _semantic(self, table, ids) -> None:
        n = table.num_rows
        if "semantic_id" not in table.column_names:
            _append(self.has, np.zeros(n, np.int8))
            return
        col = _whole(table.column("semantic_id"))
        valid = col.is_valid().to_numpy(False)
        offs, vals = _list_parts(col)
        lens = np.diff(offs)
        if valid.any():
            nd = self.nd if self.nd is not None else int(lens[valid][0])
            bad = np.flatnonzero(valid & (lens != nd))
            if bad.size or nd == 0:
                i = int(bad[0]) if bad.size else int(np.flatnonzero(valid)[0])
                self.fail(ids, i, f"semantic_id has {int(lens[i])} tokens, " + (
                    f"earlier items {nd}" if self.nd is not None or bad.size else "it must have some"))
            self.nd = nd
            starts = offs[:-1][valid]
            if self.sid is not None:  # codes per level: their tokens
                try:
                    block = self.sid.to_tokens(vals[starts[:, None] + np.arange(nd)[None, :]])
                except MissingCode as e:
                    self.fail(ids, int(np.flatnonzero(valid)[e.row]), str(e))
                offs, vals = np.arange(n + 1, dtype=np.int64) * nd, np.full((n, nd), 0, np.int64)
                vals[valid] = block
                vals = vals.reshape(-1)
                starts = offs[:-1][valid]
            self._range(vals, offs, ids, "semantic_id")
            _append(self.sem, vals[starts[:, None] + np.arange(nd)[None, :]])
        _append(self.has, valid)

    def _attr(self, name: str, col) -> None:
        """One attribute's column over the row group (null: absent), its values added as columns."""
        pa = _arrow()[0]
        import pyarrow.compute as pc

        if pa.types.is_dictionary(col.type):  # pandas' categoricals
            col = col.cast(col.type.value_type)
        t = col.type
        valid = col.is_valid().to_numpy(False)
        rows = self.rows + np.flatnonzero(valid)
        col = col.filter(pa.array(valid)) if col.null_count else col
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            vals = col.to_numpy().astype(np.float64)
            if not np.isfinite(vals).all():
                raise CatalogError(f"{self.path}: row {int(rows[np.flatnonzero(~np.isfinite(vals))[0]])}: "
                                   f"attrs.{name} must be a finite number")
            self._attrs_add(name, "num", rows, vals)
        elif pa.types.is_boolean(t):
            self._attrs_add(name, "bool", rows, col.to_numpy(False).astype(np.int8))
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            enc = pc.dictionary_encode(col)
            self._attrs_add(name, "str", rows, enc.indices.to_numpy(False), enc.dictionary.to_pylist())
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
                pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)):
            offs = col.offsets.to_numpy().astype(np.int64)
            values = col.values.slice(int(offs[0]), int(offs[-1] - offs[0]))
            if values.null_count:
                raise CatalogError(f"{self.path}: attribute column {name!r} holds a null inside a list")
            enc = pc.dictionary_encode(values)
            self._attrs_add(name, "strs", rows, enc.indices.to_numpy(False), enc.dictionary.to_pylist(), np.diff(offs))
        else:
            raise CatalogError(f"{self.path}: attribute column {name!r} is {t}; an attribute is a string, a number, "
                               f"a bool or a list of strings")

    def _attrs_add(self, name: str, kind: str, rows: np.ndarray, data, vocab=None, lens=None) -> None:
        try:
            self.attrs.add_column(name, kind, rows, data, vocab, lens)
        except ValueError as e:
            raise CatalogError(f"{self.path}: row {int(rows[0])}: {e}") from None

    def _meta(self, table, names: list[str], ids) -> None:
        if "meta" in table.column_names:
            for i, s in enumerate(_whole(table.column("meta")).to_pylist()):
                if s is not None:
                    try:
                        obj = orjson.loads(s)
                    except orjson.JSONDecodeError:
                        obj = None
                    if not isinstance(obj, dict):
                        self.fail(ids, i, "'meta' must be a JSON object")
                    self.meta.setdefault(self.rows + i, {}).update(obj)
        if names:
            cols = {name: _whole(table.column(name)).to_pylist() for name in names}
            for i in range(table.num_rows):
                extra = {name: c[i] for name, c in cols.items() if c[i] is not None}
                if extra:
                    self.meta.setdefault(self.rows + i, {}).update(extra)

    def finish(self) -> Catalog:
        if not self.rows:
            raise CatalogError(f"item catalog {self.path!r} has no items")
        ids = IdColumn(np.frombuffer(self.id_data, np.uint8), np.frombuffer(self.id_ptr, np.int64))
        has = np.frombuffer(self.has, np.int8).astype(bool)
        sem = None
        if self.nd is not None:
            given = np.frombuffer(self.sem, np.int32).reshape(-1, self.nd)
            if given.shape[0] == self.rows:  # every item has one: the array itself
                sem = given
            else:
                sem = np.full((self.rows, self.nd), -1, np.int32)
                sem[has] = given
        try:
            attrs = self.attrs.build(self.rows)
        except ValueError as e:
            raise CatalogError(f"{self.path}: {e}") from None
        tokens = np.frombuffer(self.tok_flat, np.int32) if len(self.tok_flat) else np.zeros(0, np.int32)
        return Catalog.from_columns(ids, tokens, np.frombuffer(self.tok_ptr, np.int64),
                                    np.frombuffer(self.id_tokens, np.int64), sem, has, attrs, self.meta)


def _whole(column):
    """A chunked column as one array."""
    return column.combine_chunks() if hasattr(column, "combine_chunks") else column


def _first(mask) -> int:
    return int(np.flatnonzero(mask.to_numpy(False))[0])


def _list_parts(col) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n + 1] from 0, values) of a list column of integers; a null list is empty."""
    pa = _arrow()[0]
    if pa.types.is_fixed_size_list(col.type):
        col = col.cast(pa.large_list(col.type.value_type))
    offs = col.offsets.to_numpy().astype(np.int64)
    values = col.values.slice(int(offs[0]), int(offs[-1] - offs[0]))
    offs = offs - offs[0]
    if col.null_count:  # a null slot's offsets may span values: none of them are the row's
        lens = np.diff(offs) * col.is_valid().to_numpy(False)
        keep = np.repeat(col.is_valid().to_numpy(False), np.diff(offs))
        values = values.filter(pa.array(keep))
        offs = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offs[1:])
    if values.null_count:
        raise CatalogError("a list of token ids holds a null")
    return offs, values.to_numpy().astype(np.int64)


def _attr_array(pa, col):
    """An attribute column as an arrow array (absent: null)."""
    if col.kind == "num":
        return pa.array(col.data, mask=~col.present)
    if col.kind == "bool":
        return pa.array(col.data == 1, mask=col.data < 0)
    values = pa.array(col.values, pa.large_string())
    if col.kind == "str":
        return values.take(pa.array(col.data, mask=col.data < 0))
    ptr = col.ptr.astype(np.int64)
    flat = values.take(pa.array(col.data[ptr[0]:ptr[-1]]))
    return pa.LargeListArray.from_arrays(pa.array(ptr - ptr[0]), flat, mask=pa.array(~col.present))


def load(path: str, tokenizer=None, vocab_size: int | None = None, progress: bool = False,
         sid_tokens=None) -> Catalog:
    """Reads a Parquet catalog a batch of rows at a time, with a progress bar over its rows;
    `sid_tokens` (sgrec.catalog.sid.SidTokens): semantic IDs are codes, mapped to tokens."""
    from tqdm import tqdm

    pa, pq = _arrow()
    try:
        f = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise CatalogError(f"cannot read Parquet item catalog {path!r}: {e}") from None
    schema = f.schema_arrow
    _check_schema(pa, schema, path)
    rest = [n for n in schema.names if n not in KNOWN]
    attr_names, meta_names = ([], rest) if "attrs" in schema.names else (rest, [])
    cols = _Columns(path, tokenizer, vocab_size, sid_tokens)
    with tqdm(total=f.metadata.num_rows, unit="item", unit_scale=True, desc="item catalog", disable=not progress) as bar:
        for batch in f.iter_batches(batch_size=BATCH):
            cols.add(batch, attr_names, meta_names)
            bar.update(batch.num_rows)
    pa.default_memory_pool().release_unused()  # the batches' buffers back to the system
    return cols.finish()


def write(catalog: Catalog, path: str, row_group_size: int = 1 << 20) -> None:
    """The catalog's live rows as a Parquet file `load` reads back as the same catalog: token ids as
    lists, attributes as the `attrs` struct, the other fields as `meta` (JSON)."""
    pa, pq = _arrow()
    cat = catalog.compacted()
    n = len(cat)
    iptr, tptr = cat.ids.ptr.astype(np.int64), cat.token_ptr.astype(np.int64)
    ids = pa.LargeStringArray.from_buffers(n, pa.py_buffer(iptr - iptr[0]),
                                           pa.py_buffer(np.ascontiguousarray(cat.ids.flat[iptr[0]:iptr[-1]])))
    tokens = pa.LargeListArray.from_arrays(pa.array(tptr - tptr[0]), pa.array(cat.token_flat[tptr[0]:tptr[-1]]))
    columns = {"id": ids, "token_ids": tokens,
               "id_token": pa.array(cat.id_tokens, mask=cat.id_tokens < 0)}
    if cat.semantic_ids is not None:
        nd = cat.semantic_ids.shape[1]
        sem = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * nd),
                                       pa.array(cat.semantic_ids.reshape(-1)), mask=pa.array(~cat.has_semantic))
        columns["semantic_id"] = sem
    if cat.attrs.columns:
        names = list(cat.attrs.columns)
        columns["attrs"] = pa.StructArray.from_arrays([_attr_array(pa, cat.attrs.columns[k]) for k in names],
                                                      names=names)
    if cat.meta:
        columns["meta"] = pa.array([orjson.dumps(cat.meta[i]).decode() if i in cat.meta else None for i in range(n)],
                                   type=pa.large_string())
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
