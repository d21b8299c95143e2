"""Bipartite-attention ranking (BAT §6.2, §6.4): RE, UP, IP, cache-agnostic and BAT on a
MovieLens-100K ranking trace, at three total cache budgets, plus the Table 4 ablation.

    python benchmarks/bench_rank.py                          # defaults below (~10 min on 2 busy cores)
    python benchmarks/bench_rank.py --requests 200 --ranks 0  # quick

Trace (BAT §6.2, scaled down for CPU with the ratios kept).
- Users and requests: --users ML-100K users drawn at random; --requests log entries of those users
  drawn uniformly with replacement, so a user's request rate follows their history frequency (§6.2:
  "sample the users with replacement from the history log ... take their history access frequency
  as the basis"). Each request is (user u, movie m): m is the true next item. Request times are
  drawn uniformly over --horizon-s seconds ("randomly sample the intervals between consecutive
  accesses"), replayed in time order; the cache meta service uses a 60-minute window.
- Candidates: 100 per request (--candidates): m plus others, half by popularity (rating counts),
  half by co-occurrence (a movie rated by a random other rater of u's previous movie).
- Items: movie titles tokenized by the model's tokenizer, cut to --item-tokens (BAT's datasets have
  10-18 tokens per item and prompts up to 8K; the default 4 tokens and 2K prompts are both 1/4).
- User profiles: the titles of the user's rated movies, repeated to a length that grows with the
  user's number of ratings as L_max * (n_u / n_max)^g, L_max so that the longest prompt is
  --max-prompt; g is solved so that the mean profile over the trace's users is --user-item-ratio
  times the mean candidate tokens (BAT Table 1, a per-dataset average over users: tau_u is about
  1.1-1.5x the 100 candidates' tokens; with 1.25, 48% of users and 22% of requests have fewer user
  than item tokens, against 36% of users in BAT's trace (§3) and "over 70% of requests" to user-as-
  prefix by the cache-agnostic rule on Books (§5.3)). --ratio-over request averages over requests
  instead (the earlier reading: hot users weigh more, so profiles come out about half as long and
  79% of users are shorter than their candidates). Static per user (pre-encoded, BAT §5.1).
- Past period (Algorithm 1's F, "e.g. past one day"): a second trace of the same users and samplers
  over the preceding --horizon-s, drawn with its own random stream (the replayed trace is unchanged
  by it). It gives the item counts of the HRCS plan, the order in which the item stores are filled at
  start-up (hottest first, §5.2 step 3), the item counts the stores' replacement starts from, and
  BAT's budget split. Nothing is read from the replayed trace itself.

Budgets. Each system gets the same total cache M (KV tokens), split into two hard budgets: the
user-prefix cache (the radix tree, capped by RankExecutor(user_cache_tokens=...), evicting down to
the cap after each insert) and the item store (--item-cache-tokens). The KV pool is the two budgets
plus one longest prompt of working room, which the caches never keep. M = f * (C + U) for each f in
--budgets, C the catalog's item tokens (plus header), U the trace's distinct user tokens (C + U:
everything the trace could reuse). As in BAT §5.2 the item pool is allocated first and the rest is
user cache; its size comes from sgrec.rank.budget.split_budget on the past period (the item budget
that reuses the most tokens in a static model of both caches: the hottest items, then the users
with the most reusable tokens per token of space; the whole catalog when items are hot enough,
only the hottest part when the catalog does not fit beside the hot users, as BAT does at the
100M-item scale of §6.6), or from --item-share.
UP: users M. IP: items min(M, C) (it has no use for more). cache-agnostic (greedy) and BAT (auto):
the same split (BAT Fig. 8 fixes the item cache for both).

Throughput. req/s (wall) is measured with a tiny random model, requests back to back. On a shared,
busy machine that is noisy, so each system also gets an estimate: a degree-2 polynomial t(computed,
cached) fitted (best of --fit-repeats) on measured forwards of this model, summed over the
requests' (computed, cached) tokens; est req/s = requests / that sum. The targets are checked on
both.

Ablation (Table 4), --ranks N data-parallel ranks (users routed by id), per rank M = f * (C + U / N)
(--ablation-budget f). None: UP only. A: bipartite (items replicated on every rank, greedy). AB:
+HRCS placement (Algorithm 1 with B = --bandwidth-gbps in this model's KV tokens); a cold item
owned by another rank is recomputed unless --fetch (then fetched from the owner's store through
sgrec.items.fetch loopback endpoints; the estimate adds the transfer time at B). AC: +hotness-
aware prefix selection (auto) with items replicated. ABC: both.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from collections import Counter

import torch

from sgrec.catalog import Catalog, Item
from sgrec.data.movielens import load_ml100k
from sgrec.items import hrcs
from sgrec.mem.kv_pool import KVPool
from sgrec.model.config import ModelConfig
from sgrec.radix.tree import RadixCache
from sgrec.rank import budget
from sgrec.rank.executor import RankExecutor
from sgrec.rank.policy import CacheMeta
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs
from sgrec.tokenizer import Tokenizer
from sgrec.tools.make_tiny_model import make_tiny_model
from sgrec.tools.results import row, write_record

INSTR_TEXT = "Which item will the user choose next?"
HEADER_TEXT = "Candidate items:"
WINDOW_S = 3600.0


def build_workload(tok: Tokenizer, vocab: int, n_requests: int, n_users: int, n_cand: int, max_prompt: int,
                   item_tokens: int, ratio: float, horizon_s: float, seed: int, ratio_over: str = "user"):
    data = load_ml100k()
    rng = random.Random(seed)
    items = []
    for mid, mv in sorted(data.movies.items()):
        toks = tok.encode(mv.title or f"movie {mid}", add_special_tokens=False)[:item_tokens] or [3]
        items.append(Item(str(mid), tuple(toks), rng.randrange(3, vocab)))
    catalog = Catalog(items)
    hist = data.histories()
    pop = Counter(x.item for x in data.interactions)
    pop_ids, pop_w = zip(*pop.items())
    raters: dict[int, list[int]] = {}
    for x in data.interactions:
        raters.setdefault(x.item, []).append(x.user)
    instr = tok.encode(INSTR_TEXT, add_special_tokens=False)
    header = tok.encode(HEADER_TEXT, add_special_tokens=False)

    users = rng.sample(sorted(hist), min(n_users, len(hist)))
    log = [(u, k) for u in users for k in range(len(hist[u]))]

    def draw(rng: random.Random) -> list[tuple[int, list[str], float]]:
        picks = [rng.choice(log) for _ in range(n_requests)]
        times = sorted(rng.uniform(0.0, horizon_s) for _ in picks)
        rng.shuffle(picks)
        reqs = []
        for (u, k), ts in zip(picks, times):
            true = hist[u][k].item
            last = hist[u][k - 1].item if k else None
            cands = {true}
            while len(cands) < n_cand:
                if rng.random() < 0.5 or last is None:
                    cands.add(rng.choices(pop_ids, pop_w)[0])
                else:
                    other = rng.choice(raters[last])
                    cands.add(rng.choice(hist[other]).item)
            cl = [str(c) for c in cands]
            rng.shuffle(cl)
            reqs.append((u, cl, ts))
        return reqs

    reqs = draw(rng)
    # the past period (Algorithm 1's F, the budget split, the item store's start-up order): the same
    # users and samplers over the preceding horizon, drawn independently of the replayed trace
    past_reqs = draw(random.Random(seed + 1_000_003))

    # profile lengths: L_max * (n_u / n_max)^g with the request-weighted mean = ratio * mean tau_i
    item_len = [sum(len(catalog.get(c).token_ids) for c in cl) for _, cl, _ in reqs]
    tau_i = sum(item_len) / len(item_len)
    l_max = max(16, max_prompt - max(item_len) - len(instr) - len(header))
    n_max = max(len(hist[u]) for u, _, _ in reqs)

    def lengths(g: float) -> dict[int, int]:
        return {u: max(16, min(l_max, round(l_max * (len(hist[u]) / n_max) ** g))) for u in users}

    seen = sorted({u for u, _, _ in reqs})
    lo, hi = 0.0, 8.0  # mean length falls as g grows
    for _ in range(50):
        g = (lo + hi) / 2
        ls = lengths(g)
        if ratio_over == "user":  # Table 1's average over users
            mean = sum(ls[u] for u in seen) / len(seen)
        else:  # over requests (hot users weigh more)
            mean = sum(ls[u] for u, _, _ in reqs) / len(reqs)
        lo, hi = (g, hi) if mean > ratio * tau_i else (lo, g)
    ls = lengths((lo + hi) / 2)
    profiles = {}
    for u in users:
        base = [t for x in hist[u] for t in catalog.get(str(x.item)).token_ids]
        profiles[u] = (base * (ls[u] // len(base) + 1))[: ls[u]]
    trace = [(f"u{u}", profiles[u], cl, ts) for u, cl, ts in reqs]
    past = [(f"u{u}", profiles[u], cl, ts - horizon_s) for u, cl, ts in past_reqs]
    return catalog, trace, instr, header, past


class Rank:
    """One data-parallel rank: its own runner (KV pool), radix tree and RankExecutor, with a hard
    user-cache budget and an item-store budget; the pool adds one request's working room."""

    def __init__(self, model, catalog, header, policy, user_budget, item_budget, transient, placement=None,
                 rank=0, n=1, item_order=None, item_counts=None, user_history=()):
        pool = user_budget + item_budget + transient
        if placement is None and n > 1:  # replicated: every rank may keep every item
            placement = hrcs.Placement(n, {it.id for it in catalog.items}, {})
        self.args = ServerArgs(model_path=model, device="cpu", dtype="float32", max_total_tokens=max(pool, 2),
                               item_cache_tokens=item_budget, rank_prefix_policy=policy, dp_size=n,
                               max_rank_candidates=1000)
        self.runner = ModelRunner(self.args)
        self.tree = RadixCache(self.runner.kv_pool.allocator)
        self.clock = [0.0]
        meta = CacheMeta(window_s=WINDOW_S, clock=lambda: self.clock[0])  # trace time
        self.ex = RankExecutor(self.runner, self.tree, catalog, self.args, header_ids=header, meta=meta,
                               dp_rank=rank, placement=placement, user_cache_tokens=user_budget)
        if item_counts:  # the past period's item counts: the store's hotness starts from them
            meta.seed_items(item_counts)
        for user, ts in user_history:  # the past period's requests: the users' window frequencies so far
            meta.record_user(user, now=ts)
        if policy != "none" and item_budget:
            self.ex.precompute(progress=False, order=item_order)
        self.user_budget, self.item_budget = user_budget, item_budget


