"""xBeam selection (xGR §2.2, §6.2-6.3): per-beam top-K, global top-BW with early termination,
beam buffers reused in place.

Ordering contract (shared with the naive reference in reference.py, so results compare exactly):
a step keeps the m best candidates by accumulated log-probability, ties going to the
lexicographically smaller path; the kept beams are stored in lexicographic path order (sorted by
(parent row, token)), which makes parent indices non-decreasing: the property the in-place reorder
below relies on. Final results are sorted by score, ties by path. A beam's per-beam top-K breaks a
tie at its K-th place the same way: the smaller token (`per_beam_topk`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgrec.beam.filters import TrieFilter
from sgrec.beam.trie import SemanticIdTrie, children_logp
from sgrec.mem.kv_pool import copyable

# per-beam top-k at or above this k (and >= the beams kept) is replaced by one global selection; both
# give the same beams: below it the per-row top-k is as fast (measured: [512, 3392] scores, k 128)
GLOBAL_SELECT_MIN_K = 256

NEG_INF = float("-inf")


def per_beam_topk(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k best (log-prob, column), sorted descending; -inf where a row has fewer than k
    valid tokens. Values tied across the k-th place go to the lower columns (torch.topk alone
    leaves that choice open): a row where more than k entries are >= its k-th value is redone with
    a stable sort, as the naive reference and the Triton trie step (which rank by (value, column))
    do."""
    k = min(k, logp.shape[-1])
    vals, toks = torch.topk(logp, k, dim=-1, largest=True, sorted=True)
    if 0 < k < logp.shape[-1]:
        kth = vals[:, -1:]
        split = ((logp >= kth).sum(-1) > k) & torch.isfinite(kth[:, 0])
        if bool(split.any()):
            rows = split.nonzero().flatten()
            srt = torch.sort(logp[rows], dim=-1, descending=True, stable=True)
            vals[rows], toks[rows] = srt.values[:, :k], srt.indices[:, :k]
    return vals, toks


def _ordered_top(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, m: int, vocab: int):
    """Top m of flat candidates by score, ties by (parent, token); returned in (parent, token) order."""
    flat = parents * vocab + tokens
    by_path = torch.argsort(flat)
    order = torch.sort(scores[by_path], descending=True, stable=True).indices[:m]
    keep = by_path[order]
    keep = keep[torch.argsort(flat[keep])]
    return parents[keep], tokens[keep], scores[keep]


