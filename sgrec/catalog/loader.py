"""Loading a catalog file of either form: the binary bundle (`binary.py`, recognised by its zip
magic) or JSON Lines (`jsonl.py`)."""

from __future__ import annotations

from sgrec.catalog import binary, jsonl
from sgrec.catalog.store import Catalog


def load_catalog(path: str, tokenizer=None, vocab_size: int | None = None, progress: bool = False) -> Catalog:
    """Reads a catalog. `tokenizer` (sgrec.tokenizer.Tokenizer) is needed for `text` items and string
    `id_token`s of JSON Lines; `vocab_size` bounds every token id; `progress` shows a bar."""
    if binary.is_binary(path):
        return binary.load(path, vocab_size, progress)
    return jsonl.load(path, tokenizer, vocab_size, progress)
