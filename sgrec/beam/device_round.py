"""A retrieve round whose beam steps read nothing back to the host (xGR §7's multi-round
pipeline): the path of --attention-backend triton, where each level's selection is the Triton trie
step (sgrec.model.kernels.trie_step) and each beam step's attention the batched staged kernel.

What makes a step free of host reads is that every shape in it is known before the round starts.
Request r keeps at most m_r(d) beams at level d (its beam width; at the last level also at most
num_items), and no more than the trie has nodes at depth d + 1, so its rows at depth d + 1 are

    n_r[d + 1] = min(m_r(d), trie.num_nodes[d + 1])

fixed before any beam is scored. Where a request keeps fewer (filters, a short pool), the rest of
its rows are dead: score -inf, no children (the trie step skips them), and their logits unread. So
the round's tensors -- the beams' tokens, scores and nodes in one flat buffer (request r's rows
one block), the prompts' slots, each step's positions, slots and kernel block table, each level's
selection plan -- are made once, after the prefill (the round's one host-to-device upload), and the
steps only launch kernels: the forward, the trie step, and the reorder of the kept beams' tokens
and unshared K/V, gathered from their parents' rows (a gather into a new tensor, then a scatter:
the parents' rows are read before any row is written). The round reads the kept counts back once,
at its end.

The kept beams are the torch path's (sgrec.beam.search.select_level), ties included: dead rows
change neither a request's pool nor its widest beam (tests/triton_interpreted.py).
"""

from __future__ import annotations

import torch

from sgrec.beam.attention import StagedMeta
from sgrec.beam.kernel_step import level, level_filter
from sgrec.beam.search import BeamBuffers
from sgrec.model.kernels.staged_attention import BLOCK_B, beam_blocks
from sgrec.model.kernels.trie_step import plan_step, trie_step_flat


def level_rows(trie, beam_width: int, num_items: int) -> list[int]:
    """rows[d]: a request's beam rows at trie depth d (rows[0] = 1, the root), the bound above."""
    nd = trie.depth
    return [1] + [min(min(beam_width, num_items) if d == nd - 1 else beam_width, trie.num_nodes[d + 1])
                  for d in range(nd)]


