"""Residual codebooks for semantic IDs: trained with faiss k-means, and the assignment of new items.

A codebook file (`.npz`) holds `codebooks` (float32 [L, K, D]: K codewords of dimension D per
level) and `token_ids` (int64 [L, K]: the vocabulary token of code k at level l). Training
(`train`) runs k-means on the item embeddings, then on the residuals left after subtracting each
item's nearest codeword, level by level (residual k-means, as OpenOneRec builds its three levels).

Assignment (`assign`) walks the same levels: the code of level l is the nearest codeword to the
residual (squared L2), ties to the lower code, and the residual loses that codeword. The answer is
a function of each embedding alone, whatever the batch: one float32 GEMM per block and level finds
each residual's two nearest codewords, and where their distances are closer than float32
arithmetic can separate (a bound of 4 * D * eps * (|x|^2 + max |c|^2)), the distances to the
codewords within that bound of the nearest are computed again in float64, and the smallest wins,
ties to the lower code. So
`python -m sgrec.catalog sid-assign` and a server assigning on upsert (`--semantic-id-codebooks`)
give an item the same semantic ID.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sgrec.catalog.item import CatalogError

BLOCK = 4096  # rows assigned per GEMM


@dataclass
class Codebooks:
    codebooks: np.ndarray  # float32 [L, K, D]
    token_ids: np.ndarray  # int64 [L, K]

    @property
    def levels(self) -> int:
        return int(self.codebooks.shape[0])

    @property
    def size(self) -> int:
        return int(self.codebooks.shape[1])

    @property
    def dim(self) -> int:
        return int(self.codebooks.shape[2])

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            np.savez(f, codebooks=self.codebooks, token_ids=self.token_ids)

    @classmethod
    def load(cls, path: str, vocab_size: int | None = None, where: str = "--semantic-id-codebooks") -> "Codebooks":
        """The file's codebooks; CatalogError naming the file and the array that does not fit
        (a missing array, a wrong shape, a token id outside the vocabulary)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as e:
            raise CatalogError(f"{where} {path!r}: cannot read it as an .npz of codebooks ({e})") from None
        for name in ("codebooks", "token_ids"):
            if name not in arrays:
                raise CatalogError(f"{where} {path!r}: no {name!r} array (sid-train writes codebooks and token_ids)")
        cb, tok = arrays["codebooks"], arrays["token_ids"]
        if cb.ndim != 3 or 0 in cb.shape or cb.dtype.kind != "f":
            raise CatalogError(f"{where} {path!r}: codebooks must be float [levels, codes, dim], got {cb.dtype} "
                               f"{list(cb.shape)}")
        if tok.shape != cb.shape[:2] or tok.dtype.kind not in "iu":
            raise CatalogError(f"{where} {path!r}: token_ids must be integers [levels, codes] = {list(cb.shape[:2])}, "
                               f"got {tok.dtype} {list(tok.shape)}")
        if not np.isfinite(cb).all():
            raise CatalogError(f"{where} {path!r}: codebooks hold a value that is not finite")
        check_tokens(tok, vocab_size, f"{where} {path!r}")
        return cls(np.ascontiguousarray(cb, dtype=np.float32), tok.astype(np.int64))

    def assign(self, embeddings: np.ndarray) -> np.ndarray:
        """int64 [N, L]: each embedding's code per level (the levels' search arrays made once)."""
        if self.__dict__.get("_levels") is None:
            self._levels = [_Level(c) for c in self.codebooks]
        return assign(self.codebooks, embeddings, self._levels)

    def tokens(self, codes: np.ndarray) -> np.ndarray:
        """int64 [N, L]: the token ids of codes [N, L]."""
        return self.token_ids[np.arange(self.levels), codes]


def check_tokens(token_ids: np.ndarray, vocab_size: int | None, where: str) -> None:
    """CatalogError naming the first token id of [L, K] outside [0, vocab_size)."""
    bad = np.argwhere((token_ids < 0) | ((token_ids >= vocab_size) if vocab_size else False))
    if bad.size:
        lv, k = bad[0].tolist()
        raise CatalogError(f"{where}: token_ids[{lv}][{k}] is {int(token_ids[lv, k])}, not a token id in "
                           f"[0, {vocab_size}) of the model's vocabulary")


