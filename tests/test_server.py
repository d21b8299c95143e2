"""The server as a real subprocess on loopback: native routes, errors, overload, faults, metrics."""

import contextlib
import json
import os
import threading
import time

import httpx
import psutil
import pytest

from sgrec.tools.probe import (HANG_S, Departing, kv_state, pause_in_place, paused_in_place, running_per_rank,
                               wait_for)
from prometheus_client.parser import text_string_to_metric_families

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(start_server, model):
    return start_server(model, "--max-total-tokens", "4096", "--enable-metrics", "--served-model-name", "tiny")


def wait_until(pred, timeout=HANG_S, every=0.1):
    """Whether `pred()` became true within `timeout` (a bound on hangs, not on speed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def kv_idle_and_free(srv) -> bool:
    """Flushes the cache (only possible when nothing runs or waits) and checks every KV slot is free."""
    if srv.client.post("/flush_cache").status_code != 200:
        return False
    info = srv.client.get("/server_info").json()
    return all(s["memory_usage"]["kv_used_tokens"] == 0 and s["num_running_reqs"] == 0 and s["num_queue_reqs"] == 0
               for s in info["internal_states"])


def test_server_info_is_current_once_a_flush_or_pause_returns(server, start_server, tiny_model_dir):
    """Each rank reports its stats before it answers a flush or a pause, so /server_info read right
    after shows the flushed pool and the held request (never the periodic report from before)."""
    c = server.client
    for i in range(3):
        r = c.post("/generate", json={"input_ids": [40 + i] * 30, "sampling_params": {"max_new_tokens": 2, **GREEDY}})
        assert r.status_code == 200
        assert c.post("/flush_cache").status_code == 200
        assert kv_state(c).kv_used == 0
    # the held request: 30,000 tokens to decode (2,000 take under half a second here), on a server
    # whose model and pool hold them, so that it is still running when the pause lands
    long = start_server(tiny_model_dir("llama", max_position_embeddings=32768), "--max-total-tokens", "32768")
    c = long.client
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 30000, **GREEDY}}
    with httpx.Client(base_url=long.url, timeout=HANG_S) as h, h.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response and the server aborts it
        assert next(x for x in lines if x).startswith("data: {")
        with paused_in_place(c):
            st = kv_state(c)
            assert (st.running, st.queued) == (1, 0) and st.kv_used > 0
            r.close()
            wait_for(lambda: running_per_rank(c) == [(0, 0)], "the request aborted")
    assert wait_until(lambda: kv_idle_and_free(long))


# ---- /generate shapes ----------------------------------------------------------------------
def test_generate_single_batch_and_logprobs(server):
    c = server.client
    one = c.post("/generate", json={"text": "hello there", "sampling_params": {"max_new_tokens": 5, **GREEDY}}).json()
    assert set(one) >= {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5 and len(one["output_ids"]) == 5
    assert {"id", "prompt_tokens", "cached_tokens", "e2e_latency", "weight_version"} <= set(meta)
    batch = c.post("/generate", json={"text": ["hello there", "a b"], "sampling_params": {"max_new_tokens": 5, **GREEDY},
                                      "rid": "bt"}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == one["output_ids"]
    assert [b["meta_info"]["id"] for b in batch] == ["bt_0", "bt_1"]
    lp = c.post("/generate", json={"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 3, **GREEDY},
                                   "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2,
                                   "token_ids_logprob": [3, 4], "return_text_in_logprobs": True}).json()["meta_info"]
    assert [e[1] for e in lp["input_token_logprobs"]] == [6, 7, 8, 9]
    assert lp["input_token_logprobs"][0][0] is None and isinstance(lp["input_token_logprobs"][0][2], str)
    assert len(lp["output_token_logprobs"]) == 3 == lp["output_token_logprobs_length"]
    assert lp["input_top_logprobs"][0] is None and all(len(r) == 2 for r in lp["input_top_logprobs"][1:])
    assert all([e[1] for e in r] == [3, 4] for r in lp["output_token_ids_logprobs"])
    forced = c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3, **GREEDY,
                                                                      "logit_bias": {"7": 100}}}).json()
    assert forced["output_ids"] == [7, 7, 7]
    n = c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "n": 3}}).json()
    assert isinstance(n, list) and len(n) == 3


def test_generate_streaming_is_cumulative_with_done(server):
    with server.client.stream("POST", "/generate", json={"text": "stream me", "stream": True,
                                                          "sampling_params": {"max_new_tokens": 6, **GREEDY}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[5:]) for ln in lines[:-1]]
    # Tokens that arrive faster than the client reads may share a chunk; each chunk is cumulative.
    lens = [len(ch["output_ids"]) for ch in chunks]
    assert lens == sorted(set(lens)) and lens[-1] == 6
    assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])
    assert all(b["output_ids"][: len(a["output_ids"])] == a["output_ids"] for a, b in zip(chunks, chunks[1:]))
    full = server.client.post("/generate", json={"text": "stream me", "sampling_params": {"max_new_tokens": 6, **GREEDY}})
    assert chunks[-1]["text"] == full.json()["text"]
    with server.client.stream("POST", "/generate", json={"text": ["a", "b c"], "stream": True,
                                                          "sampling_params": {"max_new_tokens": 2}}) as r:
        idx = {json.loads(ln[5:])["index"] for ln in r.iter_lines() if ln and ln != "data: [DONE]"}
    assert idx == {0, 1}


# ---- bad input -----------------------------------------------------------------------------
BAD = [
    ({"text": ""}, 400),
    ({"input_ids": []}, 400),
    ({}, 400),
    ({"text": 5}, 400),
    ({"text": ["a", 3]}, 400),
    ({"input_ids": "abc"}, 400),
    ({"input_ids": [1, -2]}, 400),
    ({"input_ids": [1, 10**9]}, 400),
    ({"input_ids": list(range(5, 3000))}, 400),
    ({"text": "a", "sampling_params": {"foo": 1}}, 400),
    ({"text": "a", "sampling_params": "hot"}, 400),
    ({"text": "a", "sampling_params": {"temperature": -0.5}}, 400),
    ({"text": "a", "sampling_params": {"temperature": "warm"}}, 400),
    ({"text": "a", "sampling_params": {"top_p": 0}}, 400),
    ({"text": "a", "sampling_params": {"top_k": -5}}, 400),
    ({"text": "a", "sampling_params": {"min_p": 1.5}}, 400),
    ({"text": "a", "sampling_params": {"max_new_tokens": -3}}, 400),
    ({"text": "a", "sampling_params": {"n": 0}}, 400),
    ({"text": "a", "sampling_params": {"repetition_penalty": 5}}, 400),
    ({"text": "a", "sampling_params": {"stop": 7}}, 400),
    ({"text": "a", "sampling_params": {"regex": "a+"}}, 400),
    ({"text": "a", "return_logprob": "yes"}, 400),
    ({"text": "a", "stream": "yes"}, 400),
    ({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 9}, 400),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, 400),
    ({"text": "a", "image_data": "http://example.invalid/x.png"}, 400),
]


@pytest.mark.parametrize("body,status", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_inputs_get_4xx(server, body, status):
    r = server.client.post("/generate", json=body)
    assert r.status_code == status, r.text
    assert "error" in r.json()
    assert "Traceback" not in r.text


def test_malformed_json_and_server_keeps_serving(server):
    r = server.client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = server.client.post("/generate", json={"text": "a", "sampling_params": {"foo": 1}})
    assert isinstance(r.json()["error"], str) and "unknown field `foo`" in r.json()["error"]
    r = server.client.post("/generate", json={"text": "a", "sampling_params": {"top_p": 0}})
    assert "top_p" in r.json()["error"]["message"]
    assert server.client.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    assert server.client.get("/health").status_code == 200


# ---- info routes ---------------------------------------------------------------------------
def test_info_routes(server, model):
    c = server.client
    info = c.get("/get_model_info").json()
    assert info == c.get("/model_info").json()
    assert info["model_path"] == model and info["served_model_name"] == "tiny" and info["is_generation"] is True
    sinfo = c.get("/server_info").json()
    assert sinfo["version"] == "0.5.23" and sinfo["max_total_num_tokens"] == 4096 and sinfo["status"] == "ready"
    assert c.get("/get_server_info").status_code == 200 and len(sinfo["internal_states"]) == 1
    assert (sinfo["chunked_prefill_size"], sinfo["max_batch_tokens"]) == (2048, 16384)  # sized for the CPU
    assert sinfo["cpu_threads"] == len(os.sched_getaffinity(0))  # every CPU this process may use: one rank
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 2048
    assert c.get("/v1/models/tiny").json()["id"] == "tiny"
    assert c.get("/v1/models/other").status_code == 404
    r = c.get("/flush_cache")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain") and "Cache flushed" in r.text
    assert c.get("/health_generate").status_code == 200 and c.get("/health").text == ""


def test_forward_threads_default_to_the_cpus_this_process_may_use(model):
    from sgrec.server_args import ServerArgs

    cpus = len(os.sched_getaffinity(0))
    assert ServerArgs(model_path=model).forward_threads() == cpus
    assert ServerArgs(model_path=model, dp_size=2).forward_threads() == max(1, cpus // 2)
    assert ServerArgs(model_path=model, cpu_threads=3, dp_size=2).forward_threads() == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        ServerArgs(model_path=model, cpu_threads=0)


def test_the_forward_leaves_threads_to_catalog_updates_while_they_arrive(model):
    from sgrec.scheduler.threads import ForwardThreads, update_reserve
    from sgrec.server_args import ServerArgs

    now = [100.0]
    t = ForwardThreads(4, 1, window=2.0, clock=lambda: now[0])
    assert t.now() == 4  # no update yet
    t.update_seen()
    assert t.now() == 3
    now[0] = 101.9
    assert t.now() == 3  # within the window after the last update
    t.update_seen()
    now[0] = 103.8
    assert t.now() == 3  # a later update extends it
    now[0] = 103.9
    assert t.now() == 4
    one = ForwardThreads(1, 1, clock=lambda: now[0])
    one.update_seen()
    assert one.now() == 1  # at least one thread stays
    off = ForwardThreads(2, 0, clock=lambda: now[0])
    off.update_seen()
    assert off.now() == 2  # --catalog-update-cores 0
    assert ServerArgs(model_path=model).catalog_update_cores == 1
    assert update_reserve(ServerArgs(model_path=model), "cpu") == 1
    assert update_reserve(ServerArgs(model_path=model, catalog_update_cores=3), "cpu") == 3
    assert update_reserve(ServerArgs(model_path=model), "cuda") == 0  # CPU threads only launch kernels there
    # the deterministic mode checked its linear layers' bits at the start-up thread count: kept
    assert update_reserve(ServerArgs(model_path=model, enable_deterministic_inference=True), "cpu") == 0
    with pytest.raises(ValueError, match="catalog_update_cores"):
        ServerArgs(model_path=model, catalog_update_cores=-1)


def test_cpu_threads_flag_sets_the_forwards_threads(start_server, model):
    srv = start_server(model, "--max-total-tokens", "1024", "--cpu-threads", "1")
    assert srv.client.get("/server_info").json()["cpu_threads"] == 1
    r = srv.client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


# ---- metrics ---------------------------------------------------------------------------------
def scrape(srv) -> dict:
    text = srv.client.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0) + s.value
    return out


def test_metrics_parse_and_move(server):
    before = scrape(server)
    assert all(k.startswith("sgrec:") for k in before)
    for name in ("sgrec:num_running_reqs", "sgrec:num_queue_reqs", "sgrec:token_usage", "sgrec:cache_hit_rate",
                 "sgrec:prompt_tokens_total", "sgrec:generation_tokens_total",
                 "sgrec:time_to_first_token_seconds_count", "sgrec:e2e_request_latency_seconds_count"):
        assert name in before, name
    server.client.post("/generate", json={"input_ids": [7] * 20, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    server.client.post("/generate", json={"input_ids": [7] * 20, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    after = scrape(server)
    assert after["sgrec:prompt_tokens_total"] - before["sgrec:prompt_tokens_total"] == 40
    assert after["sgrec:generation_tokens_total"] - before["sgrec:generation_tokens_total"] == 8
    assert after["sgrec:e2e_request_latency_seconds_count"] - before["sgrec:e2e_request_latency_seconds_count"] == 2
    assert after["sgrec:time_to_first_token_seconds_count"] > before["sgrec:time_to_first_token_seconds_count"]
    assert after["sgrec:cache_hit_rate"] > 0
    assert wait_until(lambda: scrape(server)["sgrec:token_usage"] > 0)  # the cached prefix holds slots


# ---- faults and overload (own servers) -------------------------------------------------------
def test_api_key(start_server, model):
    srv = start_server(model, "--max-total-tokens", "4096", "--api-key", "s3cret", "--enable-metrics",
                       "--max-running-requests", "1", "--max-queued-requests", "0")
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1}}
    key = {"Authorization": "Bearer s3cret"}
    assert srv.client.post("/generate", json=body).status_code == 401
    assert srv.client.post("/generate", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert srv.client.get("/v1/models").status_code == 401
    assert srv.client.post("/generate", json=body, headers=key).status_code == 200
    # a full rank (R + Q = 1 + 0 outstanding): the key is checked first, so a client without it learns nothing
    long = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 2000, **GREEDY}}
    with httpx.Client(base_url=srv.url, timeout=60, headers=key) as c, c.stream("POST", "/generate", json=long) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response and the server aborts it
        first = next(x for x in lines if x)
        assert r.status_code == 200 and first.startswith("data: {") and "error" not in first, first
        assert srv.client.post("/generate", json=body).status_code == 401
        full = srv.client.post("/generate", json=body, headers=key)
        assert full.status_code == 503 and full.json()["message"] == "The request queue is full."
    assert wait_until(lambda: srv.client.post("/generate", json=body, headers=key).status_code == 200)
    assert srv.client.get("/health").status_code == 200 and srv.client.get("/metrics").status_code == 200
    assert "s3cret" not in srv.read_log()
    assert srv.stop() == 0


def test_burst_over_queue_limit_gets_503_and_nothing_hangs(start_server, tiny_model_dir):
    """R + Q = 3 streaming requests of 60,000 tokens each hold the rank (observed: their headers come
    after submission), kept there by pausing it in place (none can end during the burst on any
    machine), then a concurrent burst of 13 gets 503 each, at once; once the holders are closed (aborted) the server frees every slot and
    serves again. (It used to send 16 at once and expect some 503s: on a fast CPU the tiny model
    answered them faster than they arrived, and every one got 200.)"""
    srv = start_server(tiny_model_dir("llama", max_position_embeddings=65536), "--max-total-tokens", "200000",
                       "--max-running-requests", "1", "--max-queued-requests", "2")
    long = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 60000, **GREEDY}}
    results = []

    def one(i):
        r = httpx.post(srv.url + "/generate", timeout=60,
                       json={"input_ids": [5 + i, 6, 7], "sampling_params": {"max_new_tokens": 40, **GREEDY}})
        results.append((r.status_code, r.json()))

    with httpx.Client(base_url=srv.url, timeout=60) as c, contextlib.ExitStack() as held:
        streams = [held.enter_context(c.stream("POST", "/generate", json=long)) for _ in range(3)]
        assert [r.status_code for r in streams] == [200] * 3
        lines = streams[0].iter_lines()  # kept: a dropped iterator closes the response and the server aborts it
        first = next(x for x in lines if x)
        assert first.startswith("data: {") and '"error"' not in first, first
        pause_in_place(srv.client)  # the holders stay where they are until they leave
        threads = [threading.Thread(target=one, args=(i,)) for i in range(13)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 13
        for code, body in results:
            assert code == 503 and body["message"] == "The request queue is full." and body["code"] == 503
    assert wait_until(lambda: kv_idle_and_free(srv))  # the held streams' aborts freed everything
    assert srv.client.post("/continue_generation").json() == CONTINUED
    done = srv.client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40, **GREEDY}})
    assert done.status_code == 200 and done.json()["meta_info"]["completion_tokens"] == 40


PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}


def test_full_rank_answers_503_before_validating(start_server, model):
    """With --max-running-requests + --max-queued-requests requests outstanding, the tokenizer manager
    answers 503 at once, before reading the body: a body that would be a 400 gets the 503 then, and
    the 400 again once the rank has room. The rank is held full by pausing it in place (no request
    can end meanwhile on any machine: CI once saw both requests end before the checks)."""
    srv = start_server(model, "--max-total-tokens", "4096", "--max-running-requests", "1",
                       "--max-queued-requests", "1")
    bad = {"text": "", "sampling_params": {"max_new_tokens": 1}}  # empty prompt: 400 when admitted
    assert srv.client.post("/generate", json=bad).status_code == 400
    long = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 2000, **GREEDY}}
    with httpx.Client(base_url=srv.url, timeout=60) as c, \
            c.stream("POST", "/generate", json=long) as r1, c.stream("POST", "/generate", json=long) as r2:
        assert r1.status_code == r2.status_code == 200  # headers come after submission: both are in
        lines = r1.iter_lines()  # kept: a dropped iterator closes the response and the server aborts it
        first = next(x for x in lines if x)
        assert first.startswith("data: {") and '"error"' not in first, first
        # r1 runs, r2 waits behind it (R = 1): the rank holds 2 = R + Q requests, kept there
        assert srv.client.post("/pause_generation", json={"mode": "in_place"}).json() == PAUSED
        g = srv.client.post("/generate", json=bad)
        assert g.status_code == 503 and g.json()["message"] == "The request queue is full."  # the scheduler's shape
        o = srv.client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 1})
        assert o.status_code == 503 and o.json()["message"] == "The request queue is full."
        s = srv.client.post("/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [5]})
        assert s.status_code == 503 and s.json()["message"] == "The request queue is full."
        assert g.json()["type"] == o.json()["type"] == s.json()["type"] == "503"
        # answered before the body is read: even malformed JSON gets the 503, on every route
        for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/rank",
                     "/v1/retrieve"):
            r = srv.client.post(path, content=b"{not json")
            assert r.status_code == 503 and r.json()["message"] == "The request queue is full.", path
        assert srv.client.get("/server_info").status_code == 200  # other routes are not gated
        assert srv.client.get("/health").status_code == 200  # paused on purpose: alive
        assert srv.client.post("/continue_generation").json() == CONTINUED
        # busy, not broken: outputs keep coming (or, had both ended by now, the health request got in)
        assert srv.client.get("/health").status_code == 200
    # the clients left: both are aborted and the rank has room again
    assert wait_until(lambda: srv.client.post("/generate", json=bad).status_code == 400)
    ok = srv.client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    assert wait_until(lambda: kv_idle_and_free(srv))


def test_a_slow_reader_holds_no_place_in_the_queue(start_server, model):
    """A request the rank has finished leaves the queue's count when its last output arrives, not
    when its client reads it: two unread streams that ended let the next request in, and /health
    answers 200 (it used to wait for outputs that would never come, then 503). 2000 tokens each: the
    cumulative chunks outgrow the sockets' buffers, so the server's writes wait for the reader."""
    srv = start_server(model, "--max-total-tokens", "4096", "--max-running-requests", "1",
                       "--max-queued-requests", "1", "--enable-metrics")
    unread = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 2000, **GREEDY}}
    done = scrape(srv)["sgrec:num_requests_total"]
    with httpx.Client(base_url=srv.url, timeout=60) as c, \
            c.stream("POST", "/generate", json=unread) as r1, c.stream("POST", "/generate", json=unread) as r2:
        assert r1.status_code == r2.status_code == 200  # both sent; neither is read until the end
        assert wait_until(lambda: scrape(srv)["sgrec:num_requests_total"] == done + 2)  # the rank ended both
        bad = srv.client.post("/generate", json={"text": "", "sampling_params": {"max_new_tokens": 1}})
        assert bad.status_code == 400  # admitted (validated), not the full queue's 503
        assert srv.client.get("/health").status_code == 200
        for r in (r1, r2):
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            assert chunks[-1]["meta_info"]["completion_tokens"] == 2000  # nothing lost for the slow reader


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: bfloat16 where the CPU has avx512_bf16 / AMX
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_requests_and_their_tokens(start_server, model, mode, dtype):
    """/pause_generation "in_place" (KV kept) and "retract" (back to the queue, recomputed or taken
    from the cache) stop every batch: a request sent while paused gets no token until
    /continue_generation, and every request then ends with the tokens an unpaused run gives.
    A retracted request resumes through an extend over its cached prefix where the unpaused run
    decoded: the same tokens are promised bit for bit only under --enable-deterministic-inference
    (in bfloat16 another summation order may flip a near tie, at whichever token the retract lands
    on), so the retract runs under that flag; in place, the request keeps its KV and its kernels."""
    flags = ["--enable-deterministic-inference"] if mode == "retract" else []
    srv = start_server(model, "--max-total-tokens", "4096", "--enable-metrics", "--dtype", dtype, *flags)
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 400, **GREEDY}}
    ref = srv.client.post("/generate", json={**body, "stream": False}).json()["output_ids"]
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r1:
        lines = r1.iter_lines()
        first = next(x for x in lines if x)  # (r1 may end before the pause on a fast machine: still checked)
        assert srv.client.post("/pause_generation", json={"mode": mode}).json() == PAUSED
        made = scrape(srv)["sgrec:generation_tokens_total"]
        late = {}
        t = threading.Thread(target=lambda: late.update(r=srv.client.post(
            "/generate", json={**body, "input_ids": [9, 8, 7, 6], "stream": False})))
        t.start()
        # the late request reaches the rank and waits there: nothing runs while paused
        assert wait_until(lambda: srv.client.get("/server_info").json()["internal_states"][0]["num_queue_reqs"] >= 1)
        assert scrape(srv)["sgrec:generation_tokens_total"] == made and t.is_alive()
        assert srv.client.get("/health").status_code == 200
        assert srv.client.post("/continue_generation", json={}).json() == CONTINUED
        chunks = [json.loads(x[6:]) for x in [first, *lines] if x.startswith("data: {")]
        t.join(60)
    assert chunks[-1]["output_ids"] == ref and chunks[-1]["meta_info"]["completion_tokens"] == 400
    assert late["r"].status_code == 200 and late["r"].json()["meta_info"]["completion_tokens"] == 400
    assert wait_until(lambda: kv_idle_and_free(srv))


def test_pause_abort_ends_every_request_and_bad_bodies_get_400(start_server, model):
    srv = start_server(model, "--max-total-tokens", "4096")
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 2000, **GREEDY}}
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r1:
        lines = r1.iter_lines()
        assert next(x for x in lines if x).startswith("data: {")
        assert srv.client.post("/pause_generation", json={"mode": "in_place"}).json() == PAUSED  # r1 held
        assert srv.client.post("/pause_generation").json() == PAUSED  # mode "abort", SGLang's default
        last = [x for x in lines if x.startswith("data: {")][-1]
        assert json.loads(last[6:])["error"]["message"] == "Aborted by /pause_generation"
    for bad, field in (({"mode": "later"}, "mode"), ({"mode": None}, "mode"), ({"when": 1}, "when"), ([1], "object")):
        r = srv.client.post("/pause_generation", json=bad)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = srv.client.post("/continue_generation", json={"torch_empty_cache": "yes"})
    assert r.status_code == 400 and "torch_empty_cache" in r.json()["error"]["message"]
    assert srv.client.post("/continue_generation").json() == CONTINUED
    ok = srv.client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    assert wait_until(lambda: kv_idle_and_free(srv))


def test_disconnect_storm_frees_kv(start_server, model):
    """Six streamed clients leave after their first chunk; then six non-streamed ones, taken into the
    queue of a rank paused in place (none can end by itself), leave once the server shows them all:
    each is aborted and every slot is freed."""
    srv = start_server(model, "--max-total-tokens", "4096")
    body = {"input_ids": [9, 10, 11, 12], "sampling_params": {"max_new_tokens": 2000, **GREEDY}}

    def stream_and_leave():
        with httpx.stream("POST", srv.url + "/generate", json={**body, "stream": True}, timeout=HANG_S) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # leave after the first chunk

    threads = [threading.Thread(target=stream_and_leave) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    with paused_in_place(srv.client):
        leaving = [Departing(srv.url, "/generate", {**body, "input_ids": [9 + i, 10, 11, 12]}) for i in range(6)]
        wait_for(lambda: running_per_rank(srv.client) == [(0, 6)], "the six requests queued")
        for d in leaving:
            d.leave()
        wait_for(lambda: running_per_rank(srv.client) == [(0, 0)], "the six requests aborted")
    assert wait_until(lambda: kv_idle_and_free(srv)), srv.client.get("/server_info").json()["internal_states"]
    assert srv.client.post("/generate", json={"text": "after", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_killed_scheduler_fails_health_and_inflight_and_exits(start_server, tiny_model_dir):
    """A request that cannot finish (60,000 tokens, and the rank paused in place once it is observed
    running), when the scheduler is killed:
    it gets a 500 naming the dead process (how fast: docs/reliability.md; no test bounds a time)."""
    srv = start_server(tiny_model_dir("llama", max_position_embeddings=65536), "--max-total-tokens", "61000")
    result = {}

    def long_request():
        try:
            r = httpx.post(srv.url + "/generate", timeout=600,
                           json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 60000, **GREEDY}})
        except httpx.HTTPError as e:
            result["error"] = repr(e)
            return
        result["status"], result["text"] = r.status_code, r.text

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: running_per_rank(srv.client) == [(1, 0)], "the request running")
    pause_in_place(srv.client)  # held running from here on, on any machine
    assert result == {}, f"the request ended before the kill: {result}"
    children = psutil.Process(srv.proc.pid).children()
    sched = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
    assert len(sched) == 1
    sched[0].kill()
    t.join(HANG_S)
    assert "status" in result, result
    assert result["status"] == 500 and "died" in json.loads(result["text"])["message"], result
    try:  # the launcher keeps answering for about a second before it exits: health must fail
        health = httpx.get(srv.url + "/health", timeout=5).status_code
    except httpx.TransportError:
        health = "refused (already exited)"
    assert health in (503, "refused (already exited)")
    assert srv.proc.wait(HANG_S) != 0
    assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children))


def test_sigterm_shuts_down_cleanly(start_server, model):
    srv = start_server(model, "--max-total-tokens", "1024", "--dp-size", "2")
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert len([p for p in children if "spawn_main" in " ".join(p.cmdline())]) >= 2
    assert srv.stop() == 0
    assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children))


def test_dp_ranks_share_load_and_routing_key_pins(start_server, tiny_model_dir):
    srv = start_server(tiny_model_dir("llama", max_position_embeddings=65536), "--max-total-tokens", "62000",
                       "--dp-size", "2")
    ids = [11, 12, 13, 14, 15, 16, 17, 18]
    body = {"input_ids": ids, "routing_key": "user-42", "sampling_params": {"max_new_tokens": 2, **GREEDY}}
    first = srv.client.post("/generate", json=body).json()
    again = [srv.client.post("/generate", json=body).json() for _ in range(3)]
    # The same user lands on the same rank every time, so its prefix is always cached there.
    assert first["meta_info"]["cached_tokens"] == 0
    assert all(a["meta_info"]["cached_tokens"] == len(ids) - 1 for a in again)
    assert all(a["output_ids"] == first["output_ids"] for a in again)
    # least loaded: with a request running on one rank (60,000 tokens: it runs until this test leaves),
    # the next one goes to the other rank
    long = {"stream": True, "sampling_params": {"max_new_tokens": 60000, **GREEDY}}
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c1, httpx.Client(base_url=srv.url, timeout=HANG_S) as c2:
        with c1.stream("POST", "/generate", json={"input_ids": [20] * 5, **long}):
            wait_for(lambda: sorted(running_per_rank(srv.client)) == [(0, 0), (1, 0)], "one request running")
            with c2.stream("POST", "/generate", json={"input_ids": [21] * 5, **long}) as r2:
                wait_for(lambda: running_per_rank(srv.client) == [(1, 0), (1, 0)], "one request on each rank")
                # /pause_generation answers once both ranks stopped; "abort" ends the request on each
                assert srv.client.post("/pause_generation", json={"mode": "abort"}).json() == PAUSED
                assert '"Aborted by /pause_generation"' in [x for x in r2.iter_lines() if x.startswith("data: {")][-1]
                wait_for(lambda: running_per_rank(srv.client) == [(0, 0), (0, 0)], "nothing running on either rank")
                assert srv.client.post("/continue_generation").json() == CONTINUED
    assert wait_until(lambda: kv_idle_and_free(srv))  # leaving aborted both
