"""The item catalog shared by ranking (BAT) and retrieval (xGR): items (`item.py`), held as columns
(`store.py`) with attribute columns and request filters (`attrs.py`), loaded from JSON Lines
(`jsonl.py`) or the binary bundle (`binary.py`; `python -m sgrec.catalog convert`); changed while
serving as versions (`update.py`, `versions.py`) kept durable by a journal (`journal.py`, folded into
the file by `compact.py`: `python -m sgrec.catalog compact`). Import from here:
`from sgrec.catalog import Catalog, Item`."""

from sgrec.catalog.item import CatalogError, Item, UnknownItemError, check_token_ids
from sgrec.catalog.store import Catalog
from sgrec.catalog.loader import load_catalog

__all__ = ["Catalog", "CatalogError", "Item", "UnknownItemError", "check_token_ids", "load_catalog"]