def select_beams(cand: torch.Tensor, cand_tok: torch.Tensor, m: int, vocab: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Global top-m of a [n, k] candidate pool whose rows are sorted descending (-inf = no candidate).

    Early termination, vectorised: the m-th best value of the first c columns is a lower bound tau
    on the m-th best of the pool. A row whose entry at column c is below tau (or missing) cannot
    contribute anything past column c, so its scan stops there; while some row has not stopped, c
    doubles. Then only the block's entries >= tau are ranked. Returns (parent, token, score,
    candidates ranked), the kept candidates in (parent, token) order; fewer than m when the pool
    has fewer finite entries.
    """
    n, k = cand.shape
    if n == 0 or k == 0 or m <= 0:
        empty = cand.new_empty(0, dtype=torch.int64)
        return empty, empty.clone(), cand.new_empty(0), 0
    c = min(k, -(-m // n))
    while True:
        block = cand[:, :c]
        if block.numel() >= m:
            tau = torch.topk(block.reshape(-1), m, sorted=False).values.min()
        else:
            tau = torch.tensor(NEG_INF, device=cand.device)
        if c >= k:
            break
        nxt = cand[:, c]
        if bool(((nxt < tau) | torch.isneginf(nxt)).all()):
            break
        c = min(k, 2 * c)
    keep = torch.isfinite(block) & (block >= tau)
    rows = torch.arange(n, device=cand.device)[:, None].expand(n, c)
    p, t, s = _ordered_top(block[keep], rows[keep], cand_tok[:, :c][keep], m, vocab)
    return p, t, s, int(keep.sum())


def select_global(scores: torch.Tensor, toks: torch.Tensor, m: int, vocab: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top m of an [n, C] score matrix whose column j of row i is token toks[i, j] (-inf = not a
    candidate), no per-row cap: what per-beam top-K then global top-m gives when K >= m (a row can
    place at most m anyway), in one pass instead of n sorted per-row top-Ks. Same contract: ties by
    path, (parent, token) order."""
    flat = scores.reshape(-1)
    tau = torch.topk(flat, min(m, flat.numel()), sorted=False).values.min()
    keep = torch.nonzero((flat >= tau) & torch.isfinite(flat)).flatten()  # ties at tau included
    return _ordered_top(flat[keep], keep // scores.shape[1], toks.reshape(-1)[keep], m, vocab)


def select_beams_full_sort(cand: torch.Tensor, cand_tok: torch.Tensor, m: int, vocab: int):
    """Reference: the whole pool sorted, no early termination."""
    n, k = cand.shape
    finite = torch.isfinite(cand)
    rows = torch.arange(n, device=cand.device)[:, None].expand(n, k)
    return _ordered_top(cand[finite], rows[finite], cand_tok[finite], m, vocab)


# ---- in-place reorder ---------------------------------------------------------------------------
def inplace_schedule(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write order for new_row[i] = old_row[parents[i]] done in one buffer (xGR §5.1).

    parents must be non-decreasing. direction[i] is +1 when row i is filled from below
    (parents[i] > i, an "upward" write), -1 when filled from above, 0 when it stays. Upward writes
    go first in ascending i, then the downward ones in descending i. Why no row is overwritten
    before it is read: an upward write to i reads p[i] > i, which no earlier upward write (targets
    < i) touched; a downward write to i reads j = p[i] < i, and j is never an upward target
    (p[j] <= p[i] = j) nor an earlier downward target (those are > i). The same holds for any
    chunked execution that reads a chunk's sources before writing its targets.
    Returns (dst rows, src rows, direction) in write order; rows that stay are left out.
    """
    n = parents.numel()
    if n > 1 and bool((parents[1:] < parents[:-1]).any()):
        raise ValueError("inplace_schedule needs non-decreasing parent indices")
    i = torch.arange(n, device=parents.device)
    direction = torch.sign(parents - i)
    up = torch.nonzero(direction > 0).flatten()  # ascending
    down = torch.nonzero(direction < 0).flatten().flip(0)  # descending
    dst = torch.cat([up, down])
    return dst, parents[dst], direction


def apply_schedule_(buf: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, chunk: int = 64) -> None:
    """buf[dst[j]] = buf[src[j]] in schedule order, `chunk` writes at a time (each chunk reads its
    sources, then writes): one buffer, at most `chunk` rows in flight. dst/src index dim 0 of buf;
    they may be [W, c] (a row of c buffer rows per write)."""
    buf = copyable(buf)
    for a in range(0, dst.shape[0], chunk):
        d, s = dst[a:a + chunk].reshape(-1), src[a:a + chunk].reshape(-1)
        buf.index_copy_(0, d, buf.index_select(0, s))


def reorder_rows_(buf: torch.Tensor, parents: torch.Tensor, chunk: int = 64,
                  schedule: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """buf[:len(parents)] = buf[parents] in place (parents non-decreasing). `schedule`:
    inplace_schedule(parents)'s (dst, src), when the caller already has it."""
    dst, src = schedule if schedule is not None else inplace_schedule(parents)[:2]
    apply_schedule_(buf, dst, src, chunk)


# ---- per-request beam buffers -------------------------------------------------------------------
@dataclass
class BeamBuffers:
    """[BW, ND] tokens plus scores, parents and trie nodes, allocated once per request; `n` rows live."""

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor
    nodes: torch.Tensor
    n: int = 0

    @classmethod
    def allocate(cls, beam_width: int, depth: int, device: torch.device | str = "cpu") -> "BeamBuffers":
        return cls(
            tokens=torch.zeros(beam_width, depth, dtype=torch.int64, device=device),
            scores=torch.zeros(beam_width, dtype=torch.float32, device=device),
            parents=torch.zeros(beam_width, dtype=torch.int64, device=device),
            nodes=torch.zeros(beam_width, dtype=torch.int64, device=device),
        )

    def advance_(self, step: int, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor,
                 nodes: torch.Tensor, chunk: int = 64,
                 schedule: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Rows 0..m-1 become the kept candidates: their paths are the parents' first `step` tokens
        (rewritten in place) plus the new token."""
        m = parents.numel()
        if step > 0:
            reorder_rows_(self.tokens[:, :step], parents, chunk, schedule)
        self.tokens[:m, step] = tokens
        self.parents[:m] = parents
        self.scores[:m] = scores
        self.nodes[:m] = nodes
        self.n = m


def select_level(logits: torch.Tensor, trie: SemanticIdTrie, depth: int, parent_nodes: torch.Tensor,
                 parent_scores: torch.Tensor, filt: TrieFilter | None, top_k: int, m: int, restricted: bool):
    """Level `depth` of one request, in torch: its kept (parents, tokens, scores, child nodes), in
    (parent, token) order (children_logp, select_step, the children's node ids)."""
    logp, toks = children_logp(logits, trie, depth, parent_nodes, filt, restricted)
    parents, tokens, scores = select_step(logp, toks, parent_scores, top_k, m, trie.vocab_size)
    return parents, tokens, scores, trie.child_nodes(depth, parent_nodes[parents], tokens)


def select_step(logp: torch.Tensor, toks: torch.Tensor, parent_scores: torch.Tensor, top_k: int, m: int,
                vocab: int):
    """A level's kept (parent, token, score) from each beam's children (children_logp: logp and
    tokens [n, C]): per-beam top-k, then the global top m. When the top-k pool holds fewer than m
    valid candidates, every valid child competes (k = C), so a level keeps min(m, valid children)
    beams: with filters, num_items come back whenever that many allowed items exist."""
    fanout = logp.shape[1]
    k = min(top_k, fanout)
    if k >= m and k >= GLOBAL_SELECT_MIN_K:  # the per-beam cap cannot bind: one global pass is cheaper
        return select_global(parent_scores[:, None] + logp, toks, m, vocab)
    while True:
        vals, cols = per_beam_topk(logp, k)
        parents, tokens, scores, _ = select_beams(parent_scores[:, None] + vals, toks.gather(1, cols), m, vocab)
        if parents.numel() >= m or k >= fanout:
            return parents, tokens, scores
        k = fanout
