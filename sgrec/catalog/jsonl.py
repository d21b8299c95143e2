"""Loading the item catalog from JSON Lines, one item per line, straight into columns.

Each line: `{"id": "i1", "text": "..." | "token_ids": [...], "id_token": 17, "semantic_id": [3, 9, 1],
"attrs": {"genre": ["Comedy"], "year": 1995}}`. Only `id` and the tokens are required:
`id_token` (an int token id, or a string the tokenizer maps to exactly one token) is needed to
rank the item by id token, `semantic_id` (ND token ids, the same ND for every item that has one)
to retrieve it or rank it by semantic ID, `attrs` (a flat object of string / number / bool /
string-list values) for request filters. Other keys (title, year, ...) are kept as the item's
`meta`. A bad line is a start-up error naming the file and line.
"""

from __future__ import annotations

import os
from array import array

import numpy as np
import orjson

from sgrec.catalog.attrs import AttrBuilder
from sgrec.catalog.item import CatalogError, Item, check_token_ids
from sgrec.catalog.sid import MissingCode
from sgrec.catalog.store import Catalog

_KNOWN = {"id", "text", "token_ids", "id_token", "semantic_id", "attrs"}


class ColumnBuilder:
    """Items appended one at a time into growing C arrays (no Python object per token)."""

    def __init__(self, vocab_size: int | None, sid_tokens=None):
        self.vocab_size = vocab_size
        self.sid = sid_tokens  # sgrec.catalog.sid.SidTokens: semantic IDs are codes, mapped in finish()
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.lines = array("q")  # the source line of each row (for late errors)
        self.tokens = array("i")
        self.ptr = array("q", [0])
        self.id_tokens = array("q")
        self.sem = array("i")
        self.has_sem = array("b")
        self.nd: int | None = None
        self.attrs = AttrBuilder()
        self.meta: dict[int, dict] = {}

    def add(self, obj: dict, line: int, tokenizer=None, maybe_bool: bool = True) -> None:
        """One parsed line. ValueError / TypeError / OverflowError describe what is wrong with it;
        `maybe_bool` False promises the line has no JSON true/false (skips a per-token check)."""
        if not isinstance(obj, dict):
            raise ValueError("each line must be a JSON object")
        item_id = obj.get("id")
        if type(item_id) is not str or not item_id:
            raise ValueError("'id' must be a non-empty string")
        if item_id in self.index:
            raise ValueError(f"duplicate item id {item_id!r} (first on line {self.lines[self.index[item_id]]})")
        row = len(self.ids)
        toks = obj.get("token_ids")
        if (obj.get("text") is None) == (toks is None):  # null is absent, as for every optional key
            raise ValueError(f"item {item_id!r}: give exactly one of 'text' and 'token_ids'")
        if toks is None:
            toks = _encode_text(obj["text"], item_id, tokenizer)
        elif type(toks) is not list or not toks or (maybe_bool and not all(type(t) is int for t in toks)):
            check_token_ids(toks, f"item {item_id!r}: 'token_ids'", self.vocab_size)  # raises with the reason
        try:  # an error aborts the load, so a half-added row never matters
            self.tokens.extend(toks)
        except (TypeError, OverflowError):
            check_token_ids(toks, f"item {item_id!r}: 'token_ids'", self.vocab_size)
            raise
        idt = obj.get("id_token")
        if idt is None:
            idt = -1
        elif type(idt) is not int or idt < 0 or (self.vocab_size is not None and idt >= self.vocab_size):
            idt = self._id_token(idt, item_id, tokenizer)  # a string to tokenize, or an error
        sem = obj.get("semantic_id")
        if sem is not None:
            if type(sem) is not list or not sem or (maybe_bool and not all(type(t) is int for t in sem)):
                check_token_ids(sem, f"item {item_id!r}: 'semantic_id'", self.vocab_size)
            if self.nd is None:
                self.nd = len(sem)
            elif len(sem) != self.nd:
                raise ValueError(f"item {item_id!r}: semantic_id has {len(sem)} tokens, earlier items {self.nd}")
        attrs = obj.get("attrs")
        if attrs is not None:
            self.attrs.add(row, attrs)
        if len(obj) > 2 + (idt >= 0) + (sem is not None) + (attrs is not None):
            extra = {k: v for k, v in obj.items() if k not in _KNOWN}
            if extra:
                self.meta[row] = extra
        if sem is not None:
            try:  # a non-int raises here (bools were ruled out above); the range is checked in finish()
                self.sem.extend(sem)
            except (TypeError, OverflowError):
                check_token_ids(sem, f"item {item_id!r}: 'semantic_id'", self.vocab_size)
                raise
        self.has_sem.append(sem is not None)
        self.ptr.append(len(self.tokens))
        self.id_tokens.append(idt)
        self.ids.append(item_id)
        self.index[item_id] = row
        self.lines.append(line)

    def _id_token(self, idt, item_id: str, tokenizer) -> int:
        if isinstance(idt, str):
            if tokenizer is None:
                raise ValueError(f"item {item_id!r}: a string 'id_token' needs a tokenizer")
            ids = tokenizer.encode(idt, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"item {item_id!r}: id_token {idt!r} is {len(ids)} tokens, not one")
            idt = ids[0]
        return check_token_ids([idt], f"item {item_id!r}: 'id_token'", self.vocab_size)[0]

    def finish(self, where: str) -> Catalog:
        """The catalog; CatalogError (naming `where` and the line) for a token id out of the vocabulary."""
        if not self.ids:
            raise CatalogError(f"item catalog {where!r} has no items")
        tokens = np.frombuffer(self.tokens, dtype=np.int32) if len(self.tokens) else np.zeros(0, np.int32)
        ptr = np.frombuffer(self.ptr, dtype=np.int64)
        self._check_range(where, "token_ids", tokens, lambda j: int(np.searchsorted(ptr, j, side="right")) - 1)
        has = np.frombuffer(self.has_sem, dtype=np.int8).astype(bool)
        sem = None
        if self.nd is not None:
            flat = np.frombuffer(self.sem, dtype=np.int32)
            sem_rows = np.flatnonzero(has)
            if self.sid is not None:  # codes per level: their tokens
                try:
                    flat = self.sid.to_tokens(flat.reshape(-1, self.nd)).reshape(-1)
                except MissingCode as e:
                    row = int(sem_rows[e.row])
                    raise CatalogError(f"{where}:{self.lines[row]}: item {self.ids[row]!r}: {e}") from None
            self._check_range(where, "semantic_id", flat, lambda j: int(sem_rows[j // self.nd]))
            sem = np.full((len(self.ids), self.nd), -1, dtype=np.int32)
            sem[has] = flat.reshape(-1, self.nd)
        try:
            attrs = self.attrs.build(len(self.ids))
        except ValueError as e:
            raise CatalogError(f"{where}: {e}") from None
        # the arrays are read-only views of the builder's buffers (no copy at 10^7 items)
        return Catalog.from_columns(self.ids, tokens, ptr, np.frombuffer(self.id_tokens, np.int64), sem, has, attrs,
                                    self.meta)


    def _check_range(self, where: str, field: str, flat: np.ndarray, row_of) -> None:
        """CatalogError naming the line of the first token id of `flat` outside the vocabulary."""
        bad = np.flatnonzero((flat < 0) | ((flat >= self.vocab_size) if self.vocab_size else False))
        if bad.size:
            row = row_of(int(bad[0]))
            raise CatalogError(f"{where}:{self.lines[row]}: item {self.ids[row]!r}: '{field}' holds "
                               f"{int(flat[bad[0]])}, not a token id in [0, {self.vocab_size})")


def _encode_text(text, item_id: str, tokenizer) -> list[int]:
    if not isinstance(text, str) or not text:
        raise ValueError(f"item {item_id!r}: 'text' must be a non-empty string")
    if tokenizer is None:
        raise ValueError(f"item {item_id!r}: 'text' needs a tokenizer")
    toks = tokenizer.encode(text, add_special_tokens=False)
    if not toks:
        raise ValueError(f"item {item_id!r}: 'text' encodes to no tokens")
    return toks


def load(path: str, tokenizer=None, vocab_size: int | None = None, progress: bool = False,
         sid_tokens=None) -> Catalog:
    """Reads a JSONL catalog into columns, with a progress bar over the file's bytes; `sid_tokens`
    (sgrec.catalog.sid.SidTokens): semantic IDs are codes, mapped to tokens."""
    from tqdm import tqdm

    try:
        f = open(path, "rb")
        size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise CatalogError(f"cannot read item catalog {path!r}: {e.strerror}") from None
    b = ColumnBuilder(vocab_size, sid_tokens)
    loads = orjson.loads
    with f, tqdm(total=size, unit="B", unit_scale=True, desc="item catalog", disable=not progress) as bar:
        done = 0
        for lineno, raw in enumerate(f, 1):
            done += len(raw)
            if lineno % 65536 == 0:
                bar.update(done)
                done = 0
            if not raw.strip():
                continue
            try:
                try:
                    obj = loads(raw)
                except orjson.JSONDecodeError as e:
                    raise ValueError(f"not valid JSON ({e})") from None
                b.add(obj, lineno, tokenizer, maybe_bool=b"true" in raw or b"false" in raw)
            except (ValueError, TypeError, OverflowError) as e:
                raise CatalogError(f"{path}:{lineno}: {e}") from None
        bar.update(done)
    return b.finish(path)


def item_line(it: Item) -> dict:
    """An item as its JSON Lines object (token ids, not text)."""
    obj = {"id": it.id, "token_ids": list(it.token_ids)}
    if it.id_token is not None:
        obj["id_token"] = it.id_token
    if it.semantic_id is not None:
        obj["semantic_id"] = list(it.semantic_id)
    if it.attrs:
        obj["attrs"] = it.attrs
    obj.update(it.meta)
    return obj


def write(items, path: str) -> None:
    """Items (e.g. `catalog.items`) as JSON Lines, one per line."""
    with open(path, "wb") as f:
        for it in items:
            f.write(orjson.dumps(item_line(it)) + b"\n")
