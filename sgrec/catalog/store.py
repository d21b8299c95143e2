"""The item catalog: JSON Lines, one item per line, shared by ranking (BAT) and retrieval (xGR).

Each line: `{"id": "i1", "text": "..." | "token_ids": [...], "id_token": 17, "semantic_id": [3, 9, 1]}`.
`id_token` is the vocabulary token whose logit scores the item (BAT §2.2): an int token id, or a
string that the tokenizer maps to exactly one token. `semantic_id` (optional; retrieval) is a list
of ND token ids, the same ND for every item that has one. Other keys (title, year, ...) are kept
in `Item.meta`. Bad lines are a start-up error naming the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import orjson


class CatalogError(ValueError):
    """A malformed catalog file (start-up error)."""


class UnknownItemError(ValueError):
    """A request named item ids that are not in the catalog (a 400)."""

    def __init__(self, ids: list[str]):
        shown = ", ".join(repr(i) for i in ids[:5]) + (" ..." if len(ids) > 5 else "")
        super().__init__(f"Unknown item id(s) not in the catalog: {shown}")
        self.ids = ids


@dataclass(frozen=True)
class Item:
    id: str
    token_ids: tuple[int, ...]
    id_token: int
    semantic_id: tuple[int, ...] | None = None
    meta: dict = field(default_factory=dict, compare=False, hash=False)


class Catalog:
    def __init__(self, items: Iterable[Item]):
        self.items: list[Item] = list(items)
        self.index: dict[str, int] = {}
        for n, it in enumerate(self.items):
            if it.id in self.index:
                raise CatalogError(f"duplicate item id {it.id!r}")
            self.index[it.id] = n
        nds = {len(it.semantic_id) for it in self.items if it.semantic_id is not None}
        if len(nds) > 1:
            raise CatalogError(f"items have semantic_id of different lengths {sorted(nds)}")
        self.semantic_id_len: int | None = nds.pop() if nds else None

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self.index

    def get(self, item_id: str) -> Item:
        return self.items[self.index[item_id]]

    def lookup(self, item_ids: Iterable[str]) -> list[Item]:
        """The items for these ids, in order; UnknownItemError names every unknown one."""
        ids = list(item_ids)
        unknown = [i for i in ids if not isinstance(i, str) or i not in self.index]
        if unknown:
            raise UnknownItemError(unknown)
        return [self.items[self.index[i]] for i in ids]

    @property
    def max_item_len(self) -> int:
        return max((len(it.token_ids) for it in self.items), default=0)

    @classmethod
    def load(cls, path: str, tokenizer=None, vocab_size: int | None = None) -> "Catalog":
        """Reads a JSONL catalog. `tokenizer` (sgrec.tokenizer.Tokenizer) is needed for `text` items
        and string `id_token`s; `vocab_size` bounds every token id."""
        items: list[Item] = []
        seen: dict[str, int] = {}
        try:
            f = open(path, "rb")
        except OSError as e:
            raise CatalogError(f"cannot read item catalog {path!r}: {e.strerror}") from None
        with f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    item = _parse_item(raw, tokenizer, vocab_size)
                except (ValueError, TypeError) as e:
                    raise CatalogError(f"{path}:{lineno}: {e}") from None
                if item.id in seen:
                    raise CatalogError(f"{path}:{lineno}: duplicate item id {item.id!r} (first on line {seen[item.id]})")
                seen[item.id] = lineno
                items.append(item)
        if not items:
            raise CatalogError(f"item catalog {path!r} has no items")
        try:
            return cls(items)
        except CatalogError as e:
            raise CatalogError(f"{path}: {e}") from None


_KNOWN = {"id", "text", "token_ids", "id_token", "semantic_id"}


def check_token_ids(value, name: str, vocab_size: int | None) -> tuple[int, ...]:
    """A non-empty list (or tuple) of ints in [0, vocab_size), else a ValueError naming `name`."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name} must be a non-empty list of token ids")
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"{name} holds {t!r}, not a token id in [0, {vocab_size})")
    return tuple(value)


def _parse_item(raw: bytes, tokenizer, vocab_size: int | None) -> Item:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    item_id = obj.get("id")
    if not isinstance(item_id, str) or not item_id:
        raise ValueError("'id' must be a non-empty string")
    if ("text" in obj) == ("token_ids" in obj):
        raise ValueError(f"item {item_id!r}: give exactly one of 'text' and 'token_ids'")
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise ValueError(f"item {item_id!r}: 'text' must be a non-empty string")
        if tokenizer is None:
            raise ValueError(f"item {item_id!r}: 'text' needs a tokenizer")
        token_ids = tuple(tokenizer.encode(obj["text"], add_special_tokens=False))
        if not token_ids:
            raise ValueError(f"item {item_id!r}: 'text' encodes to no tokens")
    else:
        token_ids = check_token_ids(obj["token_ids"], f"item {item_id!r}: 'token_ids'", vocab_size)
    if "id_token" not in obj:
        raise ValueError(f"item {item_id!r}: 'id_token' is required")
    idt = obj["id_token"]
    if isinstance(idt, str):
        if tokenizer is None:
            raise ValueError(f"item {item_id!r}: a string 'id_token' needs a tokenizer")
        ids = tokenizer.encode(idt, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"item {item_id!r}: id_token {idt!r} is {len(ids)} tokens, not one")
        idt = ids[0]
    idt = check_token_ids([idt], f"item {item_id!r}: 'id_token'", vocab_size)[0]
    sem = obj.get("semantic_id")
    if sem is not None:
        sem = check_token_ids(sem, f"item {item_id!r}: 'semantic_id'", vocab_size)
    meta = {k: v for k, v in obj.items() if k not in _KNOWN}
    return Item(item_id, token_ids, idt, sem, meta)
