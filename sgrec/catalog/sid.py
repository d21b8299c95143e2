"""Semantic IDs written as codes: a token template per level (`<s_a_{}>,<s_b_{}>,<s_c_{}>`, as
OpenOneRec writes its three levels in the vocabulary) turns code k of level l into the vocabulary
token `template[l].format(k)`, and the tokenizer turns that into a token id.

`SidTokens` maps semantic IDs given as codes (an [N, ND] array) to token ids, level by level, with
a MissingCode error naming the first code whose token the vocabulary lacks; catalogs and updates read
with `--semantic-id-tokens` go through it before their token ids are range-checked (codes may be
larger than the vocabulary). `token_table` is the [L, K] table of a codebook's codes (`sid-train`).
"""

from __future__ import annotations

import re

import numpy as np

from sgrec.catalog.item import CatalogError
from sgrec.catalog.store import Catalog


def parse_template(spec: str, where: str = "--semantic-id-tokens") -> list[str]:
    """The per-level templates of a comma-separated spec; ValueError unless each has one `{}`."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{where} must be a comma-separated list of token templates such as <s_a_{{}}>,<s_b_{{}}>")
    levels = spec.split(",")
    for t in levels:
        if t.count("{}") != 1 or t.replace("{}", "").count("{") or t.replace("{}", "").count("}"):
            raise ValueError(f"{where}: each level's template needs exactly one {{}} (the code), got {t!r}")
    return levels


class MissingCode(CatalogError):
    """A code whose token the vocabulary lacks; `row`: its row of the codes given."""

    def __init__(self, row: int, message: str):
        super().__init__(message)
        self.row = row


def _vocab(tokenizer) -> dict[str, int]:
    hf = getattr(tokenizer, "hf", tokenizer)
    return hf.get_vocab()


class SidTokens:
    """Codes -> token ids through per-level templates and a tokenizer's vocabulary."""

    def __init__(self, spec: str, tokenizer, where: str = "--semantic-id-tokens"):
        if tokenizer is None:
            raise ValueError(f"{where} needs the model's tokenizer")
        self.templates = parse_template(spec, where)
        self.where = where
        self._vocab = _vocab(tokenizer)
        self._cache: list[dict[int, int]] = [{} for _ in self.templates]
        self._codes: list[dict[int, int]] | None = None  # per level: token id -> code (to_codes)

    @property
    def levels(self) -> int:
        return len(self.templates)

    def token(self, level: int, code: int) -> int | None:
        """The token id of `code` at `level` (None: the vocabulary lacks its token)."""
        hit = self._cache[level].get(code)
        if hit is None:
            hit = self._vocab.get(self.templates[level].format(code), -1)
            self._cache[level][code] = hit
        return None if hit < 0 else hit

    def to_tokens(self, codes: np.ndarray) -> np.ndarray:
        """int32 [N, ND] token ids of codes [N, ND]; MissingCode (its `row`) for the first code whose
        token the vocabulary lacks, CatalogError for a width other than the template's."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.levels:
            raise CatalogError(f"semantic_id has {codes.shape[-1]} codes but {self.where} has {self.levels} levels")
        out = np.empty(codes.shape, dtype=np.int32)
        for lv in range(self.levels):
            uniq, inv = np.unique(codes[:, lv], return_inverse=True)
            toks = [self.token(lv, c) for c in uniq.tolist()]
            out[:, lv] = np.array([-1 if t is None else t for t in toks], dtype=np.int64)[inv.reshape(-1)]
        bad = np.argwhere(out < 0)  # row-major: the first row with a missing code, its first level
        if bad.size:
            row, lv = bad[0].tolist()
            code = int(codes[row, lv])
            raise MissingCode(row, f"semantic_id code {code} at level {lv} has no token "
                                   f"{self.templates[lv].format(code)!r} in the vocabulary ({self.where})")
        return out

    def to_codes(self, tokens: np.ndarray) -> np.ndarray:
        """int64 [N, ND] codes of token ids [N, ND] (what a code-form catalog file is written with);
        CatalogError for a token that is not one of its level's codes."""
        tokens = np.asarray(tokens)
        if self._codes is None:
            self._codes = [{} for _ in self.templates]
            pats = [re.compile(re.escape(t).replace(re.escape("{}"), "(0|[1-9][0-9]*)") + r"\Z") for t in self.templates]
            for text, tid in self._vocab.items():
                for lv, pat in enumerate(pats):
                    m = pat.match(text)
                    if m:
                        self._codes[lv][tid] = int(m.group(1))
        out = np.empty(tokens.shape, dtype=np.int64)
        for lv in range(self.levels):
            uniq, inv = np.unique(tokens[:, lv], return_inverse=True)
            codes = [self._codes[lv].get(t) for t in uniq.tolist()]
            if None in codes:
                t = int(uniq[codes.index(None)])
                raise CatalogError(f"semantic_id token {t} at level {lv} is not a code of {self.templates[lv]!r} "
                                   f"({self.where})")
            out[:, lv] = np.array(codes, dtype=np.int64)[inv.reshape(-1)]
        return out

    def written(self, catalog: Catalog) -> Catalog:
        """The catalog's live rows with their semantic IDs as codes: what a JSON Lines or Parquet
        file read with this template holds."""
        cat = catalog.compacted()
        if cat.semantic_ids is None:
            return cat
        codes = np.full(cat.semantic_ids.shape, -1, np.int64)
        codes[cat.has_semantic] = self.to_codes(cat.semantic_ids[cat.has_semantic])
        return cat.with_semantic_ids(codes, cat.has_semantic)


def token_table(spec: str, tokenizer, codes: int, where: str = "--token-template") -> np.ndarray:
    """int64 [L, codes]: the token id of every code of every level; CatalogError naming the first
    code whose token the vocabulary lacks."""
    sid = SidTokens(spec, tokenizer, where)
    grid = np.tile(np.arange(codes, dtype=np.int64), (sid.levels, 1)).T
    return sid.to_tokens(grid).T.astype(np.int64)
