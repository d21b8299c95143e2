"""The item catalog shared by ranking (BAT) and retrieval (xGR). Import from here:
`from sgrec.catalog import Catalog, Item`."""

from sgrec.catalog.store import Catalog, CatalogError, Item, UnknownItemError, check_token_ids

__all__ = ["Catalog", "CatalogError", "Item", "UnknownItemError", "check_token_ids"]
