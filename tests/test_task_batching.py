"""Rank / retrieve requests batched inside the scheduler (xGR §7): token budget, wait quota,
aborts, batched results equal to one-by-one results, and retrieve rounds of several batches
advanced a phase at a time in turn."""

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
    kw = {"dtype": "float32", "max_total_tokens": 4096, **kw}
    e = Engine(model, device="cpu", item_catalog=catalog, **kw)
    clock = FakeClock()
    e.scheduler.clock = clock
    return e, clock


def drive(sched, rids, limit: int = 200) -> tuple[int, dict[str, int]]:
    """Steps until every task in rids has finished; returns the steps taken and the step at which
    each finished (limit: steps, never time, after which the test fails)."""
    finished, n = {}, 0
    while not set(rids) <= set(finished):
        n += 1
        assert n <= limit, f"unfinished after {limit} steps: {set(rids) - set(finished)}"
        for t in sched.step():
            finished[t.rid] = n
    return n, finished


def retrieve_msg(e: Engine, rid: str, ids: list[int], bw: int = 8, n: int = 5):
    return build_retrieve_task({"rid": rid, "user": {"id": rid, "token_ids": ids}, "beam_width": bw,
                                "num_items": n}, e.tokenizer, e.builder, 512)


@pytest.mark.parametrize("interleave", [False, True])
def test_retrieve_batch_waits_its_quota_then_runs_together(model, sem_catalog, interleave):
    e, clock = engine(model, sem_catalog, batch_wait_ms=50, interleave_rounds=interleave)
    sched = e.scheduler
    users = {f"r{k}": list(range(40 + k, 70 + 3 * k)) for k in range(3)}
    tasks = [sched.add_task(retrieve_msg(e, rid, ids)) for rid, ids in users.items()]
    clock.t = 0.049
    assert sched.step() == [] and sched.tasks.batches_run == 0
    assert sched.idle_wait() == pytest.approx(0.001)
    clock.t = 0.050
    steps, finished = drive(sched, users)  # interleaved: one step a phase (the prefill, each beam level)
    assert steps == (sched.retriever.trie.depth if interleave else 1) and set(finished.values()) == {steps}
    assert sched.tasks.batches_run == 1
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


@pytest.mark.parametrize("interleave", [False, True])
def test_full_batch_runs_without_waiting_and_budget_holds(model, sem_catalog, interleave):
    # each request: 30 prompt tokens + 8 beams x 2 levels = 46 tokens; a budget of 100 holds two
    e, clock = engine(model, sem_catalog, batch_wait_ms=1000, max_batch_tokens=100, interleave_rounds=interleave)
    sched = e.scheduler
    for k in range(3):
        sched.add_task(retrieve_msg(e, f"r{k}", list(range(100 + k, 130 + k))))
    steps, finished = drive(sched, ["r0", "r1"])  # the third request does not fit next to the first two
    assert finished == {"r0": steps, "r1": steps} and len(sched.tasks) == 1  # r2 waits its quota
    assert sched.step() == [] and not sched.tasks.in_flight
    clock.t = 1.0
    assert drive(sched, ["r2"])[0] == steps and sched.tasks.batches_run == 2
    e.check_memory()


@pytest.mark.parametrize("interleave", [False, True])
def test_abort_of_a_queued_task(model, sem_catalog, interleave):
    e, clock = engine(model, sem_catalog, batch_wait_ms=10, interleave_rounds=interleave)
    sched = e.scheduler
    a = sched.add_task(retrieve_msg(e, "a", list(range(5, 25))))
    sched.add_task(retrieve_msg(e, "b", list(range(6, 26))))
    assert sched.abort("a", "client went away") is a
    assert a.finish_reason["type"] == "abort" and len(sched.tasks) == 1
    assert sched.tasks.batcher.queued_tokens("retrieve") == 20 + 8 * 2
    clock.t = 0.01
    if interleave:
        assert sched.step() == [] and sched.tasks.in_flight  # b's round is under way
        assert sched.abort("b") is None  # under way: its answer is on its way
    drive(sched, ["b"])
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


