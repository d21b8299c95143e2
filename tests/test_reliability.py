"""Reliability and security: authentication on every route, hostile sampling values,
malformed internal messages, failed batches, client disconnects mid-prefill / mid-stream /
mid-beam, a killed scheduler among several, overload, a bad catalog. Every fault test ends with
the leak checks: all KV slots free after drain, the same processes alive, no growing thread count.
"""

import json
import multiprocessing as mp
import threading
import time

import httpx
import psutil
import pytest
import zmq

from sgrec import demo
from sgrec.managers import io_struct as io
from sgrec.sampling import SamplingParams
from sgrec.server_args import ServerArgs
from sgrec.tools.probe import (HANG_S, Departing, alive, kv_after_drain, kv_state, pause_in_place, paused_in_place, proc_tree,
                               running_per_rank, wait_for)

GREEDY = {"temperature": 0, "ignore_eos": True}
THREAD_SLACK = 4  # uvicorn / asyncio helper threads may come and go


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def long_model(tiny_model_dir):
    """The tiny Llama with a 65,536-token context: a request of 60,000 new tokens runs far longer than
    any test waits, so a state built from such requests lasts until the test itself ends it."""
    return tiny_model_dir("llama", max_position_embeddings=LONG_CONTEXT)


LONG_CONTEXT, LONG_NEW = 65536, 60000


@pytest.fixture(scope="module")
def shared(start_server, model):
    """One plain server for the tests that need no special flags (each takes its own leak baseline)."""
    return start_server(model, "--max-total-tokens", "8192")