def replay(ranks: list[Rank], trace, instr, cost=None, fetch_s_per_token: float = 0.0) -> dict:
    prompt = cached = computed = fetched = 0
    prefixes = Counter()
    est = [0.0] * len(ranks)
    wall = [0.0] * len(ranks)
    for user, prof, cands, ts in trace:
        k = int(user[1:]) % len(ranks)
        rk = ranks[k]
        rk.clock[0] = float(ts)
        t0 = time.perf_counter()
        mi = rk.ex.run(user, prof, cands, instr)["meta_info"]
        wall[k] += time.perf_counter() - t0
        prompt += mi["prompt_tokens"]
        cached += mi["cached_tokens"]
        computed += mi["computed_tokens"]
        f = mi.get("fetched_tokens", 0)
        fetched += f
        prefixes[mi["prefix"]] += 1
        if cost is not None:
            est[k] += cost(mi["computed_tokens"], mi["cached_tokens"]) + f * fetch_s_per_token
        for r in ranks:  # the budgets hold after every request
            assert r.tree.total_size() <= r.user_budget, (r.tree.total_size(), r.user_budget)
            assert r.ex.store.total_size() <= max(r.item_budget, len(r.ex.header_ids))
    hits = sum(r.ex.store.hits for r in ranks)
    looks = hits + sum(r.ex.store.misses for r in ranks)
    # ranks serve in parallel: the busiest rank's time bounds the throughput
    return dict(prompt=prompt, cached=cached, computed=computed, fetched=fetched, seconds=sum(wall),
                rps=len(trace) / max(wall), est_rps=len(trace) / max(est) if max(est) else float("nan"),
                prefixes=dict(prefixes),
                item_hit=hits / looks if looks else float("nan"))


