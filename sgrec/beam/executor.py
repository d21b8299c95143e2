"""RetrieveExecutor: one xBeam generative-retrieval request on a ModelRunner (xGR §5-6).

    prompt ──(radix prefix hit + extend)──► shared KV (in the radix tree, locked while in use)
    step 0: prompt logits + dense first-step mask ──► per-beam top-K ──► global top-BW
    step s: BW tokens ──(staged attention: shared + unshared)──► logits + sparse mask ──► ...
    after ND steps: leaves ──► catalog items, best first

The prompt's KV is computed once (only the part the radix tree does not already hold), inserted
into the tree so the user's next request hits it, and read by every beam in place. The beams'
own tokens live in an unshared buffer of rows x (ND - 1) pool slots taken up front, rows =
min(beam_width, most beams the catalog allows): the last step's tokens are never attended to, so
they need no KV. When run() returns, every slot it took is free again or owned by the tree, and
lock refs are back where they were.

`naive_retrieve` is the obviously-right reference (prompt KV copied into every beam, plain
attention, dense masks built from the catalog, full sorts): tests compare against it, the
benchmark times it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sgrec.beam.attention import BeamStepMeta, StagedBeamBackend, UnsharedKV
from sgrec.beam.search import BeamBuffers, inplace_schedule, per_beam_topk, select_beams
from sgrec.beam.trie import SemanticIdTrie, SparseMaskBuffer
from sgrec.catalog import Catalog
from sgrec.model.attention import ForwardBatch, SeqLayout


class KVCacheFullError(RuntimeError):
    """The KV pool cannot hold a retrieve request even after evicting every unlocked cache entry."""


@dataclass
class RetrieveResult:
    items: list[dict]  # {"item": id, "semantic_id": [...], "score": summed log-prob}, best first
    meta: dict = field(default_factory=dict)


def _check_ids(input_ids, vocab: int) -> list[int]:
    ids = list(input_ids)
    if not ids:
        raise ValueError("input_ids must not be empty")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ValueError(f"input_ids holds {t!r}, not a token id in [0, {vocab})")
    return ids


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _prefill(runner, ids: list[int], kv: torch.Tensor, start: int) -> torch.Tensor:
    """Computes ids[start:] (kv[:start] already holds the prefix) into kv[start:]; returns the
    last position's float32 logits [1, vocab]. Chunked like the scheduler's prefill."""
    chunk = runner.args.chunked_prefill_size
    chunk = len(ids) if chunk < 0 else chunk  # -1: no chunking (ServerArgs rejects 0)
    logits = None
    for a in range(start, len(ids), chunk):
        b = min(len(ids), a + chunk)
        seq = SeqLayout(q_start=0, q_len=b - a, kv_indices=kv[:b])
        batch = runner.make_batch(ids[a:b], list(range(a, b)), kv[a:b], [seq])
        logits = runner.forward(batch, [b - a - 1])
    assert logits is not None
    return logits


class RetrieveExecutor:
    def __init__(self, runner, tree, catalog: Catalog, max_beam_width: int | None = None, reorder_chunk: int = 64):
        self.runner = runner
        self.tree = tree
        self.catalog = catalog
        self.pool = runner.kv_pool
        self.allocator = runner.kv_pool.allocator
        self.device = runner.device
        self.vocab_size = runner.config.vocab_size
        self.max_beam_width = max_beam_width or runner.args.max_beam_width
        self.reorder_chunk = reorder_chunk
        self.trie: SemanticIdTrie | None = None
        self._trie_rows: list[int] = []
        if catalog is not None and catalog.semantic_id_len:
            self.trie, self._trie_rows = SemanticIdTrie.from_catalog(catalog, self.vocab_size, self.device)
        self.backend = StagedBeamBackend()
        self.mask = SparseMaskBuffer(self.vocab_size, self.device)

    # ---- public API ---------------------------------------------------------------------
    def run(self, input_ids: list[int], beam_width: int, top_k: int, num_items: int,
            extra_key: str | None = None) -> RetrieveResult:
        t0 = time.perf_counter()
        trie = self._validate(beam_width, top_k, num_items)
        ids = _check_ids(input_ids, self.vocab_size)
        P, nd = len(ids), trie.depth
        if P + nd - 1 > self.runner.context_len:
            raise ValueError(f"prompt of {P} tokens + {nd} semantic-id steps exceeds the context "
                             f"length {self.runner.context_len}")
        rows, cols = min(beam_width, max(trie.max_beams, 1)), nd - 1
        tree, alloc = self.tree, self.allocator

        res = tree.match_prefix(ids[: P - 1], extra_key)  # the last token is always computed
        lock = res.last_node
        tree.inc_lock_ref(lock)
        cached = res.indices
        c = cached.numel()
        new_slots = unshared = None
        try:
            need = (P - c) + rows * cols
            if not self._ensure_free(need):
                raise KVCacheFullError(
                    f"retrieve needs {need} free KV slots ({P - c} prompt + {rows}x{cols} beam tokens) but "
                    f"only {alloc.available_size()} can be freed (pool {alloc.size}); lower beam_width or "
                    f"raise --max-total-tokens")
            new_slots = alloc.alloc(P - c)
            unshared = alloc.alloc(rows * cols)
            prompt_kv = torch.cat([cached.to(new_slots.device), new_slots])
            logits0 = _prefill(self.runner, ids, prompt_kv, c)
            if not tree.disable:  # hand the prompt to the tree; keep it locked while beams read it
                prefix = tree.insert(ids, prompt_kv, extra_key)
                alloc.free(prompt_kv[c:prefix])
                new_slots = None
                full = tree.match_prefix(ids, extra_key)
                tree.inc_lock_ref(full.last_node)
                tree.dec_lock_ref(lock)
                lock, prompt_kv = full.last_node, full.indices
            t1 = time.perf_counter()
            kv = UnsharedKV(self.pool, unshared.view(rows, cols), self.reorder_chunk)
            items = self._search(trie, logits0, prompt_kv, kv, beam_width, top_k, num_items)
        finally:
            if unshared is not None:
                alloc.free(unshared)
            if new_slots is not None:
                alloc.free(new_slots)
            tree.dec_lock_ref(lock)
        t2 = time.perf_counter()
        meta = {
            "prompt_tokens": P,
            "cached_tokens": c,
            "beam_width": beam_width,
            "top_k": top_k,
            "num_steps": nd,
            "shared_kv_tokens": P,
            "unshared_kv_tokens": rows * cols,
            "prefill_s": t1 - t0,
            "beam_search_s": t2 - t1,
            "e2e_latency": t2 - t0,
        }
        return RetrieveResult(items, meta)

    # ---- internals ----------------------------------------------------------------------
    def _validate(self, beam_width, top_k, num_items) -> SemanticIdTrie:
        if self.trie is None:
            raise ValueError("retrieve needs an item catalog whose items carry semantic_id")
        _check_int("beam_width", beam_width, 1, self.max_beam_width)
        _check_int("top_k", top_k, 1)
        _check_int("num_items", num_items, 1, beam_width)
        return self.trie

    def _ensure_free(self, n: int) -> bool:
        short = n - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.available_size() >= n

    def _beam_forward(self, tokens: torch.Tensor, position: int, prompt_kv: torch.Tensor,
                      unshared_idx: torch.Tensor) -> torch.Tensor:
        """One token per beam at `position`; its K/V goes to unshared_idx[:, -1]. -> logits [n, V]."""
        n = tokens.numel()
        batch = ForwardBatch(
            input_ids=tokens.contiguous(),
            positions=torch.full((n,), position, dtype=torch.int64, device=self.device),
            out_cache_loc=unshared_idx[:, -1].contiguous(),
            seqs=[],
            kv_pool=self.pool,
            attn_meta=BeamStepMeta(prompt_kv, unshared_idx),
        )
        model = self.runner.model
        return model.compute_logits(model(batch, self.backend))

    @torch.inference_mode()
    def _search(self, trie: SemanticIdTrie, logits0: torch.Tensor, prompt_kv: torch.Tensor, kv: UnsharedKV,
                beam_width: int, top_k: int, num_items: int) -> list[dict]:
        nd, V, P = trie.depth, self.vocab_size, prompt_kv.numel()
        bufs = BeamBuffers.allocate(beam_width, nd, self.device)
        for step in range(nd):
            last = step == nd - 1
            m = min(beam_width, num_items) if last else beam_width
            if step == 0:
                parent_scores = torch.zeros(1, device=self.device)
                parent_nodes = torch.zeros(1, dtype=torch.int64, device=self.device)
                masked = logits0 + trie.first_mask  # dense mask, precomputed at load
            else:
                n = bufs.n
                parent_scores, parent_nodes = bufs.scores[:n], bufs.nodes[:n]
                logits = self._beam_forward(bufs.tokens[:n, step - 1], P + step - 1, prompt_kv,
                                            kv.slots[:n, :step])
                masked = self.mask.masked(logits, trie, step, parent_nodes)
            logp = torch.log_softmax(masked, dim=-1)
            vals, toks = per_beam_topk(logp, min(top_k, trie.max_children[step]))
            parents, tokens, scores, _ = select_beams(parent_scores[:, None] + vals, toks, m, V)
            nodes = trie.child_nodes(step, parent_nodes[parents], tokens)
            schedule = inplace_schedule(parents)[:2] if step > 0 else None  # shared by KV and tokens
            if schedule is not None and not last:
                kv.reorder_(parents, step, schedule)
            bufs.advance_(step, parents, tokens, scores, nodes, self.reorder_chunk, schedule)
        n = bufs.n
        order = torch.sort(bufs.scores[:n], descending=True, stable=True).indices  # ties: path order
        rows = trie.leaf_items(bufs.nodes[:n][order]).tolist()
        paths, scores = bufs.tokens[:n][order].tolist(), bufs.scores[:n][order].tolist()
        out = []
        for r, path, s in zip(rows, paths, scores):
            item = self.catalog.items[self._trie_rows[r]]
            out.append({"item": item.id, "semantic_id": path, "score": float(s)})
        return out


# ---- the reference ------------------------------------------------------------------------------
@torch.inference_mode()
def naive_retrieve(runner, catalog: Catalog, input_ids: list[int], beam_width: int, top_k: int,
                   num_items: int) -> RetrieveResult:
    """Beam search the plain way: the prompt computed from scratch, its KV copied into every beam,
    each beam a separate sequence in a decode batch (plain attention), dense masks from the
    catalog's paths, full sorts, and a beam fork copying the parent's whole KV. Same ordering
    contract as search.py. Frees everything it allocates; ignores the radix tree."""
    t0 = time.perf_counter()
    V = runner.config.vocab_size
    ids = _check_ids(input_ids, V)
    _check_int("beam_width", beam_width, 1)
    _check_int("top_k", top_k, 1)
    _check_int("num_items", num_items, 1, beam_width)
    paths: dict[tuple[int, ...], str] = {}
    for it in catalog.items:
        if it.semantic_id is not None:
            paths.setdefault(tuple(it.semantic_id), it.id)
    if not paths:
        raise ValueError("retrieve needs an item catalog whose items carry semantic_id")
    nd = catalog.semantic_id_len
    children: dict[tuple[int, ...], set[int]] = {}
    for path in paths:
        for d in range(nd):
            children.setdefault(path[:d], set()).add(path[d])
    P, dev, alloc, pool = len(ids), runner.device, runner.kv_pool.allocator, runner.kv_pool
    width = P + nd - 1
    prompt = alloc.alloc(P)
    beam_slots = None
    if prompt is None:
        raise KVCacheFullError("naive_retrieve: no room for the prompt")
    peak = P
    try:
        logits = _prefill(runner, ids, prompt, 0)
        beams: list[tuple[int, ...]] = [()]
        scores = torch.zeros(1, device=dev)
        for step in range(nd):
            last = step == nd - 1
            m = min(beam_width, num_items) if last else beam_width
            if step > 0:
                n = len(beams)
                seqs = [SeqLayout(b, 1, beam_slots[b, : P + step]) for b in range(n)]
                batch = runner.make_batch([bm[-1] for bm in beams], [P + step - 1] * n,
                                          beam_slots[:n, P + step - 1], seqs)
                logits = runner.forward(batch, list(range(n)))
            mask = torch.full((len(beams), V), float("-inf"), device=dev)
            for b, bm in enumerate(beams):
                mask[b, sorted(children[bm])] = 0.0
            logp = torch.log_softmax(logits + mask, dim=-1)
            srt = torch.sort(logp, dim=-1, descending=True, stable=True)
            k = min(top_k, V)
            cand = (scores[:, None] + srt.values[:, :k]).reshape(-1)
            cand_tok = srt.indices[:, :k].reshape(-1)
            cand_par = torch.arange(len(beams), device=dev).repeat_interleave(k)
            ok = torch.isfinite(cand)
            cand, cand_tok, cand_par = cand[ok], cand_tok[ok], cand_par[ok]
            keep = torch.sort(cand, descending=True, stable=True).indices[:m]
            keep = keep[torch.argsort(cand_par[keep] * V + cand_tok[keep])]  # beams in path order
            par, tok = cand_par[keep].tolist(), cand_tok[keep].tolist()
            scores = cand[keep]
            beams = [beams[p] + (t,) for p, t in zip(par, tok)]
            if last:
                break
            if step == 0:  # copy the prompt KV into every beam
                beam_slots = alloc.alloc(beam_width * width)
                if beam_slots is None:
                    raise KVCacheFullError("naive_retrieve: no room for the per-beam prompt copies")
                beam_slots = beam_slots.view(beam_width, width)
                peak += beam_width * width
                src = prompt.repeat(len(beams))
                dst = beam_slots[: len(beams), :P].reshape(-1)
            else:  # fork: each new beam copies its parent's whole KV
                sel = torch.tensor(par, device=beam_slots.device)
                src = beam_slots[sel, : P + step].reshape(-1)
                dst = beam_slots[: len(beams), : P + step].reshape(-1)
            for layer in range(pool.num_layers):
                k_buf, v_buf = pool.get_kv(layer)
                k_buf[dst] = k_buf[src]
                v_buf[dst] = v_buf[src]
    finally:
        alloc.free(prompt)
        if beam_slots is not None:
            alloc.free(beam_slots.reshape(-1))
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    items = [{"item": paths[beams[i]], "semantic_id": list(beams[i]), "score": float(scores[i])} for i in order]
    return RetrieveResult(items, {"prompt_tokens": P, "kv_tokens_peak": peak, "e2e_latency": time.perf_counter() - t0})
