"""One-call recommendation: retrieve candidates with xBeam, then rank them with bipartite
attention, as one scheduler task. Both stages run in one batch, so on the same catalog version;
each stage is its executor's own batched path with the payload its route would send, so the answer
equals retrieve + rank called one after the other. The rank stage's user prefix can reuse the KV the
retrieve stage left in the radix cache (meta_info.rank.cached_tokens says how much it did)."""

from __future__ import annotations

from collections.abc import Generator


def recommend_steps(retriever, ranker, payloads: list[dict]) -> Generator:
    """Per payload ({"retrieve": retrieve payload, "rank": rank payload without item_ids}): the
    ranked candidates with both scores, or the stage's error. A generator of the retrieve round's
    phases (RetrieveExecutor.run_steps); the rank stage runs in the last."""
    out: list[dict | Exception | None] = [None] * len(payloads)
    retrieved = yield from retriever.run_steps([p["retrieve"] for p in payloads])
    ranks, rank_of = [], []
    for i, (p, r) in enumerate(zip(payloads, retrieved)):
        if isinstance(r, Exception):
            out[i] = r
        elif not r.items:
            out[i] = {"items": [], "meta_info": {"retrieve": r.meta, "rank": None}}
        else:
            ranks.append({**p["rank"], "item_ids": [it["item"] for it in r.items]})
            rank_of.append(i)
    for i, res in zip(rank_of, ranker.run_batch(ranks) if ranks else []):
        if isinstance(res, Exception):
            out[i] = res
            continue
        found = {it["item"]: it for it in retrieved[i].items}
        out[i] = {"items": [{"item": x["item"], "score": x["score"], "retrieve_score": found[x["item"]]["score"],
                             "semantic_id": found[x["item"]]["semantic_id"]} for x in res["ranking"]],
                  "meta_info": {"retrieve": retrieved[i].meta, "rank": res["meta_info"]}}
    return out  # type: ignore[return-value]