def fit_cost(model, max_tokens: int, repeats: int):
    """t(computed, cached) seconds: degree-2 fit (relative errors) of measured forwards, each shape's
    best of `repeats` passes over the grid."""
    args = ServerArgs(model_path=model, device="cpu", dtype="float32", max_total_tokens=2 * max_tokens + 8)
    runner = ModelRunner(args)
    s_grid = sorted({max(16, round(max_tokens * x)) for x in (0.1, 0.2, 0.35, 0.5, 0.75, 1.0)})
    p_grid = sorted({round(max_tokens * x) for x in (0.0, 0.25, 0.5, 0.75)})
    shapes = [(s, p) for s in s_grid for p in p_grid if s + p <= max_tokens * 1.25]
    best: dict[tuple[int, int], float] = {}
    for _ in range(repeats):  # passes over all shapes, so a burst of load hits one pass, not one shape
        for sfx, pfx, t in hrcs.measure_prefill(runner, shapes, repeats=1):
            best[(sfx, pfx)] = min(t, best.get((sfx, pfx), math.inf))
    samples = [(sfx, pfx, t) for (sfx, pfx), t in best.items()]
    m = hrcs.PrefillTimeModel.fit(samples, relative=True)
    err = max(abs(m(s, p) - t) / t for s, p, t in samples)
    return m, samples, err


