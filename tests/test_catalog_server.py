"""Live catalogs on a real server process: updates under concurrent traffic, every answer
consistent with the version it names, deletes never returned after their acknowledgement, rollback
restoring earlier answers, all-or-nothing batches, the admin key, a kill -9 right after an
acknowledged update, a torn journal line, and the item KV of a replaced item equal to a fresh
server's."""

import json
import os
import random
import threading

import httpx
import pytest

from sgrec.tools.probe import wait_for
from tests.test_rec_server import write_catalog

KEY, ADMIN = "user-key", "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
FLAGS = ("--max-total-tokens", "4096", "--max-rank-candidates", "40", "--max-beam-width", "16")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def new_files(d) -> dict:
    cat = write_catalog(d / "catalog.jsonl", n=30, semantic=True)
    return {"catalog": cat, "journal": str(d / "updates.journal"), "dir": d}


def start_live(start_server, model, files, *extra):
    return start_server(model, *FLAGS, "--item-catalog", files["catalog"], "--catalog-journal", files["journal"],
                        "--api-key", KEY, "--admin-api-key", ADMIN, "--catalog-history", "4", *extra)


@pytest.fixture(scope="module")
def server(start_server, model, tmp_path_factory):
    """A server the tests below share: each reads only what it wrote itself (versions relative to
    its own updates, its own item ids), so any order of them passes."""
    return start_live(start_server, model, new_files(tmp_path_factory.mktemp("live")))


@pytest.fixture
def files(tmp_path):
    """A fresh catalog and journal of the test's own."""
    return new_files(tmp_path)


@pytest.fixture
def own_server(request, start_server, model, files):
    """A server of the test's own, on `files`, at version 0 (stopped when the test ends); indirect
    parameters: more flags."""
    srv = start_live(start_server, model, files, *getattr(request, "param", ()))
    yield srv
    srv.stop()


def post(srv, path, body, headers=ADMIN_AUTH):
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=120)


