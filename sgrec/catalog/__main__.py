"""`python -m sgrec.catalog convert IN OUT`: between JSON Lines, Parquet and the binary bundle (IN in
any of them; by OUT's suffix: `.npz` writes the bundle, `.parquet` Parquet, anything else JSON Lines). `--tokenizer` is needed when IN has `text`
items or string id tokens; `--vocab-size` bounds every token id.
`python -m sgrec.catalog compact CATALOG [--journal J]`: folds the update journal into the catalog
file (sgrec.catalog.compact)."""

from __future__ import annotations

import argparse
import sys
import time

from sgrec.catalog import binary, jsonl, parquet
from sgrec.catalog.item import CatalogError
from sgrec.catalog.loader import load_catalog


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sgrec.catalog", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    cv = sub.add_parser("convert", help="convert a catalog between JSON Lines, Parquet and the binary .npz bundle")
    cv.add_argument("input", help="a JSON Lines catalog, a Parquet file or a .npz bundle")
    cv.add_argument("output", help="OUT.npz: the binary bundle; OUT.parquet: Parquet; any other name: JSON Lines")
    cv.add_argument("--tokenizer", help="tokenizer path (HF) for `text` items and string id tokens")
    cv.add_argument("--vocab-size", type=int, help="reject token ids outside [0, vocab size)")
    cp = sub.add_parser("compact", help="fold the update journal into the catalog file (stop the server first)")
    cp.add_argument("catalog", help="the catalog file (--item-catalog): rewritten in its own form")
    cp.add_argument("--journal", help="the journal (--catalog-journal; default: CATALOG.journal)")
    cp.add_argument("--tokenizer", help="tokenizer path (HF) when the catalog file has `text` items")
    cp.add_argument("--vocab-size", type=int, help="reject token ids outside [0, vocab size)")
    a = ap.parse_args(argv)
    if a.cmd == "compact":
        return _compact(a)
    tok = None
    if a.tokenizer:
        from sgrec.tokenizer import Tokenizer

        tok = Tokenizer(a.tokenizer)
    vocab = a.vocab_size or (tok.vocab_size if tok is not None else None)
    t0 = time.perf_counter()
    try:
        cat = load_catalog(a.input, tok, vocab, progress=True)
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    if a.output.endswith(".npz"):
        binary.save(cat, a.output)
    elif a.output.endswith(".parquet"):
        try:
            parquet.write(cat, a.output)
        except CatalogError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        jsonl.write(cat.items, a.output)
    print(f"{len(cat)} items (semantic IDs: {int(cat.has_semantic.sum())}, attributes: "
          f"{', '.join(cat.attrs.columns) or 'none'}) read in {t1 - t0:.1f} s, written to {a.output} in "
          f"{time.perf_counter() - t1:.1f} s")
    return 0


def _compact(a) -> int:
    from sgrec.catalog.compact import compact

    tok = None
    if a.tokenizer:
        from sgrec.tokenizer import Tokenizer

        tok = Tokenizer(a.tokenizer)
    t0 = time.perf_counter()
    try:
        version, n = compact(a.catalog, a.journal, tok, a.vocab_size or (tok.vocab_size if tok else None), progress=True)
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.catalog}: version {version}, {n} items, journal emptied ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