def hrcs_placement(model, catalog, trace, past, ranks, candidates, bandwidth_gbps, cost):
    """Algorithm 1: B in this model's KV tokens/s, alpha = 0.1, t = the fitted cost model, F = the
    candidate counts of the past period."""
    cfg = ModelConfig.from_dir(model)  # the replays' KV: float32
    bpt = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    tau_i = sum(len(it.token_ids) for it in catalog.items) / len(catalog)
    counts = Counter(c for _, _, cands, _ in past for c in cands)
    ids = [it.id for it in catalog.items]
    freqs = [counts.get(i, 0) + 1e-3 for i in ids]
    tau_u = sum(len(p) for _, p, _, _ in trace) / len(trace)
    bandwidth = bandwidth_gbps * 1e9 / 8 / bpt
    plan = hrcs.make_plan(ids, [len(it.token_ids) for it in catalog.items], freqs, bpt, bandwidth, tau_u, tau_i,
                          0.1, candidates, ranks, cost)
    return plan, bandwidth


def fmt_row(name, M, r, base):
    return (f"| {name} | {M} | {r['cached'] / r['prompt']:.3f} | {r['item_hit']:.3f} | "
            f"{r['computed'] / base['computed']:.3f} | {r['est_rps']:.2f} | {r['rps']:.2f} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(r['prefixes'].items()))} |")


