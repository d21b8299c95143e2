"""Catalog versions: the current catalog and the last few before it, what each version changed,
and the journal records applied to them (`prepare` builds the next version without touching the
current one; `commit` makes it current). `replay` rebuilds the versions from the catalog file and
its journal at start-up.

Versions only grow: a rollback to version T makes a new version whose catalog is T's (the same
object, so its answers are T's exactly). Kept: the current version and the `keep - 1` before it,
contiguous, so the ids a rollback changes are the union of what the versions after T changed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from sgrec.catalog import journal
from sgrec.catalog.item import CatalogError
from sgrec.catalog.store import Catalog
from sgrec.catalog.update import Applied, UpdateError, apply_update, check_ids, parse_items

logger = logging.getLogger(__name__)


class UnknownVersionError(LookupError):
    """A rollback to a version that is not kept (a 404)."""


@dataclass
class Prepared:
    """The next version, built and not yet current."""

    version: int
    op: str
    applied: Applied


class CatalogVersions:
    def __init__(self, catalog: Catalog, version: int = 0, keep: int = 8):
        if keep < 1:
            raise ValueError("keep at least the current version")
        self.keep = keep
        catalog = catalog.with_room()  # columns copied once here, so that no update copies them
        self.catalogs: OrderedDict[int, Catalog] = OrderedDict({version: catalog})
        self.changed: dict[int, set[str]] = {}  # version -> ids it changed (vs the version before)

    @property
    def version(self) -> int:
        return next(reversed(self.catalogs))

    @property
    def current(self) -> Catalog:
        return self.catalogs[self.version]

    def kept(self) -> list[int]:
        return list(self.catalogs)

    def prepare(self, record: dict, vocab_size: int | None = None) -> Prepared:
        """The next version from a journal-shaped record (its "version" must be the next number);
        UpdateError for a batch that does not apply, UnknownVersionError for a rollback target not
        kept. Nothing changes until `commit`."""
        v, op = record.get("version"), record.get("op")
        if v != self.version + 1:
            raise UpdateError(f"version {v} is not the next one ({self.version + 1})")
        cur = self.current
        if op == "upsert":
            applied = apply_update(cur, parse_items(record.get("items"), None, vocab_size))
        elif op == "delete":
            applied = apply_update(cur, None, check_ids(record.get("ids")))
        elif op == "rollback":
            to = record.get("to")
            if to not in self.catalogs:
                raise UnknownVersionError(f"catalog version {to!r} is not kept (kept: {self.kept()})")
            changed = set().union(*(self.changed.get(u, set()) for u in range(to + 1, self.version + 1)))
            applied = Applied(self.catalogs[to], changed)
        else:
            raise UpdateError(f"unknown catalog op {op!r}")
        return Prepared(v, op, applied)

    def commit(self, prepared: Prepared, trim: bool = True) -> None:
        if prepared.version != self.version + 1:
            raise RuntimeError(f"commit of version {prepared.version} on version {self.version}")
        self.catalogs[prepared.version] = prepared.applied.catalog
        self.changed[prepared.version] = prepared.applied.changed
        if trim:
            self.trim()

    def trim(self) -> None:
        while len(self.catalogs) > self.keep:
            v, _ = self.catalogs.popitem(last=False)
            self.changed.pop(v, None)
            self.changed.pop(next(iter(self.catalogs)), None)  # nothing before it to roll back to


def replay(catalog: Catalog, journal_path: str | None, keep: int = 8, vocab_size: int | None = None
           ) -> CatalogVersions:
    """The versions after replaying the journal over the catalog file's catalog. A torn last line is
    dropped with a warning; a corrupt line or a record that does not apply is a CatalogError naming
    the journal's line."""
    base, records, warning = journal.read(journal_path) if journal_path else (0, [], None)
    if warning:
        logger.warning("%s", warning)
    if journal_path:  # which journal a server replays, so a user sees why its catalog differs from the file
        logger.info("catalog journal %s: %s", journal_path,
                    f"replaying {len(records)} update record(s) over the catalog file (version {base}), "
                    f"to version {records[-1]['version']}" if records else
                    f"no update records (the catalog file as it is, version {base})")
    versions = CatalogVersions(catalog, base, keep)
    last_use = {r["to"]: n for n, r in enumerate(records) if r["op"] == "rollback"}  # target -> last record
    for n, rec in enumerate(records):
        try:
            versions.commit(versions.prepare(rec, vocab_size), trim=False)
        except (UpdateError, UnknownVersionError) as e:
            raise CatalogError(f"{journal_path}: record of version {rec['version']}: {e}") from None
        # keep what a later rollback returns to, and the window of the last `keep`
        for v in [v for v in versions.catalogs if last_use.get(v, -1) <= n][:-keep]:
            del versions.catalogs[v]
    versions.trim()
    return versions


def catalog_facts(catalog: Catalog, versions: CatalogVersions) -> dict:
    """What GET /v1/catalog reports about the current version."""
    live = catalog.alive_mask()
    return {
        "version": versions.version,
        "kept_versions": versions.kept(),
        "num_items": len(catalog),
        "semantic_id_len": catalog.semantic_id_len,
        "num_with_id_token": int(((catalog.id_tokens >= 0) & live).sum()),
        "num_with_semantic_id": int((catalog.has_semantic & live).sum()),
        "num_with_attrs": int((catalog.attrs.present_rows() & live).sum()),
        "attributes": {name: col.kind for name, col in catalog.attrs.columns.items()},
    }
