"""RetrieveExecutor: one xBeam generative-retrieval request on a ModelRunner (xGR §5-6).

    prompt ──(radix prefix hit + extend)──► shared KV (in the radix tree, locked while in use)
    step 0: prompt logits at the root's children ──► per-beam top-K ──► global top-BW
    step s: BW tokens ──(staged attention: shared + unshared)──► logits at each beam's children ──► ...
    after ND steps: leaves ──► catalog items, best first (every allowed item of a shared path)

The prompt's KV is computed once (only the part the radix tree does not already hold), inserted
into the tree so the user's next request hits it, and read by every beam in place. The beams'
own tokens live in an unshared buffer of rows x (ND - 1) pool slots taken up front, rows =
min(beam_width, most beams the catalog allows): the last step's tokens are never attended to, so
they need no KV. When run() returns, every slot it took is free again or owned by the tree, and
lock refs are back where they were.

A level's selection (children_logp, per-beam top-K, global top-BW: search.select_level) runs per request
in torch, or, under --attention-backend triton, for every request of the round in one Triton trie
step (`kernel_step`), which keeps the same beams, ties included.

The obviously-right reference that tests compare against and the benchmark times is
reference.naive_retrieve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from sgrec.beam import kernel_step, search
from sgrec.beam.attention import BeamBatchMeta, BeamStates, BeamStepMeta, StagedBeamBackend, StagedMeta, UnsharedKV
from sgrec.beam.filters import FilterCache, TrieFilter, build_filter, num_trie_items
from sgrec.beam.layered import LayeredTrie
from sgrec.beam.search import BeamBuffers, inplace_schedule, select_level
from sgrec.beam.trie import SemanticIdTrie
from sgrec.catalog import Catalog, check_token_ids
from sgrec.model.attention import ForwardBatch, SeqLayout
from sgrec.policy.batching import fixed_round_steps, run_to_end


MAX_GRAPH_STEPS = 16  # most beam steps (semantic-ID length - 1) a CUDA graph takes: more than catalogs use


class KVCacheFullError(RuntimeError):
    """The KV pool cannot hold a retrieve request even after evicting every unlocked cache entry."""


@dataclass
class RetrieveResult:
    items: list[dict]  # {"item": id, "semantic_id": [...], "score": summed log-prob}, best first
    meta: dict = field(default_factory=dict)


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _prefill(runner, ids: list[int], kv: torch.Tensor, start: int, state: torch.Tensor | None = None
             ) -> torch.Tensor:
    """Computes ids[start:] (kv[:start] already holds the prefix; `state`, a family with recurrent
    layers: the state slot that has read it) into kv[start:]; returns the last position's float32
    logits [1, vocab]. Chunked like the scheduler's prefill."""
    chunk = runner.args.prefill_chunk
    logits = None
    for a in range(start, len(ids), chunk):
        b = min(len(ids), a + chunk)
        seq = SeqLayout(q_start=0, q_len=b - a, kv_indices=kv[:b])
        batch = runner.make_batch(ids[a:b], list(range(a, b)), kv[a:b], [seq], None if state is None else [state])
        logits = runner.forward(batch, [b - a - 1])
    assert logits is not None
    return logits


@dataclass
class _Request:
    """One retrieve request inside a round: its inputs, the KV it holds and its beams."""

    index: int  # position in run_batch's list
    ids: list[int]
    beam_width: int
    top_k: int
    num_items: int
    extra_key: str | None
    t0: float
    filt: TrieFilter | None = None  # exclude / include / attribute filter on the trie
    lock: object = None  # the radix node locked for the prompt
    cached: int = 0  # prompt tokens the tree held on arrival
    prompt_kv: torch.Tensor | None = None
    new_slots: torch.Tensor | None = None  # prompt slots not (yet) owned by the tree
    unshared: torch.Tensor | None = None
    kv: UnsharedKV | None = None
    bufs: BeamBuffers | None = None
    logits0: torch.Tensor | None = None
    t1: float = 0.0
    state_slots: torch.Tensor | None = None  # a family with recurrent layers: one state slot a beam row
    states: BeamStates | None = None
    encoded: object = None  # an encoder-decoder's input in the tree (sgrec.beam.encdec.Encoded)


def trie_device(runner) -> torch.device | None:
    """Where the runner's beam step reads the catalog trie's arrays (None: on the host, as numpy)."""
    return runner.device if runner.beam_plan().trie_on_device else None


