"""Prefill-only requests (PrefillOnly): hybrid prefilling, suffix KV discarding, SRJF with
continuous JCT calibration, and SGLang's score semantics."""

import math
import random

import pytest
import torch

from sgrec import Engine
from sgrec.model.attention import SeqLayout
from sgrec.policy.prefill_only import LinearJct, pick_prefill_only
from sgrec.scheduler.scheduler import Scheduler  # noqa: F401  (imported for its side effects on failure)

ARCHS = ["llama", "qwen2", "qwen3"]


def rand_ids(n, vocab, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# ---- hybrid prefilling == the normal forward -----------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_hybrid_forward_equals_normal_forward(tiny_model_dir, arch, chunk):
    engine = Engine(tiny_model_dir(arch), device="cpu", dtype="float32", max_total_tokens=512,
                    hybrid_chunk_size=chunk)
    runner, alloc = engine.runner, engine.runner.kv_pool.allocator
    vocab = runner.config.vocab_size
    # two sequences in one batch; the second attends to a cached prefix of 7 tokens
    prefix_ids = rand_ids(7, vocab, 1)
    pre_slots = alloc.alloc(7)
    runner.forward(runner.make_batch(prefix_ids, list(range(7)), pre_slots,
                                     [SeqLayout(0, 7, pre_slots)]), [6])
    a, b = rand_ids(23, vocab, 2), rand_ids(11, vocab, 3)

    def run(fn):
        sa, sb = alloc.alloc(len(a)), alloc.alloc(len(b))
        seqs = [SeqLayout(0, len(a), sa), SeqLayout(len(a), len(b), torch.cat([pre_slots, sb]))]
        batch = runner.make_batch(a + b, list(range(len(a))) + list(range(7, 7 + len(b))), torch.cat([sa, sb]), seqs)
        out = fn(batch, list(range(len(a) + len(b))))
        alloc.free(sa), alloc.free(sb)
        return out

    normal = run(runner.forward)
    hybrid = run(runner.forward_prefill_only)
    assert (normal - hybrid).abs().max().item() <= 1e-4


# ---- the prefill-only path through the scheduler -------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(tiny_model_dir("llama"), device="cpu", dtype="float32", max_total_tokens=2048,
                  hybrid_chunk_size=4)


def test_prefill_only_logprobs_equal_the_decode_path(engine):
    vocab = engine.vocab_size
    ids = rand_ids(37, vocab, 5)
    labels = [3, 17, 100, 255]
    po = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                         logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=labels)
    engine.flush_cache()
    ref = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=labels)
    m_po, m_ref = po["meta_info"], ref["meta_info"]
    assert m_po["completion_tokens"] == 0 and m_po["finish_reason"]["type"] == "length"
    for (lp, t, _), (lr, tr, _) in zip(m_po["output_token_ids_logprobs"][0], m_ref["output_token_ids_logprobs"][0]):
        assert t == tr and abs(lp - lr) <= 1e-4
    got = [x[0] for x in m_po["input_token_logprobs"][1:]]
    want = [x[0] for x in m_ref["input_token_logprobs"][1:]]
    assert len(got) == len(ids) - 1 and max(abs(x - y) for x, y in zip(got, want)) <= 1e-4
    assert [x[1] for x in m_po["output_top_logprobs"][0]] == [x[1] for x in m_ref["output_top_logprobs"][0]]
    engine.check_memory()


def test_packed_prefill_only_batch_equals_one_at_a_time(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    prompts = [rand_ids(n, 512, 10 + n) for n in (9, 30, 17, 4)]
    kw = dict(device="cpu", dtype="float32", max_total_tokens=1024)
    outs = []
    for tokens in (0, 64):
        e = Engine(path, prefill_only_batch_tokens=tokens, **kw)
        res = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                         token_ids_logprob=[5, 6, 7])
        outs.append([[x[0] for x in r["meta_info"]["output_token_ids_logprobs"][0]] for r in res])
        e.check_memory()
    assert max(abs(a - b) for x, y in zip(*outs) for a, b in zip(x, y)) <= 1e-4