def train(embeddings: np.ndarray, levels: int, size: int, niter: int = 20, seed: int = 0,
          progress: bool = False) -> np.ndarray:
    """float32 [levels, size, D]: residual k-means codebooks (faiss.Kmeans per level, seeded)."""
    try:
        import faiss
    except ImportError:
        raise ValueError("training codebooks needs faiss: pip install 'sgrec[codebooks]'") from None

    x = _rows(embeddings, "embeddings")
    if not 1 <= size <= x.shape[0]:
        raise ValueError(f"--codebook-size must be in [1, {x.shape[0]}] (the number of embeddings), got {size}")
    if levels < 1:
        raise ValueError(f"--levels must be a positive integer, got {levels}")
    residual = x.copy()
    out = np.empty((levels, size, x.shape[1]), dtype=np.float32)
    for lv in range(levels):
        km = faiss.Kmeans(x.shape[1], size, niter=niter, seed=seed + lv, verbose=progress,
                          max_points_per_centroid=max(256, -(-x.shape[0] // size)))
        km.train(residual)
        out[lv] = km.centroids
        residual -= out[lv][nearest(residual, out[lv])]
    return out


def assign(codebooks: np.ndarray, embeddings: np.ndarray, levels: list | None = None) -> np.ndarray:
    """int64 [N, L]: level by level, the nearest codeword to the residual (ties to the lower code)."""
    x = _rows(embeddings, "embeddings")
    if x.shape[1] != codebooks.shape[2]:
        raise ValueError(f"embeddings have {x.shape[1]} dimensions, the codebooks {codebooks.shape[2]}")
    levels = levels or [_Level(c) for c in codebooks]
    codes = np.empty((x.shape[0], len(levels)), dtype=np.int64)
    for a in range(0, x.shape[0], BLOCK):
        residual = x[a : a + BLOCK].copy()
        for lv, level in enumerate(levels):
            c = level.nearest(residual)
            codes[a : a + BLOCK, lv] = c
            residual -= level.c[c]
    return codes


def nearest(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """int64 [N]: the index of each row's nearest centroid (squared L2), the lowest index on a tie;
    the same for a row whatever the other rows (see the module's docstring)."""
    level = _Level(centroids)
    return np.concatenate([level.nearest(x[a : a + BLOCK]) for a in range(0, len(x), BLOCK)])


class _Level:
    """One level's codewords, with what every block's search reuses."""

    def __init__(self, centroids: np.ndarray):
        self.c = np.ascontiguousarray(centroids, dtype=np.float32)
        self.m2t = np.ascontiguousarray(-2 * self.c.T)  # x @ m2t + |c|^2 = |x - c|^2 - |x|^2
        self.norm = np.einsum("ij,ij->i", self.c, self.c)
        self.max_norm = float(self.norm.max())
        self.eps = 4 * self.c.shape[1] * float(np.finfo(np.float32).eps)
        self.c64 = self.c.astype(np.float64)

    def nearest(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        if self.c.shape[0] == 1:
            return np.zeros(n, dtype=np.int64)
        dist = x @ self.m2t
        dist += self.norm
        rows = np.arange(n)
        out = dist.argmin(axis=1)
        best = dist[rows, out]
        dist[rows, out] = np.inf
        tol = self.eps * (np.einsum("ij,ij->i", x, x) + self.max_norm)
        close = np.flatnonzero(dist.min(axis=1) - best <= tol)
        if close.size:  # near-ties: the exact minimum is one of the codewords within tol of the best
            dist[close, out[close]] = best[close]
            i, j = np.nonzero(dist[close] - best[close, None] <= tol[close, None])
            diff = x[close[i]].astype(np.float64) - self.c64[j]
            exact = np.square(diff).sum(axis=1)  # each pair summed on its own: the same in any batch
            first = np.lexsort((j, exact, i))  # per row: the smallest distance, then the lowest code
            keep = first[np.r_[True, i[first][1:] != i[first][:-1]]]
            out[close[i[keep]]] = j[keep]
        return out.astype(np.int64)


def dedup_codes(paths: np.ndarray) -> np.ndarray:
    """int64 [N]: each row's place among the rows with the same path before it (0 for the first):
    the disambiguating level that gives every item a path of its own (TIGER's fourth level)."""
    paths = np.ascontiguousarray(paths)
    _, inv = np.unique(paths, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    order = np.argsort(inv, kind="stable")
    grouped = inv[order]
    start = np.r_[0, np.flatnonzero(np.diff(grouped)) + 1]
    rank = np.arange(grouped.size) - np.repeat(start, np.diff(np.r_[start, grouped.size]))
    out = np.empty(paths.shape[0], dtype=np.int64)
    out[order] = rank
    return out


def _rows(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 2 or 0 in a.shape or a.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a numeric [N, D] array, got {a.dtype} {list(a.shape)}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} hold a value that is not finite (row {int(np.argwhere(~np.isfinite(a))[0, 0])})")
    return a