def retrieve(srv, user, bw=8):
    r = post(srv, "/v1/retrieve", {"user": {"token_ids": user}, "beam_width": bw, "num_items": bw}, AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def rank(srv, user, items, prefix="item", headers=AUTH):
    r = post(srv, "/v1/rank", {"user": {"token_ids": user}, "items": items, "prefix": prefix}, headers)
    assert r.status_code == 200, r.text
    return r.json()


def info(srv, headers=AUTH):
    r = httpx.get(srv.url + "/v1/catalog", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def initial_paths(path) -> dict[str, tuple]:
    with open(path) as f:
        return {o["id"]: tuple(o["semantic_id"]) for o in map(json.loads, f)}


@pytest.mark.parametrize("own_server,user_len,clients", [((), (3, 12), 3), (("--interleave-rounds",), (600, 900), 5)],
                         indirect=["own_server"], ids=["whole", "interleaved"])
def test_updates_under_traffic_answer_from_one_version_each(own_server, files, user_len, clients):
    """Clients retrieve and rank while items are inserted, re-pathed and deleted: every answer's
    items exist in the version it names, with that version's semantic ID; after a delete is
    acknowledged, no later request returns the item. With --interleave-rounds (and users long
    enough that rounds are mostly under way), a switch waits for the rounds under way, one of
    which would fail on a switched trie."""
    server = own_server
    start = info(server)
    assert start["version"] == 0 and start["num_items"] == 30 and start["semantic_id_len"] == 3
    assert start["num_with_id_token"] == 30 and start["num_with_semantic_id"] == 30
    paths = {0: initial_paths(files["catalog"])}  # version -> {id: semantic id}
    answers, stop, errors = [], threading.Event(), []
    rng = random.Random(0)

    def client(seed):
        r = random.Random(seed)
        while not stop.is_set():
            try:
                user = [r.randrange(3, 500) for _ in range(r.randint(*user_len))]
                answers.append(("retrieve", retrieve(server, user)))
                ids = r.sample(sorted(paths[0]), 5)
                resp = post(server, "/v1/rank", {"user": {"token_ids": user}, "items": ids}, AUTH)
                answers.append(("rank", resp.status_code, resp.json(), ids))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(clients)]
    for t in threads:
        t.start()
    deleted_after = {}  # id -> version whose acknowledgement deleted it
    try:
        for n in range(1, 9):
            cur = dict(paths[n - 1])
            if n % 3 == 0:  # delete what retrieve returns now
                top = [it["item"] for it in retrieve(server, [5, 6, 7])["items"][:2]]
                r = post(server, "/v1/catalog/delete", {"ids": top + ["never-there"]})
                assert r.status_code == 200, r.text
                assert r.json() == {"version": n, "inserted": 0, "replaced": 0, "deleted": 2, "unknown_ids": 1}
                for i in top:
                    cur.pop(i)
                    deleted_after[i] = n
                after = retrieve(server, [5, 6, 7])  # admitted after the acknowledgement
                assert after["meta_info"]["catalog_version"] >= n
                assert not {it["item"] for it in after["items"]} & set(top)
            else:  # new items on fresh paths, and old ones moved to other paths
                new = [{"id": f"v{n}_{k}", "token_ids": [rng.randrange(3, 500) for _ in range(3)],
                        "id_token": rng.randrange(3, 500), "semantic_id": [3 + n % 2, k % 3, rng.randrange(3)]}
                       for k in range(4)]
                moved = [{"id": i, "token_ids": [7, 8], "id_token": 9, "semantic_id": [rng.randrange(3), 2, k]}
                         for k, i in enumerate(rng.sample(sorted(cur), 2))]
                r = post(server, "/v1/catalog/items", {"items": new + moved})
                assert r.status_code == 200, r.text
                assert r.json()["version"] == n and r.json()["replaced"] == 2 and r.json()["inserted"] == 4
                cur.update({it["id"]: tuple(it["semantic_id"]) for it in new + moved})
            paths[n] = cur
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    retrieved = [a[1] for a in answers if a[0] == "retrieve"]
    assert len(retrieved) >= 8 and len({a["meta_info"]["catalog_version"] for a in retrieved}) >= 3
    for a in retrieved:
        v = a["meta_info"]["catalog_version"]
        for it in a["items"]:
            assert paths[v].get(it["item"]) == tuple(it["semantic_id"]), (v, it)
            assert it["item"] not in deleted_after or v < deleted_after[it["item"]]
    for _, status, body, ids in (a for a in answers if a[0] == "rank"):
        if status == 200:  # every candidate existed in the version that ranked it
            v = body["meta_info"]["catalog_version"]
            assert {r["item"] for r in body["ranking"]} == set(ids) and set(ids) <= set(paths[v])
        else:  # a candidate deleted before the request ran: a 400 naming it
            assert status == 400 and "Unknown item" in body["message"]
    now = info(server)
    assert now["version"] == 8 and now["num_items"] == len(paths[8]) and now["kept_versions"] == [5, 6, 7, 8]


def test_rollback_restores_the_earlier_answers(server):
    r = post(server, "/v1/catalog/items", {"items": [
        {"id": f"ro{k}", "token_ids": [60 + k, 61], "id_token": 30 + k, "semantic_id": [1, 2, k]} for k in range(2)]})
    v = r.json()["version"]
    users = [[11, 12, 13], [40, 41, 42, 43, 44]]
    before = [retrieve(server, u) for u in users]
    ranked = rank(server, users[0], ["ro0", "ro1"])
    r = post(server, "/v1/catalog/items", {"items": [
        {"id": "ro0", "token_ids": [99, 98, 97], "id_token": 5, "semantic_id": [0, 0, 0]},
        {"id": "r1", "token_ids": [4], "semantic_id": [0, 0, 1]}]})
    assert r.status_code == 200, r.text
    assert rank(server, users[0], ["ro0", "ro1"])["ranking"] != ranked["ranking"]
    r = post(server, "/v1/catalog/rollback", {"version": v})
    assert r.status_code == 200 and r.json() == {"version": v + 2, "rolled_back_to": v}, r.text
    for u, b in zip(users, before):
        a = retrieve(server, u)
        assert a["meta_info"]["catalog_version"] == v + 2
        assert [(it["item"], it["semantic_id"]) for it in a["items"]] == [
            (it["item"], it["semantic_id"]) for it in b["items"]]
        assert max(abs(x["score"] - y["score"]) for x, y in zip(a["items"], b["items"])) <= 1e-5
    again = rank(server, users[0], ["ro0", "ro1"])  # ro0's item KV was recomputed from its old tokens
    assert [x["item"] for x in again["ranking"]] == [x["item"] for x in ranked["ranking"]]
    assert max(abs(x["score"] - y["score"]) for x, y in zip(again["ranking"], ranked["ranking"])) <= 1e-5


def test_every_item_on_a_shared_path_is_returned_in_prior_then_id_order(server):
    """Three items upserted on one semantic ID: retrieve, recommend and the beam form of /generate
    return all three (num_items counts items), larger `prior` first, an item without one last."""
    items = [{"id": "sp-a", "token_ids": [70, 71], "semantic_id": [3, 2, 2], "attrs": {"prior": 1}},
             {"id": "sp-c", "token_ids": [72], "semantic_id": [3, 2, 2]},
             {"id": "sp-b", "token_ids": [73, 74], "semantic_id": [3, 2, 2], "attrs": {"prior": 5.5}}]
    assert post(server, "/v1/catalog/items", {"items": items}).status_code == 200
    want = ["sp-b", "sp-a", "sp-c"]
    only = {"include_items": want}
    r = post(server, "/v1/retrieve", {"user": {"token_ids": [9, 8]}, "beam_width": 8, "num_items": 8, **only}, AUTH)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [x["item"] for x in got["items"]] == want and got["meta_info"]["exhausted"] is True
    assert {tuple(x["semantic_id"]) for x in got["items"]} == {(3, 2, 2)}
    assert len({x["score"] for x in got["items"]}) == 1  # one path, one score
    r = post(server, "/v1/retrieve", {"user": {"token_ids": [9, 8]}, "beam_width": 8, "num_items": 2, **only}, AUTH)
    assert [x["item"] for x in r.json()["items"]] == want[:2]
    r = post(server, "/v1/recommend", {"user": {"token_ids": [9, 8]}, "retrieve": {"beam_width": 4,
             "num_candidates": 3}, "top_k": 3, **only}, AUTH)
    assert r.status_code == 200, r.text
    assert sorted(x["item"] for x in r.json()["items"]) == sorted(want)
    r = post(server, "/generate", {"input_ids": [9, 8], "sampling_params": {"beam_width": 4, "n": 3},
                                   "constrain_to_catalog": True, **only}, AUTH)
    assert r.status_code == 200, r.text
    assert [b["meta_info"]["item"] for b in r.json()["meta_info"]["beam_results"]] == want
    r = post(server, "/v1/retrieve", {"user": {"token_ids": [9, 8]}, "beam_width": 8, "num_items": 8,
                                      "exclude_items": ["sp-b"], **only}, AUTH)
    assert [x["item"] for x in r.json()["items"]] == want[1:]


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/catalog/items", {"items": [{"id": "ok1", "token_ids": [5]}, {"id": "bad", "token_ids": []}]}, 400,
     "items[1] ('bad'): items[1].token_ids must be a non-empty list"),
    ("/v1/catalog/items", {"items": [{"id": "ok1", "token_ids": [5], "semantic_id": [1, 2]}]}, 400,
     "semantic_id has 2 tokens here but 3"),
    ("/v1/catalog/items", {"items": [{"id": "ok1", "token_ids": [5], "attrs": {"a": {"b": 1}}}]}, 400,
     "items[0] ('ok1'): attrs.a must be"),
    ("/v1/catalog/items", {"item": []}, 400, "items must be a non-empty list"),
    ("/v1/catalog/items", {"items": [{"id": "ok1", "token_ids": [5], "embedding": [0.5, 1.0]}]}, 400,
     "items[0] ('ok1'): items[0].embedding needs a server started with --semantic-id-codebooks"),
    ("/v1/catalog/delete", {"ids": [1]}, 400, "ids must be a non-empty list of item id strings"),
    ("/v1/catalog/rollback", {"version": 10**6}, 404, "catalog version 1000000 is not kept"),  # never made
    ("/v1/catalog/rollback", {"version": "1"}, 400, "version must be an integer in [0, 2^63)"),
    ("/v1/catalog/rollback", {"version": -1}, 400, "version must be an integer in [0, 2^63)"),
    ("/v1/catalog/rollback", {"version": 2**63}, 400, "version must be an integer in [0, 2^63)"),
])
def test_bad_updates_change_nothing(server, path, body, status, message):
    v = info(server)
    r = post(server, path, body)
    assert r.status_code == status and message in r.json()["message"], r.text
    assert info(server) == v
    assert post(server, "/v1/rank", {"user": {"token_ids": [5]}, "items": ["ok1"]}, AUTH).status_code == 400


