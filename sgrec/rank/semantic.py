"""Ranking candidates by their semantic-ID path.

A candidate's score is the teacher-forced log-likelihood of its ND-token path right after the rank
prompt: log p(s1 | prompt) + log p(s2 | prompt, s1) + ... (full-vocabulary log_softmax). Path token
k sits at position last + k (last: the position of the layout's last token), sees every token of
the layout and, causally, the path tokens before it.

All candidates of a request are computed together over their sub-trie, in the rank forward
itself: after the layout's tokens its sequence holds one row per distinct path prefix (its last
token; `path_rows`), which sees the whole layout and, causally, its own prefix's rows. Teacher
forcing knows every path token up front, so every level of every candidate is in that one forward,
next to the layout, and the layout's KV (cached or fresh) is read in place, never copied per
candidate; the last path token needs no row. The layout's last token gives level 0's logits, the
path rows the others (`path_logliks`). `reference_loglik` is the plain one-candidate-at-a-time
reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgrec.model.attention import SeqLayout

SCORE_BY = ("auto", "id_token", "semantic_id")

Path = tuple[int, ...]


def _names(ids: list[str]) -> str:
    return ", ".join(repr(i) for i in ids[:5]) + (" ..." if len(ids) > 5 else "")


def _has(ids: list[str]) -> str:
    return "has" if len(ids) == 1 else "have"


def resolve_score_by(items, score_by: str | None) -> str:
    """"id_token" or "semantic_id" for these candidates (catalog Items); ValueError naming the
    candidates the asked form (or, under auto, every form) cannot score."""
    score_by = "auto" if score_by is None else score_by
    if score_by not in SCORE_BY:
        raise ValueError(f"score_by must be one of {', '.join(SCORE_BY)}; got {score_by!r}")
    no_id = [it.id for it in items if it.id_token is None]
    no_sem = [it.id for it in items if it.semantic_id is None]
    if score_by == "id_token" and no_id:
        raise ValueError(f"items: {_names(no_id)} {_has(no_id)} no id_token; use score_by semantic_id")
    if score_by == "semantic_id" and no_sem:
        raise ValueError(f"items: {_names(no_sem)} {_has(no_sem)} no semantic_id; use score_by id_token")
    if score_by != "auto":
        return score_by
    if not no_id:
        return "id_token"
    if not no_sem:
        return "semantic_id"
    neither = [i for i in no_id if i in set(no_sem)]
    if neither:
        raise ValueError(f"items: {_names(neither)} {_has(neither)} neither id_token nor semantic_id")
    raise ValueError(f"items: no score_by fits every candidate: {_names(no_sem)} {_has(no_sem)} no semantic_id, "
                     f"{_names(no_id)} {_has(no_id)} no id_token")


class PathTrie:
    """The sub-trie of one request's candidate paths (all of length depth): levels[l - 1] lists
    the distinct prefixes of length l (1 <= l < depth), sorted; each needs one forward row and
    one KV slot."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = [tuple(int(t) for t in p) for p in paths]
        self.depth = len(self.paths[0])
        if any(len(p) != self.depth for p in self.paths):
            raise ValueError("semantic_id paths of one request must have the same length")
        self.levels = [sorted({p[:l] for p in self.paths}) for l in range(1, self.depth)]

    def prefixes(self) -> list[Path]:
        """Every distinct prefix of length 1 .. depth - 1, shortest first: the path rows."""
        return [p for lv in self.levels for p in lv]

    def num_rows(self) -> int:
        """Path rows forwarded (= KV slots they need)."""
        return sum(len(lv) for lv in self.levels)


def path_rows(trie: PathTrie, last_pos: int, layout_cols: int) -> tuple[list[int], list[int], torch.Tensor]:
    """The path rows a rank forward appends to its layout's sequence, one per distinct prefix in
    level order (trie.prefixes()), their KV after the layout's: (tokens, positions, bool mask
    [R, layout_cols + R]). The row of a prefix of length l holds its last token at position
    last_pos + l and sees every one of the layout's `layout_cols` columns and the rows of its own
    prefixes of length 1..l (itself last)."""
    prefixes = trie.prefixes()
    row_of = {p: r for r, p in enumerate(prefixes)}
    rows, cols = [], []
    for r, p in enumerate(prefixes):
        rows += [r] * len(p)
        cols += [layout_cols + row_of[p[:k]] for k in range(1, len(p) + 1)]
    mask = torch.zeros(len(prefixes), layout_cols + len(prefixes), dtype=torch.bool)
    mask[:, :layout_cols] = True
    mask[rows, cols] = True
    return [p[-1] for p in prefixes], [last_pos + len(p) for p in prefixes], mask


def path_logliks(trie: PathTrie, logits0: torch.Tensor, path_logits: torch.Tensor) -> torch.Tensor:
    """float32 log-likelihoods [len(trie.paths)] in path order, from the logits at the layout's last
    token (level 0, [V]) and at the path rows ([trie.num_rows(), V], path_rows' order): per path
    the full-vocabulary log-probability of each of its tokens after its prefix, summed."""
    dev = path_logits.device
    lp = torch.log_softmax(torch.cat([logits0.reshape(1, -1), path_logits]).float(), -1)
    row_of = {(): 0}
    row_of.update((p, r + 1) for r, p in enumerate(trie.prefixes()))
    r_idx = torch.tensor([[row_of[p[:l]] for l in range(trie.depth)] for p in trie.paths], device=dev)
    t_idx = torch.tensor(trie.paths, dtype=torch.int64, device=dev)
    return lp[r_idx, t_idx].sum(1)


def reference_loglik(runner, lay, path: Path) -> float:
    """One candidate the plain way: the layout's tokens + path[:-1] as one sequence computed from
    scratch under the layout's mask extended (path rows see every layout token and, causally, the
    path), log_softmax summed over the path's positions. Takes len(lay) + len(path) - 1 free slots
    (the caller makes room) and frees them; reads no cache."""
    T, nd = len(lay), len(path)
    n = T + nd - 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:T, :T] = lay.mask()
    mask[T:, :T] = True
    mask[T:, T:] = torch.ones(nd - 1, nd - 1, dtype=torch.bool).tril()
    ids = list(lay.token_ids) + [int(t) for t in path[:-1]]
    pos = list(lay.positions) + [lay.positions[-1] + k for k in range(1, nd)]
    alloc = runner.memory.allocator
    slots = alloc.alloc(n)
    if slots is None:
        raise RuntimeError(f"reference_loglik: no room for {n} slots")
    try:
        batch = runner.make_batch(ids, pos, slots, [SeqLayout(0, n, slots, mask)])
        logits = runner.forward(batch, list(range(T - 1, n)))
        logp = torch.log_softmax(logits.float(), -1)
        return sum(float(logp[k, int(t)]) for k, t in enumerate(path))
    finally:
        alloc.free(slots)
