"""One beam-search level on the semantic-ID trie in Triton (xGR §6.1-6.3): each beam's log-probabilities
over its valid children, per-beam top-k, and the global top-m of every request of a round.

Inputs are plain tensors (the trie level in CSR form, the requests' filters as node lists):

    logits      [N, L]    each beam's logits: the whole vocabulary, or (restricted) only the
                          level's columns, level.level_col[token] being a token's column
    level       a TrieLevel: node x's children, in token order, are a run of positions; a
                          dense level's (SemanticIdTrie) are positions ptr[x] .. ptr[x + 1] - 1, each
                          position the child's id at the next depth; a LayeredTrie's leaf level's are
                          positions start[x] .. start[x] + count[x] - 1 of its arena, where a base
                          position is the child's slot and a tail position names it (tail_id)
    nodes       [N]       each beam's node; parent_scores [N] float32, its running score
    row_ptr     request r owns beams row_ptr[r] .. row_ptr[r + 1] - 1, keeps m[r] beams with per-beam top_k[r]
    filters[r]  None or (dense, allowed, blocked) at the next depth: a bool per node id (an attribute
                filter's count > 0), the sorted ids an include list allows, the sorted ids whose
                allowed count fell to 0 (exclusions); each may be None. A child is valid when it passes all.

What it computes is sgrec.beam.trie.children_logp followed by sgrec.beam.search.select_step:

  1. logp = log_softmax over each beam's valid children ((x - max) - log(sum exp(x - max)), float32);
  2. k = min(top_k, C), C the most children of any of the request's beams; the pool is each beam's k
     best children by (logp descending, token ascending); when k >= m and k >= global_min_k, or the
     pool holds fewer than m valid children while k < C, the pool is every valid child;
  3. score = parent_score + logp (float32); the kept beams are the pool's m best by (score
     descending, parent ascending, token ascending), returned in (parent, token) order with their
     score and child node.

Three kernels: `children` (one program per beam: the log-softmax, the filters by binary search, and
the beam's children sorted by (logp, token) with one tl.sort of (ordinal of logp, column) keys);
`select` (one program per request: the m-th best score by bisection over float ordinals, each count
a binary search per beam, whose sorted scores never increase; then how many of each beam's entries
above it and of the entries tied with it, in path order, are kept); `emit` (one program per beam:
its kept children in token order, written at the request's running offset). Under TRITON_INTERPRET=1
it runs on CPU tensors.

`trie_step_flat` reads nothing back to the host: a request's output rows are fixed in advance
(`plan_step`, made once per level of a round), its kept beams first and dead rows (score -inf) after,
and a beam whose score is -inf (a dead row of the previous level) has no children, so a round can
carry fixed row counts from level to level (sgrec.beam.device_round). `trie_step` returns each
request's kept beams alone (it reads the kept counts back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgrec.model.kernels import built, pow2

_KERNELS: dict[bool, object] = {}


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def children(LOGITS, s_l, LCOL, NODES, PSC, CPTR, CLEN, CTOK, TTOK, TID, base, ROWREQ, FILT, DENSE, ALLOWED,
                 BLOCKED, n_iter_f, SORT_S, SORT_C, S_COL, NVALID, NCHILD, BLOCK_C: tl.constexpr,
                 RESTRICTED: tl.constexpr, RUNS: tl.constexpr):
        b = tl.program_id(0)
        node = tl.load(NODES + b)
        start = tl.load(CPTR + node)
        if RUNS:
            cnt = tl.load(CLEN + node)
        else:
            cnt = tl.load(CPTR + node + 1) - start
        cnt = tl.where(tl.load(PSC + b) > float("-inf"), cnt, 0)  # a dead beam (score -inf): no children
        c = tl.arange(0, BLOCK_C)
        inr = c < cnt
        pos = start + c
        # each child's token and id at the next depth (the interpreter runs no nested jit function
        # defined here: emit repeats this lookup)
        if RUNS:
            tail = pos >= base
            tok = (tl.load(CTOK + pos, mask=inr & ~tail, other=0)
                   + tl.load(TTOK + (pos - base), mask=inr & tail, other=0))
            kid = tl.where(tail, tl.load(TID + (pos - base), mask=inr & tail, other=0), pos)
        else:
            tok = tl.load(CTOK + pos, mask=inr, other=0)
            kid = pos
        if RESTRICTED:
            col = tl.load(LCOL + tok, mask=inr, other=0)
        else:
            col = tok
        x = tl.load(LOGITS + b * s_l + col, mask=inr, other=0.0).to(tl.float32)
        f = FILT + tl.load(ROWREQ + b) * 5  # (dense offset or -1, allowed lo, hi or -1, -1, blocked lo, hi)
        valid = inr
        dense_off = tl.load(f)
        if dense_off >= 0:
            valid = valid & (tl.load(DENSE + dense_off + kid, mask=inr, other=0) != 0)
        for part in tl.static_range(2):  # an include list's ids (kept), an exclusion's (struck)
            lo = tl.load(f + 1 + 2 * part)
            hi = tl.load(f + 2 + 2 * part)
            if part == 0:
                ARR = ALLOWED
            else:
                ARR = BLOCKED
            left = tl.zeros([BLOCK_C], tl.int64) + lo  # lower bound of kid in ARR[lo:hi]
            right = tl.zeros([BLOCK_C], tl.int64) + hi
            for _ in range(n_iter_f):
                act = left < right
                mid = (left + right) >> 1
                below = act & (tl.load(ARR + mid, mask=act, other=0) < kid)
                left = tl.where(below, mid + 1, left)
                right = tl.where(act & ~below, mid, right)
            found = (left < hi) & (tl.load(ARR + left, mask=left < hi, other=-1) == kid)
            if part == 0:
                valid = valid & (found | (lo < 0))  # lo -1: no include list
            else:
                valid = valid & ~found
        n_valid = tl.sum(valid.to(tl.int32), 0)
        xm = tl.where(valid, x, float("-inf"))
        mx = tl.where(n_valid > 0, tl.max(xm, 0), 0.0)
        total = tl.sum(tl.where(valid, tl.exp(xm - mx), 0.0), 0)
        logp = (xm - mx) - tl.log(tl.maximum(total, 1.0))  # -inf off the valid children (total >= 1 if any)
        score = tl.load(PSC + b) + logp
        tl.store(S_COL + b * BLOCK_C + c, score)
        bits = logp.to(tl.int32, bitcast=True)
        o = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # a float's order as an int (no NaN here)
        key = (o.to(tl.int64) << 32) | (BLOCK_C - 1 - c).to(tl.int64)  # ties: the lower column first
        key = tl.sort(key, descending=True)
        hi_bits = (key >> 32).to(tl.int32)
        best = tl.where(hi_bits >= 0, hi_bits, hi_bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        tl.store(SORT_C + b * BLOCK_C + c, (BLOCK_C - 1 - (key & (BLOCK_C - 1))).to(tl.int32))
        tl.store(SORT_S + b * BLOCK_C + c, tl.where(c < n_valid, tl.load(PSC + b) + best, float("-inf")))
        tl.store(NVALID + b, n_valid)
        tl.store(NCHILD + b, cnt.to(tl.int32))

    @triton.jit
    def select(RP, MM, TOPK, NVALID, NCHILD, SORT_S, OUTOFF, P_ROW, E_ROW, T_ROW, OFF_ROW, TOTAL, global_min_k,
               n_iter_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0)
        a = tl.load(RP + r)
        i = tl.arange(0, BLOCK_R)
        row = a + i
        rok = i < tl.load(RP + r + 1) - a
        m = tl.load(MM + r)
        nv = tl.load(NVALID + row, mask=rok, other=0).to(tl.int64)
        C = tl.max(tl.load(NCHILD + row, mask=rok, other=0), 0).to(tl.int64)
        k = tl.minimum(tl.load(TOPK + r), C)
        every = ((k >= m) & (k >= global_min_k)) | ((tl.sum(tl.minimum(nv, k), 0) < m) & (k < C))
        lim = tl.minimum(nv, tl.where(every, C, k))  # each beam's pool: its first lim sorted children
        lo = tl.full([], -2147483648, tl.int64)  # the m-th best score's ordinal lies in [lo, hi]
        hi = tl.full([], 2147483647, tl.int64)
        above = tl.zeros([BLOCK_R], tl.int64)
        upto = tl.zeros([BLOCK_R], tl.int64)
        for it in range(34):  # 32 bisection steps, then the counts above the m-th score and up to it
            mid = (lo + hi + 1) >> 1
            t = tl.where(it < 32, mid, tl.where(it == 32, lo + 1, lo))
            left = tl.zeros([BLOCK_R], tl.int64)  # per beam: how many pool entries have ordinal >= t
            right = lim
            for _ in range(n_iter_c):
                act = left < right
                j = (left + right) >> 1
                s = tl.load(SORT_S + row * BLOCK_C + j, mask=rok & act, other=0.0)
                bits = s.to(tl.int32, bitcast=True)
                o = tl.where(s == 0.0, 0, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF))
                ge = act & (o.to(tl.int64) >= t)
                left = tl.where(ge, j + 1, left)
                right = tl.where(act & ~ge, j, right)
            enough = tl.sum(left, 0) >= m
            lo = tl.where((it < 32) & enough, mid, lo)
            hi = tl.where((it < 32) & ~enough, mid - 1, hi)
            above = tl.where(it == 32, left, above)
            upto = tl.where(it == 33, left, upto)
        few = tl.sum(lim, 0) <= m  # the whole pool is kept
        above = tl.where(few, lim, above)
        tied = tl.where(few, 0, upto - above)
        want = m - tl.sum(above, 0)  # ties with the m-th score: in path order, beam by beam
        take = tl.minimum(tl.maximum(want - (tl.cumsum(tied, 0) - tied), 0), tied)
        kept = above + take
        off = tl.load(OUTOFF + r) + tl.cumsum(kept, 0) - kept
        tl.store(P_ROW + row, above, mask=rok)
        tl.store(E_ROW + row, above + tied, mask=rok)
        tl.store(T_ROW + row, take, mask=rok)
        tl.store(OFF_ROW + row, off, mask=rok)
        tl.store(TOTAL + r, tl.sum(kept, 0))

    @triton.jit
    def emit(SORT_C, S_COL, NODES, CPTR, CLEN, CTOK, TTOK, TID, base, ROWREQ, OUTPTR, P_ROW, E_ROW, T_ROW, OFF_ROW,
             OUT_P, OUT_T, OUT_S, OUT_N, BLOCK_C: tl.constexpr, RUNS: tl.constexpr):
        b = tl.program_id(0)
        above = tl.load(P_ROW + b)
        upto = tl.load(E_ROW + b)
        take = tl.load(T_ROW + b)
        off = tl.load(OFF_ROW + b)
        j = tl.arange(0, BLOCK_C)
        c = tl.load(SORT_C + b * BLOCK_C + j)
        tied = (j >= above) & (j < upto)
        ties = tl.sort(tl.where(tied, c, BLOCK_C))  # the tied entries' columns, ascending
        last = tl.where(take > 0, tl.sum(tl.where(j == take - 1, ties, 0), 0), -1)
        kept = (j < above) | (tied & (c <= last))
        cols = tl.sort(tl.where(kept, c, BLOCK_C))  # the kept children in token order
        ok = (j < above + take) & (off + j < tl.load(OUTPTR + tl.load(ROWREQ + b) + 1))  # within its out rows
        col = tl.where(ok, cols, 0)
        pos = tl.load(CPTR + tl.load(NODES + b)) + col
        if RUNS:  # as in children
            tail = pos >= base
            tok = (tl.load(CTOK + pos, mask=ok & ~tail, other=0)
                   + tl.load(TTOK + (pos - base), mask=ok & tail, other=0))
            kid = tl.where(tail, tl.load(TID + (pos - base), mask=ok & tail, other=0), pos)
        else:
            tok = tl.load(CTOK + pos, mask=ok, other=0)
            kid = pos
        tl.store(OUT_P + off + j, tl.zeros([BLOCK_C], tl.int64) + b, mask=ok)
        tl.store(OUT_T + off + j, tok, mask=ok)
        tl.store(OUT_S + off + j, tl.load(S_COL + b * BLOCK_C + col, mask=ok, other=0.0), mask=ok)
        tl.store(OUT_N + off + j, kid, mask=ok)

    return children, select, emit


Filter = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _pack_filters(filters: list[Filter | None], device) -> tuple[torch.Tensor, ...]:
    """FILT [R, 5] (dense offset or -1, allowed lo, hi (-1, -1: no include list), blocked lo, hi)
    and the concatenated dense, allowed and blocked arrays; the most binary-search steps needed."""
    table, dense, allowed, blocked = [], [], [], []
    lens = {"dense": 0, "allowed": 0, "blocked": 0}
    longest = 0
    for f in filters:
        d, a, x = f if f is not None else (None, None, None)
        row = [-1, -1, -1, lens["blocked"], lens["blocked"]]
        if d is not None:
            row[0] = lens["dense"]
            dense.append(d.to(device, torch.int8))
            lens["dense"] += d.numel()
        if a is not None:
            row[1:3] = [lens["allowed"], lens["allowed"] + a.numel()]
            allowed.append(a.to(device, torch.int64))
            lens["allowed"] += a.numel()
            longest = max(longest, a.numel())
        if x is not None:
            row[4] = lens["blocked"] + x.numel()
            blocked.append(x.to(device, torch.int64))
            lens["blocked"] += x.numel()
            longest = max(longest, x.numel())
        table.append(row)

    def cat(parts, dtype):
        return torch.cat(parts) if parts else torch.zeros(1, dtype=dtype, device=device)

    return (torch.tensor(table, dtype=torch.int64, device=device), cat(dense, torch.int8), cat(allowed, torch.int64),
            cat(blocked, torch.int64), longest.bit_length())


@dataclass
class TrieLevel:
    """A trie level as the kernel reads it (module doc): node x's children are the positions
    ptr[x] .. ptr[x + 1] - 1 (count None: CSR), or ptr[x] .. ptr[x] + count[x] - 1 (runs). A
    position p < base holds the token tok[p] and is the child's id; p >= base holds the token
    tail_tok[p - base] and the child tail_id[p - base]. A dense level has no tail (base: all).
    level_col: each vocabulary id's column among the level's logit columns (None: unrestricted)."""

    ptr: torch.Tensor
    tok: torch.Tensor
    max_children: int
    level_col: torch.Tensor | None = None
    count: torch.Tensor | None = None
    tail_tok: torch.Tensor | None = None
    tail_id: torch.Tensor | None = None
    base: int = 0

    @property
    def runs(self) -> bool:
        return self.count is not None


@dataclass
class StepPlan:
    """What a level's launch needs that the beams' values do not decide, on the device: made once
    per level of a round (host to device copies), so a round's steps read nothing back. Request r
    owns input beams row_ptr[r] .. row_ptr[r + 1] - 1 and output rows out_ptr[r] ..
    out_ptr[r + 1] - 1; it keeps at most m[r] beams, written while its output rows last."""

    row_ptr: list[int]
    out_ptr: list[int]
    rowreq: torch.Tensor  # [n] each input beam's request
    dev_row_ptr: torch.Tensor
    dev_m: torch.Tensor
    dev_top_k: torch.Tensor
    dev_out_ptr: torch.Tensor
    dead_parent: torch.Tensor  # [out rows] a dead output row's parent: its request's first beam
    filters: tuple  # _pack_filters' (table, dense, allowed, blocked, binary-search steps)


def plan_step(row_ptr: list[int], top_k: list[int], m: list[int], filters: list[Filter | None] | None,
              device, out_rows: list[int] | None = None) -> StepPlan:
    """A StepPlan; out_rows[r] (default m[r]) output rows for request r: at least the beams it can
    keep (min(m[r], the level's nodes) when its beams are distinct nodes), or the rest are dropped."""
    R = len(row_ptr) - 1
    out_rows = list(m) if out_rows is None else out_rows
    out_ptr = [0]
    for x in out_rows:
        out_ptr.append(out_ptr[-1] + x)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64).to(device)  # noqa: E731
    counts = [row_ptr[r + 1] - row_ptr[r] for r in range(R)]
    return StepPlan(list(row_ptr), out_ptr, torch.repeat_interleave(torch.arange(R), torch.tensor(counts)).to(device),
                    ints(row_ptr), ints(m), ints(top_k), ints(out_ptr),
                    torch.repeat_interleave(torch.tensor(row_ptr[:-1]), torch.tensor(out_rows)).to(device),
                    _pack_filters(filters or [None] * R, device))


def trie_step_flat(logits: torch.Tensor, level: TrieLevel, nodes: torch.Tensor, parent_scores: torch.Tensor,
                   plan: StepPlan, restricted: bool = False, global_min_k: int = 256) -> tuple[torch.Tensor, ...]:
    """See the module doc; no value is read back to the host. Returns (parents, tokens, scores,
    child nodes, kept): request r's out rows out_ptr[r] .. hold its kept beams first, in (parent,
    token) order, then dead rows (score -inf, token 0, node 0, parent its first beam); a parent is
    a row of the input (0 .. n - 1); kept [R] how many each request kept. A dead input beam (score
    -inf) has no children. restricted: the logits hold only the level's columns (level.level_col)."""
    n, dev = nodes.numel(), nodes.device
    R = len(plan.row_ptr) - 1
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_c = pow2(max(2, level.max_children))
    children, select, emit = built(_KERNELS, _build)
    filt, dense, allowed, blocked, n_iter_f = plan.filters
    sort_s = torch.empty(n, block_c, dtype=torch.float32, device=dev)
    s_col = torch.empty_like(sort_s)
    sort_c = torch.empty(n, block_c, dtype=torch.int32, device=dev)
    n_valid = torch.empty(n, dtype=torch.int32, device=dev)
    n_child = torch.empty_like(n_valid)
    warps = 4 if block_c <= 1024 else 8
    lcol = level.level_col if restricted else level.ptr  # unread when not restricted
    runs = level.runs
    clen, ttok, tid = (x if runs else level.ptr for x in (level.count, level.tail_tok, level.tail_id))  # unread: CSR
    trie = (level.ptr, clen, level.tok, ttok, tid, level.base if runs else 0)
    children[(n,)](logits, logits.stride(0), lcol, nodes, parent_scores.float().contiguous(), *trie,
                   plan.rowreq, filt, dense, allowed, blocked, n_iter_f, sort_s, sort_c, s_col, n_valid, n_child,
                   BLOCK_C=block_c, RESTRICTED=restricted, RUNS=runs, num_warps=warps)
    p_row, e_row, t_row, off_row = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(4))
    kept = torch.empty(R, dtype=torch.int64, device=dev)  # what select keeps (emit drops past the out rows)
    widest = max(plan.row_ptr[r + 1] - plan.row_ptr[r] for r in range(R))
    select[(R,)](plan.dev_row_ptr, plan.dev_m, plan.dev_top_k, n_valid, n_child, sort_s, plan.dev_out_ptr, p_row,
                 e_row, t_row, off_row, kept, global_min_k, block_c.bit_length(), BLOCK_R=pow2(max(2, widest)),
                 BLOCK_C=block_c)
    out_p = plan.dead_parent.clone()
    out_t, out_n = (torch.zeros(plan.out_ptr[-1], dtype=torch.int64, device=dev) for _ in range(2))
    out_s = torch.full((plan.out_ptr[-1],), float("-inf"), dtype=torch.float32, device=dev)
    emit[(n,)](sort_c, s_col, nodes, *trie, plan.rowreq, plan.dev_out_ptr, p_row, e_row, t_row, off_row,
               out_p, out_t, out_s, out_n, BLOCK_C=block_c, RUNS=runs, num_warps=warps)
    return out_p, out_t, out_s, out_n, kept


def trie_step(logits: torch.Tensor, level: TrieLevel, nodes: torch.Tensor, parent_scores: torch.Tensor,
              row_ptr: list[int], top_k: list[int], m: list[int], restricted: bool = False,
              filters: list[Filter | None] | None = None,
              global_min_k: int = 256) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """trie_step_flat per request: (parents (its beam indices), tokens, scores, child nodes), in
    (parent, token) order, min(m, its pool) of them (reads the kept counts back)."""
    plan = plan_step(row_ptr, top_k, m, filters, nodes.device)
    out_p, out_t, out_s, out_n, kept = trie_step_flat(logits, level, nodes, parent_scores, plan, restricted,
                                                      global_min_k)
    out = []
    for r, k in enumerate(kept.tolist()):
        sl = slice(plan.out_ptr[r], plan.out_ptr[r] + k)
        out.append((out_p[sl] - row_ptr[r], out_t[sl], out_s[sl], out_n[sl]))
    return out
