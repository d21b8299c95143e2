"""Cross-rank item KV fetch (HRCS, BAT §5.2): in-process ranks over ZMQ inproc endpoints, each
owner answering from its server thread."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from sgrec.catalog import Catalog, Item
from sgrec.items import hrcs
from sgrec.items.fetch import ItemFetcher, ItemKVClient, connect_loopback, header_key
from sgrec.items.store import fingerprint
from sgrec.radix.tree import RadixCache
from sgrec import layout as L
from sgrec.rank.executor import RankExecutor
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs
from sgrec.tools.probe import wait_for

TOL = 1e-5
KV_TOL = 1e-4  # ARCHITECTURE.md's float32 tolerance of reused KV
HEADER = [5, 6, 7]
INSTR = [9, 10, 11]


def make_catalog(n: int = 16, seed: int = 3, vocab: int = 512) -> Catalog:
    rng = random.Random(seed)
    return Catalog(Item(f"i{k}", tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))),
                        rng.randrange(3, vocab)) for k in range(n))


def make_ranks(path: str, catalog: Catalog, n: int = 2, ratio: float = 0.25):
    item_ids = [it.id for it in catalog.items]
    placement = hrcs.plan_placement(item_ids, [float(len(item_ids) - k) for k in range(len(item_ids))], ratio, n)
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
        # the 4 remote items came in one round trip
        assert mi["fetched_tokens"] == fetched and servers[1].served == 4 and servers[1].requests == 1
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


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_cost_model_with_hand_numbers():
    """Fetch n tokens from owner p when latency_p + n * bytes/bandwidth < recompute(n): 1000 B/token at
    1 MB/s is 1 ms per token to transfer, recomputing is 2 ms per token, the prior latency 1 ms."""
    pl = hrcs.Placement(3, {"hot"}, {"a": 1, "b": 0, "c": 2})
    clock = Clock()
    client = ItemKVClient({1: "inproc://hand-1", 2: "inproc://hand-2"}, clock=clock)
    f = ItemFetcher(0, pl, client, bytes_per_token=1000, bandwidth_Bps=1e6, latency_s=0.001,
                    recompute_s=lambda n: 0.002 * n, ema_weight=0.5, probe_share=0.5, probe_min_s=0.1,
                    probe_max_s=10.0, clock=clock)
    assert f.owner("hot") is None and f.owner("b") is None and (f.owner("a"), f.owner("c")) == (1, 2)
    assert f.estimate_fetch_s(1, 10) == pytest.approx(0.011) and f.worth_fetching(1, 10)  # 11 ms < 20 ms
    assert f.estimate_fetch_s(1, 0) == pytest.approx(0.001)
    # a round trip of 31 ms for 10 tokens: 21 ms latency, which replaces the prior
    f.observe(1, 10, 0.031)
    assert f.latency == {"inproc://hand-1": pytest.approx(0.021)}
    assert f.estimate_fetch_s(1, 10) == pytest.approx(0.031) and not f.worth_fetching(1, 10)  # 31 > 20 ms
    assert f.worth_fetching(1, 25)  # 21 + 25 = 46 ms < 50 ms: the latency is spread over more tokens
    assert f.estimate_fetch_s(2, 10) == pytest.approx(0.011) and f.worth_fetching(2, 10)  # rank 2: the prior
    # the EMA (weight 0.5) moves halfway to each new sample: 21 -> 11 -> 6 ms
    f.observe(1, 10, 0.011)
    assert f.latency["inproc://hand-1"] == pytest.approx(0.011) and not f.worth_fetching(1, 10)  # 21 > 20
    f.observe(1, 10, 0.011)
    assert f.latency["inproc://hand-1"] == pytest.approx(0.006) and f.worth_fetching(1, 10)  # 16 < 20
    f.observe(1, 0, 0.5)  # a slow answer (or a timeout): 253 ms
    assert f.latency["inproc://hand-1"] == pytest.approx(0.253) and not f.worth_fetching(1, 10)
    # a skipped owner is probed when its estimate is latency / probe_share old: 253 / 0.5 = 506 ms
    assert f.probes == 0 and f.probe_interval_s(1) == pytest.approx(0.506)
    clock.t = 0.505
    assert not f.worth_fetching(1, 10)
    clock.t = 0.507
    assert f.worth_fetching(1, 10) and f.probes == 1
    assert f.probe_interval_s(2) == 0.1  # 1 ms / 0.5 = 2 ms: at least probe_min_s
    f.observe(1, 0, 100.0)  # 50 s latency: probed every probe_max_s at most
    assert f.probe_interval_s(1) == 10.0
    f.policy = "always"
    clock.t = 0.0
    f.observe(1, 0, 9.0)
    assert f.worth_fetching(1, 10)
    f.policy = "never"
    assert not f.worth_fetching(2, 10)
    f.policy, f.recompute_s = "cost", None  # no recompute model: always fetch
    assert f.worth_fetching(1, 10)
    with pytest.raises(ValueError, match="fetch policy"):
        ItemFetcher(0, pl, client, policy="sometimes")
    client.close()


def test_one_round_trip_per_owner_slow_owner_skipped_misses(tiny_model_dir):
    """Three ranks: rank 0's request needs items of ranks 1 and 2 and asks each once. Rank 2 is then
    slow (its scheduler holds the store's lock for 1 s during the next fetch): the measured latency
    puts it above the recompute time, so the following request recomputes rank 2's items without
    asking it, until a probe is due. Every answer scores like recomputation."""
    cat = make_catalog(n=24)
    exs, placement = make_ranks(tiny_model_dir("qwen2", seed=4), cat, n=3)
    clock = Clock()
    servers = connect_loopback(exs, timeout_ms=5000, recompute_s=lambda n: 0.005 * n, clock=clock)
    try:
        ex0, f = exs[0], exs[0].fetcher
        of = {r: [i for i in placement.owner if placement.owner[i] == r] for r in (1, 2)}
        cands = of[1][:3] + of[2][:3]
        toks = {r: sum(len(cat.get(i).token_ids) for i in of[r][:3]) for r in (1, 2)}
        user = [random.Random(5).randrange(3, 512) for _ in range(7)]
        want = scratch(ex0, user, cands)

        def run() -> dict:
            out = ex0.run("u", user, cands, INSTR, prefix="item")
            assert (scores_of(out, cands) - want).abs().max().item() <= TOL
            assert accounting_ok(ex0)
            return out["meta_info"]

        assert run()["fetched_tokens"] == toks[1] + toks[2]
        assert [s.requests for s in servers] == [0, 1, 1] and [s.served for s in servers] == [0, 3, 3]
        # rank 2's scheduler holds its store's lock (an eviction, say) while we fetch: until the fetch
        # has reached rank 2's server thread (counted there before it waits for the lock), then 1 s
        # more, so its round trip is >= 1 s however slowly it was sent
        held, asked = threading.Event(), servers[2].requests

        def busy_owner():
            with exs[2].store.lock:
                held.set()
                wait_for(lambda: servers[2].requests > asked, "the fetch at rank 2", every=0.01)
                time.sleep(1.0)

        addr2 = f.client.endpoints[2]
        fast2 = f.latency[addr2]  # measured on the first request
        t = threading.Thread(target=busy_owner)
        t.start()
        held.wait()
        clock.t = 2.0  # both owners due for a probe anyway: this request asks both
        assert run()["fetched_tokens"] == toks[1] + toks[2]
        t.join()
        assert [s.requests for s in servers] == [0, 2, 2]
        # a round trip of >= 1 s moved the EMA (weight 0.2) at least a fifth of the way to 1 s
        assert f.latency[addr2] >= fast2 + 0.2 * (1.0 - fast2) - 1e-9
        assert not f.worth_fetching(2, toks[2])  # >= 0.2 s vs 5 ms per token
        fast = f.worth_fetching(1, toks[1])  # rank 1's own measurement decides (fast unless this host stalls)
        mi = run()
        assert servers[2].requests == 2 and f.skipped_items == 3 + (0 if fast else 3)
        assert mi["fetched_tokens"] == (toks[1] if fast else 0) and servers[1].requests == 2 + fast
        # a probe once rank 2's estimate is latency / probe_share old: it answers fast again and its
        # estimate comes down
        before = f.latency[addr2]
        clock.t += f.probe_interval_s(2)
        assert run()["fetched_tokens"] >= toks[2] and servers[2].requests == 3
        assert f.latency[addr2] < before and f.probes >= 1
        # the owner answers only what it holds, and only for its own header
        client = f.client
        got = client.fetch_many({1: ["nope", of[1][0]], 2: [of[2][0]]}, header_key(HEADER), 2000)
        assert [i for i, _ in got[1].items] == [of[1][0]] and got[1].k.shape[1] == len(cat.get(of[1][0]).token_ids)
        assert got[2].items == [(of[2][0], len(cat.get(of[2][0]).token_ids))]
        assert client.fetch_many({1: [of[1][0]]}, header_key([1, 2]), 2000) == {1: None}
        # ... and only KV of the tokens the asker's catalog version has (a replaced item)
        i1, i2 = of[1][0], of[2][0]
        fps = {i1: fingerprint(cat.get(i1).token_ids), i2: fingerprint(cat.get(i2).token_ids) ^ 1}
        got = client.fetch_many({1: [i1], 2: [i2]}, header_key(HEADER), 2000, fps)
        assert [i for i, _ in got[1].items] == [i1] and got[2].items == []
        assert client.alive(1) and client.timeouts == 0  # a miss or another header is an answer
        assert all(accounting_ok(ex) for ex in exs)
    finally:
        for s in servers:
            s.close()


def test_owner_evicts_while_fetches_run(tiny_model_dir):
    """The owner's server thread reads item KV while the owner's scheduler evicts those items, hands
    their slots to other requests (which overwrite them) and computes them again. A fetch returns the
    items' true KV or a miss, never a torn read: (1) deterministically, a fetch that arrives while the
    scheduler holds the store's lock waits, and sees the eviction as a miss; (2) under a race, every
    fetched K/V equals the KV computed from scratch and rank requests score like recomputation."""
    cat = make_catalog(n=20)
    exs, placement = make_ranks(tiny_model_dir("qwen2", seed=4), cat, n=2)
    servers = connect_loopback(exs, timeout_ms=5000)
    owner, ex0 = exs[1], exs[0]
    store, pool = owner.store, owner.runner.kv_pool
    mine = [i for i in placement.owner if placement.owner[i] == 1]
    client, head = ex0.fetcher.client, header_key(HEADER)
    truth = {}
    for i in mine:  # reference KV: each item computed alone in its own forward
        _, k, v = store.read_kv([i])
        truth[i] = (k.clone(), v.clone())

    def scribble(n: int) -> None:
        """Another request takes n free slots and writes its own KV there."""
        slots = owner.allocator.alloc(n)
        junk = torch.full((n, *pool.get_kv(0)[0].shape[1:]), 1e4)
        for layer in range(pool.num_layers):
            pool.set_kv(layer, slots, junk, junk)
        owner.allocator.free(slots)

    try:
        # (1) the scheduler holds the lock; a fetch waits for it, then finds the items gone
        result = {}
        with store.lock:
            t = threading.Thread(target=lambda: result.update(client.fetch_many({1: mine[:4]}, head, 5000)))
            t.start()
            time.sleep(0.3)
            assert t.is_alive() and servers[1].served == servers[1].missed == 0  # the server thread waits
            freed = store.evict(10**6)
            scribble(owner.allocator.available_size())
        t.join()
        assert freed > 0 and all(i not in store for i in mine[:4])
        assert result[1] is not None and result[1].items == [] and servers[1].missed == 4
        store.precompute()
        # (2) a race: the owner's scheduler (this thread's helper) evicts, scribbles, recomputes
        stop, rounds = threading.Event(), [0]

        def churn():
            rng = random.Random(0)
            while not stop.is_set():
                store.evict(rng.randrange(1, 40))
                scribble(owner.allocator.available_size())
                store.precompute()
                rounds[0] += 1

        t = threading.Thread(target=churn)
        t.start()
        try:
            hits = misses = 0
            wait_for(lambda: rounds[0] > 0, "the churn thread running")
            # a fixed number of fetches during the churn (not a time window), and at least one hit
            while hits + misses < 5 * 200 or hits == 0:
                assert hits + misses < 5 * 20000, "no fetch ever found an item"
                ask = random.Random(hits + misses).sample(mine, 5)
                rep = client.fetch_many({1: ask}, head, 5000)[1]
                off = 0
                for i, n in rep.items:  # the same KV, up to the float noise of another batch (a torn read: 1e4)
                    assert (rep.k[:, off : off + n] - truth[i][0]).abs().max().item() <= KV_TOL
                    assert (rep.v[:, off : off + n] - truth[i][1]).abs().max().item() <= KV_TOL
                    off += n
                hits += len(rep.items)
                misses += 5 - len(rep.items)
            user = [3, 4, 5, 6, 7]
            cands = mine[:6]
            for _ in range(5):
                out = ex0.run("u", user, cands, INSTR, prefix="item")
                assert (scores_of(out, cands) - scratch(ex0, user, cands)).abs().max().item() <= TOL
        finally:
            stop.set()
            t.join()
        assert hits > 0 and rounds[0] > 0
        assert accounting_ok(owner) and accounting_ok(ex0)
    finally:
        for s in servers:
            s.close()