def test_suffix_kv_is_discarded_and_long_prompts_exceed_the_pool(tiny_model_dir):
    path = tiny_model_dir("llama")
    small = Engine(path, device="cpu", dtype="float32", max_total_tokens=48)
    big = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024)
    query, items = rand_ids(20, 512, 7), [rand_ids(n, 512, 8 + n) for n in (150, 90)]
    got = small.score(query=query, items=items, label_token_ids=[4, 9])
    want = big.score(query=query, items=items, label_token_ids=[4, 9])
    assert max(abs(a - b) for x, y in zip(got.scores, want.scores) for a, b in zip(x, y)) <= 1e-6
    # only the shared query stays cached; every other slot is free
    assert small.scheduler.tree.total_size() == 20
    small.check_memory()
    # a decoding request longer than the pool is still refused
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        small.generate(input_ids=items[0], sampling_params={"max_new_tokens": 1})


def test_max_input_len_is_enforced_and_profiled(tiny_model_dir):
    e = Engine(tiny_model_dir("llama"), device="cpu", dtype="float32", max_input_len=64)
    assert e.runner.max_input_len == 64
    e.generate(input_ids=rand_ids(64, 512, 1), sampling_params={"max_new_tokens": 0})
    with pytest.raises(ValueError, match="maximum input length \\(64 tokens\\)"):
        e.generate(input_ids=rand_ids(65, 512, 1), sampling_params={"max_new_tokens": 0})
    with pytest.raises(ValueError, match="maximum input length"):
        e.score(query=rand_ids(60, 512, 2), items=[[5] * 10], label_token_ids=[1])


# ---- score semantics == SGLang's definition through /generate logprobs ----------------------
def reference_scores(engine, prompts, labels, apply_softmax=False, temperature=1.0):
    out = []
    for ids in prompts:
        r = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                            return_logprob=True, token_ids_logprob=labels)
        lps = [x[0] for x in r["meta_info"]["output_token_ids_logprobs"][0]]
        if apply_softmax:
            w = [math.exp((x - max(lps)) / temperature) for x in lps]
            out.append([x / sum(w) for x in w])
        else:
            out.append([math.exp(x) for x in lps])
    return out


@pytest.mark.parametrize("apply_softmax,temperature", [(False, 1.0), (True, 1.0), (True, 0.5)])
@pytest.mark.parametrize("item_first", [False, True])
def test_score_equals_generate_logprobs(engine, apply_softmax, temperature, item_first):
    tok = engine.tokenizer
    query, items, labels = "user 42 watched space films;", [" Alien", " Heat", " Up"], [5, 50, 500]
    res = engine.score(query=query, items=items, label_token_ids=labels, apply_softmax=apply_softmax,
                       item_first=item_first, temperature=temperature)
    prompts = [tok.encode(f"{i}{query}" if item_first else f"{query}{i}") for i in items]
    want = reference_scores(engine, prompts, labels, apply_softmax, temperature)
    assert res.prompt_tokens == sum(map(len, prompts))
    assert max(abs(a - b) for x, y in zip(res.scores, want) for a, b in zip(x, y)) <= 1e-5
    if apply_softmax:
        assert all(abs(sum(row) - 1) < 1e-9 for row in res.scores)
    engine.check_memory()


def test_score_token_ids_and_per_item_labels(engine):
    q, items = rand_ids(12, 512, 3), [rand_ids(5, 512, 4), rand_ids(9, 512, 5)]
    labels = [[7, 8], [9, 10, 11]]
    res = engine.score(query=q, items=items, label_token_ids=labels, return_token_logprobs=True)
    for item, lab, row, raw in zip(items, labels, res.scores, res.token_logprobs):
        want = reference_scores(engine, [q + item], lab)[0]
        assert len(row) == len(lab) and max(abs(a - b) for a, b in zip(row, want)) <= 1e-5
        assert max(abs(math.exp(r) - a) for r, a in zip(raw, row)) <= 1e-12


