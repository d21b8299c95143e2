"""One copy of the catalog for every DP rank of a server: its arrays in files that each
rank maps, instead of each rank loading and holding its own.

With `--dp-size` > 1 the launcher names a folder (`ENV`, `folder_for`); rank 0 loads the catalog and
writes every array there (`write`): the columns and the ids (`store.py`, `ids.py`), the attribute
columns and the id index; then every rank, rank 0 too, maps them (`load`). Pages that no rank writes
are the page cache's, one copy for all ranks.

Arrays each version needs whole, the same on every rank (on the CPU, the semantic-ID trie of each
catalog version and its row map), go through `shared`: the first rank to ask for a version's makes
them and writes them there, every rank maps that one copy, and the version before is removed.

Updates keep working per rank: a column that versions append to (`grow.py`) is written with room
for `SPARE` times its rows more (a sparse file: the room costs nothing until written) and mapped
copy-on-write (numpy's mode "c", MAP_PRIVATE), so a rank's appends go to pages of its own and never
to the file or another rank; past the room a column moves to memory of its own (Buf.append's copy).
The index and the shared arrays are read-only maps: updates make new arrays (the index's dict of
changes, the next version's trie) and never write into them. The manifest is written last, by a rename, so
a rank that finds it finds every array.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np
import orjson

from sgrec.catalog.attrs import AttrColumn, AttrTable
from sgrec.catalog.grow import MIN_CAPACITY, Buf
from sgrec.catalog.ids import IdColumn, IdIndex
from sgrec.catalog.store import Catalog

ENV = "SGREC_CATALOG_IMAGE"
PREFIX = "sgrec-catalog-image-"
OWNER = "owner.lock"  # locked by the server that made the folder, while it runs
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


def folder_for(catalog_path: str, shm: str = "/dev/shm") -> str:
    """A new folder for a server's image: in shared memory (`shm`, a tmpfs: the versions' arrays are
    written there at memory speed, where a disk's page cache can take seconds once its dirty pages
    pile up) when it has room for 4 times the catalog file, else the system's temporary folder (a
    container's /dev/shm is often 64 MB). The calling process holds a lock on the folder's `OWNER`
    file until it exits (the launcher; it also removes the folder at exit). Folders whose owner is
    gone (a server that was killed) are removed here, so shared memory does not leak; a lock, not a
    process id, tells them apart, so servers in other PID namespaces that share /dev/shm are safe."""
    for root in (shm, tempfile.gettempdir()):
        for name in os.listdir(root) if os.path.isdir(root) else ():
            if name.startswith(PREFIX) and _unowned(os.path.join(root, name)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    try:
        st = os.statvfs(shm)
        size = (sum(e.stat().st_size for e in os.scandir(catalog_path) if e.is_file())
                if os.path.isdir(catalog_path) else os.path.getsize(catalog_path))
        roomy = st.f_bavail * st.f_frsize >= 4 * size and os.access(shm, os.W_OK)
    except OSError:
        roomy = False
    folder = tempfile.mkdtemp(prefix=PREFIX, dir=shm if roomy else None)
    owner = open(os.path.join(folder, OWNER), "a")
    fcntl.flock(owner, fcntl.LOCK_EX)
    _owned.append(owner)  # held open, so locked, for this process's life
    return folder


_owned: list = []


def _unowned(folder: str) -> bool:
    """Whether folder's owner lock is free (its owner exited or was killed). A folder without the
    lock file is one being made right now: owned."""
    try:
        with open(os.path.join(folder, OWNER)) as f:  # never made here
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except OSError:  # locked (BlockingIOError), no lock file yet (being made) or no access
        return False


def write(folder: str, catalog: Catalog) -> None:
    """The catalog (a version no update made: no dead rows, no shared storage) as files in folder."""
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
    with open(os.path.join(folder, "meta.json"), "wb") as f:
        f.write(orjson.dumps({str(r): m for r, m in catalog.meta.items()}))
    _manifest(folder, {"rows": catalog.num_rows, "live_tokens": catalog.total_tokens, "arrays": arrays,
                       "attrs": attrs})


def _manifest(folder: str, manifest: dict) -> None:
    """The manifest, written last and by a rename: whoever finds it finds every file it names."""
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


def load(folder: str) -> Catalog:
    """The catalog mapped from folder, ready to be appended to (its storage is the mapping)."""
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
    return Catalog.from_storage(ids, index, view, AttrTable(n, cols), meta, man["live_tokens"], bufs)


def shared(folder: str, kind: str, key: str, make: Callable[[], tuple[dict[str, np.ndarray], object]]
           ) -> tuple[dict[str, np.ndarray], object]:
    """(arrays, info) that every rank needs and one rank makes: the first rank to ask for `key` calls
    make() -> (arrays, JSON info) and writes them to folder/"{kind}-{key}", and every rank (the maker
    too, once it has let go of its own) maps those files read-only: one copy for all ranks. Ranks ask
    one at a time (a lock file), so the others wait for the maker instead of making their own. Once a
    rank has mapped `key`, the other keys of `kind` are removed: ranks ask for a kind's keys in the
    same order and one at a time (a catalog version's trie after every rank serves the one before),
    so no rank asks for them again, and a rank that still maps one keeps its pages until it lets go."""
    path = os.path.join(folder, f"{kind}-{key}")
    with open(os.path.join(folder, f"{kind}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # until the file closes
        if not os.path.isdir(path):
            arrays, info = make()
            tmp = path + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)  # a maker that died half-way
            os.mkdir(tmp)
            specs = {name: _write(tmp, name, arr, None) for name, arr in arrays.items()}
            del arrays
            _manifest(tmp, {"arrays": specs, "info": info})
            os.rename(tmp, path)
        with open(os.path.join(path, MANIFEST)) as f:
            man = json.load(f)
        out = {name: _map(path, name, spec, False) for name, spec in man["arrays"].items()}
        for name in os.listdir(folder):
            if name.startswith(kind + "-") and name != os.path.basename(path):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return out, man["info"]
