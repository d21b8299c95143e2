"""Engine.generate follows SGLang's native /generate semantics (docs/reference/sglang-api.md §2)."""

import random
import threading

import pytest
import torch

from sgrec import Engine

GREEDY = {"temperature": 0, "ignore_eos": True}


def random_ids(n, vocab, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(path):
    return Engine(path, device="cpu", dtype="float32", max_total_tokens=4096)


@pytest.fixture(scope="module")
def hf(path, hf_model):
    return hf_model(path)


def hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


# ---- logprob fields ----------------------------------------------------------------------
def test_logprob_start_len_minus_one_gives_only_output(engine):
    out = engine.generate(input_ids=random_ids(12, 512, 1), sampling_params={"max_new_tokens": 5, **GREEDY},
                          return_logprob=True)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == []
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == meta["output_token_logprobs_length"] == 5
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    assert "input_top_logprobs" not in meta and "output_token_ids_logprobs" not in meta


@pytest.mark.parametrize("start", [0, 1, 7, 11, 12])
def test_logprob_start_len_entries(engine, start):
    ids = random_ids(12, 512, 2)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, **GREEDY}, return_logprob=True,
                          logprob_start_len=start, return_text_in_logprobs=True)
    entries = out["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(ids) - start
    assert [e[1] for e in entries] == ids[start:]
    if entries:
        assert entries[0][0] is None
        assert all(isinstance(e[0], float) and e[0] <= 0 for e in entries[1:])
        assert [e[2] for e in entries] == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids[start:]]


def test_top_logprobs_and_token_ids_logprob(engine):
    ids = random_ids(9, 512, 3)
    vocab = list(range(engine.vocab_size))
    full = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, **GREEDY}, return_logprob=True,
                           logprob_start_len=0, token_ids_logprob=vocab)
    top = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, **GREEDY}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=4, token_ids_logprob=[5, 9])
    fm, tm = full["meta_info"], top["meta_info"]
    assert tm["input_top_logprobs"][0] is None and tm["input_token_ids_logprobs"][0] is None
    for kind in ("input", "output"):
        fulls = fm[f"{kind}_token_ids_logprobs"]
        tops = tm[f"{kind}_top_logprobs"]
        pairs = tm[f"{kind}_token_ids_logprobs"]
        assert len(tops) == len(fulls) == len(pairs)
        for f_row, t_row, p_row in zip(fulls, tops, pairs):
            if f_row is None:
                continue
            want = sorted(((v, t) for v, t, _ in f_row), reverse=True)[:4]
            assert [t for _, t, _ in t_row] == [t for _, t in want]
            assert [v for v, _, _ in t_row] == pytest.approx([v for v, _ in want], abs=1e-6)
            assert [t for _, t, _ in p_row] == [5, 9]
            assert [v for v, _, _ in p_row] == pytest.approx([f_row[5][0], f_row[9][0]], abs=1e-6)
    # The chosen token's logprob is its value in the full distribution.
    for (v, t, _), row in zip(fm["output_token_logprobs"], fm["output_token_ids_logprobs"]):
        assert v == pytest.approx(row[t][0], abs=1e-6)


def test_sampled_logprobs_use_temperature(engine, hf):
    ids = random_ids(10, 512, 4)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0.5, "sampling_seed": 1},
                          return_logprob=True, logprob_start_len=0)
    logits = hf_last_logits(hf, ids)
    want = torch.log_softmax(logits / 0.5, dim=-1)
    (v, t, _), = out["meta_info"]["output_token_logprobs"]
    assert v == pytest.approx(want[-1, t].item(), abs=1e-4)
    inp = out["meta_info"]["input_token_logprobs"]
    assert inp[3][0] == pytest.approx(want[2, ids[3]].item(), abs=1e-4)