def test_score_softmax_computes_only_the_label_columns(tiny_model_dir, monkeypatch):
    """Score with apply_softmax needs only the labels' logits: the output layer runs over those
    columns alone, with the scores of the full-vocabulary path (which
    return_token_logprobs keeps: the raw logprobs need the whole vocabulary) within 1e-6; a
    prefill-only batch packing such a request with one that needs the whole distribution gives each
    what it asked for."""
    from sgrec.managers.io_struct import TokenizedGenerateReq

    e = Engine(tiny_model_dir("llama"), device="cpu", dtype="float32", max_total_tokens=2048,
               prefill_only_batch_tokens=256)
    model, V = e.runner.model, e.vocab_size
    widths, real = [], model.compute_logits

    def spy(hidden, columns=None):  # records (rows, columns) of every output-layer call
        out = real(hidden, columns)
        widths.append(tuple(out.shape))
        return out

    monkeypatch.setattr(model, "compute_logits", spy)
    q, items, labels = rand_ids(20, V, 7), [rand_ids(n, V, 8 + n) for n in (3, 9, 5)], [11, 22, 33, 44]
    soft = e.score(query=q, items=items, label_token_ids=labels, apply_softmax=True, temperature=0.7)
    assert {w for r, w in widths if r} == {len(labels)}
    widths.clear()
    full = e.score(query=q, items=items, label_token_ids=labels, apply_softmax=True, temperature=0.7,
                   return_token_logprobs=True)
    assert V in {w for r, w in widths if r}
    assert max(abs(a - b) for x, y in zip(soft.scores, full.scores) for a, b in zip(x, y)) <= 1e-6
    # one packed batch: a labels-only request and a plain one over the same prompt
    msgs = [TokenizedGenerateReq(rid=f"r{i}", input_ids=q + items[0], sampling_params={"max_new_tokens": 0},
                                 return_logprob=True, token_ids_logprob=labels, label_columns_only=i == 0)
            for i in range(2)]
    reqs = [e.scheduler.add_request(m) for m in msgs]
    widths.clear()
    e.scheduler.step()  # both in one prefill-only batch (46 tokens <= 256): one forward
    assert all(r.finished for r in reqs)
    assert sorted(w for r, w in widths if r) == [len(labels), V]  # two output-layer calls
    only, plain = ([lp for lp, _ in r.output_token_ids_logprobs[0]] for r in reqs)
    assert abs(sum(math.exp(x) for x in only) - 1) <= 1e-6  # normalised over the labels
    norm = math.log(sum(math.exp(x) for x in plain))
    assert max(abs(a - (b - norm)) for a, b in zip(only, plain)) <= 1e-5
    e.check_memory()


@pytest.mark.parametrize("kwargs,message", [
    (dict(items=["a"]), "label_token_ids is required"),
    (dict(items=None, label_token_ids=[1]), "items must be provided"),
    (dict(items=["a"], label_token_ids=[]), "nonempty list"),
    (dict(items=["a"], label_token_ids=[1, 1]), "duplicate"),
    (dict(items=["a"], label_token_ids=[100000]), "out of vocabulary"),
    (dict(items=["a"], label_token_ids=[-1]), "nonnegative"),
    (dict(items=["a", "b"], label_token_ids=[[1], [2], [3]]), "one list per item"),
    (dict(items=["a"], label_token_ids=[1], temperature=0.5), "requires apply_softmax"),
    (dict(items=["a"], label_token_ids=[1], temperature=0, apply_softmax=True), "greater than zero"),
    (dict(query="q", items=[[1, 2]], label_token_ids=[1]), "Invalid combination"),
])
def test_score_bad_input(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.score(**kwargs)


def test_score_empty_items(engine):
    assert engine.score(query="x", items=[], label_token_ids=[1]).scores == []


# ---- SRJF with continuous JCT calibration (PrefillOnly §6.2 example) ------------------------
@pytest.mark.parametrize("policy,hits", [("fcfs", {"C"}), ("srjf-static", {"B"}), ("srjf", {"D", "B"})])
def test_continuous_calibration_doubles_hits_on_the_paper_example(tiny_model_dir, policy, hits):
    pa, pb = rand_ids(40, 512, 1), rand_ids(40, 512, 2)
    reqs = {  # lengths A < C < B < D; A/D share a prefix, B/C share another
        "A": pa + rand_ids(10, 512, 3), "B": pb + rand_ids(30, 512, 4),
        "C": pb + rand_ids(20, 512, 5), "D": pa + rand_ids(40, 512, 6),
    }
    # room for one request's KV: caching a second prefix evicts the first
    e = Engine(tiny_model_dir("llama"), device="cpu", dtype="float32", max_total_tokens=85,
               schedule_policy=policy)
    names = list(reqs)
    outs = e.generate(input_ids=[reqs[n] for n in names], sampling_params={"max_new_tokens": 0})
    got = {n for n, o in zip(names, outs) if o["meta_info"]["cached_tokens"] > 0}
    assert got == hits
    e.check_memory()


class Job:
    def __init__(self, arrival, n_input, cached=0):
        self.arrival, self.n_input, self.cached_on_arrival = arrival, n_input, cached


def test_srjf_fairness_lets_a_long_request_through_after_a_bounded_wait():
    """A 1000-token request among a steady stream of 10-token ones (one every 0.01 s): with
    lambda = 500 it runs once 500 * wait > 990, i.e. within ~2 s; with lambda = 0 it starves."""
    def run(fairness, horizon=400):
        queue, t = [Job(0.0, 1000)], 0.0
        for step in range(horizon):
            t = step * 0.01
            queue.append(Job(t, 10))
            i = pick_prefill_only(queue, "srjf", t, lambda j: 0, fairness)
            if queue.pop(i).n_input == 1000:
                return t
        return None

    started = run(500.0)
    assert started is not None and 990 / 500 <= started <= 990 / 500 + 0.02
    assert run(0.0) is None


def test_srjf_calibration_reads_the_cache_now():
    queue = [Job(0.0, 100, cached=0), Job(0.0, 60, cached=0)]
    cached_now = {id(queue[0]): 90, id(queue[1]): 0}
    assert pick_prefill_only(queue, "srjf-static", 1.0, lambda j: cached_now[id(j)]) == 1
    assert pick_prefill_only(queue, "srjf", 1.0, lambda j: cached_now[id(j)]) == 0
    assert pick_prefill_only(queue, "fcfs", 1.0, lambda j: 0) == 0


def test_linear_jct_fit_recovers_coefficients():
    samples = [(n, c, 0.5 + 0.01 * (n - c) + 0.001 * c) for n in (100, 500, 1000) for c in (0, 50, 90)]
    jct = LinearJct.fit(samples)
    assert abs(jct.a - 0.5) < 1e-9 and abs(jct.b - 0.01) < 1e-9 and abs(jct.c - 0.001) < 1e-9


def test_linear_jct_model_is_profiled_at_start_up(tiny_model_dir):
    e = Engine(tiny_model_dir("llama"), device="cpu", dtype="float32", max_total_tokens=512,
               jct_model="linear", schedule_policy="srjf")
    jct = e.scheduler.jct
    assert isinstance(jct, LinearJct) and jct.b == 1.0  # normalised to uncached-token units
    outs = e.generate(input_ids=[rand_ids(n, 512, n) for n in (30, 10, 20)], sampling_params={"max_new_tokens": 0})
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)


