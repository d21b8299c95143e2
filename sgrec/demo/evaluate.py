"""`python -m sgrec.demo.evaluate`: recommendation quality of the packaged demo model, measured
through sgrec itself (sgrec.Engine.rank and sgrec.Engine.retrieve).

Held-out data: the last interaction of each user (leave-last-out, sgrec.demo.data); the prompt
holds the HISTORY_LEN interactions before it.
- Ranking (BAT Table 3): 100 candidates per user, the held-out item and 99 items the user never
  interacted with, drawn in proportion to training popularity ("popular", the headline: a
  stand-in for a retrieval stage's output, where popularity alone does not separate the target)
  or uniformly ("uniform"). Recall@5/10, MRR@5/10, NDCG@5/10 in the user-as-prefix and the
  item-as-prefix layout, next to ranking the candidates by training popularity.
- Retrieval (xGR): xBeam over the catalog's semantic-ID paths at beam width 32 and 128 (per-beam
  top-K = beam width), the 10 best items; Recall@10 and NDCG@10 next to the 10 most popular items.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from sgrec.demo import ARTIFACT_DIR, CATALOG_NAME, item_id
from sgrec.demo.data import CANDIDATE_SCHEMES, Split, Vocab, eval_candidates, load_split

KS = (5, 10)


def metrics(ranks: list[int]) -> dict:
    """ranks: 1-based rank of the held-out item per user (a value > 10 counts as a miss)."""
    r = np.asarray(ranks, dtype=np.float64)
    out = {}
    for k in KS:
        hit = r <= k
        out[f"Recall@{k}"] = float(hit.mean())
        out[f"MRR@{k}"] = float(np.where(hit, 1.0 / r, 0.0).mean())
        out[f"NDCG@{k}"] = float(np.where(hit, 1.0 / np.log2(r + 1), 0.0).mean())
    return out


def open_engine(model_path: str = ARTIFACT_DIR, **kw):
    from sgrec.engine import Engine

    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return Engine(model_path=model_path, item_catalog=os.path.join(model_path, CATALOG_NAME), **kw)


def engine_vocab(engine) -> Vocab:
    return Vocab.from_tokenizer(engine.tokenizer.hf, engine.scheduler.catalog)


def rank_user(engine, vocab: Vocab, split: Split, user: int, scheme: str, prefix: str) -> tuple[list[str], int]:
    """(the engine's ranking of the user's candidates, 1-based rank of the held-out item)."""
    hist, target = split.test_case(user)
    cands = eval_candidates(split, user, scheme)
    out = engine.rank(user={"id": f"u{user}", "token_ids": vocab.user_ids(hist)}, items=[item_id(c) for c in cands],
                      prefix=prefix)
    assert out["meta_info"]["prefix"] == prefix, out["meta_info"]
    order = [r["item"] for r in out["ranking"]]
    return order, order.index(item_id(target)) + 1


def popularity_rank(split: Split, user: int, scheme: str) -> int:
    _, target = split.test_case(user)
    cands = eval_candidates(split, user, scheme)
    order = sorted(range(len(cands)), key=lambda j: (-split.train_pop.get(cands[j], 0), j))
    return [cands[j] for j in order].index(target) + 1


def evaluate_ranking(engine, vocab: Vocab, split: Split, users: list[int], scheme: str) -> dict:
    res = {"popularity": metrics([popularity_rank(split, u, scheme) for u in users])}
    for prefix in ("user", "item"):
        t = time.perf_counter()
        res[f"{prefix}-as-prefix"] = metrics([rank_user(engine, vocab, split, u, scheme, prefix)[1] for u in users])
        res[f"{prefix}-as-prefix"]["seconds"] = time.perf_counter() - t
    return res


def seen_items(split: Split, user: int) -> list[str]:
    """Every movie the user rated before the held-out one (what a service would not show again)."""
    return [item_id(m) for m in split.sequences[user][:-1]]


def retrieve_user(engine, vocab: Vocab, split: Split, user: int, beam_width: int, num_items: int = 10,
                  exclude_seen: bool = False) -> list[str]:
    """The engine's xBeam retrieval for the user (per-beam top-K = beam width), best first; with
    exclude_seen, the user's rated movies are excluded inside the beam search."""
    hist, _ = split.test_case(user)
    out = engine.retrieve(user={"id": f"u{user}", "token_ids": vocab.retrieve_ids(hist)}, beam_width=beam_width,
                          top_k=beam_width, num_items=num_items,
                          exclude_items=seen_items(split, user) if exclude_seen else None)
    return [r["item"] for r in out["items"]]