@pytest.mark.parametrize("flags", [(), ("--interleave-rounds",)], ids=["whole", "interleaved"])
def test_server_batches_concurrent_retrieves(start_server, model, sem_catalog, flags):
    """Concurrent /v1/retrieve and /v1/rank calls on a real server wait their quota and run as one
    batch per kind; each answer equals the same request's answer alone."""
    from concurrent.futures import ThreadPoolExecutor

    srv = start_server(model, "--max-total-tokens", "4096", "--item-catalog", sem_catalog, "--batch-wait-ms", "400",
                       *flags)
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
    e, clock = engine(model, sem_catalog, batch_wait_ms=0)
    sched = e.scheduler
    score = sched.add_request(score_msg("s"))
    sched.add_task(retrieve_msg(e, "r0", list(range(5, 25))))
    assert [t.rid for t in sched.step()] == ["r0"]
    sched.add_task(retrieve_msg(e, "r1", list(range(6, 26))))  # due at once, but the score waited a batch
    assert [r.rid for r in sched.step()] == ["s"] and score.finished
    assert [t.rid for t in sched.step()] == ["r1"]
    e.check_memory()


def test_interleaved_rounds_cannot_starve_prompts(model, sem_catalog):
    """Interleaved, the phases of the batches under way go first too, but never twice in a row while
    a prefill-only (score) request waits."""
    e, clock = engine(model, sem_catalog, batch_wait_ms=0, interleave_rounds=True)
    sched = e.scheduler
    assert sched.retriever.trie.depth == 3  # a round: prefill, level 1, level 2 (and the results)
    score = sched.add_request(score_msg("s"))
    sched.add_task(retrieve_msg(e, "r0", list(range(5, 25))))
    assert sched.step() == [] and sched.tasks.in_flight  # r0's prefill
    assert [r.rid for r in sched.step()] == ["s"] and score.finished  # the score waited one phase
    assert sched.step() == []  # r0's level 1, then, with nothing else waiting, its level 2
    assert [t.rid for t in sched.step()] == ["r0"]
    e.check_memory()


def score_msg(rid: str):
    """A prefill-only (score) request."""
    from sgrec.managers.io_struct import TokenizedGenerateReq
    from sgrec.sampling import SamplingParams

    wire = {**SamplingParams().to_wire(), "max_new_tokens": 0}
    return TokenizedGenerateReq(rid=rid, input_ids=list(range(3, 40)), sampling_params=wire)


def recorded_batches(sched) -> list[tuple[list[dict], list[int]]]:
    """Records each retrieve batch the queue starts: its payloads and what each of its phases
    yielded (-1: it waited for another batch's round to release the pool)."""
    out = []
    kind = sched.tasks.kinds["retrieve"]
    run = kind.run_steps

    def steps(payloads: list[dict]):
        phases, it = [], run(payloads)
        out.append((payloads, phases))
        while True:
            try:
                phases.append(next(it))
            except StopIteration as end:
                return end.value
            yield phases[-1]

    kind.run_steps = steps
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batches_under_way_interleave_and_equal_each_batch_run_alone(model, sem_catalog, dtype):
    """Retrieve batches that fall due while others are under way start at once and advance a phase
    per step in turn; on a pool too small for all of them, a batch waits (holding nothing) for one
    under way to end. No task is lost, the pool balances after, and every task's items (scores
    included) equal, bit for bit, those of its batch run alone on a cold cache (a batch of one
    request here, so its round is the same rows either way)."""
    # 31-46 prompt tokens + 4 or 8 beams x 2 levels: never two requests in a 76-token batch
    e, clock = engine(model, sem_catalog, batch_wait_ms=0, max_batch_tokens=76, max_total_tokens=256, dtype=dtype,
                      interleave_rounds=True)
    sched = e.scheduler
    batches = recorded_batches(sched)
    rng = random.Random(3)
    rids, tasks, most, finished = [], {}, 0, []
    for k in range(12):  # one to four requests each step; prompts with distinct first tokens share no prefix
        for j in range(rng.choice([1, 1, 2, 4])):
            rid = f"r{k}_{j}"
            ids = [10 + 4 * k + j] + [rng.randrange(3, 500) for _ in range(rng.randint(30, 45))]
            tasks[rid] = sched.add_task(retrieve_msg(e, rid, ids, bw=rng.choice([4, 8]), n=4))
            rids.append(rid)
        finished += [t.rid for t in sched.step()]
        most = max(most, len(sched.tasks.running))
    finished += drive(sched, set(rids) - set(finished))[1]
    assert sorted(finished) == sorted(rids)
    assert most >= 2 and any(-1 in phases for _, phases in batches)  # interleaved, and some batch waited
    assert sorted(rid for ps, _ in batches for rid in ps_rids(ps, tasks)) == sorted(rids)  # each ran once
    assert {len(ps) for ps, _ in batches} == {1}
    e.check_memory()
    assert sched.retriever.rounds_under_way == 0
    for payloads, _ in batches:
        sched.flush_cache()
        alone = sched.retriever.run_batch(payloads)
        for rid, want in zip(ps_rids(payloads, tasks), alone):
            assert tasks[rid].result["items"] == want.items, rid
    e.check_memory()


