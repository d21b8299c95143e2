"""The encoder-decoder family (T5, as TIGER trains it) against transformers on the same checkpoint:
the logits of the encoder-decoder forward and of decode steps (plain and gated feed-forward, tied
and untied heads, float32 and the default dtype), retrieve's beams over the catalog's semantic IDs
against an exhaustive search and a plain beam search over transformers' logits, the encoder read once
per request whatever the beam width, its whole-input cache, and a real server's routes."""

from __future__ import annotations

import json

import pytest
import torch

from sgrec.beam.encdec import EncoderDecoderRetrieve, make_retriever
from sgrec.catalog import Catalog, Item
from sgrec.model.attention import SeqLayout
from sgrec.model.config import ModelConfig
from sgrec.radix.tree import RadixCache, whole_key
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs

from test_hybrid_model import sid_catalog
from test_hicache import master  # noqa: F401 (the Mooncake master fixture)
from test_rank import ids

DTYPES = ["float32", "auto"]  # auto: bfloat16 where the CPU has avx512_bf16 / AMX


@pytest.fixture(scope="module")
def t5_dir(tiny_model_dir):
    return tiny_model_dir("t5", seed=4)


@pytest.fixture(scope="module")
def gated_dir(tiny_model_dir):
    """T5 v1.1's kind: gated-gelu feed-forward, an output layer of its own, a deeper decoder."""
    return tiny_model_dir("t5", seed=5, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                          num_decoder_layers=3)


@pytest.fixture(scope="module")
def hf_t5():
    from transformers import T5ForConditionalGeneration

    made = {}

    def get(path: str, dtype: torch.dtype = torch.float32):
        if (path, dtype) not in made:
            made[path, dtype] = T5ForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
        return made[path, dtype]

    return get


def runner_for(path: str, dtype: str = "float32", **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, device="cpu", dtype=dtype, **{"max_total_tokens": 4096, **kw}))


def packed(runner: ModelRunner, seqs: list[list[int]], slots: list[torch.Tensor], start_pos: int = 0,
           encoder_slots=None):
    """A batch of the sequences (each from position start_pos) into their slots."""
    flat, pos, layouts = [], [], []
    for s, sl in zip(seqs, slots):
        layouts.append(SeqLayout(len(flat), len(s), sl))
        flat += s
        pos += range(start_pos, start_pos + len(s))
    return runner.make_batch(flat, pos, torch.cat(slots), layouts, encoder_slots=encoder_slots)


def hf_logits(hf, enc: list[int], dec: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec])).logits[0].float()


def tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """Max |logit difference| from transformers in the same dtype: float32 rounding, or four
    bfloat16 steps at the logits' scale."""
    if dtype == torch.float32:
        return 2e-3
    return 4 * 2.0 ** (torch.floor(torch.log2(logits.abs().max())).item() - 7)


# ---- the model ---------------------------------------------------------------------------------------
def test_the_config_reads_t5s_fields_and_refuses_what_it_cannot_serve(t5_dir, tmp_path):
    cfg = ModelConfig.from_dir(t5_dir)
    assert (cfg.family, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers) == ("encoder-decoder", 64, 4, 16, 2)
    assert cfg.decoder_start_token_id == 0
    with open(f"{t5_dir}/config.json") as f:
        raw = json.load(f)
    for field, value, words in [("feed_forward_proj", "gated-swiglu", "feed_forward_proj"),
                                ("feed_forward_proj", "fancy-relu", "feed_forward_proj"),
                                ("d_kv", 0, "d_kv"), ("is_encoder_decoder", False, "is_encoder_decoder")]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, field: value}))
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_dir(str(tmp_path))