def test_updates_need_the_admin_key(server):
    body = {"ids": ["not-there"]}
    assert post(server, "/v1/catalog/delete", body, headers={}).status_code == 401
    assert post(server, "/v1/catalog/delete", body, headers=AUTH).status_code == 401
    assert httpx.get(server.url + "/v1/catalog", timeout=60).status_code == 401
    assert httpx.get(server.url + "/v1/catalog", headers=ADMIN_AUTH, timeout=60).status_code == 401
    doc = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=60).json()
    for path in ("/v1/catalog/items", "/v1/catalog/delete", "/v1/catalog/rollback"):
        assert "401" in doc["paths"][path]["post"]["responses"] and "404" in doc["paths"][path]["post"]["responses"]
    assert "get" in doc["paths"]["/v1/catalog"]


def test_kill_9_after_an_acknowledged_update_loses_nothing(own_server, start_server, model, files):
    server = own_server
    item = {"id": "durable", "token_ids": [21, 22, 23], "id_token": 77, "semantic_id": [2, 2, 2]}
    r = post(server, "/v1/catalog/items", {"items": [item]})
    assert r.status_code == 200, r.text
    version = r.json()["version"]
    server.proc.kill()  # SIGKILL right after the acknowledgement: no shutdown path runs
    server.proc.wait()
    again = start_live(start_server, model, files)
    facts = info(again)
    assert facts["version"] == version == 1
    out = rank(again, [5, 6], ["durable", "i1"])
    assert out["meta_info"]["catalog_version"] == version and {r["item"] for r in out["ranking"]} == {"durable", "i1"}
    again.stop()
    with open(files["journal"], "ab") as f:  # a crash in the middle of writing the next record
        f.write(b'{"version": ' + str(version + 1).encode() + b', "op": "delete", "ids": ["dur')
    third = start_live(start_server, model, files)
    assert info(third)["version"] == version
    assert "dropped a torn last journal record" in third.read_log()
    r = post(third, "/v1/catalog/delete", {"ids": ["i2"]})  # appends after the cut land on their own line
    assert r.status_code == 200 and r.json()["version"] == version + 1, r.text
    third.stop()


