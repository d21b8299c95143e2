"""The item pool of one server's DP ranks (sgrec/items/pool.py), in process: two ranks, each with its
own executor, that plan the same placement and fetch each other's shards over ZMQ."""

from __future__ import annotations

import itertools
import random

import pytest
import zmq

from sgrec.items.pool import ItemPool
from sgrec.radix.tree import RadixCache
from sgrec.rank.executor import RankExecutor
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs
from tests.test_item_fetch import HEADER, INSTR, accounting_ok, make_catalog, scores_of, scratch

TOL = 1e-5


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_executor(path: str, catalog) -> RankExecutor:
    args = ServerArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=1024)
    runner = ModelRunner(args)
    ex = RankExecutor(runner, RadixCache(runner.kv_pool.allocator), catalog, args, header_ids=HEADER)
    ex.precompute()
    return ex


_runs = itertools.count()


@pytest.fixture
def pools(tiny_model_dir):
    cat = make_catalog(n=20)
    path = tiny_model_dir("qwen2", seed=4)
    # endpoints are new for every test: a request queued for a closed inproc endpoint of an earlier
    # test would otherwise reach the server that binds the same name later in the shared context
    run = next(_runs)
    addrs = [f"inproc://pool-test-{run}-{k}" for k in range(2)]
    ctx = zmq.Context.instance()
    clock = Clock()
    made = []
    for k in range(2):
        ex = make_executor(path, cat)
        # a fast network (Algorithm 1: R_max >= 1): only the hottest item is replicated; recomputing
        # costs 1 s per token, so the cost model always fetches
        made.append(ItemPool(ex, ex.runner, ctx, addrs, k, clock=clock, bandwidth_gbps=1e6,
                             prefill_time=lambda s, p: 0.01, recompute_per_token_s=1.0))
    for p in made:
        p.refresh()  # the scheduler loop's first call: each rank computes its share
    yield made, cat
    for p in made:
        p.close()


def test_ranks_agree_on_the_placement_and_hold_their_shards(pools):
    (p0, p1), cat = pools
    assert (p0.ex.dp_rank, p1.ex.dp_rank) == (0, 1) and p0.ex.placement.owner == p1.ex.placement.owner
    held0, held1 = set(p0.ex.store.entries), set(p1.ex.store.entries)
    rep = p0.ex.placement.replicated
    assert held0 | held1 == {it.id for it in cat.items}
    assert held0 & held1 == rep and len(rep) < len(cat.items) // 2  # only the hot share is on both
    assert held0 == {it.id for it in cat.items if p0.ex.placement.owns(0, it.id)}


def test_fetch_from_the_peer(pools):
    (p0, p1), cat = pools
    ex0 = p0.ex
    items = [it.id for it in cat.items]
    user = [random.Random(2).randrange(3, 500) for _ in range(8)]
    want = scratch(ex0, user, items)
    out = ex0.run("u", user, items, INSTR, prefix="item")
    remote = sum(len(cat.get(i).token_ids) for i in items if i not in ex0.store)
    assert out["meta_info"]["fetched_tokens"] == remote > 0 and p1.server.served > 0
    assert p1.server.requests == 1 and p0.fetcher.recompute_s(3) == 3.0  # one round trip for all
    assert (scores_of(out, items) - want).abs().max().item() <= TOL
    assert p0.stats()["fetched_tokens"] == remote and p1.stats()["served"] == p1.server.served
    assert accounting_ok(ex0)


def test_dead_peer_is_recomputed_not_an_error(pools):
    (p0, p1), cat = pools
    p1.server.close()  # rank 1 is gone but still listed
    p0.fetcher.timeout_ms = 50
    items = [it.id for it in cat.items]
    user = [9, 8, 7, 6]
    out = p0.ex.run("u", user, items, INSTR, prefix="item")
    assert out["meta_info"]["fetched_tokens"] == 0 and p0.client.timeouts == 1
    assert (scores_of(out, items) - scratch(p0.ex, user, items)).abs().max().item() <= TOL


def test_client_keeps_sockets_and_dead_marks_by_address():
    from sgrec.items.fetch import ItemKVClient

    clock = Clock()
    c = ItemKVClient({1: "inproc://x-1", 2: "inproc://x-2"}, clock=clock)
    c._mark_dead("inproc://x-2")
    c.set_endpoints({1: "inproc://x-2", 2: "inproc://x-3"})  # renumbered: the dead address keeps its mark
    assert not c.alive(1) and c.alive(2) and not c.alive(3)
    clock.t += 10
    assert c.alive(1)
    c.close()
