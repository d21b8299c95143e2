"""Folding the update journal into a new catalog file (`python -m sgrec.catalog compact`), crash-safe.

The new catalog (in the catalog file's own form: JSON Lines, Parquet or the .npz bundle) and the new journal
(one `base` record: the version the new catalog file is) are written beside the old ones and fsynced,
then renamed over them, catalog first. A crash anywhere leaves either the old pair or enough to finish:
`finish` (run by the server at start-up and by `compact` itself) completes a compaction whose new
journal is whole and drops the leftovers of one that never got that far.
"""

from __future__ import annotations

import logging
import os

import orjson

from sgrec.catalog import binary, journal, jsonl, parquet
from sgrec.catalog.loader import load_catalog
from sgrec.catalog.versions import replay

logger = logging.getLogger(__name__)


def _tmp(path: str) -> str:
    return path + ".compact-tmp"


def _whole_base(path: str) -> bool:
    """Whether the new journal was written to the end (one base record and its newline)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data.endswith(b"\n") and orjson.loads(data).get("op") == "base"
    except (OSError, ValueError, AttributeError):
        return False


def finish(catalog_path: str, journal_path: str) -> str | None:
    """Completes or drops an interrupted compaction; returns what it did (None: nothing to do)."""
    cat_tmp, jr_tmp = _tmp(catalog_path), _tmp(journal_path)
    if _whole_base(jr_tmp):  # both new files are on disk: roll forward
        if os.path.exists(cat_tmp):
            os.replace(cat_tmp, catalog_path)
        os.replace(jr_tmp, journal_path)
        journal.fsync_dir(journal_path)
        return f"finished an interrupted compaction of {catalog_path}"
    dropped = [p for p in (cat_tmp, jr_tmp) if os.path.exists(p)]
    for p in dropped:
        os.remove(p)
    return f"dropped an unfinished compaction's files {dropped}" if dropped else None


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_synced(path: str, write) -> None:
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def compact(catalog_path: str, journal_path: str | None = None, tokenizer=None, vocab_size: int | None = None,
            progress: bool = False, sid_tokens=None) -> tuple[int, int]:
    """Writes the journal's current version as the catalog file and empties the journal; returns
    (version, items). CatalogError when a server holds the journal (stop it first) or it is corrupt."""
    journal_path = journal_path or journal.default_path(catalog_path)
    lock = journal.Journal(journal_path)
    lock.hold()  # until the end: no server appends meanwhile
    try:
        if (done := finish(catalog_path, journal_path)) is not None:
            logger.warning("%s", done)
        journal.repair(journal_path)
        versions = replay(load_catalog(catalog_path, tokenizer, vocab_size, progress, sid_tokens), journal_path, 1,
                          vocab_size)
        cat, version = versions.current, versions.version
        if sid_tokens is not None and not binary.is_binary(catalog_path):
            cat = sid_tokens.written(cat)  # a file of codes stays one (the binary bundle holds token ids)
        if binary.is_binary(catalog_path):
            _write_synced(_tmp(catalog_path), lambda p: binary.save(cat, p))
        elif parquet.is_parquet(catalog_path):
            _write_synced(_tmp(catalog_path), lambda p: parquet.write(cat, p))
        else:
            _write_synced(_tmp(catalog_path), lambda p: jsonl.write(cat.items, p))
        _write_synced(_tmp(journal_path), lambda p: _write_bytes(p, orjson.dumps({"version": version, "op": "base"})
                                                                 + b"\n"))
        os.replace(_tmp(catalog_path), catalog_path)
        journal.fsync_dir(catalog_path)
        os.replace(_tmp(journal_path), journal_path)
        journal.fsync_dir(journal_path)
        return version, len(cat)
    finally:
        lock.close()
