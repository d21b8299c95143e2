"""Beam search on valid semantic-ID paths inside SGLang (xBeam's valid-path rule, xGR §6.1).

SGLang 0.5.23's beam search does not consult grammars: `BeamCoordinator.validate_and_init`
(sglang/srt/beam_search/coordinator.py) refuses a beam request that carries json_schema / regex /
ebnf / structural_tag ("Beam search is not supported with constrained decoding."), and selection
ranks the raw pre-sample logits (`capture_pre_sample_logits` clones them before the sampler, where
the vocab mask is applied; `_rows_topk_logprobs` + `joint_select` never see a mask). So for a
request with `beam_width > 1` and an sgrec-sid structural_tag these hooks constrain the beams:

  BeamCoordinator.validate_and_init  around: compile the request's trie filter (an invalid spec is the
                                     request's 400), let SGLang admit the beam group without the
                                     grammar, and attach a `BeamTrie` (each beam row's trie node)
  capture_pre_sample_logits          after: in each captured beam row, every token but the row's
                                     valid, allowed children (after a full path: the stop tokens)
                                     gets -inf, so the log-softmax and top-2k run over valid
                                     children only, exactly sgrec's children_logp
  BeamCoordinator._select_group      around: marks the selection as an sgrec-sid group's (joint_select's
                                     hook acts on those only), then advances each row's trie node by
                                     the selected (parent, token); rows whose score is -inf are
                                     padding (dead)
  joint_select                       after, in an sgrec-sid group's selection only: -inf candidates
                                     are not beams: finished ones are dropped,
                                     and when no finite survivor is left the group finishes (fewer
                                     valid paths than beam_width keep the width with dead rows)
  BeamGroup.finalize                 after: dead (-inf) beams are not returned

Rows and beams line up as in SGLang: row 0 is the leader, then the member rows; `parent_idx`
names the row a survivor extends. The rows' trie nodes stay on the device: masks and advances read
nothing back to the host per step (finalize reads one count, the rows that left the trie: none).
"""

from __future__ import annotations

import contextvars
import json

import torch

from sgrec.sglang_plugin import grammar

COORDINATOR = "sglang.srt.beam_search.coordinator.BeamCoordinator"
DEAD = -1


def sid_spec(structural_tag: str | None) -> bool:
    """Whether a structural_tag opts in to sgrec-sid."""
    if not structural_tag:
        return False
    try:
        obj = json.loads(structural_tag)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("type") == grammar.NAME


