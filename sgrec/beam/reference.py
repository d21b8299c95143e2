"""The obviously-right reference of a retrieve request (what tests compare RetrieveExecutor with,
and what benchmarks/bench_xbeam.py times): the prompt computed from scratch, its KV copied into every
beam, each beam a separate sequence of a plain decode batch, dense masks built from the catalog's
paths, full sorts; with recurrent layers, each beam's state copied from its parent's."""

from __future__ import annotations

import time

import torch

from sgrec.beam.executor import KVCacheFullError, RetrieveResult, _check_int, _prefill
from sgrec.catalog import Catalog, check_token_ids
from sgrec.model.attention import SeqLayout


@torch.inference_mode()
def naive_retrieve(runner, catalog: Catalog, input_ids: list[int], beam_width: int, top_k: int,
                   num_items: int) -> RetrieveResult:
    """Beam search the plain way: the prompt computed from scratch, its KV copied into every beam,
    each beam a separate sequence in a decode batch (plain attention), dense masks from the
    catalog's paths, full sorts, and a beam fork copying the parent's whole KV (and its state,
    where the family has recurrent layers). Same ordering
    contract as search.py. Frees everything it allocates; ignores the radix tree."""
    t0 = time.perf_counter()
    V = runner.config.vocab_size
    ids = list(check_token_ids(input_ids, "input_ids", V))
    _check_int("beam_width", beam_width, 1)
    _check_int("top_k", top_k, 1)
    _check_int("num_items", num_items, 1, beam_width)
    paths: dict[tuple[int, ...], list[int]] = {}  # path -> its catalog rows
    for r in catalog.semantic_rows().tolist():
        paths.setdefault(tuple(catalog.semantic_ids[r].tolist()), []).append(r)
    if not paths:
        raise ValueError("retrieve needs an item catalog whose items carry semantic_id")
    nd = catalog.semantic_id_len
    children: dict[tuple[int, ...], set[int]] = {}
    for path in paths:
        for d in range(nd):
            children.setdefault(path[:d], set()).add(path[d])
    P, dev, alloc, pool = len(ids), runner.device, runner.memory.allocator, runner.kv_pool
    width = P + nd - 1
    prompt = alloc.alloc(P)
    beam_slots = None
    if prompt is None:
        raise KVCacheFullError("naive_retrieve: no room for the prompt")
    states = runner.memory.states if runner.memory.states_per_request else None
    prompt_state = beam_states = None
    peak = P
    try:
        if states is not None:
            prompt_state, beam_states = states.alloc(1), states.take(beam_width)
            if prompt_state is None or beam_states is None:
                raise KVCacheFullError("naive_retrieve: no room for the beams' states")
        logits = _prefill(runner, ids, prompt, 0, prompt_state)
        beams: list[tuple[int, ...]] = [()]
        scores = torch.zeros(1, device=dev)
        for step in range(nd):
            last = step == nd - 1
            m = min(beam_width, num_items) if last else beam_width
            if step > 0:
                n = len(beams)
                seqs = [SeqLayout(b, 1, beam_slots[b, : P + step]) for b in range(n)]
                batch = runner.make_batch([bm[-1] for bm in beams], [P + step - 1] * n,
                                          beam_slots[:n, P + step - 1], seqs,
                                          None if states is None else list(beam_states[:n].split(1)))
                logits = runner.forward(batch, list(range(n)))
            mask = torch.full((len(beams), V), float("-inf"), device=dev)
            for b, bm in enumerate(beams):
                mask[b, sorted(children[bm])] = 0.0
            logp = torch.log_softmax(logits + mask, dim=-1)
            srt = torch.sort(logp, dim=-1, descending=True, stable=True)
            for k in (min(top_k, V), V):  # short of m valid candidates: every valid child competes
                cand = (scores[:, None] + srt.values[:, :k]).reshape(-1)
                cand_tok = srt.indices[:, :k].reshape(-1)
                cand_par = torch.arange(len(beams), device=dev).repeat_interleave(k)
                ok = torch.isfinite(cand)
                cand, cand_tok, cand_par = cand[ok], cand_tok[ok], cand_par[ok]
                if cand.numel() >= m:
                    break
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
            pool.copy_rows(dst, src)
            if states is not None:  # each beam's state: a copy of its parent's (the prompt's at step 0)
                states.copy_(beam_states[: len(beams)], prompt_state.repeat(len(beams)) if step == 0
                             else beam_states[torch.tensor(par, device=beam_states.device)])
    finally:
        for slots in (prompt_state, beam_states):
            if slots is not None:
                states.free(slots)
        alloc.free(prompt)
        if beam_slots is not None:
            alloc.free(beam_slots.reshape(-1))
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    items = [{"item": item, "semantic_id": list(beams[i]), "score": float(scores[i])}
             for i in order for item in _path_items(catalog, paths[beams[i]])][:num_items]
    return RetrieveResult(items, {"prompt_tokens": P, "kv_tokens_peak": peak, "e2e_latency": time.perf_counter() - t0})


def _path_items(catalog: Catalog, rows: list[int]) -> list[str]:
    """The ids of a path's items, as retrieve orders them: a larger number `prior` first, items
    without one last, then by id."""
    def key(r):
        prior = catalog.item(r).attrs.get("prior")
        number = isinstance(prior, (int, float)) and not isinstance(prior, bool)
        return (0, -prior, catalog.ids[r]) if number else (1, 0, catalog.ids[r])
    return [catalog.ids[r] for r in sorted(rows, key=key)]