def test_linear_jct_fit_is_exact_nnls():
    # the subset enumeration is the non-negative least-squares optimum (scipy's NNLS as reference)
    import numpy as np
    from scipy.optimize import nnls

    rng = random.Random(3)
    for _ in range(200):
        samples = [(n, c, abs(rng.uniform(0, 0.01) + rng.uniform(-2e-5, 2e-5) * (n - c) + rng.uniform(-1e-5, 1e-5) * c))
                   for n in (128, 256, 512) for c in (0, n // 2, n - 8)]
        jct = LinearJct.fit(samples)
        x = np.array([[1.0, n - c, c] for n, c, _ in samples])
        y = np.array([t for _, _, t in samples])
        ref, _ = nnls(x, y)
        ours = float(np.sum((x @ np.array([jct.a, jct.b, jct.c]) - y) ** 2))
        assert min(jct.a, jct.b, jct.c) >= 0
        assert ours <= float(np.sum((x @ ref - y) ** 2)) * (1 + 1e-9) + 1e-18


def test_jct_profile_retries_then_falls_back_to_token_count(monkeypatch):
    # a profile whose times do not grow with uncached tokens (noise on a busy host) is retaken with
    # 3 runs per point; if it still says b = 0 the scheduler ranks by uncached tokens instead
    from sgrec.policy import prefill_only as policy

    calls = []
    fits = [LinearJct(0.01, 0.0, 1e-6), LinearJct(0.01, 0.0, 2e-6)]
    monkeypatch.setattr(policy, "_profile", lambda runner, lengths, repeats: calls.append(repeats) or fits.pop(0))
    assert policy.profile_linear_jct(None, [8]) == LinearJct(0.0, 1.0, 0.0)
    assert calls == [1, 3]
    calls.clear()
    fits[:] = [LinearJct(0.01, 0.0, 1e-6), LinearJct(0.01, 2e-4, 1e-6)]
    assert policy.profile_linear_jct(None, [8]) == LinearJct(0.01, 2e-4, 1e-6)
    assert calls == [1, 3]


def test_linear_jct_fit_never_goes_negative():
    # noisy timings that an unconstrained fit would give a negative per-cached-token cost
    samples = [(100, 0, 0.10), (100, 50, 0.04), (100, 90, 0.0), (200, 0, 0.21), (200, 100, 0.08), (200, 190, 0.0)]
    jct = LinearJct.fit(samples)
    assert min(jct.a, jct.b, jct.c) >= 0 and jct.b > 0
    assert all(jct(n, c) >= 0 for n, c, _ in samples)
