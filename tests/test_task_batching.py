"""Rank / retrieve requests batched inside the scheduler (xGR §7): token budget, wait quota,
aborts, and batched results equal to one-by-one results."""

import random
import time

import pytest

from sgrec import Engine
from sgrec.managers.rec import build_rank_task, build_retrieve_task
from tests.test_rec_server import write_catalog


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def sem_catalog(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("semcat") / "catalog.jsonl", n=27, seed=1, semantic=True)


def engine(model, catalog, **kw) -> tuple[Engine, FakeClock]:
    e = Engine(model, device="cpu", dtype="float32", max_total_tokens=4096, item_catalog=catalog, **kw)
    clock = FakeClock()
    e.scheduler.clock = clock
    return e, clock


def retrieve_msg(e: Engine, rid: str, ids: list[int], bw: int = 8, n: int = 5):
    return build_retrieve_task({"rid": rid, "user": {"id": rid, "token_ids": ids}, "beam_width": bw,
                                "num_items": n}, e.tokenizer, e.builder, 512)


def test_retrieve_batch_waits_its_quota_then_runs_together(model, sem_catalog):
    e, clock = engine(model, sem_catalog, batch_wait_ms=50)
    sched = e.scheduler
    users = {f"r{k}": list(range(40 + k, 70 + 3 * k)) for k in range(3)}
    tasks = [sched.add_task(retrieve_msg(e, rid, ids)) for rid, ids in users.items()]
    clock.t = 0.049
    assert sched.step() == [] and sched.tasks.batches_run == 0
    assert sched.idle_wait() == pytest.approx(0.001)
    clock.t = 0.050
    done = sched.step()
    assert {t.rid for t in done} == set(users) and sched.tasks.batches_run == 1
    assert all(t.result["meta_info"]["batch_size"] == 3 for t in tasks)
    # the same requests one at a time, from a cold cache: equal items and order, scores within 1e-4
    sched.clock = time.monotonic
    sched.flush_cache()
    for t in tasks:
        alone = e.retrieve({"id": t.rid, "token_ids": users[t.rid]}, beam_width=8, num_items=5)
        assert alone["meta_info"]["batch_size"] == 1
        assert [x["item"] for x in alone["items"]] == [x["item"] for x in t.result["items"]]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(alone["items"], t.result["items"])) <= 1e-4
        sched.flush_cache()
    e.check_memory()


def test_full_batch_runs_without_waiting_and_budget_holds(model, sem_catalog):
    # each request: 30 prompt tokens + 8 beams x 2 levels = 46 tokens; a budget of 100 holds two
    e, clock = engine(model, sem_catalog, batch_wait_ms=1000, max_batch_tokens=100)
    sched = e.scheduler
    for k in range(3):
        sched.add_task(retrieve_msg(e, f"r{k}", list(range(100 + k, 130 + k))))
    done = sched.step()  # the third request does not fit next to the first two: they go now
    assert [t.rid for t in done] == ["r0", "r1"]
    assert sched.step() == [] and len(sched.tasks) == 1  # r2 waits its quota
    clock.t = 1.0
    assert [t.rid for t in sched.step()] == ["r2"]
    e.check_memory()


def test_abort_of_a_queued_task(model, sem_catalog):
    e, clock = engine(model, sem_catalog, batch_wait_ms=10)
    sched = e.scheduler
    a = sched.add_task(retrieve_msg(e, "a", list(range(5, 25))))
    sched.add_task(retrieve_msg(e, "b", list(range(6, 26))))
    assert sched.abort("a", "client went away") is a
    assert a.finish_reason["type"] == "abort" and len(sched.tasks) == 1
    assert sched.tasks.batcher.queued_tokens("retrieve") == 20 + 8 * 2
    clock.t = 0.01
    assert [t.rid for t in sched.step()] == ["b"]
    assert sched.abort("b") is None  # finished: nothing to abort
    e.check_memory()


