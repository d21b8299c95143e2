"""Scale-out (issue #12) on loopback: sgrec servers sharing item KV through one real Mooncake Store
(the storage tier replaced the ZMQ pool across servers) behind the real sglang-router
(generation routes) and Caddy (recommendation routes, rendezvous hashing of X-User-Id), started by
the launch/ recipe. Which server answered is read from the X-Sgrec-Server response header that every
sgrec response carries."""

from __future__ import annotations

import math
import os
import time
import zlib

import httpx
import pytest

from launch.front import read_servers
from launch.local_cluster import LocalCluster
from tests.test_rec_server import write_catalog

USERS = [f"user{k}" for k in range(48)]  # 3 servers: each gets none with odds < 1e-7
ITEMS = [f"i{k}" for k in range(30)]
TOL = 1e-5


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("scale_cat") / "catalog.jsonl")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model, catalog, tmp_path_factory):
    from sgrec.tools.mooncake_master import missing

    if missing():  # CI installs what it needs (the test extra and libibverbs1)
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"the cluster needs Mooncake: {missing()}")
    # an item store of 16 tokens keeps about 5 of the 30 items: the others come from the Mooncake Store
    # once any server computed them; wait_complete: a request waits for its candidates' reads, so a
    # test sees every item the store has (the timeout policy is tested in tests/test_hicache.py);
    # item_reads always: read whatever the cost model would pick for this tiny model on a loaded machine
    # (the cost model is tested in process: tests/test_hicache.py)
    c = LocalCluster(["--model-path", model, "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
                      "--item-catalog", catalog, "--item-cache-tokens", "16",
                      "--hicache-storage-prefetch-policy", "wait_complete"],
                     workdir=str(tmp_path_factory.mktemp("cluster")), segment_mb=64, store_extra={"item_reads": "always"})
    try:
        yield c.up(2)
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference(model, catalog):
    """Scores of one standalone in-process engine (no item pool)."""
    from sgrec import Engine

    e = Engine(model, device="cpu", dtype="float32", max_total_tokens=4096, item_catalog=catalog)

    def scores(user: dict) -> dict[str, float]:
        return {x["item"]: x["score"] for x in e.rank(user, ITEMS, prefix="item")["ranking"]}

    return scores


def user_body(u: str, prefix: str | None = None) -> dict:
    body = {"user": {"id": u, "token_ids": [30 + zlib.crc32(u.encode()) % 50, *range(40, 56)]}, "items": ITEMS[:20]}
    if prefix:
        body["prefix"] = prefix
    return body


