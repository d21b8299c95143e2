"""Loading the item catalog from JSON Lines, one item per line.

Each line: `{"id": "i1", "text": "..." | "token_ids": [...], "id_token": 17, "semantic_id": [3, 9, 1]}`.
`id_token` is the vocabulary token whose logit scores the item (BAT §2.2): an int token id, or a
string that the tokenizer maps to exactly one token. `semantic_id` (optional; retrieval) is a list
of ND token ids, the same ND for every item that has one. Other keys (title, year, ...) are kept
in `Item.meta`. Bad lines are a start-up error naming the file and line.
"""

from __future__ import annotations

import orjson

from sgrec.catalog.item import CatalogError, Item, check_token_ids

_KNOWN = {"id", "text", "token_ids", "id_token", "semantic_id"}


def read_items(path: str, tokenizer=None, vocab_size: int | None = None) -> list[Item]:
    """The items of a JSONL catalog, in file order. `tokenizer` (sgrec.tokenizer.Tokenizer) is needed
    for `text` items and string `id_token`s; `vocab_size` bounds every token id. CatalogError names
    the file and line of a bad line."""
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
    return items


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