def test_prefill_only_request(engine, hf):
    ids = random_ids(10, 512, 5)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          token_ids_logprob=[3, 7, 11])
    assert out["text"] == "" and out["output_ids"] == []
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    # The next-token distribution after the prompt is reported (what /v1/score reads).
    want = torch.log_softmax(hf_last_logits(hf, ids)[-1], dim=-1)
    (row,) = meta["output_token_ids_logprobs"]
    assert [t for _, t, _ in row] == [3, 7, 11]
    assert [v for v, _, _ in row] == pytest.approx([want[3].item(), want[7].item(), want[11].item()], abs=1e-4)


# ---- batches, n, rids --------------------------------------------------------------------
def test_batch_equals_single_requests_in_order(engine):
    prompts = [random_ids(n, 512, 20 + n) for n in (4, 17, 9)]
    batch = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, **GREEDY})
    singles = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 6, **GREEDY}) for p in prompts]
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [4, 17, 9]


def test_text_batch_and_per_item_sampling_params(engine):
    outs = engine.generate(["one two", "three four five"], sampling_params=[{"max_new_tokens": 2, **GREEDY}, {"max_new_tokens": 4, **GREEDY}])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 4]
    assert outs[0]["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("one two"))


def test_n_fans_out_in_sglang_order(engine):
    prompts = [random_ids(5, 512, 30), random_ids(8, 512, 31)]
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "n": 2}, rid="job")
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [5, 8, 5, 8]
    assert [o["meta_info"]["id"] for o in outs] == ["job_0", "job_1", "job_2", "job_3"]
    single = engine.generate("hello", sampling_params={"max_new_tokens": 3, "n": 3})
    assert isinstance(single, list) and len(single) == 3
    assert engine.generate("hello", sampling_params={"max_new_tokens": 1}, rid="r1")["meta_info"]["id"] == "r1"


# ---- sampling ----------------------------------------------------------------------------
def test_seed_is_reproducible_and_independent_of_batch(engine):
    ids = random_ids(7, 512, 40)
    sp = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    a = engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]
    b = engine.generate(input_ids=[random_ids(3, 512, 41), ids], sampling_params=[{"max_new_tokens": 5}, sp])[1]["output_ids"]
    c = engine.generate(input_ids=ids, sampling_params={**sp, "sampling_seed": 99})["output_ids"]
    assert a == b
    assert a != c


def test_top_k_one_and_min_p_one_are_greedy(engine):
    ids = random_ids(7, 512, 42)
    greedy = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, **GREEDY})["output_ids"]
    for extra in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        sp = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, **extra}
        assert engine.generate(input_ids=ids, sampling_params=sp)["output_ids"] == greedy, extra


def test_logit_bias_and_min_new_tokens(engine):
    eos = engine.tokenizer.eos_token_id
    out = engine.generate("hi", sampling_params={"max_new_tokens": 20, "temperature": 0, "logit_bias": {str(eos): 100.0},
                                 "min_new_tokens": 5})
    assert len(out["output_ids"]) == 6 and out["output_ids"][-1] == eos and eos not in out["output_ids"][:5]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    forced = engine.generate("hi", sampling_params={"max_new_tokens": 4, **GREEDY, "logit_bias": {"17": 100.0}})
    assert forced["output_ids"] == [17] * 4


def test_stop_token_ids_and_stop_strings(engine):
    ids = random_ids(6, 512, 50)
    free = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, **GREEDY})
    toks = free["output_ids"]
    t = toks[5]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, **GREEDY, "stop_token_ids": [t]})
    first = toks.index(t)
    assert out["output_ids"] == toks[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": t}
    assert out["text"] == engine.tokenizer.decode(toks[:first])
    # A stop string taken from the middle of the free-running text.
    text = free["text"]
    start = next(i for i in range(4, len(text) - 2) if text[i : i + 2].isalpha())
    stop = text[start : start + 2]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, **GREEDY, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    kept = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, **GREEDY, "stop": [stop], "no_stop_trim": True})
    assert kept["output_ids"] == out["output_ids"]  # same stopping point, only the text is untrimmed
    assert kept["text"] == engine.tokenizer.decode(kept["output_ids"]) and stop in kept["text"]