def rank_via(url: str, u: str, prefix: str | None = None, header: bool = True) -> httpx.Response:
    r = httpx.post(url + "/v1/rank", json=user_body(u, prefix), headers={"X-User-Id": u} if header else {},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r


def server_of(r: httpx.Response) -> str:
    return "http://" + r.headers["x-sgrec-server"]


def caddy_owners(c: LocalCluster) -> dict[str, str]:
    return {u: server_of(rank_via(c.front.url, u)) for u in USERS}


def router_owners(c: LocalCluster, users: list[str] = USERS) -> dict[str, str]:
    out = {}
    for u in users:
        r = httpx.post(c.front.router_url + "/generate", headers={"X-SMG-Routing-Key": u}, timeout=60,
                       json={"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        out[u] = server_of(r)
    return out


def live(c: LocalCluster) -> list:
    """The servers still running: the membership tests below add and kill servers, and tests run in
    any order (pytest-randomly), so every test reads the cluster as it finds it."""
    return [s for s in c.servers if s.proc.poll() is None]


def test_one_user_one_server_behind_caddy_and_router(cluster):
    urls = {s.url for s in live(cluster)}
    first = caddy_owners(cluster)
    assert set(first.values()) == urls  # both servers get users
    assert caddy_owners(cluster) == first  # and every user stays where it was
    # keys the router has not seen: it keeps a key where it first sent it ("manual" policy), so after
    # the membership tests the old keys need not reach a newly admitted server
    fresh = [f"fresh-{u}" for u in USERS]
    by_router = router_owners(cluster, fresh)
    assert set(by_router.values()) == urls and router_owners(cluster, fresh) == by_router
    for u in fresh[:4]:  # the OpenAI route too, and Caddy's catch-all hands X-User-Id to the router as its key
        r = httpx.post(cluster.front.router_url + "/v1/completions", headers={"X-SMG-Routing-Key": u}, timeout=60,
                       json={"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and server_of(r) == by_router[u], r.text
        r = httpx.post(cluster.front.url + "/generate", headers={"X-User-Id": u}, timeout=60,
                       json={"text": "hello", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and server_of(r) == by_router[u], r.text


def test_rank_through_proxy_equals_direct(cluster):
    for u in USERS[:6]:
        via = rank_via(cluster.front.url, u, prefix="none")
        direct = rank_via(server_of(via), u, prefix="none", header=False)
        assert via.json()["ranking"] == direct.json()["ranking"]  # recomputed from scratch: bit-equal
        via = rank_via(cluster.front.url, u)
        direct = rank_via(server_of(via), u, header=False)
        a, b = via.json()["ranking"], direct.json()["ranking"]
        assert [x["item"] for x in a] == [x["item"] for x in b]
        assert max(abs(x["score"] - y["score"]) for x, y in zip(a, b)) <= TOL
    score = {"query": [11, 12, 13], "items": [[20, 21], [30]], "label_token_ids": [3, 99]}
    via = httpx.post(cluster.front.url + "/v1/score", json=score, headers={"X-User-Id": "u"}, timeout=60)
    direct = httpx.post(server_of(via) + "/v1/score", json=score, timeout=60)
    assert via.status_code == direct.status_code == 200
    pairs = [(x, y) for a, b in zip(via.json()["scores"], direct.json()["scores"]) for x, y in zip(a, b)]
    assert len(pairs) == 4 and all(math.isclose(x, y, rel_tol=1e-4) for x, y in pairs)  # cached prefix: float noise


def item_rank(url: str, u: str, header: bool = True) -> dict:
    """Ranks all items with the item-as-prefix layout (candidates' KV from the item store, the
    storage tier or computed)."""
    body = {**user_body(u, "item"), "items": ITEMS}
    r = httpx.post(url + "/v1/rank", json=body, headers={"X-User-Id": u} if header else {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def assert_matches(out: dict, want: dict[str, float]) -> None:
    assert {x["item"] for x in out["ranking"]} == set(ITEMS)
    assert max(abs(x["score"] - want[x["item"]]) for x in out["ranking"]) <= TOL


def storage_after(url: str, t: float) -> dict:
    """The server's storage-tier counters as read after time `t` with no write pending (writes run on
    a background thread; the scheduler reports its counters every 0.5 s)."""
    def fresh():
        h = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]["hicache"]
        return h["storage"] if h["as_of"] > t and h["storage"]["pending_writes"] == 0 else None

    got = wait_for(fresh, timeout=60, step=0.1)
    assert got, "storage writes still pending after 60 s"
    return got


def computed_here_loaded_there(here, there, u: str, reference) -> dict:
    """Ranks every item on `here` (the candidates its store lacks are computed and written to the
    store), then on `there`: the candidates `there` lacks are loaded, and both score like one
    standalone engine. Returns `there`'s answer."""
    assert_matches(item_rank(here.url, u, header=False), reference(user_body(u)["user"]))
    storage_after(here.url, time.time())
    out = item_rank(there.url, u, header=False)
    assert_matches(out, reference(user_body(u)["user"]))
    return out


def test_item_kv_computed_on_one_server_is_loaded_by_another(cluster, reference):
    """Each server keeps the items its store has room for; any other candidate that another server
    computed comes from the Mooncake Store and scores exactly like one standalone engine."""
    a, b = live(cluster)[:2]
    before = storage_after(b.url, time.time())
    out = computed_here_loaded_there(a, b, "mover", reference)
    meta = out["meta_info"]
    assert meta["stored_tokens"] > 0 and meta["cached_tokens"] >= meta["stored_tokens"]
    st = storage_after(b.url, time.time())
    assert st["hits"] > 0  # (this time the items may have come from b's host tier, where earlier reads left them)
    # both sides of the read-or-recompute choice are measured and shown: b read item KV and ran forwards
    h = httpx.get(b.url + "/get_server_info", timeout=30).json()["internal_states"][0]["hicache"]
    assert h["item_read"]["calls"] >= 1 and h["item_read"]["per_token_s"] is not None
    assert h["item_recompute"]["calls"] >= 1 and h["item_recompute"]["per_token_s"] is not None
    if len(live(cluster)) == len(cluster.servers):  # (after the kill test, reads of the dead server's share fail)
        assert st["failures"] == before["failures"]


def wait_for(pred, timeout: float = 120.0, step: float = 0.5):
    """pred()'s first truthy value, or its last one after `timeout` (a bound on hangs, not on speed)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


def test_admit_a_server_without_restarting_the_others(cluster, reference):
    before_caddy, before_router = caddy_owners(cluster), router_owners(cluster)
    running = live(cluster)
    pids = [s.proc.pid for s in running]
    new = cluster.add_server()
    assert cluster.front.reconcile()["added"] == [new.url]
    cluster.front.wait_router()
    after = caddy_owners(cluster)
    moved = {u for u in USERS if after[u] != before_caddy[u]}
    assert moved and all(after[u] == new.url for u in moved)  # rendezvous hashing: only to the new server
    assert router_owners(cluster) == before_router  # the router keeps its users where they were
    assert [s.proc.pid for s in running if s.proc.poll() is None] == pids  # nobody restarted
    assert len(read_servers(cluster.servers_path)) == len(running) + 1
    # the new server is on the same store: it loads what the others computed, and the reverse
    assert computed_here_loaded_there(running[0], new, "newcomer", reference)["meta_info"]["stored_tokens"] > 0
    assert computed_here_loaded_there(new, running[0], "newcomer-2", reference)["meta_info"]["stored_tokens"] > 0


def test_killed_server_moves_its_users_and_loses_no_request(cluster, reference):
    if len(live(cluster)) < 3:  # two survivors, so that one can load what the other computes
        new = cluster.add_server()
        assert cluster.front.reconcile()["added"] == [new.url]
        cluster.front.wait_router()
    before_caddy, before_router = caddy_owners(cluster), router_owners(cluster)
    victim, survivor = live(cluster)[:2]
    victim.kill()  # SIGKILL: no goodbye, its port refuses connections from now on
    after = caddy_owners(cluster)  # every request answered 200 (asserted inside)
    assert all(after[u] != victim.url for u in USERS)
    assert all(after[u] == before_caddy[u] for u in USERS if before_caddy[u] != victim.url)
    by_router = router_owners(cluster)
    assert all(by_router[u] != victim.url for u in USERS)
    assert all(by_router[u] == before_router[u] for u in USERS if before_router[u] != victim.url)
    # the dead server's share of the store is gone with it: a survivor's read of an object there
    # fails or misses, and the item is recomputed: right scores, no error
    assert_matches(item_rank(survivor.url, "after-kill", header=False), reference(user_body("after-kill")["user"]))
    # the front removes it: from the servers file, the router and Caddy
    removed = wait_for(lambda: victim.url in cluster.front.reconcile()["removed"], timeout=30, step=0)
    assert removed and victim.url not in [s["url"] for s in read_servers(cluster.servers_path)]
    cluster.front.wait_router()
    assert caddy_owners(cluster) == after
    # the survivors share items through the store again (after the back-off of a failed read)
    other = next(s for s in live(cluster) if s is not survivor)
    out = wait_for(lambda: (o := computed_here_loaded_there(survivor, other, "after-removal", reference))
                   ["meta_info"]["stored_tokens"] and o)
    assert out, "the survivors no longer share items through the store"

