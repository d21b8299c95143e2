"""The catalog's update journal: one JSON object per line, appended and fsynced before an update is
acknowledged, replayed over the catalog file at start-up (so a crash after an acknowledgement loses
nothing), folded into a new catalog file by `python -m sgrec.catalog compact`.

Records, numbered by catalog version (the catalog file alone is version 0, or the `base` record's):

    {"version": 1, "op": "upsert", "items": [<JSON Lines items, token ids>]}
    {"version": 2, "op": "delete", "ids": ["i1", ...]}
    {"version": 3, "op": "rollback", "to": 1}
    {"version": 7, "op": "base"}          first line only: the catalog file is version 7 (compaction)

A last line cut short by a crash mid-write (no newline, or not valid JSON) is dropped with a warning
(`repair` truncates it away before new records are appended); any other bad line is a CatalogError
naming the file and line. The file is created on the first update, and the process that writes it
holds an exclusive lock on it, so two servers cannot interleave their records.
"""

from __future__ import annotations

import fcntl
import os

import orjson

from sgrec.catalog.item import CatalogError
from sgrec.server_args import default_journal_path

OPS = {"upsert": "items", "delete": "ids", "rollback": "to", "base": None}


def default_path(catalog_path: str) -> str:
    """`<catalog>.journal`, or under the state directory for a catalog inside the installed package."""
    return default_journal_path(catalog_path)


def _check(rec, expect: int | None, first: bool) -> int:
    """The record's version; ValueError describing what is wrong with it."""
    if not isinstance(rec, dict):
        raise ValueError("a record must be a JSON object")
    op, v = rec.get("op"), rec.get("version")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if type(v) is not int or v < 1 and op != "base":
        raise ValueError(f"'version' must be a positive integer, got {v!r}")
    if op == "base":
        if not first:
            raise ValueError("a base record may only be the first line")
        return v
    if expect is not None and v != expect:
        raise ValueError(f"version {v} where {expect} was due")
    key = OPS[op]
    val = rec.get(key)
    if op == "rollback" and (type(val) is not int or not 0 <= val < v):
        raise ValueError(f"'to' must be an earlier version, got {val!r}")
    if op != "rollback" and (not isinstance(val, list) or not val):
        raise ValueError(f"{op} needs a non-empty list {key!r}")
    return v


def read(path: str) -> tuple[int, list[dict], str | None]:
    """(base version, records, warning about a torn last line or None); no file: (0, [], None)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0, [], None
    except OSError as e:
        raise CatalogError(f"cannot read the catalog journal {path!r}: {e.strerror}") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    base, records, warning = 0, [], None
    expect = None
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = orjson.loads(raw)
            v = _check(rec, expect, not records and base == 0)
        except (orjson.JSONDecodeError, ValueError) as e:
            raise CatalogError(f"{path}:{n}: corrupt journal record: {e}") from None
        if rec["op"] == "base":
            base, expect = v, v + 1
            continue
        if expect is None and v != base + 1:
            raise CatalogError(f"{path}:{n}: corrupt journal record: version {v} where {base + 1} was due")
        records.append(rec)
        expect = v + 1
    if tail.strip():
        warning = (f"{path}:{len(lines) + 1}: dropped a torn last journal record ({len(tail)} bytes without "
                   "a newline: a crash while it was written; it was never acknowledged)")
    return base, records, warning


def repair(path: str) -> str | None:
    """Truncates a torn last line away (see `read`); returns its warning or None."""
    _, _, warning = read(path)
    if warning is not None:
        with open(path, "rb+") as f:
            data = f.read()
            f.truncate(data.rfind(b"\n") + 1)
            f.flush()
            os.fsync(f.fileno())
    return warning


def last_version(path: str) -> int:
    base, records, _ = read(path)
    return records[-1]["version"] if records else base


class Journal:
    """The writer: `append` returns once the record is on disk (write, flush, fsync)."""

    def __init__(self, path: str):
        self.path = path
        self._f = None

    def hold(self):
        """Opens the journal for appending and takes its lock (CatalogError when another process has it)."""
        if self._f is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)  # a state directory's first use
            f = open(self.path, "ab")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                raise CatalogError(f"the catalog journal {self.path!r} is held by another process "
                                   "(another server on the same catalog, or a compaction)") from None
            fsync_dir(self.path)
            self._f = f
        return self._f

    def append(self, record: dict) -> None:
        f = self.hold()
        f.write(orjson.dumps(record) + b"\n")
        f.flush()
        os.fsync(f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
