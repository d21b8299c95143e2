"""Bipartite-attention ranking (BAT §6.2, §6.4): RE, UP, IP, cache-agnostic and BAT on a
MovieLens-100K ranking trace, at three cache budgets, plus the Table 4 ablation.

    python benchmarks/bench_rank.py                                  # defaults below
    python benchmarks/bench_rank.py --requests 200 --candidates 50 --max-prompt 4096

Trace. A random set of --requests/6 ML-100K users; --requests of their ratings drawn uniformly (so
a user's request count follows their activity, BAT §6.2 samples users with replacement by their
history frequency), replayed in time order: each rating (user u, movie m, time t) is a rank
request of u at t whose true next item is m. Candidates: m plus --candidates - 1 others, half sampled by
popularity (rating counts), half by co-occurrence (a movie rated by a random other user of u's
previous movie). Items: the movie titles, tokenized by the model's tokenizer (at most 16 tokens).
User profile: the titles of the user's rated movies, repeated up to a length proportional to the
user's number of ratings, so that the longest prompt approaches --max-prompt (BAT §6.2 expands to
8K; CPU default 4K, same shape). Static per user (pre-encoded, as in BAT §5.1).

Systems (one rank; every cached system gets the same total cache budget M tokens):
RE (prefix none), UP (all of M for users), IP (all of M for items), cache-agnostic greedy and BAT
(auto; item store min(catalog, M/2), the rest for users). Per system: hit rate (cached / prompt
tokens), computed-token fraction (computed / RE's computed tokens), requests/s measured on a
tiny random model (rank requests run back to back in this process, item precompute not timed).

Ablation (Table 4) with --ranks N data-parallel ranks (users routed by id, each rank its own
model, KV pool of budget M and caches): None (UP only), A (bipartite, items replicated,
greedy), AB (+HRCS placement), AC (+hotness-aware), ABC. A cold item owned by another rank is
recomputed (no cross-rank KV fetch is implemented), so B here trades user-cache room for
recomputed cold items.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import tempfile
import time
from collections import Counter

import torch

from sgrec.catalog import Catalog, Item
from sgrec.data.movielens import load_ml100k
from sgrec.radix import hrcs
from sgrec.radix.tree import RadixCache
from sgrec.rank.executor import RankExecutor
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs
from sgrec.tokenizer import Tokenizer
from sgrec.tools.make_tiny_model import make_tiny_model

MAX_ITEM_TOKENS = 16
INSTR_TEXT = "Which item will the user choose next?"
HEADER_TEXT = "Candidate items:"


def build_workload(tok: Tokenizer, vocab: int, n_requests: int, n_cand: int, max_prompt: int, seed: int):
    data = load_ml100k()
    rng = random.Random(seed)
    items = []
    for mid, mv in sorted(data.movies.items()):
        toks = tok.encode(mv.title or f"movie {mid}", add_special_tokens=False)[:MAX_ITEM_TOKENS] or [3]
        items.append(Item(str(mid), tuple(toks), rng.randrange(3, vocab)))
    catalog = Catalog(items)
    hist = data.histories()
    pop = Counter(x.item for x in data.interactions)
    pop_ids, pop_w = zip(*pop.items())
    raters: dict[int, list[int]] = {}
    for x in data.interactions:
        raters.setdefault(x.item, []).append(x.user)
    instr = tok.encode(INSTR_TEXT, add_special_tokens=False)
    item_budget = sum(len(catalog.get(str(m)).token_ids) for m in pop_ids[:n_cand]) * 2  # ~ a long candidate list
    longest = max(len(v) for v in hist.values())
    room = max(16, max_prompt - item_budget - len(instr))
    profiles = {}
    for u, h in hist.items():
        base = [t for x in h for t in catalog.get(str(x.item)).token_ids]
        n = max(16, round(len(h) / longest * room))
        profiles[u] = (base * (n // len(base) + 1))[:n]
    chosen = set(rng.sample(sorted(hist), min(len(hist), max(8, n_requests // 6))))
    pool = [k for k, x in enumerate(data.interactions) if x.user in chosen]
    picked = set(rng.sample(pool, min(n_requests, len(pool))))
    trace = []
    prev: dict[int, int] = {}
    for k, x in enumerate(data.interactions):
        last = prev.get(x.user)
        prev[x.user] = x.item
        if k not in picked:
            continue
        cands = {x.item}
        while len(cands) < n_cand:
            if rng.random() < 0.5 or last is None:
                cands.add(rng.choices(pop_ids, pop_w)[0])
            else:
                other = rng.choice(raters[last])
                cands.add(rng.choice(hist[other]).item)
        cl = [str(c) for c in cands]
        rng.shuffle(cl)
        trace.append((f"u{x.user}", profiles[x.user], cl, x.timestamp))
    return catalog, trace, instr, tok.encode(HEADER_TEXT, add_special_tokens=False)


class Rank:
    """One data-parallel rank: its own runner (KV pool), radix tree and RankExecutor."""

    def __init__(self, model, catalog, header, policy, user_budget, item_budget, transient, placement=None,
                 rank=0, n=1):
        pool = user_budget + item_budget + transient
        self.args = ServerArgs(model_path=model, device="cpu", dtype="float32", max_total_tokens=max(pool, 2),
                               item_cache_tokens=item_budget, rank_prefix_policy=policy, dp_size=n,
                               max_rank_candidates=1000)
        self.runner = ModelRunner(self.args)
        self.tree = RadixCache(self.runner.kv_pool.allocator)
        clock_now = [0.0]
        self.clock = clock_now
        from sgrec.rank.policy import CacheMeta

        meta = CacheMeta(window_s=3600.0, clock=lambda: clock_now[0])  # trace time, a 60-minute window
        self.ex = RankExecutor(self.runner, self.tree, catalog, self.args, header_ids=header, meta=meta,
                               dp_rank=rank, placement=placement)
        if policy != "none" and item_budget:
            self.ex.precompute(progress=False)


def replay(ranks: list[Rank], trace, instr) -> dict:
    t0 = time.perf_counter()
    prompt = cached = computed = 0
    prefixes = Counter()
    for user, prof, cands, ts in trace:
        rk = ranks[int(user[1:]) % len(ranks)]
        rk.clock[0] = float(ts)
        out = rk.ex.run(user, prof, cands, instr)
        mi = out["meta_info"]
        prompt += mi["prompt_tokens"]
        cached += mi["cached_tokens"]
        computed += mi["computed_tokens"]
        prefixes[mi["prefix"]] += 1
    dt = time.perf_counter() - t0
    return dict(prompt=prompt, cached=cached, computed=computed, seconds=dt, rps=len(trace) / dt,
                prefixes=dict(prefixes))


def hrcs_placement(model, catalog, trace, ranks, candidates):
    """Algorithm 1 with B = 10 Gbit/s in KV tokens of this model, alpha = 0.1, t from a degree-2 fit of
    measured prefills, F = candidate counts of the first half of the trace (the 'past period')."""
    args = ServerArgs(model_path=model, device="cpu", dtype="float32", max_total_tokens=1 << 13)
    runner = ModelRunner(args)
    tau_i = sum(len(it.token_ids) for it in catalog.items) / len(catalog)
    prefix = round(candidates * tau_i)
    shapes = [(s, p) for s in (64, 256, 1024) for p in (0, prefix // 2, prefix)]
    model_t = hrcs.PrefillTimeModel.fit(hrcs.measure_prefill(runner, shapes))
    cfg = runner.config
    bpt = runner.kv_pool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runner.dtype)
    counts = Counter(c for _, _, cands, _ in trace[: len(trace) // 2] for c in cands)
    ids = [it.id for it in catalog.items]
    freqs = [counts.get(i, 0) + 1e-3 for i in ids]
    tau_u = sum(len(p) for _, p, _, _ in trace) / len(trace)
    plan = hrcs.make_plan(ids, [len(it.token_ids) for it in catalog.items], freqs, bpt, 10e9 / 8 / bpt, tau_u, tau_i,
                          0.1, candidates, ranks, model_t)
    return plan


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--candidates", type=int, default=50)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--budgets", default="0.05,0.15,0.4", help="total cache M as fractions of the trace's distinct user tokens")
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel ranks of the ablation (0: skip it)")
    ap.add_argument("--ablation-budget", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="bench_rank_")
    model = make_tiny_model(os.path.join(tmp, "m"), arch="qwen2", seed=0, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=4, max_position_embeddings=8192)
    tok = Tokenizer(model)
    catalog, trace, instr, header = build_workload(tok, tok.vocab_size, a.requests, a.candidates, a.max_prompt, a.seed)
    users = {u: p for u, p, _, _ in trace}
    user_tokens = sum(len(p) for p in users.values())
    cat_tokens = sum(len(it.token_ids) for it in catalog.items) + len(header)
    transient = max(len(p) for p in users.values()) + a.candidates * MAX_ITEM_TOKENS + len(instr) + len(header) + 8
    reqs_per_user = Counter(u for u, _, _, _ in trace)
    lens = [len(p) for _, p, _, _ in trace]
    item_lens = [sum(len(catalog.get(c).token_ids) for c in cands) for _, _, cands, _ in trace]
    print(f"# bench_rank  {datetime.date.today()}  {platform.processor() or platform.machine()}  "
          f"torch {torch.__version__} threads {a.threads}")
    print(f"trace: {len(trace)} requests, {len(users)} users ({sum(1 for v in reqs_per_user.values() if v == 1)} seen once), "
          f"{a.candidates} candidates; user tokens mean {sum(lens) / len(lens):.0f} max {max(lens)}; item tokens per "
          f"request mean {sum(item_lens) / len(item_lens):.0f}; tau_u >= tau_i in "
          f"{sum(u >= i for u, i in zip(lens, item_lens)) / len(lens):.0%}; distinct user tokens {user_tokens}; "
          f"catalog {len(catalog)} items, {cat_tokens} tokens")

    base = replay([Rank(model, catalog, header, "none", 0, 0, transient)], trace, instr)
    rows = [("RE", "-", base)]
    for frac in [float(x) for x in a.budgets.split(",")]:
        M = max(64, round(frac * user_tokens))
        split_items = min(cat_tokens, M // 2)
        systems = [("UP", "user", M, 0), ("IP", "item", 0, min(M, cat_tokens)),
                   ("cache-agnostic", "greedy", M - split_items, split_items), ("BAT", "auto", M - split_items, split_items)]
        for name, pol, ub, ib in systems:
            res = replay([Rank(model, catalog, header, pol, ub, ib, transient)], trace, instr)
            rows.append((name, f"{M}", res))
    print("\n| system | cache M (tokens) | hit rate | computed / RE | req/s | prefixes |")
    print("|---|---:|---:|---:|---:|---|")
    for name, M, r in rows:
        print(f"| {name} | {M} | {r['cached'] / r['prompt']:.3f} | {r['computed'] / base['computed']:.3f} | "
              f"{r['rps']:.1f} | {r['prefixes']} |")

    by = {(n, m): r for n, m, r in rows}
    budgets = sorted({m for _, m, _ in rows if m != "-"}, key=int)
    print("\ntargets:")
    for i, M in enumerate(budgets):
        bat, up, ip = by[("BAT", M)], by[("UP", M)], by[("IP", M)]
        line = (f"  M={M}: BAT {bat['rps']:.1f} req/s vs max(UP, IP) {max(up['rps'], ip['rps']):.1f} "
                f"[{'ok' if bat['rps'] >= max(up['rps'], ip['rps']) else 'MISSED'}]; computed vs RE "
                f"{bat['computed'] / base['computed']:.2f} [{'ok' if bat['computed'] <= 0.5 * base['computed'] else 'MISSED'}]")
        if i == 0:
            line += f"; BAT/UP {bat['rps'] / up['rps']:.2f}x [{'ok' if bat['rps'] >= 1.5 * up['rps'] else 'MISSED'}]"
        print(line)

    if a.ranks > 1:
        M = max(64, round(a.ablation_budget * user_tokens / a.ranks))
        plan = hrcs_placement(model, catalog, trace, a.ranks, a.candidates)
        rep = plan.replication
        print(f"\nablation: {a.ranks} ranks, M = {M} tokens per rank; HRCS r = {rep.ratio:.3f} "
              f"({rep.num_replicated} items replicated, R_max {rep.r_max:.3f}, t {rep.prefill_time * 1e3:.2f} ms), "
              f"per-rank item tokens {plan.per_rank_tokens}, expected remote fraction {plan.remote_fraction:.3f}")
        split_rep = min(cat_tokens, M // 2)
        split_hrcs = min(max(plan.per_rank_tokens) + len(header), M // 2)
        configs = [("None", "user", M, 0, None), ("A", "greedy", M - split_rep, split_rep, None),
                   ("AB", "greedy", M - split_hrcs, split_hrcs, plan.placement),
                   ("AC", "auto", M - split_rep, split_rep, None),
                   ("ABC", "auto", M - split_hrcs, split_hrcs, plan.placement)]
        print("\n| config | hit rate | computed / RE | req/s |")
        print("|---|---:|---:|---:|")
        for name, pol, ub, ib, pl in configs:
            ranks = [Rank(model, catalog, header, pol, ub, ib, transient, pl, r, a.ranks) for r in range(a.ranks)]
            r = replay(ranks, trace, instr)
            print(f"| {name} | {r['cached'] / r['prompt']:.3f} | {r['computed'] / base['computed']:.3f} | {r['rps']:.1f} |")


if __name__ == "__main__":
    main()
