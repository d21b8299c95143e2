"""Semantic IDs: three levels of hierarchical k-means over item features, plus a final
disambiguation level so that every item has a unique path (TIGER-style codes).

Features per movie: co-occurrence embedding (truncated SVD of the movie x user matrix of the
training interactions, L2-normalised), genre multi-hot and release year. Level 1 clusters all
movies, level 2 each level-1 cluster, level 3 each level-2 cluster; level 4 numbers the movies
that share a level-3 leaf (0 for most). Deterministic given the seed. `node_codes` renumbers
levels 2 and 3 by trie node (the packaged model's tokens: 16 + 256 + 1,536 + 16 of them).
"""

from __future__ import annotations

import numpy as np

GENRE_WEIGHT = 0.6
YEAR_WEIGHT = 0.5


def kmeans(x: np.ndarray, k: int, rng: np.random.Generator, iters: int = 40) -> np.ndarray:
    """Labels of Lloyd's k-means with k-means++ seeding (k clipped to the number of distinct rows)."""
    n = len(x)
    k = min(k, len(np.unique(x, axis=0)))
    if k <= 1:
        return np.zeros(n, dtype=np.int64)
    centers = [x[rng.integers(n)]]
    d2 = ((x - centers[0]) ** 2).sum(1)
    for _ in range(1, k):
        p = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
        c = x[rng.choice(n, p=p)]
        centers.append(c)
        d2 = np.minimum(d2, ((x - c) ** 2).sum(1))
    c = np.stack(centers)
    labels = np.zeros(n, dtype=np.int64)
    for it in range(iters):
        dist = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)
        new = dist.argmin(1)
        if it and (new == labels).all():
            break
        labels = new
        for j in range(k):
            members = x[labels == j]
            if len(members):
                c[j] = members.mean(0)
    # relabel clusters by size (largest first), then by smallest member, for stable codes
    order = sorted(range(k), key=lambda j: (-(labels == j).sum(), int(np.argmax(labels == j))))
    remap = np.empty(k, dtype=np.int64)
    remap[order] = np.arange(k)
    return remap[labels]


def item_features(movie_ids: list[int], movies: dict, train_sequences: dict[int, list[int]], dim: int = 32) -> np.ndarray:
    """[num_movies, dim + genres + 1] float features, rows in `movie_ids` order."""
    index = {m: i for i, m in enumerate(movie_ids)}
    users = sorted(train_sequences)
    mat = np.zeros((len(movie_ids), len(users)), dtype=np.float64)
    for j, u in enumerate(users):
        for m in train_sequences[u]:
            mat[index[m], j] = 1.0
    mat /= np.sqrt(mat.sum(1, keepdims=True) + 1.0)
    u_, s, _ = np.linalg.svd(mat, full_matrices=False)
    emb = u_[:, :dim] * s[:dim]
    emb /= np.linalg.norm(emb, axis=1, keepdims=True) + 1e-9
    genres = sorted({g for m in movie_ids for g in movies[m].genres})
    gh = np.zeros((len(movie_ids), len(genres)))
    for i, m in enumerate(movie_ids):
        for g in movies[m].genres:
            gh[i, genres.index(g)] = 1.0
    gh /= np.sqrt(gh.sum(1, keepdims=True) + 1e-9)
    years = np.array([movies[m].year or 1990 for m in movie_ids], dtype=np.float64)
    year = ((years - years.mean()) / (years.std() + 1e-9))[:, None]
    return np.concatenate([emb, GENRE_WEIGHT * gh, YEAR_WEIGHT * year / 2], axis=1)


def hierarchical_codes(x: np.ndarray, branching: tuple[int, ...] = (16, 16, 16), seed: int = 0) -> np.ndarray:
    """int64 [n, len(branching) + 1]: the k-means cluster at each level and a final
    disambiguation index; every row is unique."""
    rng = np.random.default_rng(seed)
    n = len(x)
    codes = np.zeros((n, len(branching) + 1), dtype=np.int64)
    groups = [np.arange(n)]
    for level, k in enumerate(branching):
        nxt = []
        for g in groups:
            labels = kmeans(x[g], k, rng)
            codes[g, level] = labels
            nxt += [g[labels == j] for j in range(labels.max() + 1)]
        groups = [g for g in nxt if len(g)]
    for g in groups:
        codes[g, -1] = np.arange(len(g))
    assert len({tuple(r) for r in codes}) == n
    return codes


def node_codes(codes: np.ndarray) -> np.ndarray:
    """The same paths with every k-means level after the first numbered by its trie node (the
    distinct prefix up to that level, in lexicographic order) instead of by its index among its
    siblings: each such token then names one cluster of movies, whatever its parent, so its
    (tied) embedding can sit with its movies'. The first and the disambiguation level are kept."""
    out = codes.copy()
    for level in range(1, codes.shape[1] - 1):
        _, inverse = np.unique(codes[:, : level + 1], axis=0, return_inverse=True)
        out[:, level] = inverse.reshape(-1)
    assert len({tuple(r) for r in out}) == len(out)
    return out
