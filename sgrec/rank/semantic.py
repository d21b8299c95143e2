"""Ranking candidates by their semantic-ID path (issue 21).

A candidate's score is the teacher-forced log-likelihood of its ND-token path right after the rank
prompt: log p(s1 | prompt) + log p(s2 | prompt, s1) + ... (full-vocabulary log_softmax). Path token
k sits at position last + k (last: the position of the layout's last token), sees every token of
the layout and, causally, the path tokens before it.

All candidates of a request are computed together over their sub-trie with
staged attention (sgrec.beam.attention): the rank forward gives the level-0 logits; level l forwards
one row per distinct prefix of length l (its last token), whose shared KV is the whole layout and
whose unshared KV is the slots of that prefix's tokens. The last path token needs no forward.
`walk` does this for several requests at once, every level in one forward (teacher forcing knows
all path tokens up front); `reference_loglik` is the
plain one-candidate-at-a-time reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgrec.beam.attention import BeamBatchMeta, BeamStepMeta, StagedBeamBackend
from sgrec.model.attention import ForwardBatch, SeqLayout

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

    def num_rows(self) -> int:
        """Tokens forwarded by the walk (= KV slots it needs)."""
        return sum(len(lv) for lv in self.levels)


@dataclass
class WalkJob:
    """One request's walk: its trie, the slots of its whole layout (the shared KV), the position of
    the layout's last token, its level-0 logits [V] and trie.num_rows() slots for the path tokens."""

    trie: PathTrie
    shared: torch.Tensor
    last_pos: int
    logits0: torch.Tensor
    slots: torch.Tensor


def walk(runner, jobs: list[WalkJob]) -> list[torch.Tensor]:
    """Per job the float32 log-likelihoods [len(paths)] of its paths, in path order. Teacher
    forcing knows every path token up front, so every level of every job runs in ONE forward: a
    BeamBatchMeta group per (job, level l) whose rows attend to the job's layout and to their own
    l path slots (each layer writes all rows' KV before any attends). Writes KV only into job.slots."""
    dev, backend = runner.device, StagedBeamBackend()
    slot_of: list[dict[Path, int]] = []
    for j in jobs:
        prefixes = [p for lv in j.trie.levels for p in lv]
        slot_of.append(dict(zip(prefixes, j.slots.tolist())))
    groups, toks, pos, locs = [], [], [], []
    for b, j in enumerate(jobs):
        shared = j.shared.to(dev)  # one tensor for the job's levels: their shared stage runs once
        for l in range(1, j.trie.depth):
            prefixes = j.trie.levels[l - 1]
            idx = torch.tensor([[slot_of[b][p[:k]] for k in range(1, l + 1)] for p in prefixes],
                               dtype=torch.int64, device=dev)
            groups.append(BeamStepMeta(shared, idx))
            toks += [p[-1] for p in prefixes]
            pos += [j.last_pos + l] * len(prefixes)
            locs.append(idx[:, -1])
    logits = None
    if groups:
        batch = ForwardBatch(input_ids=torch.tensor(toks, dtype=torch.int64, device=dev),
                             positions=torch.tensor(pos, dtype=torch.int64, device=dev),
                             out_cache_loc=torch.cat(locs).contiguous(), seqs=[], kv_pool=runner.kv_pool,
                             attn_meta=groups[0] if len(groups) == 1 else BeamBatchMeta(groups))
        model = runner.model
        logits = model.compute_logits(model(batch, backend))
    out, a = [], 0
    for j in jobs:
        lp = [torch.log_softmax(j.logits0.float(), -1)[None]]
        for lv in j.trie.levels:
            lp.append(torch.log_softmax(logits[a : a + len(lv)].float(), -1))
            a += len(lv)
        rows = [{p: r for r, p in enumerate(lv)} for lv in [[()]] + j.trie.levels]
        r_idx = torch.tensor([[rows[l][p[:l]] for l in range(j.trie.depth)] for p in j.trie.paths], device=dev)
        t_idx = torch.tensor(j.trie.paths, dtype=torch.int64, device=dev)
        per_level = [lp[l][r_idx[:, l], t_idx[:, l]] for l in range(j.trie.depth)]
        out.append(torch.stack(per_level, 1).sum(1))
    return out


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
    alloc = runner.kv_pool.allocator
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