@pytest.mark.parametrize("which", ["t5", "gated"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_and_decode_logits_match_transformers(t5_dir, gated_dir, hf_t5, which, dtype):
    """Two inputs of different lengths encoded in one batch; their decoders' teacher-forced logits in
    one batch, then one decode step each: transformers' in the same dtype (float32: rounding;
    bfloat16: within four bfloat16 steps at the logits' scale)."""
    path = t5_dir if which == "t5" else gated_dir
    runner = runner_for(path, dtype)
    enc, dec, nxt = [ids(13, seed=1), ids(5, seed=2)], [[0, *ids(3, seed=3)], [0]], [ids(1, seed=4), ids(1, seed=5)]
    alloc = runner.memory.allocator
    enc_slots = [alloc.alloc(len(e)) for e in enc]
    runner.encode(packed(runner, enc, enc_slots))
    dec_slots = [alloc.alloc(len(d)) for d in dec]
    got = runner.forward(packed(runner, dec, dec_slots, encoder_slots=enc_slots), list(range(sum(map(len, dec)))))
    new = [alloc.alloc(1) for _ in nxt]
    step = runner.make_batch([n[0] for n in nxt], [len(d) for d in dec], torch.cat(new),
                             [SeqLayout(i, 1, torch.cat([dec_slots[i], new[i]])) for i in range(2)],
                             encoder_slots=enc_slots)
    got = torch.cat([got, runner.forward(step, [0, 1])])
    hf = hf_t5(path, runner.dtype)
    want = torch.cat([hf_logits(hf, e, d) for e, d in zip(enc, dec)]
                     + [hf_logits(hf, e, d + n)[-1:] for e, d, n in zip(enc, dec, nxt)])
    assert (got - want).abs().max() <= tolerance(runner.dtype, want)


# ---- retrieve: xBeam with the encoder's output shared ------------------------------------------------
def retriever(runner, cache: bool = True, catalog: Catalog | None = None) -> EncoderDecoderRetrieve:
    tree = RadixCache(runner.memory.allocator, disable=not cache)
    ex = make_retriever(runner, tree, catalog or sid_catalog(60, seed=2))
    assert isinstance(ex, EncoderDecoderRetrieve)
    return ex


def valid_children(catalog: Catalog) -> tuple[dict[tuple, list[int]], dict[tuple, str], int]:
    paths = {tuple(it.semantic_id): it.id for it in catalog.items}
    depth = len(next(iter(paths)))
    children: dict[tuple, set[int]] = {}
    for p in paths:
        for d in range(depth):
            children.setdefault(p[:d], set()).add(p[d])
    return {q: sorted(c) for q, c in children.items()}, paths, depth


def level_logp(hf, enc: list[int], prefixes: list[tuple], children) -> dict[tuple, dict[int, float]]:
    """Each prefix's valid children's log-probabilities, normalised over those children (the
    per-level normalisation retrieve documents), from transformers' decoder logits."""
    out = {}
    for q in prefixes:
        row = hf_logits(hf, enc, [0, *q])[-1]
        kids = children[q]
        out[q] = dict(zip(kids, torch.log_softmax(row[kids], -1).tolist()))
    return out


def exhaustive_scores(hf, catalog: Catalog, enc: list[int]) -> dict[str, float]:
    """Every item's score: its path's summed per-level log-probabilities, the whole catalog scored."""
    children, paths, depth = valid_children(catalog)
    logp = level_logp(hf, enc, sorted(children), children)
    return {item: sum(logp[p[:d]][p[d]] for d in range(depth)) for p, item in paths.items()}


def reference_beams(hf, catalog: Catalog, enc: list[int], bw: int, top_k: int, num_items: int) -> list[tuple]:
    """A plain beam search over transformers' logits: per level, each beam's top_k valid children,
    then the best bw of all (ties: path order); the best num_items leaves as (path, score)."""
    children, _, depth = valid_children(catalog)
    beams = [((), 0.0)]
    for d in range(depth):
        logp = level_logp(hf, enc, [p for p, _ in beams], children)
        cands = []
        for p, s in beams:
            kids = sorted(logp[p].items(), key=lambda kv: -kv[1])[:top_k]
            cands += [(p + (t,), s + lp) for t, lp in kids]
        cands.sort(key=lambda c: -c[1])
        beams = cands[: (min(bw, num_items) if d == depth - 1 else bw)]
    return beams


@pytest.mark.parametrize("dtype", DTYPES)
def test_retrieve_over_the_whole_catalog_gives_transformers_scores(t5_dir, hf_t5, dtype):
    """Beams wide enough for every prefix: every item, best first, with its exhaustive score under
    transformers' logits in the same dtype (float32: rounding; bfloat16: a few bfloat16 steps of each
    of the three levels' logits, where transformers' own bfloat16 and float32 scores differ by 0.2)."""
    runner = runner_for(t5_dir, dtype)
    ex = retriever(runner)
    enc = ids(23, seed=11)
    want = exhaustive_scores(hf_t5(t5_dir, runner.dtype), ex.catalog, enc)
    got = ex.run(enc, beam_width=64, top_k=64, num_items=60)
    assert sorted(it["item"] for it in got.items) == sorted(want)
    scores = [it["score"] for it in got.items]
    assert scores == sorted(scores, reverse=True)
    tol = 2e-4 if runner.dtype == torch.float32 else 0.3
    assert max(abs(it["score"] - want[it["item"]]) for it in got.items) <= tol


@pytest.mark.parametrize("bw,top_k", [(4, 2), (16, 16), (8, 3)])
def test_narrow_beams_are_a_plain_beam_search_over_transformers_logits(gated_dir, hf_t5, bw, top_k):
    runner = runner_for(gated_dir)
    ex = retriever(runner, cache=False)
    enc = ids(17, seed=bw)
    got = ex.run(enc, beam_width=bw, top_k=top_k, num_items=bw // 2)
    want = reference_beams(hf_t5(gated_dir), ex.catalog, enc, bw, top_k, bw // 2)
    assert [tuple(it["semantic_id"]) for it in got.items] == [p for p, _ in want]
    assert max(abs(it["score"] - s) for it, (_, s) in zip(got.items, want)) <= 2e-4
    assert runner.memory.allocator.available_size() == runner.memory.size


def test_the_encoder_reads_each_request_once_whatever_the_beam_width_and_a_repeat_not_at_all(t5_dir):
    """Counted, not timed: one encoder pass per request at BW 2 and at BW 64; the same input again is
    a whole-key hit (no pass, the cold answers); another input, even one sharing a prefix, a miss."""
    runner = runner_for(t5_dir)
    ex = retriever(runner)
    enc = ids(30, seed=6)
    narrow = ex.run(enc, beam_width=2, top_k=2, num_items=2)
    assert runner.encoded_inputs == 1 and narrow.meta["cached_tokens"] == 0
    ex.tree.reset()
    wide = ex.run(enc, beam_width=64, top_k=64, num_items=10)
    assert runner.encoded_inputs == 2
    again = ex.run(enc, beam_width=64, top_k=64, num_items=10)
    assert runner.encoded_inputs == 2 and again.meta["cached_tokens"] == len(enc)
    assert again.items == wide.items
    longer = ex.run(enc + [7], beam_width=64, top_k=64, num_items=10)
    shorter = ex.run(enc[:-1], beam_width=64, top_k=64, num_items=10)
    assert runner.encoded_inputs == 4 and longer.meta["cached_tokens"] == shorter.meta["cached_tokens"] == 0
    cold = retriever(runner_for(t5_dir), cache=False)
    assert cold.run(enc[:-1], beam_width=64, top_k=64, num_items=10).items == shorter.items
    alloc = runner.memory.allocator
    assert alloc.available_size() + ex.tree.total_size() == runner.memory.size
    assert ex.tree.total_size() == 3 * (len(enc) + 1) and ex.tree.protected_size() == 0  # inputs and digests


@pytest.mark.parametrize("widths", [[4, 16, 8], [2, 4, 8]])  # narrow beams: one padded cross-attention a step
def test_a_round_of_requests_gives_each_what_it_gets_alone(t5_dir, widths):
    runner = runner_for(t5_dir)
    ex = retriever(runner, cache=False)
    reqs = [dict(input_ids=ids(9 + 4 * k, seed=20 + k), beam_width=bw, top_k=bw, num_items=min(bw, 3))
            for k, bw in enumerate(widths)]
    together = ex.run_batch(reqs)
    alone = [ex.run(**r) for r in reqs]
    for a, b in zip(together, alone):
        assert [it["item"] for it in a.items] == [it["item"] for it in b.items]
        assert max(abs(x["score"] - y["score"]) for x, y in zip(a.items, b.items)) <= 1e-5


def test_exclusions_and_capacity_errors(t5_dir):
    from sgrec.beam import KVCacheFullError

    runner = runner_for(t5_dir)
    ex = retriever(runner, cache=False)
    enc = ids(12, seed=3)
    first = [it["item"] for it in ex.run(enc, beam_width=8, top_k=8, num_items=8).items]
    got = ex.run(enc, beam_width=8, top_k=8, num_items=8, exclude_items=first[:3])
    rest = retriever(runner, cache=False, catalog=Catalog([it for it in ex.catalog.items if it.id not in first[:3]]))
    assert [it["item"] for it in got.items] == [it["item"] for it in rest.run(enc, beam_width=8, top_k=8,
                                                                            num_items=8).items]
    small = retriever(runner_for(t5_dir, max_total_tokens=64), cache=False)
    with pytest.raises(KVCacheFullError, match="lower beam_width or raise --max-total-tokens"):
        small.run(ids(40, seed=1), beam_width=64, top_k=64, num_items=4)


def test_the_whole_key_shares_no_prefix_between_different_inputs():
    a, b = whole_key([5, 6, 7]), whole_key([5, 6, 8])
    assert a[1:] == [5, 6, 7] and a[0] != b[0] and min(a[0], b[0]) >= 1 << 62
    assert whole_key([5, 6, 7]) == a and whole_key([5, 6]) [0] != a[0]


# ---- rank: each candidate's path under the decoder --------------------------------------------------
def ranker(runner, catalog: Catalog):
    from sgrec.rank.executor import RankExecutor

    return RankExecutor(runner, RadixCache(runner.memory.allocator), catalog, runner.args)


def path_logliks(hf, enc: list[int], paths: list[tuple]) -> dict[tuple, float]:
    """Each path's teacher-forced log-likelihood under transformers' decoder (full-vocabulary
    log_softmax at every level), one path at a time."""
    out = {}
    for p in paths:
        logp = torch.log_softmax(hf_logits(hf, enc, [0, *p[:-1]]), -1)
        out[p] = sum(logp[d, t].item() for d, t in enumerate(p))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_scores_each_candidates_path_with_transformers_numbers_in_any_order(gated_dir, hf_t5, dtype):
    """The profile and the instruction are the encoder's input; each candidate's log-likelihood is
    transformers' teacher-forced one (float32: rounding; bfloat16: a few steps of four levels'
    log-probabilities) and the ranking is their softmax; reversing the candidates changes no bit; the
    user's next request finds its input whole in the tree."""
    runner = runner_for(gated_dir, dtype)
    catalog = sid_catalog(60, seed=2)
    ex = ranker(runner, catalog)
    user, instr = ids(19, seed=7), ids(3, seed=8)
    cands = [it.id for it in catalog.items[::7]]
    got = ex.run("u1", user, cands, instr)
    paths = {it.id: tuple(it.semantic_id) for it in catalog.items}
    want = path_logliks(hf_t5(gated_dir, runner.dtype), user + instr, [paths[c] for c in cands])
    tol = 2e-4 if runner.dtype == torch.float32 else 0.3
    assert sorted(r["item"] for r in got["ranking"]) == sorted(cands)
    assert max(abs(r["log_likelihood"] - want[paths[r["item"]]]) for r in got["ranking"]) <= tol
    probs = torch.softmax(torch.tensor([r["log_likelihood"] for r in got["ranking"]], dtype=torch.float64), 0)
    assert torch.allclose(torch.tensor([r["score"] for r in got["ranking"]], dtype=torch.float64), probs, atol=1e-6)
    assert got["meta_info"]["score_by"] == "semantic_id" and got["meta_info"]["cached_tokens"] == 0
    again = ex.run("u1", user, cands[::-1], instr)
    assert again["meta_info"]["cached_tokens"] == len(user) + len(instr)
    assert {r["item"]: r["log_likelihood"] for r in again["ranking"]} == {r["item"]: r["log_likelihood"]
                                                                          for r in got["ranking"]}
    assert runner.memory.allocator.available_size() + ex.tree.total_size() == runner.memory.size
    assert ex.tree.protected_size() == 0


def test_rank_refuses_what_an_encoder_decoder_cannot_mean(t5_dir):
    runner = runner_for(t5_dir)
    catalog = sid_catalog(20, seed=1)
    ex = ranker(runner, catalog)
    cands = [it.id for it in catalog.items[:3]]
    with pytest.raises(ValueError, match="score_by 'id_token'.*semantic-ID path"):
        ex.run("u", ids(5, seed=1), cands, [5], score_by="id_token")
    with pytest.raises(ValueError, match="prefix 'item'.*reads no item tokens"):
        ex.run("u", ids(5, seed=1), cands, [5], prefix="item")
    assert len(ex.run("u", ids(5, seed=1), cands, [5], prefix="none")["ranking"]) == 3
    assert ex.tree.total_size() == 0  # prefix none: nothing cached


# ---- the input cache under LARU and the host tier -----------------------------------------------------
def test_inputs_evicted_to_the_host_tier_come_back_as_whole_hits_under_laru(t5_dir, tmp_path):
    """Four users' 63-token inputs (whole keys of four 16-token pages) through a pool that holds two:
    LARU evicts inputs to the host tier, and each user's repeat loads its whole key back, is a hit
    (the encoder does not run) and gets its cold answer, bit for bit."""
    from sgrec.engine import Engine

    from test_rec_server import write_catalog

    catalog = write_catalog(tmp_path / "catalog.jsonl", n=27, seed=1, semantic=True)
    eng = Engine(model_path=t5_dir, device="cpu", dtype="float32", item_catalog=catalog, max_total_tokens=200,
                 enable_hierarchical_cache=True, hicache_page_size=16, radix_eviction_policy="laru")
    users = [ids(63, seed=40 + u) for u in range(4)]
    ask = lambda u: eng.retrieve(user={"token_ids": users[u]}, beam_width=8, num_items=4)  # noqa: E731
    cold = [ask(u) for u in range(4)]
    assert [c["meta_info"]["cached_tokens"] for c in cold] == [0] * 4
    encoded = eng.runner.encoded_inputs
    warm = [ask(u) for u in range(4)]
    assert eng.scheduler.hicache.loaded_tokens["host"] >= 64  # at least one input came back from the host
    assert [w["meta_info"]["cached_tokens"] for w in warm] == [63] * 4 and eng.runner.encoded_inputs == encoded
    assert [w["items"] for w in warm] == [c["items"] for c in cold]
    eng.scheduler.check_memory()


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_inputs_move_between_engines_through_storage(t5_dir, tmp_path, monkeypatch, request, backend):
    """One engine encodes two users' inputs for retrieve and a third for generate, and writes their
    pages to the storage tier (a folder, or a real Mooncake Store on loopback); the other finds each
    whole there on the user's next request (the prefetch asks for the whole key): a hit with no
    encoder pass and the first engine's answer."""
    from sgrec.engine import Engine

    from test_rec_server import write_catalog

    if backend == "mooncake":
        master = request.getfixturevalue("master")
        extra = dict(hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend_extra_config=json.dumps(
            {"master_server_address": master.address, "global_segment_size": 64 << 20,
             "local_buffer_size": 16 << 20}))
    else:
        monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "store"))
        extra = {}
    catalog = write_catalog(tmp_path / "catalog.jsonl", n=27, seed=1, semantic=True)
    a, b = (Engine(model_path=t5_dir, device="cpu", dtype="float32", item_catalog=catalog, max_total_tokens=400,
                   enable_hierarchical_cache=True, hicache_page_size=16, hicache_storage_backend=backend, **extra)
            for _ in range(2))
    users = [ids(63, seed=50 + u) for u in range(3)]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = [a.retrieve(user={"token_ids": u}, beam_width=8, num_items=4) for u in users[:2]]
    wrote = a.generate(input_ids=users[2], sampling_params=sp)
    a.scheduler.hicache.flush()  # every page written (the writer is off the step)
    moved = [b.retrieve(user={"token_ids": u}, beam_width=8, num_items=4) for u in users[:2]]
    assert [m["meta_info"]["cached_tokens"] for m in moved] == [63, 63] and b.runner.encoded_inputs == 0
    assert [m["items"] for m in moved] == [f["items"] for f in first]
    read = b.generate(input_ids=users[2], sampling_params=sp)
    assert read["meta_info"]["cached_tokens"] == 63 and b.runner.encoded_inputs == 0
    assert read["output_ids"] == wrote["output_ids"]
    assert b.scheduler.hicache.stats()["loaded_tokens"]["storage"] == 3 * 64
    b.scheduler.check_memory()


# ---- a real server -----------------------------------------------------------------------------------
def test_a_server_retrieves_transformers_beams_and_refuses_what_an_encoder_cannot_mean(
        start_server, t5_dir, hf_t5, tmp_path):
    """The default dtype, the radix cache on: /v1/retrieve over the whole catalog gives transformers'
    exhaustive scores, its repeat is a cache hit with the same answer, /generate's constrained beams
    are retrieve's, /v1/rank gives transformers' path log-likelihoods and /v1/recommend is retrieve
    then rank; the input's token logprobs and rank by id token are 400s that say why, and the server
    goes on serving (generation and scoring: test_t5_generate.py)."""
    from sgrec.model import cpu_caps

    from test_rec_server import write_catalog

    catalog = write_catalog(tmp_path / "catalog.jsonl", n=27, seed=1, semantic=True)
    srv = start_server(t5_dir, "--dtype", "auto", "--max-total-tokens", "4096", "--item-catalog", catalog,
                       "--max-beam-width", "32")
    dtype = torch.bfloat16 if cpu_caps.cpu_bf16_support().native else torch.float32
    tol = 2e-4 if dtype == torch.float32 else 0.3  # as in the tests above
    history = ids(21, seed=21)
    body = {"user": {"id": "u1", "token_ids": history}, "beam_width": 32, "num_items": 27}
    r = srv.client.post("/v1/retrieve", json=body)
    assert r.status_code == 200, r.text
    with open(catalog) as f:
        paths = {it["id"]: it["semantic_id"] for it in map(json.loads, f)}
    sids = Catalog([Item(i, (1,), 1, tuple(p)) for i, p in paths.items()])
    want = exhaustive_scores(hf_t5(t5_dir, dtype), sids, history)
    got = r.json()["items"]
    assert sorted(it["item"] for it in got) == sorted(want)
    assert all(it["semantic_id"] == paths[it["item"]] for it in got)
    assert max(abs(it["score"] - want[it["item"]]) for it in got) <= tol
    again = srv.client.post("/v1/retrieve", json=body).json()
    assert again["meta_info"]["cached_tokens"] == len(history) and again["items"] == got

    beams = srv.client.post("/generate", json={"input_ids": history, "sampling_params": {"beam_width": 8, "n": 3},
                                               "constrain_to_catalog": True})
    assert beams.status_code == 200, beams.text
    ref = srv.client.post("/v1/retrieve", json={"user": {"token_ids": history}, "beam_width": 8,
                                                "num_items": 3}).json()["items"]
    assert [b["output_ids"] for b in beams.json()["meta_info"]["beam_results"]] == [x["semantic_id"] for x in ref]

    r = srv.client.post("/generate", json={"input_ids": history, "return_logprob": True, "logprob_start_len": 0,
                                           "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 400 and "logprob_start_len 0: an encoder-decoder model's prompt" in r.text, r.text
    instr = [5, 6]
    rank = srv.client.post("/v1/rank", json={"user": {"id": "u1", "token_ids": history}, "items": ["i1", "i20", "i7"],
                                             "instruction": instr})
    assert rank.status_code == 200, rank.text
    want = path_logliks(hf_t5(t5_dir, dtype), history + instr, [tuple(paths[i]) for i in ("i1", "i20", "i7")])
    assert max(abs(r["log_likelihood"] - want[tuple(paths[r["item"]])]) for r in rank.json()["ranking"]) <= tol
    bad = srv.client.post("/v1/rank", json={"user": {"token_ids": history}, "items": ["i1"], "instruction": instr,
                                            "score_by": "id_token"})
    assert bad.status_code == 400 and "score_by 'id_token'" in bad.text, bad.text
    rec = srv.client.post("/v1/recommend", json={"user": {"id": "u1", "token_ids": history},
                                                 "rank": {"instruction": instr},
                                                 "retrieve": {"beam_width": 8, "num_candidates": 4}})
    assert rec.status_code == 200, rec.text
    retrieved = srv.client.post("/v1/retrieve", json={"user": {"token_ids": history}, "beam_width": 8,
                                                      "num_items": 4}).json()["items"]
    ranked = srv.client.post("/v1/rank", json={"user": {"id": "u1", "token_ids": history}, "instruction": instr,
                                               "items": [x["item"] for x in retrieved]}).json()["ranking"]
    assert [x["item"] for x in rec.json()["items"]] == [x["item"] for x in ranked]
    assert srv.client.post("/v1/retrieve", json=body).json()["items"] == got  # still serving
