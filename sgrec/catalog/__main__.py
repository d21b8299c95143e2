"""`python -m sgrec.catalog convert IN OUT`: between JSON Lines, Parquet and the binary bundle (IN in
any of them; by OUT's suffix: `.npz` writes the bundle, `.parquet` Parquet, anything else JSON Lines). `--tokenizer` is needed when IN has `text`
items or string id tokens; `--vocab-size` bounds every token id; `--semantic-id-tokens TEMPLATE`
reads semantic IDs written as codes (sgrec.catalog.sid).
`python -m sgrec.catalog compact CATALOG [--journal J]`: folds the update journal into the catalog
file (sgrec.catalog.compact).
`python -m sgrec.catalog sid-train --embeddings E.npy --levels L --codebook-size K --out C.npz`:
residual k-means codebooks with faiss, and the token of each code (sgrec.catalog.codebooks).
`python -m sgrec.catalog sid-assign IN OUT --codebooks C.npz --embeddings E.npy`: every item's
semantic ID from the codebooks (E's rows are IN's items in order)"""

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
    _reading(cv)
    cp = sub.add_parser("compact", help="fold the update journal into the catalog file (stop the server first)")
    cp.add_argument("catalog", help="the catalog file (--item-catalog): rewritten in its own form")
    cp.add_argument("--journal", help="the journal (--catalog-journal; default: CATALOG.journal)")
    _reading(cp)
    tr = sub.add_parser("sid-train", help="train residual k-means codebooks (faiss) over item embeddings")
    tr.add_argument("--embeddings", required=True, help="E.npy: float [items, dim] item embeddings")
    tr.add_argument("--levels", type=int, required=True, help="semantic-ID levels (codebooks)")
    tr.add_argument("--codebook-size", type=int, required=True, help="codes per level")
    tr.add_argument("--out", required=True, help="C.npz: codebooks [levels, codes, dim] and token_ids [levels, codes]")
    tr.add_argument("--token-template", help="the vocabulary token of each level's codes, comma-separated, e.g. "
                    "'<s_a_{}>,<s_b_{}>,<s_c_{}>' (needs --tokenizer)")
    tr.add_argument("--token-offset", type=int, help="instead of a template: code k of level l is token id "
                    "OFFSET + l * codebook-size + k (a vocabulary of numbered codes, as TIGER's)")
    tr.add_argument("--tokenizer", help="tokenizer path (HF) for --token-template")
    tr.add_argument("--vocab-size", type=int, help="reject token ids outside [0, vocab size)")
    tr.add_argument("--niter", type=int, default=20, help="k-means iterations per level (default 20)")
    tr.add_argument("--seed", type=int, default=0, help="k-means seed (level l uses seed + l)")
    sa = sub.add_parser("sid-assign", help="assign every item of a catalog its semantic ID from trained codebooks")
    sa.add_argument("input", help="the catalog (JSON Lines, Parquet or .npz)")
    sa.add_argument("output", help="the catalog with semantic IDs, in the form OUT's suffix names (as convert)")
    sa.add_argument("--codebooks", required=True, help="C.npz written by sid-train")
    sa.add_argument("--embeddings", required=True, help="E.npy: one embedding per item of INPUT, in its order")
    sa.add_argument("--dedup-level", metavar="TEMPLATE", help="append a level that tells apart the items of one "
                    "path (the n-th item of a path, in INPUT's order, gets code n), its tokens from TEMPLATE "
                    "such as '<s_d_{}>' (needs --tokenizer)")
    _reading(sa)
    a = ap.parse_args(argv)
    try:
        return {"convert": _convert, "compact": _compact, "sid-train": _sid_train, "sid-assign": _sid_assign}[a.cmd](a)
    except (CatalogError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _reading(p: argparse.ArgumentParser) -> None:
    """The options every command that reads a catalog takes."""
    p.add_argument("--tokenizer", help="tokenizer path (HF) for `text` items and string id tokens")
    p.add_argument("--vocab-size", type=int, help="reject token ids outside [0, vocab size)")
    p.add_argument("--semantic-id-tokens", metavar="TEMPLATE", help="semantic IDs are given as codes, one per level: "
                   "code k of level l is the token TEMPLATE[l] with k for {} (e.g. '<s_a_{}>,<s_b_{}>,<s_c_{}>'; "
                   "needs --tokenizer)")


def _open(a):
    """(tokenizer or None, vocabulary size or None, SidTokens or None) from the reading options."""
    tok = None
    if a.tokenizer:
        from sgrec.tokenizer import Tokenizer

        tok = Tokenizer(a.tokenizer)
    vocab = a.vocab_size or (tok.vocab_size if tok is not None else None)
    sid = None
    if getattr(a, "semantic_id_tokens", None):
        from sgrec.catalog.sid import SidTokens

        sid = SidTokens(a.semantic_id_tokens, tok)
    return tok, vocab, sid


def _write(cat, path: str, sid=None) -> None:
    """The catalog in the form `path`'s suffix names; with `sid`, JSON Lines and Parquet write
    semantic IDs as codes (the binary bundle holds token ids)."""
    if path.endswith(".npz"):
        binary.save(cat, path)
        return
    if sid is not None:
        cat = sid.written(cat)
    if path.endswith(".parquet"):
        parquet.write(cat, path)
    else:
        jsonl.write(cat.items, path)


def _convert(a) -> int:
    tok, vocab, sid = _open(a)
    t0 = time.perf_counter()
    cat = load_catalog(a.input, tok, vocab, progress=True, sid_tokens=sid)
    t1 = time.perf_counter()
    _write(cat, a.output, sid)
    print(f"{len(cat)} items (semantic IDs: {int(cat.has_semantic.sum())}, attributes: "
          f"{', '.join(cat.attrs.columns) or 'none'}) read in {t1 - t0:.1f} s, written to {a.output} in "
          f"{time.perf_counter() - t1:.1f} s")
    return 0


def _compact(a) -> int:
    from sgrec.catalog.compact import compact

    tok, vocab, sid = _open(a)
    t0 = time.perf_counter()
    version, n = compact(a.catalog, a.journal, tok, vocab, progress=True, sid_tokens=sid)
    print(f"{a.catalog}: version {version}, {n} items, journal emptied ({time.perf_counter() - t0:.1f} s)")
    return 0


def _sid_train(a) -> int:
    import numpy as np

    from sgrec.catalog import codebooks

    if (a.token_template is None) == (a.token_offset is None):
        raise ValueError("give one of --token-template (with --tokenizer) and --token-offset")
    tok, vocab, _ = _open(a)
    if a.token_template is not None:
        from sgrec.catalog.sid import parse_template, token_table

        if len(parse_template(a.token_template, "--token-template")) != a.levels:
            raise ValueError(f"--token-template has {len(a.token_template.split(','))} levels, --levels {a.levels}")
        tokens = token_table(a.token_template, tok, a.codebook_size)
    else:
        tokens = a.token_offset + np.arange(a.levels * a.codebook_size, dtype=np.int64).reshape(a.levels, -1)
    codebooks.check_tokens(tokens, vocab, "--token-offset")
    emb = np.load(a.embeddings, mmap_mode="r")
    t0 = time.perf_counter()
    books = codebooks.Codebooks(codebooks.train(emb, a.levels, a.codebook_size, a.niter, a.seed, progress=True),
                                tokens)
    books.save(a.out)
    print(f"{a.levels} levels x {a.codebook_size} codes over {books.dim}-dimensional embeddings of "
          f"{emb.shape[0]} items trained in {time.perf_counter() - t0:.1f} s, written to {a.out}")
    return 0


def _sid_assign(a) -> int:
    import numpy as np

    from sgrec.catalog import codebooks

    tok, vocab, sid = _open(a)
    books = codebooks.Codebooks.load(a.codebooks, vocab, "--codebooks")
    cat = load_catalog(a.input, tok, vocab, progress=True, sid_tokens=sid)
    emb = np.load(a.embeddings, mmap_mode="r")
    if emb.ndim != 2 or emb.shape[0] != len(cat):
        raise ValueError(f"--embeddings holds {list(emb.shape)}: one row per item of {a.input} ({len(cat)}) needed")
    t0 = time.perf_counter()
    sem = books.tokens(books.assign(emb))
    if a.dedup_level:
        from sgrec.catalog.sid import MissingCode, SidTokens

        rank = codebooks.dedup_codes(sem)[:, None]
        try:
            sem = np.concatenate([sem, SidTokens(a.dedup_level, tok, "--dedup-level").to_tokens(rank)], axis=1)
        except MissingCode as e:
            raise CatalogError(f"item {cat.ids[e.row]!r}: the {e} (a path of more items than its codes)") from None
    out = cat.with_semantic_ids(sem)
    t1 = time.perf_counter()
    _write(out, a.output, sid)
    shared = len(out) - len(np.unique(sem, axis=0))
    print(f"{len(out)} items assigned {sem.shape[1]}-token semantic IDs in {t1 - t0:.1f} s "
          f"({len(out) / max(t1 - t0, 1e-9):,.0f} items/s; {shared} share a path with an earlier item), "
          f"written to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