def test_a_replaced_items_kv_equals_a_fresh_servers(own_server, start_server, model, files):
    """A replaced item's new tokens change its item-as-prefix scores to exactly what a server started
    on a catalog file that already holds the new item gives."""
    live = own_server
    user, cands = [31, 32, 33, 34], ["k0", "k1", "k2"]
    old = [{"id": f"k{k}", "token_ids": [300 + k, 301 + k], "id_token": 20 + k, "semantic_id": [4, 4, k]}
           for k in range(3)]
    assert post(live, "/v1/catalog/items", {"items": old}).status_code == 200
    before = rank(live, user, cands)  # k0's KV is in the item store now
    new = {"id": "k0", "token_ids": [401, 402, 403, 404], "id_token": 12, "semantic_id": [4, 4, 0]}
    assert post(live, "/v1/catalog/items", {"items": [new]}).status_code == 200
    got = rank(live, user, cands)
    assert got["meta_info"]["prefix"] == "item" and got["ranking"] != before["ranking"]
    fresh_catalog = files["dir"] / "fresh.jsonl"
    with open(fresh_catalog, "w") as f:
        for row in [new, *old[1:], {"id": "x", "token_ids": [5], "semantic_id": [0, 0, 0]}]:
            f.write(json.dumps(row) + "\n")
    fresh = start_server(model, *FLAGS, "--item-catalog", str(fresh_catalog), "--api-key", KEY)
    want = rank(fresh, user, cands)
    assert want["meta_info"]["prefix"] == "item"
    # ARCHITECTURE.md's invariant 1: reused KV (k1, k2 from the item store) equals recomputed KV within 1e-5,
    # and so do these softmax scores (stale KV of k0's old tokens moves them by ~1e-1)
    assert {x["item"]: x["score"] for x in got["ranking"]} == pytest.approx(
        {x["item"]: x["score"] for x in want["ranking"]}, abs=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: bfloat16 where the CPU has avx512_bf16 / AMX
def test_the_forward_leaves_a_thread_to_updates_while_they_arrive(start_server, model, files, dtype):
    """--catalog-update-cores 1 (the default) with a 2-thread forward: the scheduler's forward runs on
    one thread while update requests arrive, rejected or accepted, and on two again once they stop
    (observed in /server_info); retrieval then serves the last version."""
    srv = start_server(model, *FLAGS, "--item-catalog", files["catalog"], "--catalog-journal", files["journal"],
                       "--cpu-threads", "2", "--dtype", dtype)

    def threads():
        return httpx.get(srv.url + "/server_info", timeout=60).json()["internal_states"][0]["forward_threads"]

    def updates_until_one_thread(item, status: int) -> int:
        for n in range(1, 41):
            r = httpx.post(srv.url + "/v1/catalog/items", json={"items": [item(n)]}, timeout=120)
            assert r.status_code == status, r.text
            if threads() == 1:
                return n
        pytest.fail("the forward kept 2 threads while updates arrived")

    wait_for(lambda: threads() == 2, "a 2-thread forward before any update")
    # rejected ones too: their bodies were parsed and validated beside the steps
    updates_until_one_thread(lambda n: {"id": f"t{n}", "token_ids": "not a list"}, 400)
    wait_for(lambda: threads() == 2, "every thread again after the rejected updates")
    n = updates_until_one_thread(lambda n: {"id": f"t{n}", "token_ids": [40 + n], "id_token": 7,
                                            "semantic_id": [n % 3, 1, 2]}, 200)
    wait_for(lambda: threads() == 2, "every thread again after the updates")
    r = retrieve(srv, [5, 6, 7])
    assert r["meta_info"]["catalog_version"] == n and r["items"]


def test_every_data_parallel_rank_serves_the_acknowledged_version(start_server, model, tmp_path):
    """--dp-size 2: an update is applied on both ranks before it is acknowledged; requests pinned to
    either rank (routing_key) see it, and both rank a replaced item alike (item KV from its owner
    or recomputed, never the old tokens')."""
    import zlib

    cat = write_catalog(tmp_path / "catalog.jsonl", n=30, semantic=True)
    srv = start_server(model, *FLAGS, "--item-catalog", cat, "--dp-size", "2")
    keys = {zlib.crc32(k.encode()) % 2: k for k in ("alice", "bob", "carol", "dave")}
    assert set(keys) == {0, 1}

    def on(rank_, path, body):
        r = httpx.post(srv.url + path, json={**body, "routing_key": keys[rank_]}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    user = {"token_ids": [9, 10, 11]}
    before = [on(k, "/v1/rank", {"user": user, "items": ["i0", "i1", "i2"], "prefix": "item"}) for k in (0, 1)]
    top = next(it["item"] for it in on(0, "/v1/retrieve", {"user": user, "beam_width": 8, "num_items": 8})["items"]
               if it["item"] not in ("i0", "i1", "i2"))
    assert httpx.post(srv.url + "/v1/catalog/items", json={"items": [
        {"id": "i0", "token_ids": [200, 201, 202], "id_token": 3, "semantic_id": [0, 0, 0]}]}).json()["version"] == 1
    assert httpx.post(srv.url + "/v1/catalog/delete", json={"ids": [top]}).json()["version"] == 2
    for k in (0, 1):
        got = on(k, "/v1/retrieve", {"user": user, "beam_width": 8, "num_items": 8})
        assert got["meta_info"]["catalog_version"] == 2 and top not in {it["item"] for it in got["items"]}
    after = [on(k, "/v1/rank", {"user": user, "items": ["i0", "i1", "i2"], "prefix": "item"}) for k in (0, 1)]
    scores = [{x["item"]: x["score"] for x in a["ranking"]} for a in after]
    assert scores[0] == pytest.approx(scores[1], abs=1e-5)
    assert scores[0] != pytest.approx({x["item"]: x["score"] for x in before[0]["ranking"]}, abs=1e-4)
    # one trie per version for both ranks (sgrec.catalog.image.shared): each rank maps the files of
    # version 2's, and they are the only trie files left in the catalog image
    import psutil

    from sgrec.catalog import image

    mapped = [{m.path for m in p.memory_maps() if image.PREFIX in m.path and not m.path.endswith("(deleted)")}
              for p in psutil.Process(srv.pid).children(recursive=True)]
    tries = [{os.path.dirname(f) for f in m if "/trie-" in f} for m in mapped]
    tries = [t for t in tries if t]
    assert len(tries) == 2 and tries[0] == tries[1] and len(tries[0]) == 1
    (folder,) = tries[0]
    assert os.path.basename(folder).startswith("trie-v2-")
    assert [n for n in os.listdir(os.path.dirname(folder)) if n.startswith("trie-")] == [os.path.basename(folder)]
