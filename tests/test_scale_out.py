"""Scale-out (issue #12) on loopback: sgrec servers sharing one item pool (HRCS across servers)
behind the real sglang-router (generation routes) and Caddy (recommendation routes, rendezvous
hashing of X-User-Id), started by the launch/ recipe. Which server answered is read from the
X-Sgrec-Server response header that every sgrec response carries."""

from __future__ import annotations

import math
import time
import zlib

import httpx
import pytest

from launch.local_cluster import LocalCluster
from sgrec.items.peers import read_peer_file, read_servers
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
    # item_fetch "always": the fetch tests below need fetches, whatever the cost model would pick on
    # a loaded machine (the cost model is tested in process: tests/test_item_fetch.py)
    c = LocalCluster(["--model-path", model, "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
                      "--item-catalog", catalog], workdir=str(tmp_path_factory.mktemp("cluster")),
                     item_fetch="always")
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


def fetched_rank(url: str, u: str, header: bool = True) -> dict:
    body = {**user_body(u, "item"), "items": ITEMS}
    r = httpx.post(url + "/v1/rank", json=body, headers={"X-User-Id": u} if header else {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def assert_matches(out: dict, want: dict[str, float]) -> None:
    assert {x["item"] for x in out["ranking"]} == set(ITEMS)
    assert max(abs(x["score"] - want[x["item"]]) for x in out["ranking"]) <= TOL


def test_cold_item_fetched_from_a_peer_scores_like_local(cluster, reference):
    """Each server holds the hot items and its shard of the cold ones; ranking all items on one
    server fetches the other's shard over tcp:// and scores exactly like one standalone engine."""
    for srv in live(cluster):
        u = "fetcher"
        # bounded retries: on a loaded machine a fetch may pass its 200 ms timeout (then the item is
        # recomputed and the owner skipped for 5 s); the scores are right either way
        out = wait_for(lambda: (o := fetched_rank(srv.url, u, header=False))["meta_info"]["fetched_tokens"] and o)
        assert out, "no item was ever fetched from the peer"
        assert_matches(out, reference(user_body(u)["user"]))
        assert_matches(fetched_rank(srv.url, u, header=False), reference(user_body(u)["user"]))


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
    assert len(read_peer_file(cluster.peers_path)) == len(running) + 1
    # the new server joined the item pool: it fetches the others' shards, the others fetch its own
    out = wait_for(lambda: (o := fetched_rank(new.url, "newcomer", header=False))["meta_info"]["fetched_tokens"] and o)
    assert out, "the new server never fetched from its peers"
    assert_matches(out, reference(user_body("newcomer")["user"]))


def test_killed_server_moves_its_users_and_loses_no_request(cluster, reference):
    if len(live(cluster)) < 3:  # two survivors, so that they still have a peer to fetch from
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
    # a survivor whose pool still lists the dead peer recomputes its items: right scores, no error
    assert_matches(fetched_rank(survivor.url, "after-kill", header=False), reference(user_body("after-kill")["user"]))
    # the front removes it: from the peer file (the pool re-plans without it), the router and Caddy
    removed = wait_for(lambda: victim.url in cluster.front.reconcile()["removed"], timeout=30, step=0)
    assert removed and victim.url not in [s["url"] for s in read_servers(cluster.peers_path)]
    cluster.front.wait_router()
    assert caddy_owners(cluster) == after
    out = wait_for(lambda: (o := fetched_rank(survivor.url, "replanned", header=False))["meta_info"]["fetched_tokens"] and o)
    assert out, "the survivors no longer fetch from each other after the re-plan"
    assert_matches(out, reference(user_body("replanned")["user"]))

