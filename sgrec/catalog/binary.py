"""The binary catalog: one uncompressed `.npz` bundle of the catalog's columns, for catalogs too big
to parse as JSON Lines at every start (text is already tokenized, string id tokens resolved).

Arrays: `format` (the version), `id_flat` and `id_ptr` (the ids' UTF-8 bytes and offsets; format 1
had `ids`, a UTF-8 JSON list, still read), `meta` (UTF-8 JSON), `token_flat`, `token_ptr`,
`id_tokens`, `has_semantic`, `semantic_ids` (when any item has one), `attrs` (UTF-8 JSON:
[{name, kind, values}]) and each attribute column's arrays `attr<k>_<part>`.
Written by `python -m sgrec.catalog convert IN OUT`.
"""

from __future__ import annotations

import numpy as np
import orjson

from sgrec.catalog.attrs import AttrColumn, AttrTable
from sgrec.catalog.ids import IdColumn
from sgrec.catalog.item import CatalogError
from sgrec.catalog.store import Catalog

FORMAT = 2
READS = (1, 2)
_ZIP_MAGIC = b"PK\x03\x04"


def is_binary(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _ZIP_MAGIC
    except OSError:
        return False


def _text(obj) -> np.ndarray:
    return np.frombuffer(orjson.dumps(obj), dtype=np.uint8)


def save(catalog: Catalog, path: str) -> None:
    catalog = catalog.compacted()  # live rows only
    arrays = {
        "format": np.array([FORMAT], dtype=np.int64),
        "id_flat": catalog.ids.flat,
        "id_ptr": catalog.ids.ptr,
        "meta": _text({str(k): v for k, v in catalog.meta.items()}),
        "token_flat": catalog.token_flat,
        "token_ptr": catalog.token_ptr,
        "id_tokens": catalog.id_tokens,
        "has_semantic": catalog.has_semantic,
    }
    if catalog.semantic_ids is not None:
        arrays["semantic_ids"] = catalog.semantic_ids
    cols = []
    for k, (name, col) in enumerate(catalog.attrs.columns.items()):
        cols.append({"name": name, "kind": col.kind, "values": col.values})
        arrays[f"attr{k}_data"] = col.data
        for part in ("present", "ptr"):
            if getattr(col, part) is not None:
                arrays[f"attr{k}_{part}"] = getattr(col, part)
    arrays["attrs"] = _text(cols)
    with open(path, "wb") as f:  # np.savez would append ".npz" to a path without it
        np.savez(f, **arrays)


def load(path: str, vocab_size: int | None = None, progress: bool = False) -> Catalog:
    """Reads a bundle written by `save`; CatalogError when it is not one or holds a token id outside
    the vocabulary."""
    from tqdm import tqdm

    import zipfile

    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise CatalogError(f"cannot read binary item catalog {path!r}: {e}") from None
    with z, tqdm(total=len(z.files), desc="item catalog", unit="array", disable=not progress) as bar:
        def get(name: str, required: bool = True):
            if name not in z.files:
                if required:
                    raise CatalogError(f"{path}: not an sgrec catalog bundle (no {name!r})")
                return None
            out = z[name]
            bar.update(1)
            return out

        fmt = int(get("format")[0])
        if fmt not in READS:
            raise CatalogError(f"{path}: catalog bundle format {fmt}, this sgrec reads {READS}")
        ids = orjson.loads(get("ids").tobytes()) if fmt == 1 else IdColumn(get("id_flat"), get("id_ptr"))
        meta = {int(k): v for k, v in orjson.loads(get("meta").tobytes()).items()}
        tokens, sem = get("token_flat"), get("semantic_ids", required=False)
        n = len(ids)
        cols = {}
        for k, c in enumerate(orjson.loads(get("attrs").tobytes())):
            cols[c["name"]] = AttrColumn(c["kind"], n, get(f"attr{k}_data"), present=get(f"attr{k}_present", False),
                                         ptr=get(f"attr{k}_ptr", False), values=c["values"])
        has = get("has_semantic")
        for name, flat in (("token_ids", tokens), ("semantic_id", None if sem is None else sem[has])):
            if vocab_size is not None and flat is not None and flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
                raise CatalogError(f"{path}: an item's '{name}' holds a token id outside [0, {vocab_size})")
        idt = get("id_tokens")
        if vocab_size is not None and idt.size and idt.max() >= vocab_size:
            raise CatalogError(f"{path}: an item's 'id_token' is outside [0, {vocab_size})")
        return Catalog.from_columns(ids, tokens, get("token_ptr"), idt, sem, has, AttrTable(n, cols), meta)
