"""The item catalog shared by ranking (BAT) and retrieval (xGR): items (`item.py`), loaded from JSON
Lines (`jsonl.py`), held in memory and looked up by id (`store.py`). Import from here:
`from sgrec.catalog import Catalog, Item`."""

from sgrec.catalog.item import CatalogError, Item, UnknownItemError, check_token_ids
from sgrec.catalog.store import Catalog

__all__ = ["Catalog", "CatalogError", "Item", "UnknownItemError", "check_token_ids"]