def test_wait_never_exceeds_quota_plus_one_tick(model, tmp_path):
    """Random arrivals of rank requests, one scheduler step per tick: every request finishes at most
    quota + tick after it arrived, no batch exceeds the token budget, none is lost."""
    catalog = write_catalog(tmp_path / "cat.jsonl", n=30, seed=2)
    quota, tick, budget = 0.02, 0.005, 120
    e, clock = engine(model, catalog, batch_wait_ms=quota * 1000, max_batch_tokens=budget)
    sched = e.scheduler
    rng = random.Random(0)
    items = [f"i{k}" for k in range(30)]
    arrivals, finished, batches = {}, {}, []
    poll = sched.tasks.batcher.poll
    sched.tasks.batcher.poll = lambda now: batches.extend(out := poll(now)) or out  # records every batch
    t, next_tick = 0.0, tick
    for k in range(40):
        t += rng.choice([0.0, 0.001, 0.004, 0.012])
        while next_tick <= t:  # the steps before the next arrival, one per tick
            clock.t, next_tick = next_tick, next_tick + tick
            for task in sched.step():
                finished[task.rid] = clock.t
        clock.t = t
        obj = {"rid": f"q{k}", "user": {"id": f"u{k % 5}", "token_ids": list(range(10, 10 + rng.randint(3, 30)))},
               "items": rng.sample(items, rng.randint(2, 8))}
        msg = build_rank_task(obj, e.tokenizer, e.builder, 100)
        sched.add_task(msg)
        arrivals[msg.rid] = t
    while sched.has_work():
        clock.t, next_tick = next_tick, next_tick + tick
        for task in sched.step():
            finished[task.rid] = clock.t
    assert set(finished) == set(arrivals)
    assert max(finished[r] - arrivals[r] for r in arrivals) <= quota + tick + 1e-9
    assert max(b.num_tokens for b in batches) <= budget and len(batches) > 5
    assert sorted(it.rid for b in batches for it in b.items) == sorted(arrivals)
    e.check_memory()


def test_server_batches_concurrent_retrieves(start_server, model, sem_catalog):
    """Concurrent /v1/retrieve and /v1/rank calls on a real server wait their quota and run as one
    batch per kind; each answer equals the same request's answer alone."""
    from concurrent.futures import ThreadPoolExecutor

    srv = start_server(model, "--max-total-tokens", "4096", "--item-catalog", sem_catalog, "--batch-wait-ms", "400")
    bodies = [{"user": {"id": f"u{k}", "token_ids": list(range(30 + k, 60 + 2 * k))}, "beam_width": 8,
               "num_items": 4} for k in range(4)]
    ranks = [{"user": {"id": f"u{k}", "token_ids": list(range(30 + k, 60 + 2 * k))},
              "items": [f"i{j}" for j in range(k, k + 6)]} for k in range(4)]

    def post(args):
        route, body = args
        r = srv.client.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(post, [("/v1/retrieve", b) for b in bodies] + [("/v1/rank", b) for b in ranks]))
    sizes = [out["meta_info"]["batch_size"] for out in together]
    assert max(sizes[:4]) >= 2 and max(sizes[4:]) >= 2  # 400 ms is far longer than the arrival spread
    assert srv.client.post("/flush_cache").status_code == 200
    for args, got in zip([("/v1/retrieve", b) for b in bodies] + [("/v1/rank", b) for b in ranks], together):
        alone = post(args)
        assert alone["meta_info"]["batch_size"] == 1
        key = "items" if args[0] == "/v1/retrieve" else "ranking"
        assert [x["item"] for x in alone[key]] == [x["item"] for x in got[key]]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(alone[key], got[key])) <= 1e-4
        assert srv.client.post("/flush_cache").status_code == 200


def test_rank_retrieve_stream_cannot_starve_prompts(model, sem_catalog):
    """Due rank / retrieve batches go first, but never twice in a row while a prefill-only (score)
    request waits."""
    from sgrec.managers.io_struct import TokenizedGenerateReq
    from sgrec.sampling import SamplingParams

    e, clock = engine(model, sem_catalog, batch_wait_ms=0)
    sched = e.scheduler
    wire = {**SamplingParams().to_wire(), "max_new_tokens": 0}
    score = sched.add_request(TokenizedGenerateReq(rid="s", input_ids=list(range(3, 40)), sampling_params=wire))
    sched.add_task(retrieve_msg(e, "r0", list(range(5, 25))))
    assert [t.rid for t in sched.step()] == ["r0"]
    sched.add_task(retrieve_msg(e, "r1", list(range(6, 26))))  # due at once, but the score waited a batch
    assert [r.rid for r in sched.step()] == ["s"] and score.finished
    assert [t.rid for t in sched.step()] == ["r1"]
    e.check_memory()