def build_trie(catalog: Catalog | None, vocab_size: int, device=None) -> tuple[LayeredTrie | None, None]:
    """The valid-path trie of a catalog, versions that cost what an update changed, with its
    beam-step arrays on `device` (None: the host's); (None, None) when no item has a semantic ID.
    The second element is the trie's row map, which a LayeredTrie has none of (its rows are the
    catalog's). Reads nothing that changes: a new version's trie is built off the scheduler's
    step, then handed to `RetrieveExecutor.use_catalog`."""
    if catalog is None or not catalog.semantic_id_len:
        return None, None
    return LayeredTrie.from_catalog(catalog, vocab_size, device)


class RetrieveExecutor:
    def __init__(self, runner, tree, catalog: Catalog, max_beam_width: int | None = None, reorder_chunk: int = 64,
                 units=None, built=None):
        """built: the catalog's trie and row map when already made (build_trie's result; the DP ranks'
        shared catalog image brings one), else built here."""
        self.runner = runner
        self.tree = tree
        self.catalog = catalog
        self.pool = runner.kv_pool
        self.allocator = runner.memory.allocator
        self.device = runner.device
        self.vocab_size = runner.config.vocab_size
        self.max_beam_width = max_beam_width or runner.args.max_beam_width
        self.reorder_chunk = reorder_chunk
        plan = runner.beam_plan()  # the runner's choice of kernels for a beam step
        # a family with recurrent layers: each beam's state in the state pool, the prompt resumed
        # only from a cached state (RadixCache.match_snapshot)
        self.states = runner.memory.states if runner.memory.states_per_request else None
        self.snapshots = runner.capabilities.prefix_reuse == "snapshot"
        if self.states is not None and tree.states is not self.states:
            raise ValueError("a family with recurrent layers needs the radix tree of the runner's state pool "
                             "(RadixCache(..., states=runner.memory.states))")
        self.trie_device = runner.device if plan.trie_on_device else None  # see trie_device
        self.rounds_under_way = 0  # rounds admitted and not yet released, of every run_steps generator
        self.use_catalog(catalog, built if built is not None else self.build_trie(catalog))
        # units: a batched step's attention stages as work units; triton: each request's stages in one kernel
        self.backend = StagedBeamBackend(units, triton=plan.staged == "triton", runner=runner)
        self.triton_select = plan.device_select  # each level's selection for all of a round's requests in one step
        if plan.device_select:  # a device round's steps read no position back (RotaryEmbedding.cos_sin's growth check)
            runner.reserve_positions(runner.context_len)
        self.graphs = self._beam_graphs() if plan.graphs else None

    def _beam_graphs(self):
        """Device-round beam steps replayed from CUDA graphs (sgrec.beam.graphs)."""
        from sgrec.beam.graphs import BeamGraphs

        return BeamGraphs(self.runner.forward_with, self.backend, self.pool, self.runner.args.cuda_graph_max_beams,
                          self.pool.size, MAX_GRAPH_STEPS, capture=True)

    def build_trie(self, catalog: Catalog | None) -> tuple[LayeredTrie | None, None]:
        """build_trie (the module's) for this executor's vocabulary and device."""
        return build_trie(catalog, self.vocab_size, self.trie_device)

    def updated_trie(self, applied) -> tuple[SemanticIdTrie | LayeredTrie | None, np.ndarray | None]:
        """build_trie of an update's catalog (a catalog.update.Applied), from the served trie: it
        costs what the update changed (the trie's `updated`), not a sort of the catalog."""
        if self.trie is None or applied.added_from is None:
            return self.build_trie(applied.catalog)
        return self.trie.updated(self._trie_rows, applied.catalog, applied.removed_rows, applied.added_from)

    @property
    def built(self) -> tuple[SemanticIdTrie | LayeredTrie | None, np.ndarray | None]:
        """The served trie and its row map, as build_trie returns them."""
        return self.trie, self._trie_rows

    def use_catalog(self, catalog: Catalog | None, built) -> tuple:
        """Serves a catalog version (between scheduler steps): its trie from `build_trie`. Returns
        what it replaced (the old trie, its rows, its filter cache), for the caller to free."""
        old = getattr(self, "trie", None), getattr(self, "_trie_rows", None), getattr(self, "filter_cache", None)
        self.catalog = catalog
        self.trie, self._trie_rows = built
        self.filter_cache = FilterCache()  # per-node counts of the old trie
        return old

    # ---- public API ---------------------------------------------------------------------
    def tokens(self, payload: dict) -> int:
        """A request's size in the scheduler's batch budget: its prompt plus one token per beam and level."""
        levels = self.trie.depth - 1 if self.trie is not None else 0
        return len(payload["input_ids"]) + int(payload["beam_width"]) * levels

    def cache_key(self, payload: dict) -> tuple[list[int], str | None]:
        """The radix key (and extra key) a request's prompt is looked up under: the prompt but its
        last token (always computed, for its logits); what the storage tier is asked for on arrival."""
        return list(payload["input_ids"][:-1]), payload.get("extra_key")

    def run(self, input_ids: list[int], beam_width: int, top_k: int, num_items: int,
            extra_key: str | None = None, exclude_items: list[str] | None = None,
            include_items: list[str] | None = None, filter: dict | None = None) -> RetrieveResult:
        out = self.run_batch([dict(input_ids=input_ids, beam_width=beam_width, top_k=top_k, num_items=num_items,
                                   extra_key=extra_key, exclude_items=exclude_items, include_items=include_items,
                                   filter=filter)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def run_batch(self, requests: list[dict]) -> list[RetrieveResult | Exception]:
        """Runs several requests (each a dict of run()'s arguments) as fixed-step rounds (xGR §7):
        their prompts in shared prefill forwards, then each beam level for all of them in one
        forward. Returns, per request, its result or the error it raised (ValueError: bad input;
        KVCacheFullError: it does not fit in the pool even alone). Requests that fit only after the
        round's others are done run in a following round."""
        return run_to_end(self.run_steps(requests))

    def run_steps(self, requests: list[dict]):
        """run_batch one phase at a time: a generator that yields after each phase of a round (its
        prefill, each beam level) but the last, which goes on into the results, and returns
        run_batch's list. Several may be driven in turn on one executor: each round holds its own
        requests' KV, and a request that does not fit while another generator's round holds the
        pool waits (the generator yields -1) for it to finish, where alone it would be refused. The
        served catalog must not change while a round is under way (`use_catalog` between rounds; a
        round that finds it changed raises)."""
        out: list[RetrieveResult | Exception | None] = [None] * len(requests)
        pending: list[_Request] = []
        for i, kw in enumerate(requests):
            try:
                r = self._parse(i, **kw)
            except (TypeError, ValueError) as e:
                out[i] = e if isinstance(e, ValueError) else ValueError(str(e))
                continue
            if r.filt is not None and r.filt.leaves == 0:  # the filters leave nothing: no forward
                out[i] = RetrieveResult([], {"prompt_tokens": len(r.ids), "cached_tokens": 0, "exhausted": True,
                                             "ignored_exclusions": r.filt.ignored_exclusions})
            else:
                pending.append(r)
        while pending:
            round_, rest = [], []
            for r in pending:
                try:
                    if self._admit(r):
                        round_.append(r)
                    elif round_ or self.rounds_under_way:
                        rest.append(r)  # fits once this round's (or another generator's) KV is released
                    else:
                        raise self._full_error(r)
                except KVCacheFullError as e:
                    out[r.index] = e
            if not round_ and rest:
                yield -1  # every request waits for another generator's round
            self.rounds_under_way += bool(round_)
            try:
                if round_:
                    yield from self._round_steps(round_)
                    for r in round_:
                        out[r.index] = self._result(r)
            finally:
                self.rounds_under_way -= bool(round_)
                for r in round_:
                    self._release(r)
            pending = rest
        return out  # type: ignore[return-value]

    # ---- a round ------------------------------------------------------------------------
    def _parse(self, index: int, input_ids, beam_width, top_k, num_items, extra_key=None, exclude_items=None,
               include_items=None, filter=None) -> _Request:
        t0 = time.perf_counter()
        self._check_served()  # a 400, before any memory is taken
        trie = self._validate(beam_width, top_k, num_items)
        ids = list(check_token_ids(input_ids, "input_ids", self.vocab_size))
        if len(ids) + trie.depth - 1 > self.runner.context_len:
            raise ValueError(f"prompt of {len(ids)} tokens + {trie.depth} semantic-id steps exceeds the context "
                             f"length {self.runner.context_len}")
        filt = build_filter(trie, self._trie_rows, self.catalog, self.filter_cache, exclude_items, include_items,
                            filter)
        return _Request(index, ids, beam_width, top_k, num_items, extra_key, t0, filt)

    def _check_served(self) -> None:
        """A ValueError (a 400) where the runner's family cannot run this executor's beams."""
        if not self.runner.capabilities.staged_beams:
            raise ValueError(f"retrieval by beam search is not served for {self.runner.family.name} models")

    def _rows_cols(self, r: _Request) -> tuple[int, int]:
        return min(r.beam_width, max(self.trie.max_beams, 1)), self.trie.depth - 1

    def _admit(self, r: _Request) -> bool:
        """Matches the prompt in the tree (locking it) and takes the request's slots (and, with
        recurrent layers, a state slot a beam row, the first holding the matched prefix's state);
        False (holding nothing) when the pool cannot hold it now."""
        tree, alloc = self.tree, self.allocator
        P = len(r.ids)
        match = tree.match_snapshot if self.snapshots else tree.match_prefix
        res = match(r.ids[: P - 1], r.extra_key)  # the last token is always computed
        tree.inc_lock_ref(res.last_node)
        snapshot = res.last_node if self.states is not None and res.last_node.state is not None else None
        if snapshot is not None:  # not evicted by make_room below
            tree.lock_state(snapshot)
        rows, cols = self._rows_cols(r)
        c = res.indices.numel()
        if not self.tree.make_room((P - c) + rows * cols, rows if self.states is not None else 0):
            if snapshot is not None:
                tree.unlock_state(snapshot)
            tree.dec_lock_ref(res.last_node)
            return False
        r.lock, r.cached = res.last_node, c
        r.new_slots = alloc.alloc(P - c)
        r.unshared = alloc.alloc(rows * cols)
        r.prompt_kv = torch.cat([res.indices.to(r.new_slots.device), r.new_slots])
        if self.states is not None:  # row 0: the prompt's state; the others are written by level 0's fork
            r.state_slots = self.states.take(rows)
            if snapshot is None:
                self.states.zero_(r.state_slots[:1])
            else:
                self.states.copy_(r.state_slots[:1], snapshot.state)
                tree.unlock_state(snapshot)
        return True

    def _full_error(self, r: _Request) -> KVCacheFullError:
        rows, cols = self._rows_cols(r)
        need = len(r.ids) + rows * cols
        if self.states is not None and rows > self.states.available_size() + self.tree.evictable_states():
            return KVCacheFullError(
                f"retrieve needs {rows} state slots (one a beam) but only {self.states.available_size()} are free "
                f"or can be freed (state pool {self.states.size}); lower beam_width or raise --max-mamba-cache-size")
        return KVCacheFullError(
            f"retrieve needs up to {need} free KV slots ({len(r.ids)} prompt + {rows}x{cols} beam tokens) but "
            f"only {self.allocator.available_size()} can be freed (pool {self.allocator.size}); lower beam_width "
            f"or raise --max-total-tokens")

    def _release(self, r: _Request) -> None:
        if r.state_slots is not None:
            self.states.free(r.state_slots)
            r.state_slots = r.states = None
        if r.unshared is not None:
            self.allocator.free(r.unshared)
            r.unshared = None
        if r.new_slots is not None:
            self.allocator.free(r.new_slots)
            r.new_slots = None
        if r.lock is not None:
            self.tree.dec_lock_ref(r.lock)
            r.lock = None

    def _round_steps(self, reqs: list[_Request]):
        """Prefill + the beam levels of the round's requests (all of one trie, so of one depth), a
        generator yielding after each phase but the last (sgrec.policy.batching.fixed_round_steps)."""
        # under --enable-deterministic-inference each step's attention goes through the batch-invariant
        # kernel, whose meta is built per step on the host: the per-step hooks, not the device round
        # nor with recurrent layers, whose beams' states the host reorders between steps
        if (self.triton_select and not self.runner.deterministic and self.states is None
                and all(kernel_step.fits(self.trie, d) for d in range(self.trie.depth))):
            from sgrec.beam.device_round import DeviceRound

            hooks = DeviceRound(self, reqs, search.GLOBAL_SELECT_MIN_K)  # no host read per step
        else:
            hooks = _RoundHooks(self, reqs)
        trie, last = self.trie, self.trie.depth - 1
        for step in fixed_round_steps(hooks, last, overlap=True):
            if step < last:  # the last phase goes on into the results
                yield step
                if self.trie is not trie:
                    raise RuntimeError("the served catalog changed while a retrieve round was under way")

    def _prefill_all(self, reqs: list[_Request]) -> None:
        """Computes every prompt's uncached tokens: requests are packed into shared forwards of at
        most --chunked-prefill-size tokens; a longer prompt is chunked on its own. Then each prompt
        goes to the radix tree and stays locked while its beams read it."""
        chunk = self.runner.args.prefill_chunk
        group: list[_Request] = []
        for r in reqs:
            n = len(r.ids) - r.cached
            if n > chunk:
                r.logits0 = _prefill(self.runner, r.ids, r.prompt_kv, r.cached, self._prompt_state(r))
                continue
            if group and sum(len(g.ids) - g.cached for g in group) + n > chunk:
                self._prefill_packed(group)
                group = []
            group.append(r)
        if group:
            self._prefill_packed(group)
        for r in reqs:
            r.t1 = time.perf_counter()
            if self.tree.disable:
                continue
            # hand the prompt to the tree; keep it locked while beams read it
            full = self.tree.hand_off(r.ids, r.prompt_kv, r.extra_key, r.cached, r.lock)
            r.new_slots = None
            r.lock, r.prompt_kv = full.last_node, full.indices
            if self.states is not None and self.snapshots and self.tree.make_room(0, 1):
                # the prompt's state, for a returning user's longer prompt to resume from
                self.tree.attach_state(full.last_node, self.states.fork(self._prompt_state(r)))

    @staticmethod
    def _prompt_state(r: _Request) -> torch.Tensor | None:
        """The state slot the prompt is read into (beam row 0's), where the family has states."""
        return None if r.state_slots is None else r.state_slots[:1]

    def _prefill_round(self, reqs: list[_Request]) -> None:
        """A round's prefill: the prompts (_prefill_all), then each request's unshared KV buffer."""
        self._prefill_all(reqs)
        for r in reqs:
            rows, cols = self._rows_cols(r)
            r.kv = UnsharedKV(self.pool, r.unshared.view(rows, cols), self.reorder_chunk)
            if r.state_slots is not None:
                r.states = BeamStates(self.states, r.state_slots)

    def _prefill_packed(self, reqs: list[_Request]) -> None:
        ids, pos, seqs, rows, locs = [], [], [], [], []
        for r in reqs:
            a, b = r.cached, len(r.ids)
            seqs.append(SeqLayout(q_start=len(ids), q_len=b - a, kv_indices=r.prompt_kv))
            ids += r.ids[a:b]
            pos += range(a, b)
            locs.append(r.prompt_kv[a:b])
            rows.append(len(ids) - 1)
        states = None if self.states is None else [self._prompt_state(r) for r in reqs]
        logits = self.runner.forward(self.runner.make_batch(ids, pos, torch.cat(locs), seqs, states), rows)
        for r, row in zip(reqs, logits):
            r.logits0 = row[None]

    def _result(self, r: _Request) -> RetrieveResult:
        rows, cols = self._rows_cols(r)
        n = r.bufs.n
        order = torch.sort(r.bufs.scores[:n], descending=True, stable=True).indices  # ties: path order
        leaves = r.bufs.nodes[:n][order]
        paths, scores = r.bufs.tokens[:n][order].tolist(), r.bufs.scores[:n][order].tolist()
        ids = self.catalog.ids
        items = [{"item": ids[row], "semantic_id": path, "score": s}
                 for rows, path, s in zip(self._path_rows(leaves, r.filt), paths, scores) for row in rows]
        del items[r.num_items:]
        available = num_trie_items(self.trie) if r.filt is None else r.filt.items
        t2 = time.perf_counter()
        meta = {
            "prompt_tokens": len(r.ids),
            "cached_tokens": r.cached,
            "beam_width": r.beam_width,
            "top_k": r.top_k,
            "num_steps": self.trie.depth,
            "shared_kv_tokens": len(r.ids),
            "unshared_kv_tokens": rows * cols,
            "prefill_s": r.t1 - r.t0,
            "beam_search_s": t2 - r.t1,
            "e2e_latency": t2 - r.t0,
            "exhausted": available < r.num_items,  # fewer allowed items exist than asked for
            "ignored_exclusions": 0 if r.filt is None else r.filt.ignored_exclusions,
        }
        return RetrieveResult(items, meta)

    def _path_rows(self, leaves: torch.Tensor, filt: TrieFilter | None) -> list[list[int]]:
        """The catalog rows each returned path yields: every allowed item on it, in the catalog's
        path_order (paths shared by several items are looked up together, the rest read their one
        item from the trie)."""
        trie, catalog_row = self.trie, self._trie_rows
        out = [[x] for x in trie.leaf_items(leaves).tolist()]
        if trie.num_duplicate_paths:
            host = leaves.cpu().numpy()
            shared = np.flatnonzero(trie.leaf_count(host) > 1)
            if shared.size:
                leaf, rows = trie.rows_of_leaves(host[shared], self.catalog)
                if filt is not None:
                    ok = np.fromiter((filt.row_allowed(int(x)) for x in rows), bool, rows.size)
                    leaf, rows = leaf[ok], rows[ok]
                starts = np.searchsorted(leaf, host[shared])
                ends = np.searchsorted(leaf, host[shared], side="right")
                for i, a, b in zip(shared.tolist(), starts.tolist(), ends.tolist()):
                    out[i] = rows[a:b].tolist()
        if catalog_row is not None:  # trie rows -> catalog rows (a LayeredTrie's are the catalog's)
            out = [[int(catalog_row[x]) for x in rows] for rows in out]
        return [self.catalog.path_order(rows) if len(rows) > 1 else rows for rows in out]

    # ---- internals ----------------------------------------------------------------------
    def _validate(self, beam_width, top_k, num_items) -> SemanticIdTrie:
        if self.trie is None:
            raise ValueError("retrieve needs an item catalog whose items carry semantic_id")
        _check_int("beam_width", beam_width, 1, self.max_beam_width)
        _check_int("top_k", top_k, 1)
        _check_int("num_items", num_items, 1, beam_width)
        return self.trie

    def _beam_forward(self, tokens: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
                      meta: BeamStepMeta | BeamBatchMeta | StagedMeta, columns: torch.Tensor | None = None,
                      state_slots: torch.Tensor | None = None, state_sources: torch.Tensor | None = None) -> torch.Tensor:
        """One token per beam (of one or several requests; state_slots: each beam's state, where
        the family has recurrent layers; state_sources: where each reads it, BeamStates.step_sources)
        -> logits [n, V], or [n, len(columns)] of just those vocabulary ids."""
        runner = self.runner
        if self.graphs is not None and isinstance(meta, StagedMeta) and self.graphs.takes(tokens.numel(), meta):
            return runner.compute_logits(self.graphs.run(tokens, positions, out_loc, meta), columns)
        batch = ForwardBatch(input_ids=tokens, positions=positions, out_cache_loc=out_loc, seqs=[],
                             kv_pool=self.pool, attn_meta=meta, state_slots=state_slots,
                             state_pool=self.states, state_sources=state_sources)
        return runner.compute_logits(runner.forward_with(batch, self.backend), columns)

    def _beam_step(self, reqs: list[_Request], step: int, positions: list[int]) -> torch.Tensor:
        """Every live beam of every request forwards its level step - 1 token (at positions[i], request
        i's) through staged attention: the logits of level `step`'s tokens only (every request of a
        round walks the same trie)."""
        groups, tokens, pos, locs, states, sources = [], [], [], [], [], []
        for r, p in zip(reqs, positions):
            n = r.bufs.n
            idx = r.kv.slots[:n, :step]
            groups.append(BeamStepMeta(r.prompt_kv, idx))
            tokens.append(r.bufs.tokens[:n, step - 1])
            pos.append(torch.full((n,), p, dtype=torch.int64, device=self.device))
            locs.append(idx[:, -1])
            if r.states is not None:
                states.append(r.states.slots[:n])
                sources.append(r.states.step_sources(n))
        meta = groups[0] if len(groups) == 1 else BeamBatchMeta(groups)
        forks = any(r.states is not None and r.states.sources is not None for r in reqs)
        logits = self._beam_forward(torch.cat(tokens), torch.cat(pos), torch.cat(locs).contiguous(), meta,
                                    self.trie.logit_columns(step), torch.cat(states).to(self.device) if states else None,
                                    torch.cat(sources).to(self.device) if forks else None)
        for r in reqs:
            if r.states is not None:
                r.states.consumed()
        return logits

    def _level(self, r: _Request, step: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Level `step` of request r: how many beams it keeps, its beams' scores and trie nodes."""
        m = min(r.beam_width, r.num_items) if step == self.trie.depth - 1 else r.beam_width
        if step == 0:  # the root: one beam
            return m, torch.zeros(1, device=self.device), torch.zeros(1, dtype=torch.int64, device=self.device)
        n = r.bufs.n
        return m, r.bufs.scores[:n], r.bufs.nodes[:n]

    def _select(self, r: _Request, step: int, logits: torch.Tensor | None) -> None:
        """Level `step` of request r: mask, per-beam top-k, global top-BW, in-place reorders."""
        m, parent_scores, parent_nodes = self._level(r, step)
        restricted = step > 0 and self.trie.logit_columns(step) is not None  # see _RoundHooks.launch
        logits = r.logits0 if step == 0 else logits
        self._advance(r, step, *select_level(logits, self.trie, step, parent_nodes, parent_scores, r.filt, r.top_k, m,
                                             restricted))

    def _select_all(self, reqs: list[_Request], step: int, logits: torch.Tensor | None) -> None:
        """Level `step` of every request of a round in one Triton trie step (kernel_step); `logits`:
        the round's beam forward (None at step 0: the prompts' logits)."""
        levels = [self._level(r, step) for r in reqs]
        restricted = step > 0 and self.trie.logit_columns(step) is not None
        logits = torch.cat([r.logits0 for r in reqs]) if step == 0 else logits
        sels = kernel_step.select_levels(self.trie, step, logits, [lv[2] for lv in levels], [lv[1] for lv in levels],
                                         [r.filt for r in reqs], [r.top_k for r in reqs], [lv[0] for lv in levels],
                                         restricted, search.GLOBAL_SELECT_MIN_K)
        for r, sel in zip(reqs, sels):
            self._advance(r, step, *sel)

    def _advance(self, r: _Request, step: int, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor,
                 nodes: torch.Tensor) -> None:
        """r's beams become the kept (parent, token, score, node) of level `step` (in path order):
        the unshared KV and the token rows reordered in place."""
        last = step == self.trie.depth - 1  # no forward reads what the last level would reorder
        schedule = inplace_schedule(parents)[:2] if step > 0 else None  # shared by the KV and the tokens
        if step > 0 and not last:
            r.kv.reorder_(parents, step, schedule)
        if r.states is not None and not last:  # level 0: the prompt's state forked to every beam
            r.states.reorder_(parents)
        r.bufs.advance_(step, parents, tokens, scores, nodes, self.reorder_chunk, schedule if step > 0 else None)


class _RoundHooks:
    """run_fixed_round's hooks for a retrieve round. Phase 0 (prefill) computes the prompts and
    selects level 0 from their logits; phase s >= 1 forwards every live beam of every request once
    (level s - 1's tokens) and selects level s. prepare(s) builds what does not depend on level
    s - 1's selection: the per-request positions and the step's constant buffers; on a CUDA
    stream it overlaps the previous step's kernels."""

    def __init__(self, ex: RetrieveExecutor, reqs: list[_Request]):
        self.ex, self.reqs = ex, reqs

    def prepare(self, step: int, phase: str) -> object:
        if phase == "prefill":
            return None
        return [len(r.ids) + step - 1 for r in self.reqs]  # the position of every beam of request r

    @torch.inference_mode()
    def launch(self, step: int, phase: str, prepared: object) -> object:
        ex = self.ex
        if phase == "prefill":
            ex._prefill_round(self.reqs)
            for r in self.reqs:
                r.bufs = BeamBuffers.allocate(r.beam_width, ex.trie.depth, ex.device)
            return None
        return ex._beam_step(self.reqs, step, prepared)

    @torch.inference_mode()
    def finish(self, step: int, phase: str, handle: object) -> None:
        if self.ex.triton_select and kernel_step.fits(self.ex.trie, step):
            self.ex._select_all(self.reqs, step, handle)
            return
        a = 0
        for r in self.reqs:
            n = r.bufs.n
            self.ex._select(r, step, None if handle is None else handle[a : a + n])
            a += n