def record_rows(base: dict, measured: list[tuple], ablation: list[tuple], ranks: int) -> list[dict]:
    """The result record's rows: each system's (name, M, f, replay) estimated and wall req/s, hit rate and
    computed tokens beside RE's (every prompt recomputed); the ablation's configs (name, user budget, item
    budget, replay) beside None's (the user prefix only)."""
    def est(r: dict) -> float | None:  # NaN without a cost model's time
        return r["est_rps"] if r and math.isfinite(r["est_rps"]) else None

    def rows(r: dict, peer: dict | None, params: dict, what: str = "") -> list[dict]:
        peer = peer or {}
        return [row(f"{what}estimated throughput", "req/s", est(r), est(peer), params=params),
                row(f"{what}wall throughput", "req/s", r["rps"], peer.get("rps"), params=params),
                row(f"{what}prompt tokens from cache", "share", r["cached"] / r["prompt"],
                    peer.get("cached", 0) / peer["prompt"] if peer else None, params=params),
                row(f"{what}computed tokens", "tokens", r["computed"], peer.get("computed"), params=params,
                    higher_is_better=False)]

    out = []
    for name, M, f, r in measured:
        out += rows(r, base, {"system": name, "budget_fraction": f, "budget_tokens": M})
    none = next((r for name, _, _, r in ablation if name == "None"), None)
    for name, ub, ib, r in ablation:
        out += rows(r, none if name != "None" else None,
                    {"config": name, "ranks": ranks, "user_budget": ub, "item_budget": ib}, "ablation: ")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--users", type=int, default=120)
    ap.add_argument("--candidates", type=int, default=100)
    ap.add_argument("--item-tokens", type=int, default=4)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--user-item-ratio", type=float, default=1.25)
    ap.add_argument("--ratio-over", choices=("user", "request"), default="user",
                    help="average the profile length over the trace's users (BAT Table 1) or its requests")
    ap.add_argument("--horizon-s", type=float, default=7200.0)
    ap.add_argument("--budgets", default="0.15,0.3,0.5", help="M = f * (C + U) for each f")
    ap.add_argument("--item-share", type=float, default=None,
                    help="BAT/cache-agnostic item store: min(C, share * M) (1: the whole catalog when it fits); "
                         "default: sgrec.rank.budget.split_budget on the past period")
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel ranks of the ablation (0: skip it)")
    ap.add_argument("--ablation-budget", type=float, default=0.3, help="per rank M = f * (C + U / N)")
    ap.add_argument("--bandwidth-gbps", type=float, default=10.0)
    ap.add_argument("--fetch", action="store_true", help="ablation: fetch remote cold items (sgrec.items.fetch)")
    ap.add_argument("--fit-repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="bench_rank_")
    model = make_tiny_model(os.path.join(tmp, "m"), arch="qwen2", seed=0, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=4, max_position_embeddings=8192)
    tok = Tokenizer(model)
    catalog, trace, instr, header, past = build_workload(tok, tok.vocab_size, a.requests, a.users, a.candidates,
                                                         a.max_prompt, a.item_tokens, a.user_item_ratio, a.horizon_s,
                                                         a.seed, a.ratio_over)
    users = {u: p for u, p, _, _ in trace}
    U = sum(len(p) for p in users.values())
    C = sum(len(it.token_ids) for it in catalog.items) + len(header)
    lens = [len(p) for _, p, _, _ in trace]
    item_lens = [sum(len(catalog.get(c).token_ids) for c in cands) for _, _, cands, _ in trace]
    prompts = [u + i + len(instr) for u, i in zip(lens, item_lens)]
    transient = max(prompts) + len(header) + 8
    per_user = Counter(u for u, _, _, _ in trace)
    item_freq = Counter(c for _, _, cands, _ in trace for c in cands)
    top = sorted(item_freq.values(), reverse=True)
    top10 = sum(top[: max(1, len(catalog) // 10)]) / sum(top)
    print(f"# bench_rank  {datetime.date.today()}  {platform.processor() or platform.machine()}  "
          f"torch {torch.__version__} threads {a.threads}")
    print(f"trace: {len(trace)} requests over {a.horizon_s / 3600:.1f} h, {len(users)} users "
          f"({sum(1 for v in per_user.values() if v == 1)} seen once, busiest {max(per_user.values())}), "
          f"{a.candidates} candidates; tau_u mean {sum(lens) / len(lens):.0f} per request, "
          f"{sum(len(p) for p in users.values()) / len(users):.0f} per user "
          f"({sum(len(p) < sum(item_lens) / len(item_lens) for p in users.values()) / len(users):.0%} of users below "
          f"tau_i), max {max(lens)}; tau_i per request mean "
          f"{sum(item_lens) / len(item_lens):.0f}; tau_u >= tau_i in {sum(u >= i for u, i in zip(lens, item_lens)) / len(lens):.0%}; "
          f"prompt mean {sum(prompts) / len(prompts):.0f} max {max(prompts)}; distinct user tokens U = {U}; "
          f"catalog {len(catalog)} items, C = {C} tokens; top 10% items get {top10:.0%} of candidate slots")

    cost, samples, err = fit_cost(model, max(prompts), a.fit_repeats)
    print(f"cost model: degree-2 fit of {len(samples)} measured forwards (best of {a.fit_repeats}), max rel. error "
          f"{err:.0%}; t(RE mean prompt) = {cost(sum(prompts) / len(prompts), 0) * 1e3:.1f} ms")

    base = replay([Rank(model, catalog, header, "none", 0, 0, transient)], trace, instr, cost)
    rows = [("RE", "-", base)]
    item_tokens = {it.id: len(it.token_ids) for it in catalog.items}
    past_reqs = [(u, len(p), cands) for u, p, cands, _ in past]
    past_counts = Counter(c for _, _, cs in past_reqs for c in cs)
    history = [(u, ts) for u, _, _, ts in past]
    order = [catalog.get(i) for i in budget.hottest_items(item_tokens, past_counts)]
    splits, measured, ablation = [], [], []
    for f in [float(x) for x in a.budgets.split(",") if x.strip()]:
        M = round(f * (C + U))
        if a.item_share is None:
            ib = budget.split_budget(M, len(header), item_tokens, past_reqs)
        else:
            ib = min(C, round(a.item_share * M))
        splits.append(f"M={M}: items {ib} ({ib / C:.0%} of C), users {M - ib}")
        systems = [("UP", "user", M, 0), ("IP", "item", 0, min(M, C)),
                   ("cache-agnostic", "greedy", M - ib, ib), ("BAT", "auto", M - ib, ib)]
        for name, pol, ub, ib_ in systems:
            res = replay([Rank(model, catalog, header, pol, ub, ib_, transient, item_order=order,
                                item_counts=past_counts, user_history=history)], trace, instr, cost)
            rows.append((name, f"{M} (f={f:g})", res))
            measured.append((name, M, f, res))
            print(f"  done {name} M={M}: est {res['est_rps']:.2f} wall {res['rps']:.2f} req/s", flush=True)
    how = "budget.split_budget on the past period" if a.item_share is None else f"item share {a.item_share:g}"
    print(f"BAT / cache-agnostic split ({how}): " + "; ".join(splits))
    print("\n| system | total cache M (tokens) | hit rate | item-store hit | computed / RE | est. req/s | wall req/s | prefixes |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, M, r in rows:
        print(fmt_row(name, M, r, base))

    by = {(n, m): r for n, m, r in rows}
    budgets = [m for n, m, _ in rows if n == "BAT"]
    if not budgets:
        print("(no budgets: main comparison skipped)")
    print("\ntargets (est. req/s; wall in brackets):")
    for i, M in enumerate(budgets):
        bat, up, ip = by[("BAT", M)], by[("UP", M)], by[("IP", M)]
        best = max(up["est_rps"], ip["est_rps"])
        line = (f"  M={M}: BAT {bat['est_rps']:.2f} [{bat['rps']:.2f}] vs max(UP, IP) {best:.2f} "
                f"[{max(up['rps'], ip['rps']):.2f}] {'ok' if bat['est_rps'] >= best else 'MISSED'}; "
                f"computed vs RE {bat['computed'] / base['computed']:.2f} "
                f"{'ok' if bat['computed'] <= 0.5 * base['computed'] else 'MISSED'}")
        if i == 0:
            line += (f"; BAT/UP {bat['est_rps'] / up['est_rps']:.2f}x [{bat['rps'] / up['rps']:.2f}x] "
                     f"{'ok' if bat['est_rps'] >= 1.5 * up['est_rps'] else 'MISSED'}")
        print(line)

    # Reference: the static two-cache model of sgrec.rank.budget run on the replayed trace itself
    # (clairvoyant: the trace's own item counts and returning users, the best item budget of the
    # grid): what a fixed split with a fixed set of cached users would compute. Not a strict bound.
    trace_reqs = [(u, len(p), cands) for u, p, cands, _ in trace]
    refs = []
    for M in budgets:
        m = int(M.split()[0])
        best = budget.split_budget(m, len(header), item_tokens, trace_reqs)
        reused = budget.reused_tokens(m, best, len(header), item_tokens, trace_reqs)
        refs.append(f"M={m}: {1 - reused / base['computed']:.3f} (items {best})")
    if refs:
        print("clairvoyant static split, computed / RE: " + "; ".join(refs))

    if a.ranks > 1:
        M = round(a.ablation_budget * (C + U / a.ranks))
        plan, bw = hrcs_placement(model, catalog, trace, past, a.ranks, a.candidates, a.bandwidth_gbps, cost)
        rep = plan.replication
        fetch_cost = 1.0 / bw if a.fetch else 0.0
        print(f"\nablation: {a.ranks} ranks, M = {M} tokens per rank ({a.ablation_budget:g} (C + U / N)); HRCS at "
              f"{a.bandwidth_gbps:g} Gbit/s = {bw:.3g} tokens/s: r = {rep.ratio:.3f} ({rep.num_replicated} items "
              f"replicated, R_max {rep.r_max:.3f}, t {rep.prefill_time * 1e3:.2f} ms), per-rank item tokens "
              f"{plan.per_rank_tokens}, expected remote fraction {plan.remote_fraction:.3f}; remote cold items "
              f"{'fetched' if a.fetch else 'recomputed'}")
        ib_rep = min(C, M)
        ib_hrcs = min(max(plan.per_rank_tokens) + len(header), M)
        configs = [("None", "user", M, 0, None), ("A", "greedy", M - ib_rep, ib_rep, None),
                   ("AB", "greedy", M - ib_hrcs, ib_hrcs, plan.placement),
                   ("AC", "auto", M - ib_rep, ib_rep, None),
                   ("ABC", "auto", M - ib_hrcs, ib_hrcs, plan.placement)]
        print("\n| config | user / item budget per rank | hit rate | item-store hit | computed / RE | est. req/s | wall req/s |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, pol, ub, ib_, pl in configs:
            ranks = [Rank(model, catalog, header, pol, ub, ib_, transient, pl, r, a.ranks, item_order=order,
                          item_counts=past_counts, user_history=[h for h in history if int(h[0][1:]) % a.ranks == r])
                     for r in range(a.ranks)]
            if a.fetch and pl is not None:
                from sgrec.items.fetch import connect_loopback

                connect_loopback([rk.ex for rk in ranks], timeout_ms=2000)
            r = replay(ranks, trace, instr, cost, fetch_cost)
            ablation.append((name, ub, ib_, r))
            print(f"| {name} | {ub} / {ib_} | {r['cached'] / r['prompt']:.3f} | {r['item_hit']:.3f} | "
                  f"{r['computed'] / base['computed']:.3f} | {r['est_rps']:.2f} | {r['rps']:.2f} |")
        print("(req/s of the N ranks serving in parallel: requests / the busiest rank's time)")
    if not a.no_record and (measured or ablation):
        path = write_record(benchmark="bench_rank",
                            title="Bipartite-attention ranking (BAT) against RE, UP, IP and cache-agnostic",
                            command=("python benchmarks/bench_rank.py " + shlex.join(argv or sys.argv[1:])).strip(),
                            results=record_rows(base, measured, ablation, a.ranks),
                            peer="RE, every prompt recomputed (ablation: None, the user prefix only)")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
