"""RankExecutor: runs one rank request with bipartite attention (BAT §4, §5).

For a request (user tokens, candidate item ids, instruction tokens) it picks the prefix (§5.3,
`sgrec.rank.policy`), builds the layout (`sgrec.layout`), takes what is cached (the user's
prefix from the radix tree for user-as-prefix; header and item KV from the item store for
item-as-prefix), computes every other token of the layout in one forward (their rows of the
layout's mask against the KV of all its tokens), and scores the candidates by a softmax over
their id_token logits at the last position (BAT §2.2), or (score_by semantic_id) over their
semantic-ID path log-likelihoods after the prompt (`sgrec.rank.semantic`: one row per distinct
path prefix, in the same forward).

KV ownership (the scheduler's discipline): a matched user prefix is locked for the request and
the user's fresh KV goes into the tree afterwards (duplicates freed); item-store hits are pinned
for the request and fresh item KV is offered to the store; every other slot is freed before `run`
returns, whatever happens. Lock refs and pins end where they started.

Budgets: the item store has `--item-cache-tokens`; the user cache is the rest of the pool, or a hard
cap `user_cache_tokens` (the tree is trimmed to it after each insert: lowest-value users first
under `auto`, as §5.3 replaces the lowest-frequency ones, else the tree's eviction order).

The §5.3 rule under `auto`, with two refinements for an item store that holds only part of the
catalog (BAT §6.6 keeps only the hottest items when the catalog does not fit): tau_i(r) is the
candidates' item tokens the store holds (what item-as-prefix would reuse), and a user's f is
weighted by the share of its prefix that item-as-prefix would not reuse anyway (CacheMeta.user_value:
tokens saved per window per token of cache, the rule's own objective). With the whole catalog
cached and long users both reduce to the paper's rule. Cross-rank items (HRCS): with
a fetcher (`join`, an sgrec.items.fetch.ItemFetcher), a miss on an item another rank owns is
filled with the owner's KV for this request (borrowed slots, freed afterwards; all of a request's
items from one owner in one round trip) or recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sgrec.beam.encdec import InputCache
from sgrec.radix.tree import whole_key
from sgrec.catalog import Catalog, Item, check_token_ids
from sgrec.items import hrcs
from sgrec.mem.cost import LinearCost
from sgrec.mem.tiers import item_key
from sgrec.items.store import ItemStore, fingerprint
from sgrec import layout as L
from sgrec.rank import encoded, forked, semantic
from sgrec.rank.forward import Forward, forward_many
from sgrec.rank.policy import NONE, PREFIX_POLICIES, CacheMeta, select_prefix

logger = logging.getLogger(__name__)

TOKEN_TIME_ALPHA = 0.1  # weight of the newest forward in the forward cost's fit (sgrec.mem.cost)
ITEM_READ_PROBE = 20  # where recomputing items beats reading them from storage, one request in this many reads
USER_FREE_RESERVE = 0.25  # uncapped user cache: free share of the pool kept for other requests


class RankCapacityError(RuntimeError):
    """The KV pool cannot hold a rank request even after evicting every unused cache entry."""


def _ranking(items: list[Item], scores: torch.Tensor, caller_pos: dict[str, int], top_k: int | None,
             semantic_id: bool) -> list[dict]:
    """The response's ranking: by score, ties in the caller's order, the top_k first. semantic_id:
    scores are path log-likelihoods, ranked by their softmax and returned beside it."""
    loglik = None
    if semantic_id:
        loglik, scores = scores.tolist(), torch.softmax(scores, dim=0)
    vals = scores.tolist()
    order = sorted(range(len(items)), key=lambda j: (-vals[j], caller_pos[items[j].id]))
    if top_k is not None:
        order = order[:top_k]
    ranking = [{"item": items[j].id, "score": vals[j]} for j in order]
    if loglik is not None:  # the path's summed log-probability, as /v1/retrieve scores it
        for r, j in zip(ranking, order):
            r["log_likelihood"] = loglik[j]
    return ranking


class RankExecutor:
    def __init__(self, runner, tree, catalog: Catalog, args, header_ids: Sequence[int] = (),
                 meta: CacheMeta | None = None, dp_rank: int = 0, placement=None,
                 user_extra_key: str | None = None, user_cache_tokens: int | None = None, tiers=None):
        self.runner = runner
        self.tree = tree
        self.catalog = catalog
        self.args = args
        if runner.memory.states_per_request and tree.states is not runner.memory.states:
            raise ValueError("a family with recurrent layers needs the radix tree of the runner's state pool "
                             "(RadixCache(..., states=runner.memory.states))")
        self.allocator = runner.memory.allocator
        self.vocab_size = runner.config.vocab_size
        self.header_ids = [int(t) for t in header_ids]
        self.meta = meta or CacheMeta()
        self.dp_rank = dp_rank
        self.placement = placement
        self.user_extra_key = user_extra_key
        # a family with an encoder: its inputs (profile and instruction) cached whole (rank/encoded.py)
        self.inputs = InputCache(runner, tree) if runner.capabilities.encoder else None
        # Cross-rank item KV (an ItemFetcher, set by join): fetch_many([(item_id, n)]) -> fetched chunks
        self.fetcher = None
        # The storage tier (radix/hicache.py HiCache with a storage backend), or None: item KV computed
        # here is written there, and a miss found there is loaded instead of recomputed
        self.tiers = tiers
        self.forward_cost = LinearCost(TOKEN_TIME_ALPHA)  # measured forwards: fixed + per computed token
        self._reads_skipped = 0  # requests whose candidates were recomputed, not read from storage
        # Hard cap on the user-prefix cache (the radix tree's share of the pool). None: the rest of the
        # pool (the tree grows into whatever the item store and running requests leave free).
        self.user_cache_tokens = None if user_cache_tokens is None else max(0, int(user_cache_tokens))
        budget = args.item_cache_tokens
        if budget is None:
            catalog_tokens = catalog.total_tokens + len(self.header_ids)
            budget = min(catalog_tokens, self.allocator.size // 2)
        self.store = ItemStore(runner, catalog, budget, self.header_ids, hotness=self.meta.item_count,
                               owns=self._owns, hot_ids=self.meta.item_counts.keys)

    # ---- start-up -------------------------------------------------------------------------
    def _owns(self, item_id: str) -> bool:
        return self.placement is None or self.placement.owns(self.dp_rank, item_id)

    def precompute(self, progress: bool = False, order: Sequence[Item] | None = None) -> int:
        """Header and item KV for the whole catalog (this rank's share with dp_size > 1), as far as
        the item budget allows, in `order` (hottest first, e.g. by a past period's access counts, as
        HRCS fills its areas, §5.2) when given, else the store's own (current hotness, then catalog
        order); returns how many items were computed (none for a family that does not run the
        item-as-prefix layout: its item KV is never read)."""
        if L.ITEM_PREFIX not in self.runner.capabilities.layouts:
            return 0
        if self.args.dp_size > 1 and self.placement is None:
            self.placement = self.plan_placement(self.args.dp_size)
        return self.store.precompute(progress, items=order)

    def plan_placement(self, n: int, prefill_time=None, bandwidth_gbps: float = hrcs.DEFAULT_BANDWIDTH_GBPS,
                       dp_rank: int | None = None):
        """Algorithm 1 over n ranks (the same plan on every rank): prefill_time(s, p) is the prefill
        model (default: fitted on this runner), bandwidth_gbps the link between the ranks; dp_rank
        (for the log) the rank this executor will be, default the one it is."""
        per_token = self.runner.memory.bytes_per_token
        prefill = prefill_time or hrcs.fit_catalog_prefill(self.runner, self.catalog, self.args.max_rank_candidates)
        placement, rep = hrcs.plan_catalog(self.catalog, n, prefill, per_token, self.args.max_rank_candidates,
                                           hrcs.DEFAULT_TAU_U, bandwidth_gbps, hrcs.DEFAULT_ALPHA)
        logger.info("HRCS: replication ratio %.3f (%d items), rank %d of %d", rep.ratio, rep.num_replicated,
                    self.dp_rank if dp_rank is None else dp_rank, n)
        return placement

    def join(self, dp_rank: int, placement, fetcher) -> None:
        """Serves as rank `dp_rank` of `placement` (HRCS, BAT §5.2; None: this rank holds every
        item): a miss on an item another rank owns goes through `fetcher` (an ItemFetcher)."""
        self.dp_rank, self.placement, self.fetcher = dp_rank, placement, fetcher

    def use_catalog(self, catalog: Catalog, changed: set[str]) -> None:
        """Serves a new catalog version (between scheduler steps): the item KV of changed items is
        dropped here; peers that ask for it check the tokens' fingerprint (sgrec.items.fetch)."""
        self.catalog = catalog
        self.store.use_catalog(catalog, changed)

    # ---- accounting -----------------------------------------------------------------------
    def total_size(self) -> int:
        """KV slots held by the item store (the tree reports its own)."""
        return self.store.total_size()

    # ---- requests -------------------------------------------------------------------------
    def validate(self, user_ids, item_ids, instruction_ids, prefix, top_k) -> list[Item]:
        """The candidates' catalog items; ValueError (a 400) on any bad input."""
        if prefix is not None and prefix not in PREFIX_POLICIES:
            raise ValueError(f"prefix must be one of {', '.join(PREFIX_POLICIES)}, got {prefix!r}")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        if not isinstance(item_ids, (list, tuple)) or not item_ids:
            raise ValueError("items must be a non-empty list of item ids")
        limit = self.args.max_rank_candidates
        if len(item_ids) > limit:
            raise ValueError(f"{len(item_ids)} candidate items exceed --max-rank-candidates {limit}")
        seen, dups = set(), []
        for i in item_ids:
            if isinstance(i, str):
                if i in seen and i not in dups:
                    dups.append(i)
                seen.add(i)
        if dups:
            raise ValueError(f"items: duplicate candidate item id(s): {', '.join(repr(d) for d in dups[:5])}")
        items = self.catalog.lookup(item_ids, full=False)
        if not instruction_ids:
            raise ValueError("the instruction must not be empty: its last token scores the candidates")
        for name, ids in (("user.token_ids", user_ids), ("instruction", instruction_ids)):
            if ids:  # an empty user profile is allowed
                check_token_ids(ids, name, self.vocab_size)
        return items

    def tokens(self, payload: dict) -> int:
        """A request's size in the scheduler's batch budget: its prompt (unknown items count 1), plus,
        when it may be scored by semantic ID, up to ND - 1 path tokens per candidate."""
        cat = self.catalog
        rows = [cat.index.get(i, -1) if isinstance(i, str) else -1 for i in payload["item_ids"]]
        lens = [cat.token_len(r) if r >= 0 else 1 for r in rows]
        paths = 0
        if cat.semantic_id_len and payload.get("score_by") != "id_token" and (
                payload.get("score_by") == "semantic_id" or any(r >= 0 and cat.id_tokens[r] < 0 for r in rows)):
            paths = cat.semantic_id_len - 1
        if self.runner.capabilities.rank_forks:  # the instruction once per candidate (rank/forked.py)
            return forked.tokens(len(payload["user_ids"]), lens, len(payload["instruction_ids"]), paths)
        return len(payload["user_ids"]) + sum(lens) + len(payload["instruction_ids"]) + len(rows) * paths

    def run_batch(self, payloads: list[dict]) -> list[dict | Exception]:
        """Several requests, their uncached tokens in one forward (one sequence each, its own mask);
        per request its result or its ValueError / RankCapacityError. Each request reads the
        caches as they were before the batch (a user twice in one batch computes its prefix twice)."""
        out: list[dict | Exception | None] = [None] * len(payloads)
        gens, specs = [], []
        try:
            for i, p in enumerate(payloads):
                gen = self._request(**p)
                try:
                    specs.append(next(gen))
                    gens.append((i, gen))
                except StopIteration as stop:  # answered without a forward (filters left no candidate)
                    out[i] = stop.value
                except (TypeError, ValueError, RuntimeError) as e:
                    out[i] = ValueError(str(e)) if isinstance(e, TypeError) else e
            if not gens:
                return out  # type: ignore[return-value]
            try:
                scores = self._forward_many(specs)
            except RankCapacityError as e:
                if len(specs) == 1:
                    out[gens[0][0]] = e
                    return out  # type: ignore[return-value]
                for (i, gen), sp in zip(gens, specs):  # not all at once: one forward each, finished at once
                    try:
                        self._finish(i, gen, self._forward_many([sp])[0], out)
                    except RankCapacityError as e1:
                        out[i] = e1
                return out  # type: ignore[return-value]
            for (i, gen), sc in zip(gens, scores):
                self._finish(i, gen, sc, out)
        finally:
            for _, gen in gens:
                gen.close()  # a request that did not finish releases its locks and slots
        return out  # type: ignore[return-value]

    @staticmethod
    def _finish(i: int, gen, scores: torch.Tensor, out: list) -> None:
        """Hands a request its scores; out[i] becomes its response (or its RankCapacityError)."""
        try:
            gen.send(scores)
        except StopIteration as stop:
            out[i] = stop.value
        except RankCapacityError as e:
            out[i] = e

    def run(self, user_key: str, user_ids: list[int], item_ids: list[str], instruction_ids: list[int],
            prefix: str | None = None, top_k: int | None = None, score_by: str | None = None) -> dict:
        out = self.run_batch([dict(user_key=user_key, user_ids=user_ids, item_ids=item_ids,
                                   instruction_ids=instruction_ids, prefix=prefix, top_k=top_k,
                                   score_by=score_by)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def _request(self, user_key: str, user_ids: list[int], item_ids: list[str], instruction_ids: list[int],
                 prefix: str | None = None, top_k: int | None = None, score_by: str | None = None,
                 exclude_items: list[str] | None = None, include_items: list[str] | None = None,
                 filter: dict | None = None):
        """A request as a generator: yields its forward (a Forward) once, receives the candidates'
        scores (semantic_id: their path log-likelihoods), returns the response. Closing it early
        releases everything it holds. Filters drop candidates first; with none left it returns an
        empty ranking without yielding."""
        items = self.validate(user_ids, item_ids, instruction_ids, prefix, top_k)
        items, ignored = self._filter(items, exclude_items, include_items, filter)
        fmeta = {"filtered_items": len(item_ids) - len(items), "ignored_exclusions": ignored}
        if not items:
            return {"ranking": [], "meta_info": {"prompt_tokens": 0, "cached_tokens": 0, **fmeta}}
        # The model sees the candidates in one canonical order (by id), whatever order the caller
        # gave: the attention of the instruction (and, item-as-prefix, the user) sums over every
        # candidate's columns, and that sum's rounding follows the column order (in bfloat16 enough to
        # swap close scores). The caller's order only breaks ties in the ranking.
        caller_pos = {it.id: k for k, it in enumerate(items)}
        if self.inputs is not None:  # an encoder-decoder: every path under the decoder (rank/encoded.py)
            return (yield from self._run_encoded(items, caller_pos, user_ids, instruction_ids, prefix, top_k,
                                                 score_by, fmeta))
        score_by = semantic.resolve_score_by(items, score_by)
        items = sorted(items, key=lambda it: it.id)
        item_ids = [it.id for it in items]
        if score_by == "id_token":
            targets = [it.id_token for it in items]
        else:
            targets = [tuple(it.semantic_id) for it in items]
        policy = prefix or self.args.rank_prefix_policy
        choice, kind = self._choose_prefix(policy, user_key, user_ids, items, item_ids, instruction_ids)
        fetched = stored = 0
        if self.runner.capabilities.rank_forks:  # one state fork per candidate (rank/forked.py)
            scores, cached, prompt = yield from self._run_forked(items, targets, user_key, user_ids, instruction_ids,
                                                                 choice == L.USER_PREFIX, policy == "auto")
            ranking = _ranking(items, scores, caller_pos, top_k, score_by == "semantic_id")
            return {"ranking": ranking, "meta_info": {
                "prefix": choice, "prompt_tokens": prompt, "cached_tokens": cached,
                "computed_tokens": prompt - cached, "score_by": score_by, **fmeta}}
        lay = L.build(kind, self.header_ids, user_ids, [it.token_ids for it in items], instruction_ids)
        if choice == L.USER_PREFIX:
            scores, cached = yield from self._run_user_prefix(lay, targets, user_key, user_ids,
                                                              by_freq=policy == "auto")
        elif choice == L.ITEM_PREFIX:
            scores, cached, fetched, stored = yield from self._run_item_prefix(lay, targets, item_ids)
        else:
            scores, cached = (yield Forward(lay, {}, targets)), 0
        ranking = _ranking(items, scores, caller_pos, top_k, score_by == "semantic_id")
        meta = {"prefix": choice, "prompt_tokens": len(lay), "cached_tokens": cached,
                "computed_tokens": len(lay) - cached, "score_by": score_by, **fmeta}
        if score_by == "semantic_id":
            meta["path_tokens"] = semantic.PathTrie(targets).num_rows()  # path tokens forwarded
        if self.fetcher is not None:
            meta["fetched_tokens"] = fetched  # of cached_tokens, KV fetched from another rank
        if self.tiers is not None:
            meta["stored_tokens"] = stored  # of cached_tokens, item KV loaded from the storage tier
        return {"ranking": ranking, "meta_info": meta}

    def _choose_prefix(self, policy: str, user_key: str, user_ids: list[int], items: list[Item],
                       item_ids: list[str], instruction_ids: list[int]) -> tuple[str, str]:
        """(the prefix the request takes: user, item or none; the layout it builds) by `policy`
        (§5.3's rule for auto, the larger prefix for greedy), among the layouts the model's family
        runs. Records the request in the cache meta (frequencies) on the way."""
        tau_u = len(user_ids)
        tau_i = sum(len(it.token_ids) for it in items)
        # f_u of §5.3: the user's decayed sliding-window frequency of the requests *before* this one
        # (the predicted near-future frequency), so a first request (f_u = 0) never displaces a
        # cached user: such users would only add compulsory misses (§5.3, "cache-agnostic").
        f_u = self.meta.user_freq(user_key)
        self.meta.record_user(user_key)
        self.meta.record_items(item_ids)
        choice = policy
        if policy == "auto":  # only auto reads the cache state (a scan of the cached users)
            capped = self.user_cache_tokens is not None and not self.tree.disable
            # tau_i(r) of the rule is what item-as-prefix would reuse: the candidates' cached item
            # tokens (all of tau_i when the catalog fits, fewer when only the hot items do)
            # The frequencies compared are CacheMeta.user_value: f times the share of the prefix that
            # item-as-prefix would not reuse anyway (h: header + cached candidates), i.e. the tokens a
            # cached prefix saves per window per token of cache, the §5.3 objective.
            reusable = self._reusable_item_tokens(items)
            h = reusable + len(self.header_ids)
            self.meta.note_reuse(user_key, tau_u, h)
            value_u = f_u * (max(0, tau_u - h) / tau_u if tau_u else 1.0)  # f_u: before this request
            choice = select_prefix(
                policy, tau_u, reusable, value_u,
                cached_freqs=self.meta.cached_freqs(exclude=user_key, value=True),
                user_cached=self.meta.is_cached(user_key, tau_u, user_ids),
                fits_without_eviction=self._user_fits(tau_u, tau_u + tau_i + len(instruction_ids)),
                replaced_freqs=self._replaced_freqs(user_key, tau_u) if capped else None,
                cacheable=not capped or tau_u <= self.user_cache_tokens,
            )
        elif policy not in (L.USER_PREFIX, L.ITEM_PREFIX, NONE):  # greedy (an unknown name: ValueError)
            choice = select_prefix(policy, tau_u, tau_i)
        kind = L.ITEM_PREFIX if choice == L.ITEM_PREFIX else L.USER_PREFIX
        layouts = self.runner.capabilities.layouts  # the layouts whose masks the model's family runs
        if kind == L.ITEM_PREFIX and kind not in layouts and policy != L.ITEM_PREFIX:
            choice, kind = L.USER_PREFIX, L.USER_PREFIX  # auto or greedy: the other layout
        if kind not in layouts:
            raise ValueError(f"prefix {policy!r} needs the {kind}-as-prefix layout, which the "
                             f"{self.runner.family.name} family does not run (its layouts: {sorted(layouts)})")
        return choice, kind

    def _filter(self, items: list[Item], exclude: list[str] | None, include: list[str] | None,
                spec: dict | None) -> tuple[list[Item], int]:
        """The candidates the request's filters keep (in order), and how many exclude ids are not in
        the catalog (ignored). Unknown include ids and bad filters: ValueError naming them."""
        cat, ignored = self.catalog, 0
        if exclude:
            ex = set(exclude)
            ignored = sum(1 for i in ex if i not in cat)
            items = [it for it in items if it.id not in ex]
        if include is not None:
            cat.rows(include)  # UnknownItemError names unknown ids
            inc = set(include)
            items = [it for it in items if it.id in inc]
        if spec is not None:
            ok = cat.filter_mask(spec)
            items = [it for it in items if ok[cat.index[it.id]]]
        return items, ignored

    def score_layout(self, lay: L.RankLayout, item_ids: Sequence[str]) -> torch.Tensor:
        """Scores (in candidate order) of a layout computed from scratch, no cache read or write:
        the reference path. `item_ids` are the candidates the layout was built from."""
        return self._forward_many([Forward(lay, {}, [it.id_token for it in self.catalog.lookup(item_ids)])])[0]

    def score_semantic_layout(self, lay: L.RankLayout, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """Path log-likelihoods (float64, in candidate order) of a layout, one candidate at a time
        from scratch (`semantic.reference_loglik`): the reference of score_by semantic_id. No cache
        read or write; frees its slots."""
        out = []
        for p in paths:
            self._make_room(len(lay) + len(p) - 1)
            out.append(semantic.reference_loglik(self.runner, lay, tuple(p)))
        return torch.tensor(out, dtype=torch.float64)

    # ---- the two cached paths -------------------------------------------------------------
    def _reusable_item_tokens(self, items: Sequence[Item]) -> int:
        """Item tokens an item-as-prefix layout of `items` would read instead of computing: those in
        the item store, with a fetcher those another rank owns (fetched when that is cheaper;
        counted as reusable here), and with a storage tier those its prefetch brought up."""
        store, remote, tiers = self.store, self.fetcher is not None, self.tiers
        return sum(len(it.token_ids) for it in items if it.id in store or (remote and not self._owns(it.id))
                   or (tiers is not None and tiers.has_item(self._item_key(it.token_ids))))

    def _user_fits(self, tau_u: int, prompt_tokens: int) -> bool:
        """The whole user prefix can be cached without replacing anyone: within the cap's free room,
        or, with no cap, in free pool slots beyond this request's own and a reserve of
        USER_FREE_RESERVE of the pool (working room of the other requests)."""
        if self.tree.disable:
            return False
        cap = self.user_cache_tokens
        if cap is not None:
            return self.tree.total_size() + tau_u <= cap
        reserve = USER_FREE_RESERVE * self.allocator.size
        return self.allocator.available_size() - prompt_tokens - tau_u >= reserve

    def _replaced_freqs(self, user_key: str, tau_u: int) -> list[float]:
        """Frequencies of the cached users BAT would evict, lowest first, to fit tau_u more tokens
        under the user-cache cap (approximate: a shared prefix frees less than its user's length)."""
        need = self.tree.total_size() + tau_u - self.user_cache_tokens
        out: list[float] = []
        if need <= 0:
            return out
        now = self.meta.clock()
        for f, u in sorted((self._victim_key(u, now), u) for u in self.meta.cached_users() if u != user_key):
            out.append(f)
            need -= self.meta.users[u].cached_len
            if need <= 0:
                break
        return out

    def _victim_key(self, user: str, now: float) -> float:
        """BAT replaces the cached users of lowest value first (CacheMeta.user_value)."""
        return self.meta.user_value(user, now)

    def _trim_users(self, keep: str, by_freq: bool) -> None:
        """Evicts user prefixes until the tree is within `user_cache_tokens`. BAT (auto, §5.3: the new
        user "replaces" the lowest-frequency cached users) evicts the lowest-frequency users first;
        every other policy uses the tree's own eviction order (--radix-eviction-policy)."""
        cap, tree = self.user_cache_tokens, self.tree
        if cap is None or tree.disable or tree.total_size() <= cap:
            return
        if by_freq:
            now = self.meta.clock()
            victims = sorted((self._victim_key(u, now), u) for u in self.meta.cached_users() if u != keep)
            for _, u in victims:
                if tree.total_size() <= cap:
                    return
                self._evict_user(u)
        if tree.total_size() > cap:
            tree.evict(tree.total_size() - cap)

    def _evict_user(self, user: str) -> int:
        """Frees the tree nodes only `user`'s prefix uses (unlocked leaves up from its deepest node)."""
        st = self.meta.users.get(user)
        freed = self.tree.evict_branch(st.node) if st is not None and st.node is not None else 0
        if st is not None:
            st.node, st.cached_len = None, 0
        return freed

    def _run_user_prefix(self, lay: L.RankLayout, targets: list, user_key: str, user_ids: list[int],
                         by_freq: bool = False):
        """Generator (see _request): the user's cached prefix is read, the fresh part of it cached."""
        tree, seg = self.tree, lay.segment("user")
        if seg is None or tree.disable:
            return (yield Forward(lay, {}, targets)), 0
        res = tree.match_prefix(user_ids, self.user_extra_key)
        tree.inc_lock_ref(res.last_node)
        m = res.indices.numel()
        fresh: dict[str, torch.Tensor | None] = {"user": None}
        try:
            scores = yield Forward(lay, {seg.start: res.indices} if m else {}, targets, fresh)
            value = res.indices if fresh["user"] is None else torch.cat([res.indices, fresh["user"]])
            fresh["user"] = None  # owned by `value` now
            try:
                tree.insert_owned(user_ids, value, self.user_extra_key, m)
            except BaseException:
                self.allocator.free(value[m:])
                raise
            after = tree.match_prefix(user_ids, self.user_extra_key)
            self.meta.set_cached(user_key, after.last_node, after.indices.numel(), user_ids)
        finally:
            if fresh["user"] is not None:  # closed after its forward: nobody takes the fresh KV
                self.allocator.free(fresh["user"])
            tree.dec_lock_ref(res.last_node)
        self._trim_users(user_key, by_freq)
        return scores, m

    def _run_forked(self, items: list[Item], targets: list, user_key: str, user_ids: list[int],
                    instruction_ids: list[int], use_cache: bool, by_freq: bool):
        """Generator (see _request) for a family whose rank forks a state per candidate
        (rank/forked.py): the user resumes from the deepest cached snapshot of its prefix; its fresh
        KV and its final state (a snapshot at its end) go to the tree. Returns (scores, cached
        tokens, prompt tokens: the user's and every continuation's)."""
        tree, extra = self.tree, self.user_extra_key
        conts = [[int(t) for t in it.token_ids] + list(instruction_ids) for it in items]
        prompt = len(user_ids) + sum(len(c) for c in conts)
        if not use_cache or tree.disable or not user_ids:
            none = torch.empty(0, dtype=torch.int64)
            return (yield forked.ForkedForward(list(user_ids), none, None, conts, targets)), 0, prompt
        res = tree.match_snapshot(user_ids, extra)
        tree.inc_lock_ref(res.last_node)
        snap = res.last_node if res.last_node.state is not None else None
        if snap is not None:  # not evicted while the request copies it
            tree.lock_state(snap)
        m = res.indices.numel()
        keep: dict[str, torch.Tensor | None] = {"user": None, "state": None}
        try:
            scores = yield forked.ForkedForward(list(user_ids), res.indices, None if snap is None else snap.state,
                                                conts, targets, keep)
            value = res.indices if keep["user"] is None else torch.cat([res.indices, keep["user"]])
            keep["user"] = None  # owned by `value` now
            try:
                tree.insert_owned(user_ids, value, extra, m)
            except BaseException:
                self.allocator.free(value[m:])
                raise
            after = tree.match_prefix(user_ids, extra)
            if after.indices.numel() == len(user_ids) and after.last_node.state is None:
                tree.attach_state(after.last_node, keep["state"])  # the user's state, for its next request
                keep["state"] = None
            self.meta.set_cached(user_key, after.last_node, after.indices.numel(), user_ids)
        finally:
            if keep["user"] is not None:  # closed after its forward: nobody takes the fresh KV
                self.allocator.free(keep["user"])
            if keep["state"] is not None:
                self.runner.memory.states.free(keep["state"])
            if snap is not None:
                tree.unlock_state(snap)
            tree.dec_lock_ref(res.last_node)
        self._trim_users(user_key, by_freq)
        return scores, m, prompt

    def _run_encoded(self, items: list[Item], caller_pos: dict[str, int], user_ids: list[int],
                     instruction_ids: list[int], prefix: str | None, top_k: int | None, score_by: str | None,
                     fmeta: dict):
        """Generator (see _request) for a family with an encoder: the profile and the instruction are
        its input, cached whole unless prefix is "none"; each candidate scored by its semantic-ID
        path (rank/encoded.py)."""
        encoded.check_options(score_by, prefix, self.runner.family.name)
        semantic.resolve_score_by(items, "semantic_id")  # a candidate without a path: a 400 naming it
        items = sorted(items, key=lambda it: it.id)
        cache = (prefix or self.args.rank_prefix_policy) != NONE
        spec = encoded.EncodedForward(list(user_ids) + list(instruction_ids), self.user_extra_key,
                                      [tuple(it.semantic_id) for it in items], cache)
        scores = yield spec
        ranking = _ranking(items, scores, caller_pos, top_k, True)
        return {"ranking": ranking, "meta_info": {
            "prefix": L.USER_PREFIX if cache else NONE, "prompt_tokens": len(spec.ids), "cached_tokens": spec.cached,
            "computed_tokens": len(spec.ids) - spec.cached, "score_by": "semantic_id", **fmeta}}

    def _run_item_prefix(self, lay: L.RankLayout, targets: list, item_ids: Sequence[str]):
        """Generator (see _request) returning (scores, cached tokens, of which fetched from another rank,
        of which loaded from the storage tier)."""
        store = self.store
        if store.header_slots is None:
            self._make_room(len(self.header_ids))
        header = store.ensure_header()
        slots = store.acquire(item_ids)
        borrowed: list[torch.Tensor] = []  # fetched item KV: used by this request only, then freed
        fresh: dict[str, torch.Tensor | None] = {}
        stored = 0
        try:
            if self.tiers is not None:
                stored = self._load_stored(lay, slots, borrowed)
            if self.fetcher is not None:
                self._fetch_remote(lay, item_ids, slots, borrowed)
            cached: dict[int, torch.Tensor] = {}
            hseg = lay.segment("header")
            if hseg is not None:
                cached[hseg.start] = header
            for seg, s in zip(lay.items(), slots):
                if s is not None:
                    cached[seg.start] = s
            fresh.update({f"item{seg.item}": None for seg, s in zip(lay.items(), slots) if s is None})
            scores = yield Forward(lay, cached, targets, fresh)
            for seg, item_id in zip(lay.items(), item_ids):
                kv = fresh.pop(f"item{seg.item}", None)
                if kv is not None and self.tiers is not None:
                    self.tiers.save_item(self._item_key(lay.token_ids[seg.start:seg.stop]), kv)
                if kv is not None and not store.admit(item_id, kv):
                    self.allocator.free(kv)
        finally:
            left = [kv for kv in fresh.values() if kv is not None]  # closed after its forward
            if left:
                self.allocator.free(torch.cat(left))
            store.release(item_ids)
            if borrowed:
                self.allocator.free(torch.cat(borrowed))
        return scores, sum(len(s) for s in cached.values()), sum(len(b) for b in borrowed) - stored, stored

    def _item_key(self, token_ids) -> str:
        return item_key(self.tiers.namespace, self.header_ids, [int(t) for t in token_ids])

    def may_use(self, payload: dict, layout: str) -> bool:
        """Whether a rank request may read cached KV in this layout (L.USER_PREFIX: its user's
        prefix; L.ITEM_PREFIX: its candidates' item KV): what the storage tier is asked for when it
        arrives. Only an explicit other layout (or none) rules it out."""
        policy = payload.get("prefix") or self.args.rank_prefix_policy
        return policy not in (NONE, L.USER_PREFIX if layout == L.ITEM_PREFIX else L.ITEM_PREFIX)

    def cache_key(self, payload: dict) -> tuple[list[int], str | None]:
        """The radix key (and extra key) a request's user is looked up under: its profile, or, for a
        family with an encoder, the whole key of its input (profile and instruction); what the
        storage tier is asked for on arrival."""
        if self.inputs is not None:
            return whole_key(list(payload["user_ids"]) + list(payload.get("instruction_ids") or [])), \
                self.user_extra_key
        return list(payload["user_ids"]), self.user_extra_key

    def stored_items(self, payload: dict) -> list[tuple[str, int]]:
        """(key, tokens) of a rank request's candidates that the item store lacks, when its layout
        may be item-as-prefix and reading them pays: what the storage tier is asked for when the
        request arrives (the scheduler's prefetch)."""
        if self.tiers is None or not self.may_use(payload, L.ITEM_PREFIX):
            return []
        cat, out = self.catalog, []
        for item_id in payload.get("item_ids") or []:
            row = cat.index.get(item_id, -1) if isinstance(item_id, str) else -1
            if row >= 0 and item_id not in self.store:
                toks = cat.token_ids(row)
                out.append((self._item_key(toks), len(toks)))
        if out and not self._read_pays(sum(n for _, n in out)):
            self.tiers.item_tokens["not_read"] += sum(n for _, n in out)
            return []
        return out

    def _read_pays(self, tokens: int) -> bool:
        """Reading `tokens` candidate tokens' KV from storage beats recomputing them: the storage
        read's predicted time (its fitted fixed part, round trips, plus per token) against what those
        tokens add to this executor's forward (the fitted slope: the forward runs anyway), both fitted
        to measured calls (sgrec.mem.cost; the rule the fetch cost model applies to peers, BAT §5.2).
        Until both are measured it reads, and where recomputing is cheaper every ITEM_READ_PROBE-th
        request reads anyway, so a change is seen. `item_reads: always` in the storage tier's extra
        config always reads."""
        read, compute = self.tiers.item_read.predict(tokens), self.token_time
        if self.tiers.item_reads == "always" or read is None or compute is None or read <= compute * tokens:
            return True
        self._reads_skipped += 1
        return self._reads_skipped % ITEM_READ_PROBE == 0

    def _load_stored(self, lay: L.RankLayout, slots: list, borrowed: list) -> int:
        """Fills misses with item KV the storage tier had (brought up to the host tier when the
        request arrived): copied into borrowed slots, as KV fetched from a peer. Returns the tokens."""
        segs = lay.items()
        found = []
        for j, s in enumerate(slots):
            if s is None:
                page = self.tiers.item(self._item_key(lay.token_ids[segs[j].start:segs[j].stop]))
                if page is not None and page.k.shape[1] == segs[j].length:
                    found.append((j, page))
        if not found:
            return 0
        n = sum(p.k.shape[1] for _, p in found)
        self._make_room(n)
        got = self.allocator.alloc(n)
        borrowed.append(got)
        self.tiers.write_rows(got, torch.cat([p.k for _, p in found], 1), torch.cat([p.v for _, p in found], 1))
        off = 0
        for j, p in found:
            slots[j] = got[off : off + p.k.shape[1]]
            off += p.k.shape[1]
        return n

    def _fetch_remote(self, lay: L.RankLayout, item_ids: Sequence[str], slots: list, borrowed: list) -> None:
        """Fills the misses of items owned by other ranks with their KV, fetched from the owners in
        one round trip per owner (those the fetcher finds cheaper than recomputing); `slots[j]`
        becomes borrowed slots (one allocation per owner's chunk, listed in `borrowed`)."""
        want = {item_id: j for j, item_id in enumerate(item_ids) if slots[j] is None and not self._owns(item_id)}
        if not want:
            return
        segs = lay.items()
        fps = {i: fingerprint(lay.token_ids[segs[j].start:segs[j].stop]) for i, j in want.items()}
        for chunk in self.fetcher.fetch_many([(i, segs[j].length) for i, j in want.items()], fps):
            n = sum(chunk.lens)
            self._make_room(n)
            got = self.allocator.alloc(n)
            borrowed.append(got)
            self.runner.memory.write_rows(got, chunk.k, chunk.v)  # the pool casts (an fp8 one saturating)
            off = 0
            for item_id, m in zip(chunk.items, chunk.lens):
                slots[want[item_id]] = got[off : off + m]
                off += m

    # ---- the forward ----------------------------------------------------------------------
    def _forward_many(self, specs: list[Forward]) -> list[torch.Tensor]:
        """forward.forward_many (forked.forward_many for forked continuations), room made by this
        executor's eviction order, its time observed."""
        if specs and isinstance(specs[0], forked.ForkedForward):
            out, seconds, tokens = forked.forward_many(self.runner, specs, self._make_room)
        elif specs and isinstance(specs[0], encoded.EncodedForward):
            out, seconds, tokens = encoded.forward_many(self.runner, self.inputs, specs, self._make_room)
        else:
            out, seconds, tokens = forward_many(self.runner, specs, self._make_room)
        self._observe_forward(seconds, tokens)
        return out

    def _observe_forward(self, seconds: float, tokens: int) -> None:
        self.forward_cost.observe(tokens, seconds)

    @property
    def token_time(self) -> float | None:
        """Seconds one more computed token adds to a forward here (the fitted slope, sgrec.mem.cost):
        what recomputing an item token costs, read by the cross-rank fetch cost model and by
        _read_pays; None before the first forward."""
        return self.forward_cost.per_token

    def _make_room(self, n: int, states: int = 0) -> None:
        """n free token slots and `states` free state slots, or a RankCapacityError."""
        if not self.tree.make_room(n, states):  # the radix tree's entries first, then the item store's
            self.store.evict(n - self.allocator.available_size())
        if n > self.allocator.available_size():
            raise RankCapacityError(
                f"KV cache full: a rank request needs {n} slots, {self.allocator.available_size()} free after "
                f"evicting every unused cache entry (pool {self.allocator.size})")
        pool = self.runner.memory.states
        if states > pool.available_size():
            raise RankCapacityError(
                f"a rank request needs {states} state slots (one a candidate and the user's), "
                f"{pool.available_size()} free after evicting every unused snapshot (state pool {pool.size}); "
                f"send fewer candidates or raise --max-mamba-cache-size")