def test_eos_stops_unless_ignored(engine):
    eos = engine.tokenizer.eos_token_id
    out = engine.generate("x", sampling_params={"max_new_tokens": 10, "temperature": 0, "logit_bias": {str(eos): 100.0}})
    assert out["output_ids"] == [eos] and out["text"] == ""
    out = engine.generate("x", sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100.0}})
    assert out["output_ids"] == [eos] * 3
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_streaming_is_cumulative_and_matches(engine):
    ids = random_ids(8, 512, 60)
    sp = {"max_new_tokens": 7, **GREEDY}
    chunks = list(engine.generate(input_ids=ids, sampling_params=sp, stream=True))
    final = engine.generate(input_ids=ids, sampling_params=sp)
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 8))
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["text"] == final["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    batch = list(engine.generate(input_ids=[ids, ids[:3]], sampling_params={"max_new_tokens": 3, **GREEDY}, stream=True))
    assert sorted({c["index"] for c in batch}) == [0, 1]


# ---- bad input -----------------------------------------------------------------------------
BAD = [
    ({"text": ""}, "empty"),
    ({"input_ids": []}, "empty"),
    ({}, "must be provided"),
    ({"text": "a", "sampling_params": {"foo": 1}}, "unknown field `foo`"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "a", "sampling_params": {"min_p": 2}}, "min_p"),
    ({"text": "a", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
    ({"text": "a", "sampling_params": {"presence_penalty": -2.5}}, "presence_penalty"),
    ({"text": "a", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"n": 0}}, "n must be"),
    ({"text": "a", "sampling_params": {"stop": ["x"] * 33}}, "stop"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10**9]}}, "out of the vocabulary"),
    ({"text": "a", "sampling_params": {"regex": "[a-z]+"}}, "not supported"),
    ({"text": "a", "sampling_params": [1]}, "must be an object"),
    ({"input_ids": [1, 2, 10**6]}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": list(range(3, 70))}, "context length"),
    ({"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 4}, "logprob_start_len"),
    ({"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": [5, 6, 7], "return_logprob": True, "token_ids_logprob": [10**6]}, "token_ids_logprob"),
    ({"input_ids": [[5, 6], [7]], "rid": ["a", "a"]}, "rid"),
]


def test_bad_input_raises_value_error_and_engine_keeps_serving(path):
    engine = Engine(path, device="cpu", dtype="float32", max_total_tokens=512, context_length=64)
    for kwargs, needle in BAD:
        with pytest.raises(ValueError, match=None) as info:
            engine.generate(**kwargs)
        assert needle.lower() in str(info.value).lower(), (kwargs, str(info.value))
    out = engine.generate("still alive", sampling_params={"max_new_tokens": 3, **GREEDY})
    assert out["meta_info"]["completion_tokens"] == 3
    engine.check_memory()
    with pytest.raises(ValueError, match="Unknown server argument"):
        Engine(path, device="cpu", dtype="float32", max_total_tokens=512, no_such_flag=1)


def test_max_new_tokens_capped_by_context(path):
    engine = Engine(path, device="cpu", dtype="float32", max_total_tokens=512, context_length=32)
    out = engine.generate(input_ids=random_ids(28, 512, 70), sampling_params={"max_new_tokens": 100, **GREEDY})
    assert out["meta_info"]["completion_tokens"] == 4


# ---- memory, retraction, policies ----------------------------------------------------------
def _workload(n, seed):
    rng = random.Random(seed)
    shared = random_ids(10, 512, seed)
    prompts = [shared[: rng.randrange(0, 10)] + random_ids(rng.randrange(3, 15), 512, seed * 100 + i) for i in range(n)]
    params = [{"max_new_tokens": rng.randrange(1, 30), **GREEDY} for _ in range(n)]
    return prompts, params


def test_retraction_under_memory_pressure_keeps_results(path):
    prompts, params = _workload(10, seed=7)
    big = Engine(path, device="cpu", dtype="float32", max_total_tokens=4096)
    want = [big.generate(input_ids=p, sampling_params=sp)["output_ids"] for p, sp in zip(prompts, params)]
    small = Engine(path, device="cpu", dtype="float32", max_total_tokens=64)
    outs = small.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == want
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
    small.check_memory()
    assert small.flush_cache()
    assert small.runner.kv_pool.allocator.available_size() == 64


@pytest.mark.parametrize("kw", [
    {"disable_radix_cache": True},
    {"schedule_policy": "lpm"},
    {"max_running_requests": 2},
    {"chunked_prefill_size": 4, "max_prefill_tokens": 9},
])
def test_scheduler_variants_give_identical_results(path, kw):
    prompts, params = _workload(8, seed=11)
    ref = Engine(path, device="cpu", dtype="float32", max_total_tokens=4096)
    want = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=params)]
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=4096, **kw)
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == want
    if kw.get("disable_radix_cache"):
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    eng.check_memory()
    eng.flush_cache()
    assert eng.runner.kv_pool.allocator.available_size() == 4096