class DeviceRound:
    """run_fixed_round's hooks (as sgrec.beam.executor._RoundHooks) for a round on the Triton path."""

    def __init__(self, ex, reqs, global_min_k: int):
        self.ex, self.reqs, self.global_min_k = ex, reqs, global_min_k  # see search.GLOBAL_SELECT_MIN_K
        trie = ex.trie
        self.rows = [level_rows(trie, r.beam_width, r.num_items) for r in reqs]
        width = [max(x[1:]) for x in self.rows]
        self.base = [sum(width[:i]) for i in range(len(reqs))]
        dev, nd = ex.device, trie.depth
        self.tokens = torch.zeros(sum(width), nd, dtype=torch.int64, device=dev)
        self.scores = torch.full((sum(width),), float("-inf"), dtype=torch.float32, device=dev)
        self.nodes = torch.zeros(sum(width), dtype=torch.int64, device=dev)

    def _live(self, d: int, base: list[int]) -> torch.Tensor:
        """The flat rows at depth d: request r's first rows[r][d] rows of its block at base[r]."""
        return torch.cat([b + torch.arange(x[d]) for b, x in zip(base, self.rows)])

    def _setup(self) -> None:
        """Everything the steps read that the beams' values do not decide, on the device at once."""
        trie, reqs, dev = self.ex.trie, self.reqs, self.ex.device
        nd = trie.depth
        slots = [r.kv.slots for r in reqs]
        self.slots = torch.cat(slots).to(dev, torch.int64)  # [sum rows, ND - 1]: each request's unshared slots
        base2 = [sum(s.shape[0] for s in slots[:i]) for i in range(len(reqs))]
        live = [self._live(d, self.base) for d in range(nd + 1)]
        live2 = [self._live(d, base2) for d in range(nd)]
        sh_ptr = [0]
        for r in reqs:
            sh_ptr.append(sh_ptr[-1] + r.prompt_kv.numel())
        shared = torch.cat([r.prompt_kv for r in reqs]).to(dev, torch.int64)
        sh_ptr = torch.tensor(sh_ptr, dtype=torch.int64).to(dev)
        self.live = [x.to(dev) for x in live]
        self.steps: list[tuple | None] = [None]
        for s in range(1, nd):
            rows = live2[s].to(dev)
            un = self.slots[rows, :s]
            pos = torch.cat([torch.full((x[s],), len(r.ids) + s - 1, dtype=torch.int64)
                             for r, x in zip(reqs, self.rows)])
            blocks = beam_blocks([x[s] for x in self.rows], BLOCK_B).to(dev)
            keep_kv = None
            if s + 1 < nd:  # the kept beams' K/V of this step's tokens move to their rows at depth s + 1
                keep_kv = (rows, self.slots[live2[s + 1].to(dev), :s].reshape(-1))
            self.steps.append((pos.to(dev), un[:, -1].contiguous(), StagedMeta(shared, sh_ptr, un.contiguous(), blocks),
                               trie.logit_columns(s), keep_kv))
        self.plans = []
        for d in range(nd):
            m = [min(r.beam_width, r.num_items) if d == nd - 1 else r.beam_width for r in reqs]
            row_ptr = [0]
            for x in self.rows:
                row_ptr.append(row_ptr[-1] + x[d])
            filters = [level_filter(r.filt, d + 1) for r in reqs]
            self.plans.append(plan_step(row_ptr, [r.top_k for r in reqs], m, filters, dev, [x[d + 1] for x in self.rows]))

    # ---- the hooks -------------------------------------------------------------------------------
    def prepare(self, step: int, phase: str) -> object:
        return None

    @torch.inference_mode()
    def launch(self, step: int, phase: str, prepared: object) -> object:
        ex = self.ex
        if phase == "prefill":
            ex._prefill_round(self.reqs)
            self._setup()
            return torch.cat([r.logits0 for r in self.reqs])
        pos, out_loc, meta, columns, _ = self.steps[step]
        tokens = self.tokens[self.live[step], step - 1]
        return ex._beam_forward(tokens, pos, out_loc, meta, columns)

    @torch.inference_mode()
    def finish(self, step: int, phase: str, logits: torch.Tensor) -> None:
        ex, trie = self.ex, self.ex.trie
        if step == 0:
            R = len(self.reqs)
            nodes = torch.zeros(R, dtype=torch.int64, device=ex.device)
            scores = torch.zeros(R, dtype=torch.float32, device=ex.device)
        else:
            nodes, scores = self.nodes[self.live[step]], self.scores[self.live[step]]
        restricted = step > 0 and trie.logit_columns(step) is not None
        parents, tokens, new_scores, new_nodes, kept = trie_step_flat(
            logits, level(trie, step), nodes, scores, self.plans[step], restricted, self.global_min_k)
        dst = self.live[step + 1]
        if step > 0:
            src = self.live[step][parents]
            self.tokens[dst, :step] = self.tokens[src, :step]
            keep_kv = self.steps[step][4]
            if keep_kv is not None:
                rows, kv_dst = keep_kv
                ex.pool.copy_rows(kv_dst, self.slots[rows[parents], :step].reshape(-1))
        self.tokens[dst, step] = tokens
        self.scores[dst] = new_scores
        self.nodes[dst] = new_nodes
        if step == trie.depth - 1:
            self._finish(kept)

    def _finish(self, kept: torch.Tensor) -> None:
        """The round's one read back: each request's kept count; its beams become r.bufs (what
        RetrieveExecutor._result reads)."""
        for r, b, x, k in zip(self.reqs, self.base, self.rows, kept.tolist()):
            w = max(x[1:])
            n = min(k, x[-1])
            parents = torch.zeros(w, dtype=torch.int64, device=self.ex.device)  # unread: _result needs none
            r.bufs = BeamBuffers(self.tokens[b:b + w], self.scores[b:b + w], parents, self.nodes[b:b + w], n)
