"""The item catalog in memory: items in catalog order, looked up by id."""

from __future__ import annotations

from typing import Iterable

from sgrec.catalog.item import CatalogError, Item, UnknownItemError
from sgrec.catalog.jsonl import read_items


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
        items = read_items(path, tokenizer, vocab_size)
        try:
            return cls(items)
        except CatalogError as e:
            raise CatalogError(f"{path}: {e}") from None
