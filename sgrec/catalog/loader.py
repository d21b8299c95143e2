"""Loading a catalog file of any form: the binary bundle (`binary.py`, recognised by its zip magic),
Parquet (`parquet.py`, by its magic) or JSON Lines (`jsonl.py`)."""

from __future__ import annotations

from sgrec.catalog import binary, jsonl, parquet
from sgrec.catalog.store import Catalog


def load_catalog(path: str, tokenizer=None, vocab_size: int | None = None, progress: bool = False,
                 sid_tokens=None) -> Catalog:
    """Reads a catalog. `tokenizer` (sgrec.tokenizer.Tokenizer) is needed for `text` items and string
    `id_token`s of JSON Lines and Parquet; `vocab_size` bounds every token id; `progress` shows a bar;
    `sid_tokens` (sgrec.catalog.sid.SidTokens): JSON Lines and Parquet give semantic IDs as codes
    (the binary bundle always holds token ids)."""
    if binary.is_binary(path):
        return binary.load(path, vocab_size, progress)
    if parquet.is_parquet(path):
        return parquet.load(path, tokenizer, vocab_size, progress, sid_tokens)
    return jsonl.load(path, tokenizer, vocab_size, progress, sid_tokens)
