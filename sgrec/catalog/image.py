"""One copy of the catalog for every DP rank of a server (issue 42): its arrays in files that each
rank maps, instead of each rank loading and holding its own.

With `--dp-size` > 1 the launcher names a folder (`ENV`); rank 0 loads the catalog and writes every
array there (`write`): the columns and the ids (`store.py`, `ids.py`), the attribute columns, the id
index, and arrays its caller adds (the scheduler: on CPU the semantic-ID trie and its row map,
`SemanticIdTrie.arrays`); then every rank, rank 0 too, maps them (`load`). Pages that no rank writes
are the page cache's, one copy for all ranks.

Updates keep working per rank: a column that versions append to (`grow.py`) is written with room
for `SPARE` times its rows more (a sparse file: the room costs nothing until written) and mapped
copy-on-write (numpy's mode "c", MAP_PRIVATE), so a rank's appends go to pages of its own and never
to the file or another rank; past the room a column moves to memory of its own (Buf.append's copy).
The index and the trie are read-only maps: updates make new arrays (SemanticIdTrie.updated, the
index's dict of changes) and never write into them. The manifest is written last, by a rename, so
a rank that finds it finds every array.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import orjson

from sgrec.catalog.attrs import AttrColumn, AttrTable
from sgrec.catalog.grow import MIN_CAPACITY, Buf
from sgrec.catalog.ids import IdColumn, IdIndex
from sgrec.catalog.store import Catalog

ENV = "SGREC_CATALOG_IMAGE"
MANIFEST = "manifest.json"
SPARE = 0.5  # Catalog.with_room's room
GROW = ("token_flat", "token_ptr", "id_tokens", "has_semantic", "semantic_ids")


def _write(folder: str, name: str, arr: np.ndarray, spare: float | None) -> dict:
    """arr's bytes in folder/name, with room for spare * len(arr) more rows (None: none)."""
    arr = np.ascontiguousarray(arr)
    rows = len(arr)
    cap = rows if spare is None else max(int(rows * (1 + spare)), MIN_CAPACITY)
    row_bytes = arr.dtype.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))
    with open(os.path.join(folder, name), "wb") as f:
        f.write(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else b"")
        f.truncate(max(cap * row_bytes, 1))  # the room: a hole, no disk or memory until written
    return {"dtype": arr.dtype.str, "shape": [cap, *arr.shape[1:]], "rows": rows}


def _map(folder: str, name: str, spec: dict, writable: bool) -> np.ndarray:
    shape = tuple(spec["shape"])
    if not shape[0] or not np.prod(shape):
        return np.zeros(shape, dtype=np.dtype(spec["dtype"]))
    return np.memmap(os.path.join(folder, name), dtype=np.dtype(spec["dtype"]), mode="c" if writable else "r",
                     shape=shape)


def write(folder: str, catalog: Catalog, extra: dict[str, np.ndarray] | None = None, extra_info=None) -> None:
    """The catalog (a version no update made: no dead rows, no shared storage) and `extra` arrays
    (read-only once mapped; `extra_info`: JSON that goes with them) as files in folder."""
    assert catalog._dead is None and catalog._bufs is None, "an image holds a catalog as loaded"
    arrays: dict[str, dict] = {}
    for name in GROW:
        arr = getattr(catalog, name)
        if arr is not None:
            arrays[name] = _write(folder, name, arr, SPARE)
    arrays["id_flat"] = _write(folder, "id_flat", catalog.ids.flat, SPARE)
    arrays["id_ptr"] = _write(folder, "id_ptr", catalog.ids.ptr, SPARE)
    index = catalog._rows
    arrays["index_hashes"] = _write(folder, "index_hashes", index.hashes, None)
    arrays["index_rows"] = _write(folder, "index_rows", index.rows, None)
    attrs = []
    for k, (name, col) in enumerate(catalog.attrs.columns.items()):
        parts = {}
        for part in ("data", "present", "ptr"):
            arr = getattr(col, part)
            if arr is not None:
                parts[part] = f"attr{k}_{part}"
                arrays[parts[part]] = _write(folder, parts[part], arr, SPARE)
        attrs.append({"name": name, "kind": col.kind, "values": list(col.values), "parts": parts})
    for name, arr in (extra or {}).items():
        arrays["extra_" + name] = _write(folder, "extra_" + name, arr, None)
    with open(os.path.join(folder, "meta.json"), "wb") as f:
        f.write(orjson.dumps({str(r): m for r, m in catalog.meta.items()}))
    manifest = {"rows": catalog.num_rows, "live_tokens": catalog.total_tokens, "arrays": arrays, "attrs": attrs,
                "extra": sorted(extra or {}), "extra_info": extra_info}
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, os.path.join(folder, MANIFEST))


def wait(folder: str, timeout: float) -> None:
    """Until rank 0 has written the image (its manifest is there); TimeoutError past timeout (if
    rank 0 dies first, the launcher stops the server)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(folder, MANIFEST)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no catalog image in {folder} after {timeout:.0f} s (rank 0 writes it)")
        time.sleep(0.05)


def load(folder: str) -> tuple[Catalog, dict[str, np.ndarray], object]:
    """(catalog, extra arrays, extra_info): the catalog mapped from folder, ready to be appended to
    (its storage is the mapping), and the extra arrays `write` was given, mapped read-only."""
    with open(os.path.join(folder, MANIFEST)) as f:
        man = json.load(f)
    specs = man["arrays"]
    n = man["rows"]

    def buf(name: str) -> Buf:
        spec = specs[name]
        return Buf(_map(folder, name, spec, True), spec["rows"])

    bufs = {name: buf(name) for name in GROW if name in specs}
    bufs["id_flat"], bufs["id_ptr"] = buf("id_flat"), buf("id_ptr")
    view = {name: b.view(b.used) for name, b in bufs.items()}
    ids = IdColumn(view["id_flat"], view["id_ptr"])
    index = IdIndex(ids, _map(folder, "index_hashes", specs["index_hashes"], False),
                    _map(folder, "index_rows", specs["index_rows"], False))
    cols = {}
    for a in man["attrs"]:
        parts = {part: buf(name) for part, name in a["parts"].items()}
        pv = {part: b.view(b.used) for part, b in parts.items()}
        values = list(a["values"])
        cols[a["name"]] = AttrColumn(a["kind"], n, pv["data"], present=pv.get("present"), ptr=pv.get("ptr"),
                                     values=values, _code={v: i for i, v in enumerate(values)}, _bufs=parts)
    with open(os.path.join(folder, "meta.json"), "rb") as f:
        meta = {int(k): v for k, v in orjson.loads(f.read()).items()}
    catalog = Catalog.from_storage(ids, index, view, AttrTable(n, cols), meta, man["live_tokens"], bufs)
    extra = {name: _map(folder, "extra_" + name, specs["extra_" + name], False) for name in man["extra"]}
    return catalog, extra, man["extra_info"]