def warm(srv, n=4):
    """A few requests so lazily started threads exist before a leak baseline is taken."""
    for _ in range(n):
        r = srv.client.post("/generate", json={"text": "warm", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200


def assert_no_leaks(srv, before):
    """All KV free after drain; the same processes, all alive; no more threads than before."""
    kv = kv_after_drain(srv.client)
    assert kv.empty, kv
    after = proc_tree(srv.proc.pid)
    assert sorted(after.pids) == sorted(before.pids), (before.pids, after.pids)
    assert after.threads <= before.threads + THREAD_SLACK, (before.threads, after.threads)


# ---- authentication ----------------------------------------------------------------------------
def test_api_key_on_every_route_of_the_openapi_document(start_server, model):
    key = "k-" + "7" * 30
    srv = start_server(model, "--max-total-tokens", "1024", "--api-key", key, "--enable-metrics")
    auth = {"Authorization": f"Bearer {key}"}
    doc = srv.client.get("/openapi.json", headers=auth).json()
    assert srv.client.get("/openapi.json").status_code == 401
    open_paths = {"/health", "/health_generate", "/ready", "/metrics"}
    checked = 0
    for path, ops in doc["paths"].items():
        url = path.replace("{model_id}", "whatever")
        for method in ops:
            for headers in ({}, {"Authorization": "Bearer " + "x" * len(key)}, {"Authorization": key},
                            {"Authorization": f"bearer {key}"}):
                r = srv.client.request(method.upper(), url, headers=headers, json={})
                if path in open_paths:
                    assert r.status_code != 401, (method, path)
                else:
                    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (method, path, r.text)
            checked += 1
    assert checked >= 19
    # prefixes of the open paths are not open
    assert srv.client.get("/healthz").status_code == 401 and srv.client.get("/metrics/x").status_code == 401
    info = srv.client.get("/server_info", headers=auth).json()
    assert info["api_key"] is None and key not in json.dumps(info) and "<redacted>" in info["launch_command"]
    r = srv.client.post("/generate", headers=auth, json={"text": "a", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200
    assert key not in srv.read_log()


# ---- hostile values: no NaN reaches the sampler, no batch fails -----------------------------------
HOSTILE = [
    {"repetition_penalty": 1e-300},
    {"temperature": 1e300, "min_new_tokens": 2},
    {"temperature": 1e-5, "logit_bias": {"5": -3e38, "6": 3e38}},
    {"temperature": 0.5, "logit_bias": {"5": 3e38}},
    {"min_new_tokens": 3, "stop_token_ids": "ALL"},  # every token banned until min_new_tokens
    {"top_p": 5e-324, "top_k": 1, "min_p": 1.0},
    {"sampling_seed": 18446744073709551615},
]


def test_hostile_sampling_values_neither_fail_the_batch_nor_hang(shared, model):
    srv = shared
    warm(srv)
    before = proc_tree(srv.proc.pid)
    with open(f"{model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    bystander_body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 30, **GREEDY}}
    expected = srv.client.post("/generate", json=bystander_body).json()["output_ids"]
    results = {}

    def one(i, sp):
        if sp.get("stop_token_ids") == "ALL":
            sp = {**sp, "stop_token_ids": list(range(vocab))}
        r = httpx.post(srv.url + "/generate", timeout=60,
                       json={"input_ids": [9, 10, 11], "sampling_params": {"max_new_tokens": 3, **sp}})
        results[i] = (r.status_code, r.json())

    def bystander():
        results["bystander"] = httpx.post(srv.url + "/generate", json=bystander_body, timeout=60).json()

    threads = [threading.Thread(target=one, args=(i, sp)) for i, sp in enumerate(HOSTILE)]
    threads.append(threading.Thread(target=bystander))
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    for i in range(len(HOSTILE)):
        code, body = results[i]
        assert code == 200 and len(body["output_ids"]) == 3, (HOSTILE[i], body)
    assert results["bystander"]["output_ids"] == expected  # batched with the hostile ones, unharmed
    assert "Traceback" not in srv.read_log()
    assert_no_leaks(srv, before)


# ---- malformed messages on the internal sockets -------------------------------------------------
def tokenizer_socket(launcher_pid: int) -> str:
    """The ipc path the launcher's TokenizerManager pulls scheduler outputs from."""
    paths = {c.laddr for c in psutil.Process(launcher_pid).net_connections(kind="unix") if c.laddr}
    (path,) = [p for p in paths if p.endswith("/tokenizer")]
    return "ipc://" + path


GARBAGE = [
    b"\xff\xfe not json",
    b"[1, 2, 3]",
    b'{"type": "Pickle", "data": "gASVAAAA"}',
    b'{"type": "BatchReqOutput", "outputs": 5}',
    b'{"type": "BatchReqOutput", "outputs": [{"rid": "nobody", "new_output_ids": "abc"}]}',
    b'{"type": "BatchReqOutput", "outputs": [{"rid": "nobody", "new_output_ids": [1, 2]}]}',
    b'{"type": "SchedulerStats", "dp_rank": 99, "num_running_reqs": 0, "num_queue_reqs": 0, "token_usage": 0,'
    b' "kv_used": 0, "kv_total": 1, "kv_cached": 0, "last_gen_throughput": 0}',
    b'{"type": "FlushCacheResult", "success": true}',
    b'{"type": "SchedulerReady", "dp_rank": 0, "max_total_num_tokens": 1, "context_len": 1, "vocab_size": 1,'
    b' "max_input_len": 1}',
]


def test_malformed_messages_to_the_tokenizer_manager_are_dropped(shared):
    srv = shared
    warm(srv)
    before = proc_tree(srv.proc.pid)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(tokenizer_socket(srv.proc.pid))
    try:
        for data in GARBAGE:
            sock.send(data)
        wait_for(lambda: srv.read_log().count("dropped a malformed message from a scheduler") == 5
                 and "dropped an unexpected SchedulerReady message" in srv.read_log(), "the 6 drops logged")
        r = srv.client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, **GREEDY}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
        assert srv.client.get("/health").status_code == 200
    finally:
        sock.close(0)
        ctx.term()
    log = srv.read_log()
    assert log.count("dropped a malformed message from a scheduler") == 5
    assert "dropped an unexpected SchedulerReady message" in log
    assert_no_leaks(srv, before)


class SchedulerHarness:
    """A real scheduler process (run_scheduler_process, spawned) on sockets this test binds, as the
    TokenizerManager binds them."""

    def __init__(self, model_path: str, tmp_path, **kw):
        from sgrec.scheduler.process import run_scheduler_process

        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        in_addr, out_addr = f"ipc://{tmp_path}/sched-in", f"ipc://{tmp_path}/sched-out"
        self.push.bind(in_addr)
        self.pull.bind(out_addr)
        args = ServerArgs(model_path=model_path, device="cpu", dtype="float32", max_total_tokens=1024, **kw)
        self.proc = mp.get_context("spawn").Process(target=run_scheduler_process,
                                                    args=(args.to_dict(), 0, in_addr, out_addr, None), daemon=True)
        self.proc.start()
        self.ready = self.next_of(io.SchedulerReady, timeout=180)

    def next_of(self, cls, timeout=HANG_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pull.poll(200):
                msg = io.decode(self.pull.recv())
                if isinstance(msg, cls):
                    return msg
            assert self.proc.is_alive(), f"scheduler died with exit code {self.proc.exitcode}"
        raise TimeoutError(cls.__name__)

    def outputs_until_finished(self, rids: set[str], timeout=HANG_S) -> dict[str, io.ReqOutput]:
        done: dict[str, io.ReqOutput] = {}
        deadline = time.monotonic() + timeout
        while set(done) != rids:
            assert time.monotonic() < deadline, f"no end for {rids - set(done)}"
            msg = self.next_of(io.BatchReqOutput, timeout=deadline - time.monotonic())
            for out in msg.outputs:
                if out.finish_reason is not None:
                    done[out.rid] = out
        return done

    def send(self, msg):
        self.push.send(io.encode(msg) if not isinstance(msg, bytes) else msg)

    def close(self):
        self.proc.terminate()
        self.proc.join(10)
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


def gen(rid, ids, max_new=3):
    return io.TokenizedGenerateReq(rid=rid, input_ids=ids,
                                   sampling_params={**SamplingParams(max_new_tokens=max_new).to_wire(),
                                                    "temperature": 0.0, "ignore_eos": True})


def test_scheduler_process_drops_malformed_messages(model, tmp_path):
    h = SchedulerHarness(model, tmp_path)
    try:
        vocab = h.ready.vocab_size
        for data in [b"\x00\x01", b'{"type": "TokenizedGenerateReq", "rid": "t", "input_ids": 5, "sampling_params": {}}',
                     b'{"type": "AbortReq", "rid": ["x"]}', b'{"type": "FlushCacheReq", "extra": 1}',
                     b'{"type": "TaskReq", "rid": "t2", "kind": "rank", "input_ids": [1], "payload": []}',
                     b'{"type": "ReqOutput", "rid": "x", "new_output_ids": []}',
                     io.encode(io.AbortReq("nobody"))]:
            h.send(data)
        # well-typed but impossible: an unknown task kind (400), an out-of-vocabulary token (the batch
        # fails inside the model: a 500 for it alone), sampling params the scheduler cannot build
        h.send(io.TaskReq(rid="k", kind="nope", input_ids=[1], payload={}))
        h.send(gen("oov", [5, vocab + 10]))
        h.send(io.TokenizedGenerateReq(rid="sp", input_ids=[5], sampling_params={"bogus": 1}))
        outs = h.outputs_until_finished({"k", "oov", "sp"})
        assert outs["k"].finish_reason["status_code"] == 400
        assert outs["oov"].finish_reason == io.abort_reason("Internal error while running the batch", 500)
        assert outs["sp"].finish_reason["status_code"] == 400
        h.send(gen("ok", [5, 6, 7], max_new=4))
        ok = h.outputs_until_finished({"ok"})["ok"]
        assert ok.finish_reason == {"type": "length", "length": 4}
        h.send(io.FlushCacheReq())
        assert h.next_of(io.FlushCacheResult).success is True
        # the stats reports after the flush result (periodic: the first one may be older) end idle and empty
        stats = wait_for(lambda: (st := h.next_of(io.SchedulerStats)).kv_used == 0 and st.num_queue_reqs == 0
                         and st.num_running_reqs == 0 and st, "an idle, empty stats report")
        assert stats.kv_used == 0
        assert h.proc.is_alive()
    finally:
        h.close()


def test_failed_batch_ends_every_request_and_returns_its_kv(model, tmp_path, monkeypatch):
    """A batch that raises (here: an injected fault in the model's forward) ends the requests it had
    taken out of the queues with a 500 (none hangs), and its KV slots come back to the pool."""
    from sgrec.scheduler.process import SchedulerLoop

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{tmp_path}/in")
    pull.bind(f"ipc://{tmp_path}/out")
    loop = SchedulerLoop(ServerArgs(model_path=model, device="cpu", dtype="float32", max_total_tokens=1024), 0,
                         f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    try:
        alloc = loop.runner.kv_pool.allocator
        for rid in ("a", "b"):
            loop.handle(gen(rid, list(range(10, 60)), max_new=5))
        real_hidden = loop.runner.hidden  # every forward of a generate batch runs the model through it

        def broken(*a, **k):
            raise RuntimeError("injected fault")

        monkeypatch.setattr(loop.runner, "hidden", broken)
        loop.step()
        msg = None
        while not isinstance(msg, io.BatchReqOutput):
            msg = io.decode(pull.recv())
        assert sorted(o.rid for o in msg.outputs) == ["a", "b"]
        assert all(o.finish_reason == io.abort_reason("Internal error while running the batch", 500)
                   for o in msg.outputs)
        assert loop.live == {} and not loop.scheduler.has_work()
        assert alloc.available_size() == alloc.size  # the prefill's slots were reclaimed
        monkeypatch.setattr(loop.runner, "hidden", real_hidden)
        loop.handle(gen("c", [5, 6, 7], max_new=3))
        for _ in range(20):
            loop.step()
            if not loop.scheduler.has_work():
                break
        assert not loop.scheduler.has_work() and loop.live == {}
        loop.scheduler.check_memory()
    finally:
        push.close(0)
        pull.close(0)


# ---- client disconnects ------------------------------------------------------------------------
def test_disconnect_mid_prefill_frees_kv(start_server, model):
    """Four streamed clients leave before a byte came, while one prompt is part-way through its chunked
    prefill: the rank, paused in place with the four queued, is resumed and paused again, which runs at
    least one step (the first 16-token chunk) and far fewer than the 476 chunks of the four prompts, on
    any machine; then it stays paused while the clients leave."""
    srv = start_server(model, "--max-total-tokens", "8192", "--chunked-prefill-size", "16")
    warm(srv)
    before = proc_tree(srv.proc.pid)
    prompt = [(7 * i) % 500 + 3 for i in range(1900)]  # 119 prefill chunks
    clients = [httpx.Client(base_url=srv.url, timeout=HANG_S) for _ in range(4)]
    got_chunk = []
    seen_mid_prefill = threading.Event()

    def stream(c, k):
        try:
            with c.stream("POST", "/generate", json={"input_ids": prompt[k:], "stream": True,
                                                     "sampling_params": {"max_new_tokens": 50, **GREEDY}}) as r:
                seen_mid_prefill.wait(HANG_S)
                got_chunk.append(False)  # leave before reading a byte: the prompt is still prefilling
        except httpx.HTTPError:
            pass

    with paused_in_place(srv.client):
        threads = [threading.Thread(target=stream, args=(c, k)) for k, c in enumerate(clients)]
        for t in threads:
            t.start()
        wait_for(lambda: running_per_rank(srv.client) == [(0, 4)], "the four prompts queued")
        assert srv.client.post("/continue_generation").status_code == 200
        pause_in_place(srv.client)
        wait_for(lambda: (st := kv_state(srv.client)).running == 1 and st.queued == 3 and st.kv_used > 0,
                 "one prompt part-way through its prefill, three queued")
        seen_mid_prefill.set()
        for t in threads:
            t.join(HANG_S)
        wait_for(lambda: running_per_rank(srv.client) == [(0, 0)], "the four requests aborted")
    for c in clients:
        c.close()
    assert_no_leaks(srv, before)
    r = srv.client.post("/generate", json={"input_ids": prompt[:40], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200


def test_disconnect_mid_stream_of_every_route_frees_kv(shared):
    """Streams of /generate, /v1/completions and /v1/chat/completions left after the first chunk; then
    the same requests not streamed, taken into the queue of a rank paused in place (none can end by
    itself), left once the server shows them all."""
    srv = shared
    warm(srv)
    before = proc_tree(srv.proc.pid)
    long = {"max_new_tokens": 1500, **GREEDY}
    bodies = [
        ("/generate", {"input_ids": [9, 10, 11], "sampling_params": long, "stream": True}),
        ("/v1/completions", {"prompt": [9, 10, 12], "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                             "stream": True, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
                                  "temperature": 0, "ignore_eos": True, "stream": True}),
    ]
    firsts = []

    def leave_after_first(path, body):
        with httpx.stream("POST", srv.url + path, json=body, timeout=HANG_S) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    firsts.append(path)
                    break

    threads = [threading.Thread(target=leave_after_first, args=pb) for pb in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert sorted(firsts) == sorted(p for p, _ in bodies)
    with paused_in_place(srv.client):
        leaving = [Departing(srv.url, path, {**body, "stream": False}) for path, body in bodies]
        wait_for(lambda: running_per_rank(srv.client) == [(0, 4)], "the four requests queued (n=2 is two)")
        for d in leaving:
            d.leave()
        wait_for(lambda: running_per_rank(srv.client) == [(0, 0)], "the four requests aborted")
    assert_no_leaks(srv, before)


@pytest.fixture(scope="module")
def demo_server(start_server):
    """The demo recommender with its 1,682-item catalog (semantic IDs): retrieve runs real beams."""
    return start_server(demo.model_path(), "--item-catalog", demo.catalog_path(), "--max-total-tokens", "65536",
                        "--max-beam-width", "512")


def test_disconnect_mid_beam_frees_kv_and_answers_stay_exact(demo_server):
    srv = demo_server
    user = {"id": "u1", "text": "<i1><i50><i100><i172><i174>\nSemantic ID:"}
    body = {"user": user, "beam_width": 256, "num_items": 10}
    want = srv.client.post("/v1/retrieve", json=body)
    assert want.status_code == 200, want.text
    warm(srv)
    before = proc_tree(srv.proc.pid)

    def leave(i):
        try:
            httpx.post(srv.url + "/v1/retrieve", timeout=0.05 + 0.02 * i,
                       json={"user": {"id": f"u{i}", "text": f"<i{i + 2}><i{i + 30}>\nSemantic ID:"},
                             "beam_width": 512, "num_items": 10})
        except httpx.TimeoutException:
            pass

    threads = [threading.Thread(target=leave, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert_no_leaks(srv, before)
    again = srv.client.post("/v1/retrieve", json=body)
    assert again.status_code == 200
    assert [x["item"] for x in again.json()["items"]] == [x["item"] for x in want.json()["items"]]


# ---- a killed scheduler among several -----------------------------------------------------------
def test_killed_scheduler_among_two_fails_inflight_and_exits_without_orphans(start_server, long_model):
    """Four requests that cannot finish (60,000 tokens each, and the ranks paused in place once they
    are observed) run on both ranks when DP1 is killed: all four get the 500, whatever the machine's speed."""
    srv = start_server(long_model, "--max-total-tokens", str(2 * (LONG_NEW + 16)), "--dp-size", "2")
    tree = proc_tree(srv.proc.pid)
    scheds = [psutil.Process(p) for p in tree.pids if "spawn_main" in " ".join(psutil.Process(p).cmdline())]
    assert len(scheds) == 2
    results = []

    def long_request(i):
        try:
            r = httpx.post(srv.url + "/generate", timeout=600,
                           json={"input_ids": [5 + i, 6, 7], "sampling_params": {"max_new_tokens": LONG_NEW, **GREEDY}})
            results.append((r.status_code, r.json()))
        except httpx.HTTPError as e:
            results.append(("transport", repr(e)))

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(4)]  # spread over both ranks
    for t in threads:
        t.start()
    wait_for(lambda: running_per_rank(srv.client) == [(2, 0), (2, 0)], "two requests running on each rank")
    pause_in_place(srv.client)  # held running from here on, on any machine
    assert results == [], f"a request ended before the kill: {results}"
    scheds[1].kill()
    for t in threads:
        t.join(HANG_S)
    assert len(results) == 4, results
    assert all(code == 500 and "died" in body["message"] for code, body in results), results
    assert srv.proc.wait(HANG_S) != 0
    # the launcher, the other rank and the resource tracker are gone
    wait_for(lambda: alive(tree.pids) == [], "every process of the server gone", every=0.2)
    assert "Scheduler process DP1 died" in srv.read_log()


# ---- overload ----------------------------------------------------------------------------------
def test_burst_of_ten_times_capacity(start_server, long_model):
    """A burst of 10 x capacity while the admitted requests cannot finish (60,000 tokens each: the
    test ends them by leaving): exactly R + Q admitted, every other one a 503, observed while the
    admitted ones still run and wait; then the server serves again."""
    running, queued = 2, 2
    srv = start_server(long_model, "--max-total-tokens", str(4 * (LONG_NEW + 16)), "--max-running-requests",
                       str(running), "--max-queued-requests", str(queued))
    warm(srv)
    before = proc_tree(srv.proc.pid)
    burst = 10 * (running + queued)
    results, leave = {}, threading.Event()

    def one(i):
        body = {"prompt": [5 + i % 50, 6, 7], "max_tokens": LONG_NEW, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=srv.url, timeout=600) as c, c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                results[i] = (r.status_code, json.loads(r.read()))
                return
            results[i] = (200, None)  # the first token came: admitted and running
            leave.wait(600)  # leaving closes the stream: the server aborts the request

    threads = [threading.Thread(target=one, args=(i,)) for i in range(burst)]
    for t in threads:
        t.start()
    try:
        rejected = lambda: [r for r in results.values() if r[0] != 200]  # noqa: E731
        wait_for(lambda: len(rejected()) >= burst - running - queued, f"{burst - running - queued} rejections")
        # the admitted ones are still in the server, running and queued, now that every other one is answered
        wait_for(lambda: running_per_rank(srv.client) == [(running, queued)], "the admitted requests running and queued")
        full = rejected()
        assert len(full) == burst - running - queued, sorted(r[0] for r in results.values())
        assert all(code == 503 and b["message"] == "The request queue is full." and b["code"] == 503 for code, b in full)
    finally:
        leave.set()
        for t in threads:
            t.join(HANG_S)
    assert len(results) == burst and sum(code == 200 for code, _ in results.values()) == running + queued
    st = kv_after_drain(srv.client)  # a stats report from after the burst (a snapshot may predate its end)
    assert st.queued == 0
    assert_no_leaks(srv, before)
    # room again: requests are served to the end
    for i in range(running + queued):
        r = srv.client.post("/v1/completions", json={"prompt": [5 + i, 6, 7], "max_tokens": 60, "temperature": 0,
                                                     "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60, r.text


# ---- start-up errors ---------------------------------------------------------------------------
def test_catalog_with_a_bad_line_is_a_clear_startup_error(model, tmp_path):
    import subprocess
    import sys

    cat = tmp_path / "catalog.jsonl"
    cat.write_text('{"id": "a", "token_ids": [5], "id_token": 7}\n{"id": "b", "token_ids": [6], "id_token": 8}\n'
                   '{"id": "c", "token_ids": "oops", "id_token": 9}\n')
    proc = subprocess.run([sys.executable, "-m", "sgrec.launch_server", "--model-path", model, "--device", "cpu",
                           "--dtype", "float32",
                           "--max-total-tokens", "1024", "--item-catalog", str(cat), "--port", "0"],
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"start-up failed: {cat}:3: item 'c': 'token_ids' must be a non-empty list of token ids" in out
    assert "Traceback" not in out


# ---- look-alike values the schema rejects are rejected by the server too (found by fuzzing) -------
@pytest.mark.parametrize("sp", [
    {"logit_bias": {"0": False}}, {"logit_bias": {"5": "1"}}, {"logit_bias": {"+5": 1}}, {"logit_bias": {" 5": 1}},
    {"watermark": 0}, {"beam_width": True}, {"stream_interval": "x"},
])
def test_sampling_params_reject_lookalike_values(sp):
    with pytest.raises(ValueError):
        SamplingParams.from_dict(sp, vocab_size=100)


@pytest.mark.parametrize("sp", [{"logit_bias": {"5": 1, "6": -2.5}}, {"watermark": False}, {"beam_width": 1},
                                {"stream_interval": 4}, {"sampling_seed": 18446744073709551615}])
def test_sampling_params_accept_the_real_values(sp):
    SamplingParams.from_dict(sp, vocab_size=100)


@pytest.mark.parametrize("body,message", [
    ({"user": {"text": "a"}, "rid": 0}, "rid must be a string"),
    ({"user": {"text": "a"}, "routing_key": 7}, "routing_key must be a string"),
    ({"user": {"text": "a"}, "model": ["m"]}, "model must be a string"),
])
def test_rec_bodies_type_check_rid_routing_key_and_model(body, message):
    from sgrec.managers.rec import build_retrieve_task

    with pytest.raises(ValueError, match=message):
        build_retrieve_task(body, None, None, 16)


def test_retrieve_defaults_fit_the_limits(model):
    from sgrec.managers.generate import Limits, RequestBuilder
    from sgrec.managers.rec import build_retrieve_task
    from sgrec.tokenizer import Tokenizer

    tok = Tokenizer(model)
    builder = RequestBuilder(tok, Limits(512, 2048, 4096, 2047, 8, 4))
    task = build_retrieve_task({"user": {"token_ids": [5, 6]}}, tok, builder, max_beam_width=4)
    assert task.payload["beam_width"] == 4 and task.payload["num_items"] == 4 and task.payload["top_k"] == 4
    task = build_retrieve_task({"user": {"token_ids": [5, 6]}}, tok, builder, max_beam_width=512)
    assert task.payload["beam_width"] == 128 and task.payload["num_items"] == 10
