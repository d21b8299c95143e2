"""Catalog updates while serving (issue 22): a batch of items to insert or replace by id, or ids to
delete, applied to a catalog as a new catalog (the old one is left as it is, so a request that
started on it finishes on it and a rollback can return to it).

A batch is all or nothing: `parse_items` names the first bad item (`items[3] ('i9'): ...`) and
`apply_update` raises UpdateError before anything changes when the batch does not fit the catalog
(semantic IDs of another length, an attribute of another kind, every item deleted). A replaced
item keeps its row (so an update that leaves every semantic ID as it was leaves the trie as it was:
`Catalog.same_paths`); new items follow the kept rows in the batch's order. `changed` (ids
inserted, deleted, or replaced with other tokens) is what caches of item KV keyed by id must drop;
an item whose attributes or semantic ID alone change keeps its KV.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sgrec.catalog.item import CatalogError
from sgrec.catalog.jsonl import ColumnBuilder, item_line
from sgrec.catalog.store import Catalog


class UpdateError(ValueError):
    """A batch that cannot be applied (a 400; nothing changed)."""


def parse_items(objs, tokenizer=None, vocab_size: int | None = None) -> Catalog:
    """The items of an update batch (JSON Lines-shaped objects) as a small catalog; UpdateError
    naming the first bad item. `text` and string `id_token`s need the tokenizer."""
    if not isinstance(objs, list) or not objs:
        raise UpdateError("items must be a non-empty list of item objects")
    b = ColumnBuilder(vocab_size)
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

    def counts(self) -> dict:
        return {"inserted": self.inserted, "replaced": self.replaced, "deleted": self.deleted,
                "unknown_ids": self.unknown}


def apply_update(catalog: Catalog, upserts: Catalog | None = None, delete: Sequence[str] = ()) -> Applied:
    """The catalog after inserting / replacing `upserts` (by id) and deleting `delete` (unknown ids
    ignored and counted); UpdateError when the result cannot be built. A replaced item keeps its
    row; new items follow the kept rows in the batch's order."""
    index = catalog.index
    out = Applied(catalog)
    gone = []
    for i in dict.fromkeys(delete):
        r = index.get(i)
        if r is None:
            out.unknown += 1
        else:
            gone.append(r)
            out.changed.add(i)
    out.deleted = len(gone)
    rep_rows, rep_pos, new_pos = [], [], []  # replaced rows and their batch positions; new items' positions
    if upserts is not None:
        for j, i in enumerate(upserts.ids):
            r = index.get(i)
            if r is None:
                new_pos.append(j)
                out.changed.add(i)
                continue
            rep_rows.append(r)
            rep_pos.append(j)
            if not np.array_equal(catalog.token_ids(r), upserts.token_ids(j)):
                out.changed.add(i)  # new tokens: its item KV is stale
        out.replaced, out.inserted = len(rep_rows), len(new_pos)
    if not gone and upserts is None:
        return out
    n = len(catalog)
    if len(gone) == n and not new_pos:
        raise UpdateError("the update would delete every item of the catalog")
    if not gone and not new_pos:  # replacements only: the rows, ids and index stay
        try:
            out.catalog = catalog.replace_rows(np.asarray(rep_rows, dtype=np.int64)[np.argsort(rep_pos)], upserts)
        except CatalogError as e:
            raise UpdateError(str(e)) from None
        return out
    alive = np.ones(n, dtype=bool)
    alive[np.asarray(gone, dtype=np.int64)] = False
    kept = alive.copy()
    kept[np.asarray(rep_rows, dtype=np.int64)] = False  # rows whose old version goes
    base_rows = np.flatnonzero(kept)
    base = catalog if len(base_rows) == n else catalog.take(base_rows) if len(base_rows) else None
    try:
        if upserts is None:
            out.catalog = base
            return out
        joined = upserts if base is None else base.concat(upserts)
    except CatalogError as e:
        raise UpdateError(str(e)) from None
    if not rep_rows:  # inserts only: the new items already follow the kept rows
        out.catalog = joined
        return out
    nb = len(base_rows)
    perm = np.cumsum(kept) - 1  # an old row's place in base
    perm[np.asarray(rep_rows, dtype=np.int64)] = nb + np.asarray(rep_pos, dtype=np.int64)
    out.catalog = joined.take(np.concatenate([perm[alive], nb + np.asarray(new_pos, dtype=np.int64)]))
    return out