def test_cached_tokens_reported_and_all_slots_free_after_flush(path):
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024)
    ids = random_ids(20, 512, 80)
    assert eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 3})["meta_info"]["cached_tokens"] == 0
    assert eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 3})["meta_info"]["cached_tokens"] == 19
    ns = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 3}, extra_key="other")
    assert ns["meta_info"]["cached_tokens"] == 0  # extra_key namespaces the cache
    eng.check_memory()
    assert eng.runner.kv_pool.allocator.available_size() < 1024
    assert eng.flush_cache()
    assert eng.runner.kv_pool.allocator.available_size() == 1024


def test_abort_frees_kv(path):
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024)
    sched = eng.scheduler
    msgs, _, _ = eng.builder.build(input_ids=[random_ids(9, 512, 90), random_ids(12, 512, 91)],
                                   sampling_params={"max_new_tokens": 50, **GREEDY})
    reqs = [sched.add_request(m) for m in msgs]
    sched.step()  # prefill both
    sched.step()  # one decode step
    assert sched.abort(reqs[0].rid) is reqs[0] and sched.abort(reqs[1].rid) is reqs[1]
    assert sched.abort("unknown") is None
    assert all(r.finish_reason["type"] == "abort" for r in reqs)
    eng.check_memory()
    eng.flush_cache()
    assert eng.runner.kv_pool.allocator.available_size() == 1024


def test_concurrent_callers_are_batched_and_correct(engine):
    prompts = [random_ids(6 + i, 512, 100 + i) for i in range(6)]
    sp = {"max_new_tokens": 10, **GREEDY}
    want = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        got[i] = engine.generate(input_ids=prompts[i], sampling_params=sp)["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want
    engine.check_memory()


def test_closing_a_stream_early_aborts_and_frees(path):
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024)
    it = eng.generate(input_ids=random_ids(9, 512, 92), sampling_params={"max_new_tokens": 100, **GREEDY}, stream=True)
    first = next(it)
    assert len(first["output_ids"]) == 1
    it.close()
    assert not eng.scheduler.has_work()
    eng.check_memory()


def test_cpu_threads_sets_the_in_process_forwards_threads(path):
    """Engine(cpu_threads=N) runs its forward on N threads: torch's intra-op count in the caller's
    process, so it is checked in a process of its own (this one's count stays as it is)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from sgrec import Engine; "
            f"e = Engine({path!r}, device='cpu', dtype='float32', max_total_tokens=1024, cpu_threads=3); "
            "out = e.generate(input_ids=[5, 6], sampling_params={'max_new_tokens': 2, 'temperature': 0}); "
            "print(torch.get_num_threads(), out['meta_info']['completion_tokens'])")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torch's own count there: 1, whatever this machine has
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["3", "2"]
