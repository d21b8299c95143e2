"""Catalog updates while serving: a batch of items to insert or replace by id, or ids to
delete, applied to a catalog as a new catalog (the old one is left as it is, so a request that
started on it finishes on it and a rollback can return to it).

A batch is all or nothing: `parse_items` names the first bad item (`items[3] ('i9'): ...`) and
`apply_update` raises UpdateError before anything changes when the batch does not fit the catalog
(semantic IDs of another length, an attribute of another kind, every item deleted). The new
version shares the old one's storage and costs what the batch changed (`Catalog.appended`): a
deleted item's row dies, a replaced item's old row dies and its new row follows, with the new
items, in the batch's order. `removed_rows` and `added_from` say which rows changed (the trie
follows them: `LayeredTrie.updated`, `SemanticIdTrie.updated`). `changed` (ids inserted, deleted,
or replaced with other tokens) is what caches of item KV keyed by id must drop; an item whose
attributes or semantic ID alone change keeps its KV.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sgrec.catalog.item import CatalogError
from sgrec.catalog.jsonl import ColumnBuilder, item_line
from sgrec.catalog.store import Catalog


class UpdateError(ValueError):
    """A batch that cannot be applied (a 400; nothing changed)."""


def parse_items(objs, tokenizer=None, vocab_size: int | None = None, sid_tokens=None) -> Catalog:
    """The items of an update batch (JSON Lines-shaped objects) as a small catalog; UpdateError
    naming the first bad item. `text` and string `id_token`s need the tokenizer; `sid_tokens`
    (sgrec.catalog.sid.SidTokens): semantic IDs are codes."""
    if not isinstance(objs, list) or not objs:
        raise UpdateError("items must be a non-empty list of item objects")
    b = ColumnBuilder(vocab_size, sid_tokens)
    for k, obj in enumerate(objs):
        try:
            b.add(obj, k, tokenizer)
        except (ValueError, TypeError, OverflowError) as e:
            raise UpdateError(f"items[{k}]{_named(obj)}: {_full_paths(str(e), k)}") from None
    try:
        return b.finish("items")
    except CatalogError as e:  # "items:K: ..." from the range check: K is the item's index
        where, _, rest = str(e).partition(": ")
        k = int(where.split(":")[1])
        raise UpdateError(f"items[{k}]{_named(objs[k])}: {_full_paths(rest, k)}") from None


def assign_semantic_ids(objs, codebooks=None, sid_tokens=None) -> tuple[list, dict[str, list[int]]]:
    """An upsert batch's items with their `embedding` taken out, and those without a `semantic_id`
    given the codebooks' (sgrec.catalog.codebooks.Codebooks; as codes where `sid_tokens` reads the
    batch's semantic IDs as codes); and item id -> the assigned tokens. UpdateError naming the item
    for an embedding without codebooks or not of their dimension (nothing assigned then)."""
    if not isinstance(objs, list):
        return objs, {}
    out, want, vecs = list(objs), [], []
    for k, obj in enumerate(objs):
        if not isinstance(obj, dict) or obj.get("embedding") is None:
            continue
        where = f"items[{k}]{_named(obj)}: items[{k}].embedding"
        if codebooks is None:
            raise UpdateError(f"{where} needs a server started with --semantic-id-codebooks")
        out[k] = {key: v for key, v in obj.items() if key != "embedding"}
        if obj.get("semantic_id") is not None:
            continue  # a given semantic ID is kept
        emb = obj["embedding"]
        if (type(emb) is not list or len(emb) != codebooks.dim
                or not all(type(x) in (int, float) and math.isfinite(x) for x in emb)):
            got = f"{len(emb)} values" if type(emb) is list else type(emb).__name__
            raise UpdateError(f"{where} must be a list of {codebooks.dim} finite numbers (the codebooks' "
                              f"dimension), got {got}")
        want.append(k)
        vecs.append(emb)
    if not want:
        return out, {}
    with np.errstate(over="ignore"):
        x = np.array(vecs, dtype=np.float64).astype(np.float32)
    if not np.isfinite(x).all():
        k = want[int(np.argwhere(~np.isfinite(x))[0, 0])]
        raise UpdateError(f"items[{k}]{_named(objs[k])}: items[{k}].embedding holds a number beyond float32's range")
    tokens = codebooks.tokens(codebooks.assign(x))
    given = tokens if sid_tokens is None else sid_tokens.to_codes(tokens)
    assigned = {}
    for k, tok, sem in zip(want, tokens.tolist(), given.tolist()):
        out[k]["semantic_id"] = sem
        assigned[out[k].get("id")] = tok
    return out, assigned


def _named(obj) -> str:
    i = obj.get("id") if isinstance(obj, dict) else None
    return f" ({i!r})" if isinstance(i, str) else ""


# a field quoted, or one whose name no word of a sentence has (`id`, `text` only quoted)
_ITEM_FIELD = re.compile(r"'(id|text|token_ids|id_token|semantic_id|attrs)'|(?<![\w.\['])(token_ids|id_token|semantic_id)"
                         r"(?![\w'])")


def _full_paths(message: str, k: int) -> str:
    """A catalog line's message (`item 'i9': 'text' must be ...`, written for a file's lines) with
    each field named by its path in the update body: `items[3].text must be ...`."""
    message = re.sub(r"^item '(?:[^'\\]|\\.)*': |^item \"(?:[^\"\\]|\\.)*\": ", "", message)
    return _ITEM_FIELD.sub(lambda m: f"items[{k}].{m.group(1) or m.group(2)}", message)


def canonical_lines(items: Catalog) -> list[dict]:
    """The batch as JSON Lines objects with token ids (what the journal keeps: replaying it needs no
    tokenizer)."""
    return [item_line(it) for it in items.items]


def check_ids(ids) -> list[str]:
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
        raise UpdateError("ids must be a non-empty list of item id strings")
    return ids


@dataclass
class Applied:
    catalog: Catalog
    changed: set[str] = field(default_factory=set)  # ids whose item KV is stale: new tokens, deleted, inserted
    inserted: int = 0
    replaced: int = 0
    deleted: int = 0
    unknown: int = 0  # deleted ids the catalog did not have (ignored)
    removed_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # rows now dead, ascending
    added_from: int | None = None  # the new rows are [added_from, catalog.num_rows)

    def counts(self) -> dict:
        return {"inserted": self.inserted, "replaced": self.replaced, "deleted": self.deleted,
                "unknown_ids": self.unknown}


def apply_update(catalog: Catalog, upserts: Catalog | None = None, delete: Sequence[str] = ()) -> Applied:
    """The next version after inserting / replacing `upserts` (by id) and deleting `delete` (unknown
    ids ignored and counted); UpdateError when it cannot be built, with nothing changed. A replaced
    item's old row dies and the batch's items follow the live rows in the batch's order
    (`Catalog.appended`: O(batch), the rows before are shared with this version)."""
    index = catalog.index
    upserts = None if upserts is None else upserts.compacted()
    out = Applied(catalog)
    gone = []
    delete = list(dict.fromkeys(delete))
    for i, r in zip(delete, index.get_many(delete)):
        if r is None:
            out.unknown += 1
        else:
            gone.append(r)
            out.changed.add(i)
    out.deleted = len(gone)
    if upserts is not None:
        ids = list(upserts.ids)
        for j, (i, r) in enumerate(zip(ids, index.get_many(ids))):
            if r is None:
                out.inserted += 1
                out.changed.add(i)
                continue
            out.replaced += 1
            gone.append(r)
            if not np.array_equal(catalog.token_ids(r), upserts.token_ids(j)):
                out.changed.add(i)  # new tokens: its item KV is stale
    if not gone and upserts is None:
        return out
    if out.deleted == len(catalog) and not out.inserted and upserts is None:
        raise UpdateError("the update would delete every item of the catalog")
    removed = np.unique(np.asarray(gone, dtype=np.int64))
    try:
        out.catalog = catalog.appended(upserts, removed)
    except CatalogError as e:
        raise UpdateError(str(e)) from None
    out.removed_rows, out.added_from = removed, catalog.num_rows
    return out
