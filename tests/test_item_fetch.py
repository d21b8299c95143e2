"""Cross-rank item KV fetch (HRCS, BAT §5.2): two in-process ranks over ZMQ inproc endpoints."""

from __future__ import annotations

import random

import torch
import zmq

from sgrec.catalog import Catalog, Item
from sgrec.radix import hrcs
from sgrec.radix.item_fetch import ItemFetcher, ItemKVClient, ItemKVServer, connect_loopback
from sgrec.radix.tree import RadixCache
from sgrec.rank import layout as L
from sgrec.rank.executor import RankExecutor
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs

TOL = 1e-5
HEADER = [5, 6, 7]
INSTR = [9, 10, 11]


def make_catalog(n: int = 16, seed: int = 3, vocab: int = 512) -> Catalog:
    rng = random.Random(seed)
    return Catalog(Item(f"i{k}", tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))),
                        rng.randrange(3, vocab)) for k in range(n))


def make_ranks(path: str, catalog: Catalog, n: int = 2):
    item_ids = [it.id for it in catalog.items]
    placement = hrcs.plan_placement(item_ids, [float(len(item_ids) - k) for k in range(len(item_ids))], 0.25, n)
    exs = []
    for rank in range(n):
        args = ServerArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=1024, dp_size=n)
        runner = ModelRunner(args)
        ex = RankExecutor(runner, RadixCache(runner.kv_pool.allocator), catalog, args, header_ids=HEADER,
                          dp_rank=rank, placement=placement)
        ex.precompute()
        exs.append(ex)
    return exs, placement


def scratch(ex: RankExecutor, user, cands) -> torch.Tensor:
    lay = L.build("item", ex.header_ids, user, [ex.catalog.get(c).token_ids for c in cands], INSTR)
    return ex.score_layout(lay, cands)


def scores_of(out: dict, cands) -> torch.Tensor:
    by_id = {r["item"]: r["score"] for r in out["ranking"]}
    return torch.tensor([by_id[c] for c in cands])


def accounting_ok(ex: RankExecutor) -> bool:
    return ex.allocator.available_size() + ex.tree.total_size() + ex.total_size() == ex.allocator.size


def test_fetched_item_scores_equal_local_compute(tiny_model_dir):
    cat = make_catalog()
    exs, placement = make_ranks(tiny_model_dir("qwen2", seed=4), cat)  # same weights on both ranks
    servers = connect_loopback(exs)
    try:
        ex0 = exs[0]
        remote = [i for i in placement.owner if placement.owner[i] == 1]
        assert remote and all(i not in ex0.store for i in remote)
        cands = remote[:4] + [i for i in placement.items_of(0)][:3]
        user = [random.Random(1).randrange(3, 512) for _ in range(9)]
        out = ex0.run("u", user, cands, INSTR, prefix="item")
        mi = out["meta_info"]
        fetched = sum(len(cat.get(c).token_ids) for c in remote[:4])
        assert mi["fetched_tokens"] == fetched and servers[1].served == 4
        # fetched item KV scores the same as computing everything locally (and as no fetch at all)
        assert (scores_of(out, cands) - scratch(ex0, user, cands)).abs().max().item() <= TOL
        ex0.fetcher = None
        local = ex0.run("u", user, cands, INSTR, prefix="item")
        assert "fetched_tokens" not in local["meta_info"]  # only reported by a rank with a fetcher
        assert (scores_of(out, cands) - scores_of(local, cands)).abs().max().item() <= TOL
        assert mi["computed_tokens"] == local["meta_info"]["computed_tokens"] - fetched
        # borrowed slots were freed; the store kept only its own items
        assert all(i not in ex0.store for i in remote) and accounting_ok(ex0) and accounting_ok(exs[1])
    finally:
        for s in servers:
            s.close()


def test_dead_peer_degrades_to_recompute(tiny_model_dir):
    cat = make_catalog()
    exs, placement = make_ranks(tiny_model_dir("qwen2", seed=4), cat)
    servers = connect_loopback(exs, timeout_ms=50)
    servers[1].close()  # rank 1 is gone
    try:
        ex0 = exs[0]
        remote = [i for i in placement.owner if placement.owner[i] == 1][:3]
        user = [7, 8, 9, 10]
        out = ex0.run("u", user, remote, INSTR, prefix="item")
        assert out["meta_info"]["fetched_tokens"] == 0
        assert (scores_of(out, remote) - scratch(ex0, user, remote)).abs().max().item() <= TOL
        client = ex0.fetcher.client
        assert client.timeouts == 1 and not client.alive(1)  # one timeout, then straight to recompute
        ex0.run("u", user, remote, INSTR, prefix="item")
        assert client.timeouts == 1 and accounting_ok(ex0)
    finally:
        servers[0].close()


def test_cost_model_and_misses():
    """Algorithm 1's cost model: recompute when the transfer is slower; a miss at the owner is None."""
    pl = hrcs.Placement(2, {"hot"}, {"a": 1, "b": 0})
    f = ItemFetcher(0, pl, ItemKVClient({}), bytes_per_token=1000, bandwidth_Bps=1e6,
                    recompute_s=lambda n: 0.002 * n)
    assert f.owner("hot") is None and f.owner("b") is None and f.owner("a") == 1
    assert f.worth_fetching(10)  # 10 ms transfer < 20 ms compute
    f.recompute_s = lambda n: 0.0005 * n
    assert not f.worth_fetching(10)  # 10 ms transfer > 5 ms compute
    assert f.fetch("a", 10) is None  # rank 1 has no endpoint: recompute

    class EmptyStore:
        header_ids = HEADER
        entries: dict = {}

    ctx = zmq.Context.instance()
    srv = ItemKVServer(EmptyStore(), None, "inproc://item-kv-test-miss", ctx)
    srv.start()
    try:
        cl = ItemKVClient({1: "inproc://item-kv-test-miss"}, ctx)
        assert cl.fetch(1, "a", "whatever", timeout_ms=500) is None and srv.missed == 1
        assert cl.alive(1)  # a miss is an answer, not a dead peer
        cl.close()
    finally:
        srv.close()