def ps_rids(payloads: list[dict], tasks: dict) -> list[str]:
    """The rids of a batch's payloads (each task's payload is the very dict its batch got)."""
    by_id = {id(t.msg.payload): rid for rid, t in tasks.items()}
    return [by_id[id(p)] for p in payloads]


def test_a_catalog_commit_waits_for_the_batches_under_way_and_starts_none_meanwhile(model, sem_catalog):
    """Interleaved, a queued commit is due only once no batch is under way; meanwhile a due batch
    stays queued. The batch under way answers from the version it started on; the one after from
    the new one."""
    e, clock = engine(model, sem_catalog, batch_wait_ms=0, interleave_rounds=True)
    sched = e.scheduler
    a = sched.add_task(retrieve_msg(e, "a", list(range(5, 25))))
    assert sched.step() == [] and sched.tasks.in_flight
    gone = ["i0", "i1", "i2", "i3", "i4", "i5", "i6", "i7", "i8"]  # every item under the first code
    prepared = sched.prepare_catalog({"version": 1, "op": "delete", "ids": gone})
    sched.queue_commit("u1", prepared)
    b = sched.add_task(retrieve_msg(e, "b", list(range(6, 26))))
    assert sched.due_commits() == []
    while sched.tasks.in_flight:
        sched.step()
        assert "b" in sched.tasks.queued and sched.tasks.batches_run == 1  # held back
    assert a.finished and a.result["meta_info"]["catalog_version"] == 0
    assert [uid for uid, _ in sched.due_commits()] == ["u1"] and sched.due_commits() == []
    sched.commit_catalog(*prepared)
    drive(sched, ["b"])
    assert b.result["meta_info"]["catalog_version"] == 1
    assert b.result["items"] and not {it["item"] for it in b.result["items"]} & set(gone)
    e.check_memory()


def test_abort_all_ends_the_batches_under_way_and_frees_their_kv(model, sem_catalog):
    """abort_all (a failed batch, a pause that aborts) ends the tasks of the batches under way too:
    each reported once, its round closed and its KV back in the pool."""
    e, clock = engine(model, sem_catalog, batch_wait_ms=0, max_batch_tokens=60,  # 47 tokens a request
                      interleave_rounds=True)
    sched = e.scheduler
    for k in range(3):
        sched.add_task(retrieve_msg(e, f"r{k}", [40 + k] + list(range(100, 130))))
    sched.step()
    assert len(sched.tasks.running) == 3 and sched.retriever.rounds_under_way == 3  # a batch each
    ended = sched.abort_all("server stopping", 503)
    assert sorted(t.rid for t in ended) == ["r0", "r1", "r2"]
    assert all(t.finish_reason["status_code"] == 503 for t in ended)
    assert sched.retriever.rounds_under_way == 0 and not sched.has_work()
    e.check_memory()