def hit_rank(items: list[str], target: str) -> int:
    return items.index(target) + 1 if target in items else 10**9


def evaluate_retrieval(engine, vocab: Vocab, split: Split, users: list[int], beam_widths=(32, 128),
                       exclude_seen: tuple[bool, ...] = (False, True)) -> dict:
    """Recall@10 / NDCG@10 of popularity and of xBeam at each beam width, without and with the
    user's rated movies excluded (popularity: its 10 most popular unseen movies); `invalid_items`
    counts returned items outside the catalog, `seen_items` returned movies the user rated."""
    pop = [item_id(m) for m in split.popularity_order()]
    res = {}
    for ex in exclude_seen:
        tag = ", seen excluded" if ex else ""
        ranks = []
        for u in users:
            seen = set(seen_items(split, u)) if ex else set()
            ranks.append(hit_rank([i for i in pop if i not in seen][:10], item_id(split.test_case(u)[1])))
        res[f"popularity{tag}"] = _r10(ranks)
    catalog = engine.scheduler.catalog
    for ex in exclude_seen:
        for bw in beam_widths:
            t = time.perf_counter()
            ranks, invalid, shown = [], 0, 0
            for u in users:
                items = retrieve_user(engine, vocab, split, u, bw, exclude_seen=ex)
                invalid += sum(i not in catalog for i in items)
                shown += len(set(items) & set(seen_items(split, u)))
                ranks.append(hit_rank(items, item_id(split.test_case(u)[1])))
            res[f"xBeam BW={bw}{', seen excluded' if ex else ''}"] = {
                **_r10(ranks), "invalid_items": invalid, "seen_items": shown, "seconds": time.perf_counter() - t}
    return res


def _r10(ranks: list[int]) -> dict:
    m = metrics(ranks)
    return {"Recall@10": m["Recall@10"], "NDCG@10": m["NDCG@10"]}


def print_table(title: str, rows: dict, cols: list[str]) -> None:
    w = max(16, *(len(name) for name in rows))
    print(f"\n{title}")
    print(f"| {'method':<{w}} | " + " | ".join(f"{c:>9}" for c in cols) + " |")
    print("|" + "-" * (w + 2) + "|" + "|".join("-" * 11 for _ in cols) + "|")
    for name, m in rows.items():
        print(f"| {name:<{w}} | " + " | ".join(f"{m[c]:>9.4f}" for c in cols) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=ARTIFACT_DIR)
    ap.add_argument("--users", type=int, default=0, help="evaluate the first N users only (0: all 943)")
    ap.add_argument("--schemes", nargs="*", default=list(CANDIDATE_SCHEMES), choices=CANDIDATE_SCHEMES,
                    help="ranking candidate schemes (none: retrieval only)")
    ap.add_argument("--beam-widths", nargs="*", type=int, default=[32, 128])
    ap.add_argument("--json", help="also write the numbers to this file")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    split = load_split()
    users = split.users[: a.users] if a.users else split.users
    engine = open_engine(a.model_path)
    vocab = engine_vocab(engine)
    print(f"model {a.model_path}: {len(users)} held-out users (last interaction each)")
    out: dict = {"users": len(users)}
    cols = [f"{m}@{k}" for m in ("Recall", "MRR", "NDCG") for k in KS]
    for scheme in a.schemes:
        res = evaluate_ranking(engine, vocab, split, users, scheme)
        out[f"rank/{scheme}"] = res
        print_table(f"Ranking, 100 candidates ({scheme} negatives)", res, cols)
    if a.beam_widths:
        res = evaluate_retrieval(engine, vocab, split, users, a.beam_widths)
        out["retrieve"] = res
        print_table("Retrieval, all 1,682 movies (top 10)", res, ["Recall@10", "NDCG@10"])
        bad = sum(v.get("invalid_items", 0) for v in res.values())
        print(f"items returned that are not in the catalog: {bad}")
        for name, v in res.items():
            if "seen_items" in v:
                print(f"{name}: {v['seen_items']} returned movies the user had rated")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