class BeamTrie:
    """The trie position of every row of one beam group, as a tensor on the rows' device: a trie node
    per row (DEAD: a padding row). Masks and advances are tensor operations over all rows at once:
    no Python loop per row and nothing read back to the host per step (tests/test_sglang_plugin.py)."""

    def __init__(self, g: grammar.SidGrammar, stop_tokens: torch.Tensor):
        self.g, self.stop_tokens = g, stop_tokens
        self.depth = 0
        self.nodes = torch.zeros(1, dtype=torch.int64, device=stop_tokens.device)  # the prompt: the root
        self.off_path = torch.zeros((), dtype=torch.int64, device=stop_tokens.device)  # read at finalize only
        self._on: dict = {}

    def _level(self, name: str, device: torch.device) -> torch.Tensor:
        """The trie's `name` tensor (child_ptr, child_tok, child_key) of the current depth on `device`."""
        key = (name, self.depth, str(device))
        if key not in self._on:
            self._on[key] = getattr(self.g.shared.trie, name)[self.depth].to(device)
        return self._on[key]

    def allowed(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [rows, C], ok [rows, C], live [rows]): row r may take tokens[r][ok[r]]; a dead row (or a
        row with no node) is not live and keeps every token (its cumulative score is already -inf)."""
        trie = self.g.shared.trie
        nodes = self.nodes.to(device)[:rows]
        if nodes.numel() < rows:
            nodes = torch.cat([nodes, torch.full((rows - nodes.numel(),), DEAD, dtype=torch.int64, device=device)])
        live = nodes != DEAD
        if self.depth >= trie.depth:  # a complete path: only the stop tokens (past it, every row is dead: a
            # step SGLang runs after the last selection, as its overlapped scheduler does on a live server)
            toks = self.stop_tokens.to(device)[None, :].expand(rows, -1)
            return toks, torch.ones(toks.shape, dtype=torch.bool, device=device), live
        ptr, tok = self._level("child_ptr", device), self._level("child_tok", device)
        n = nodes.clamp(min=0)
        kids = ptr[n][:, None] + torch.arange(trie.max_children[self.depth], device=device)[None, :]
        ok = kids < ptr[n + 1][:, None]
        kids = torch.where(ok, kids, ptr[n][:, None]).clamp(max=tok.numel() - 1)  # past the last: a repeat
        if self.g.filt is not None:
            ok &= self.g.filt.keep(self.depth + 1, kids.reshape(-1)).view_as(kids)
        return tok[kids], ok, live

    def mask_(self, logits: torch.Tensor) -> None:
        """-inf on every token a row may not take (rows in frontier order): each live row set to -inf, then
        its allowed children's logits put back (a token listed twice, once allowed: the max keeps it)."""
        toks, ok, live = self.allowed(logits.shape[0], logits.device)
        vals = logits.gather(1, toks)
        vals = torch.where(ok | ~live[:, None], vals, float("-inf"))
        logits.masked_fill_(live[:, None], float("-inf"))
        logits.scatter_reduce_(1, toks, vals, "amax")

    def advance(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> None:
        """Rows after a selection: row j extends row parents[j] by tokens[j] (dead if its score is -inf).
        A live row whose token is not a child of its node left the trie: counted in off_path, which
        finalize checks."""
        trie, dev = self.g.shared.trie, tokens.device
        nodes, par = self.nodes.to(dev), parents.to(dev, torch.int64)
        parent = torch.where(par < nodes.numel(), nodes[par.clamp(max=nodes.numel() - 1)], DEAD)
        live = (parent != DEAD) & torch.isfinite(scores.to(dev))
        if self.depth >= trie.depth:
            self.nodes = torch.full_like(parent, DEAD)
        else:
            keys = self._level("child_key", dev)
            key = parent.clamp(min=0) * trie.vocab_size + tokens.to(dev, torch.int64)
            i = torch.searchsorted(keys, key).clamp(max=keys.numel() - 1)
            found = keys[i] == key
            self.off_path = self.off_path.to(dev) + (live & ~found).sum()
            self.nodes = torch.where(live & found, i, DEAD)
        self.depth += 1


def _state(group) -> BeamTrie | None:
    return getattr(group, "sgrec_sid", None)


# ---- hooks ------------------------------------------------------------------------------------------
def around_validate_and_init(original, coordinator, req, recv_req):
    params = req.sampling_params
    spec = params.structural_tag
    if not sid_spec(spec):
        return original(coordinator, req, recv_req)
    shared = grammar.shared_trie()
    if shared is None:
        return f"{grammar.NAME}: this server has no item catalog (--grammar-backend {grammar.NAME} with {grammar.CATALOG_ENV})"
    if params.ignore_eos:
        return f"{grammar.NAME}: beam search ends each semantic-ID path with a stop token; do not set ignore_eos"
    g = shared.compile(spec)
    if not isinstance(g, grammar.SidGrammar):
        return g.error_message
    params.structural_tag = None
    try:
        error = original(coordinator, req, recv_req)
    finally:
        params.structural_tag = spec
    if error is None:
        group = req.beam_group
        stops = group.stop_token_ids
        if not stops.numel():
            return f"{grammar.NAME}: beam search needs a stop token to end a semantic-ID path"
        group.sgrec_sid = BeamTrie(g, stops)
    return error


def after_capture(result, batch, forward_batch, logits_output):
    capture = getattr(logits_output, "beam", None) if logits_output is not None else None
    if capture is None:
        return result
    if batch.beam_tail is not None:
        for gi, entry in enumerate(batch.beam_tail.entries):
            state = _state(entry.group)
            if state is not None:
                rows = torch.cat([capture.leader_logits[gi : gi + 1], capture.tail_logits[entry.start : entry.end]])
                state.mask_(rows)
                capture.leader_logits[gi : gi + 1] = rows[:1]
                capture.tail_logits[entry.start : entry.end] = rows[1:]
    elif capture.leader_rows is not None:
        for pos, row in enumerate(capture.leader_rows):
            group = batch.reqs[row].beam_group
            state = _state(group) if group is not None else None
            if state is not None:
                state.mask_(capture.leader_logits[pos : pos + 1])
    return result


_SID_SELECTION = contextvars.ContextVar("sgrec_sid_selection", default=False)


def around_select_group(original, coordinator, group, top_logprobs, top_tokens, tick):
    """SGLang's selection of one group, with joint_select's hook on for sgrec-sid groups only; then
    each row's trie node advanced by the selection."""
    state = _state(group)
    token = _SID_SELECTION.set(state is not None)
    try:
        result = original(coordinator, group, top_logprobs, top_tokens, tick)
    finally:
        _SID_SELECTION.reset(token)
    if state is not None:
        tokens, parents = result
        if parents is not None:  # a final (length-limited) step needs no next frontier
            n = group._pending_steps[-1][1].num_survivors  # the selection just staged (on the device)
            scores = group.frontier_cum_logprobs[: tokens.shape[0]]
            slot = torch.arange(scores.shape[0], device=scores.device)
            scores = torch.where(slot < n, scores, float("-inf"))  # slots past the survivors hold no beam
            state.advance(tokens, parents, scores)
    return result


def after_joint_select(sel, *args, **kwargs):
    """In an sgrec-sid group's selection, candidates scored -inf are masked-out tokens or extensions of
    dead rows, never beams (any other beam request's selection is SGLang's own)."""
    if not _SID_SELECTION.get():
        return sel
    k, c = sel.new_cum_logprobs.shape[0], sel.fin_cum_logprobs.shape[0]
    live = (torch.arange(k, device=sel.num_survivors.device) < sel.num_survivors) & torch.isfinite(sel.new_cum_logprobs)
    sel.num_survivors = torch.where(live.any(), sel.num_survivors, torch.zeros_like(sel.num_survivors))
    fin = (torch.arange(c, device=sel.num_finished.device) < sel.num_finished) & torch.isfinite(sel.fin_cum_logprobs)
    sel.num_finished = fin.sum()  # finished candidates are ranked best first: the finite ones lead
    return sel


def after_finalize(results, group):
    state = _state(group)
    if state is None:
        return results
    if int(state.off_path):  # the one read of the group's trie state, at its end
        raise RuntimeError(f"{grammar.NAME}: beam search left the valid semantic-ID paths")
    return [r for r in results if r.cum_logprob != float("-inf")]


HOOKS = [
    (f"{COORDINATOR}.validate_and_init", around_validate_and_init, "around"),
    (f"{COORDINATOR}._select_group", around_select_group, "around"),
    ("sglang.srt.beam_search.logits_capture.capture_pre_sample_logits", after_capture, "after"),
    ("sglang.srt.beam_search.joint_select.joint_select", after_joint_select, "after"),
    ("sglang.srt.beam_search.beam_group.BeamGroup.finalize", after_finalize, "after"),
]
