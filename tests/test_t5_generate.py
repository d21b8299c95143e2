"""The encoder-decoder family (T5) on the sampled paths: /generate with text or input_ids for the
encoder and the decoder's output (continuous batching, streaming, logprobs, retraction), the OpenAI
routes and /v1/score, against transformers on the same checkpoint, with the encoder reading each
distinct input once and the scheduler's accounting balanced."""

from __future__ import annotations

import json

import pytest
import torch

from sgrec.engine import Engine

from test_rank import ids
from test_t5_model import hf_t5, t5_dir  # noqa: F401 (fixtures)

DTYPES = ["float32", "auto"]  # auto: bfloat16 where the CPU has avx512_bf16 / AMX


def engine(path: str, dtype: str = "float32", **kw) -> Engine:
    return Engine(model_path=path, device="cpu", dtype=dtype, **{"max_total_tokens": 4096, **kw})


def hf_decoder_logprobs(hf, enc: list[int], dec: list[int]) -> torch.Tensor:
    """transformers' float32 log_softmax after each decoder token of `dec` (its start token first)."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_transformers(hf, enc: list[int], out: dict, start: int, lp_tol: float, margin: float) -> None:
    """Each output token is transformers' argmax after the same decoder prefix (unless its top two
    are within `margin`) and its logprob is transformers' within lp_tol."""
    toks = out["output_ids"]
    ref = hf_decoder_logprobs(hf, enc, [start, *toks[:-1]])
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, *_ in lps] == toks
    for t, (lp, tok, *_) in enumerate(lps):
        top2 = ref[t].topk(2).values
        assert tok == int(ref[t].argmax()) or float(top2[0] - top2[1]) < margin, (t, tok)
        assert abs(lp - float(ref[t, tok])) <= lp_tol, (t, lp, float(ref[t, tok]))


def bounds(eng: Engine) -> tuple[float, float]:
    """(logprob tolerance, argmax margin) against transformers in the runner's dtype: float32
    rounding, or bfloat16's (as the retrieve tests' bounds)."""
    return (2e-3, 1e-2) if eng.runner.dtype == torch.float32 else (0.1, 0.2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_generation_of_a_batch_is_transformers(t5_dir, hf_t5, dtype):
    """Three inputs of different lengths in one call (one prefill batch, then decode batches that
    carry each sequence's encoder slots): transformers' tokens and logprobs, each input encoded once."""
    eng = engine(t5_dir, dtype)
    inputs = [ids(13, seed=1), ids(5, seed=2), ids(30, seed=3)]
    before = eng.runner.encoded_inputs
    outs = eng.generate(input_ids=inputs, sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
                        return_logprob=True)
    assert eng.runner.encoded_inputs - before == 3
    hf = hf_t5(t5_dir, eng.runner.dtype)
    tol, margin = bounds(eng)
    for enc, out in zip(inputs, outs):
        assert len(out["output_ids"]) == 12 and out["meta_info"]["prompt_tokens"] == len(enc)
        check_against_transformers(hf, enc, out, eng.runner.config.decoder_start_token_id, tol, margin)
    eng.scheduler.check_memory()


def test_generation_alone_equals_generation_beside_others_and_a_repeat_is_a_cache_hit(t5_dir):
    eng = engine(t5_dir)
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    enc = ids(17, seed=7)
    alone = eng.generate(input_ids=enc, sampling_params=sp)
    assert alone["meta_info"]["cached_tokens"] == 0
    before = eng.runner.encoded_inputs
    again = eng.generate(input_ids=enc, sampling_params=sp)
    assert eng.runner.encoded_inputs == before and again["meta_info"]["cached_tokens"] == len(enc)
    assert again["output_ids"] == alone["output_ids"]
    eng.flush_cache()
    batch = eng.generate(input_ids=[ids(9, seed=8), enc, ids(25, seed=9)], sampling_params=sp)
    assert batch[1]["output_ids"] == alone["output_ids"]
    eng.scheduler.check_memory()


def test_n_samples_of_one_input_encode_it_once_and_a_seed_repeats_them(t5_dir):
    eng = engine(t5_dir, disable_radix_cache=False)
    enc = ids(21, seed=11)
    sp = {"max_new_tokens": 8, "temperature": 1.0, "n": 4, "sampling_seed": 5}
    before = eng.runner.encoded_inputs
    first = eng.generate(input_ids=enc, sampling_params=sp)
    assert eng.runner.encoded_inputs - before == 1 and len(first) == 4
    eng.flush_cache()
    second = eng.generate(input_ids=enc, sampling_params=sp)
    assert [o["output_ids"] for o in second] == [o["output_ids"] for o in first]
    eng.scheduler.check_memory()


def test_retracted_requests_resume_with_the_tokens_they_get_alone(t5_dir):
    """A pool too small for every request's outputs: decode retracts the newest request (its decoder
    KV to the tree under its input's namespace, its input released) and re-admits it later, with the
    greedy tokens it gets alone."""
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    inputs = [ids(20, seed=20 + i) for i in range(4)]
    small = engine(t5_dir, max_total_tokens=150)
    outs = small.generate(input_ids=inputs, sampling_params=sp)
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
    ref = engine(t5_dir)
    for enc, out in zip(inputs, outs):
        assert out["output_ids"] == ref.generate(input_ids=enc, sampling_params=sp)["output_ids"]
    small.scheduler.check_memory()


@pytest.mark.parametrize("dtype", DTYPES)
def test_score_reads_the_labels_at_the_decoders_first_step(t5_dir, hf_t5, dtype):
    """/v1/score on an encoder-decoder (monoT5's form): the encoder reads query + item, the labels'
    probabilities are the decoder's first distribution; apply_softmax normalises over the labels."""
    eng = engine(t5_dir, dtype)
    query, items, labels = ids(11, seed=30), [ids(4, seed=31), ids(7, seed=32)], [5, 9, 40]
    got = eng.score(query=query, items=items, label_token_ids=labels)
    soft = eng.score(query=query, items=items, label_token_ids=labels, apply_softmax=True)
    hf = hf_t5(t5_dir, eng.runner.dtype)
    tol = 1e-4 if eng.runner.dtype == torch.float32 else 2e-2
    start = eng.runner.config.decoder_start_token_id
    for item, scores, norm in zip(items, got.scores, soft.scores):
        lp = hf_decoder_logprobs(hf, query + item, [start])[0]
        assert scores == pytest.approx([float(lp[t].exp()) for t in labels], abs=tol)
        assert norm == pytest.approx(torch.softmax(lp[labels], -1).tolist(), abs=tol)
    eng.scheduler.check_memory()


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_mode_gives_a_request_its_bits_alone_in_any_batch(t5_dir, dtype):
    """--enable-deterministic-inference: a request's tokens and logprobs, bit for bit, alone and
    beside inputs of other lengths (encoded in the same forward, decoded in the same batches)."""
    eng = engine(t5_dir, dtype, enable_deterministic_inference=True, disable_radix_cache=True)
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    lp = {"return_logprob": True, "top_logprobs_num": 3}
    enc = ids(17, seed=60)
    alone = eng.generate(input_ids=enc, sampling_params=sp, **lp)
    for others in ([ids(5, seed=61), ids(40, seed=62)], [ids(17, seed=63)] * 3):
        got = eng.generate(input_ids=[others[0], enc, *others[1:]], sampling_params=sp, **lp)[1]
        assert got["output_ids"] == alone["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert got["meta_info"][key] == alone["meta_info"][key]
    eng.scheduler.check_memory()


def test_what_the_encoder_cannot_give_is_a_400_naming_the_field(t5_dir):
    eng = engine(t5_dir)
    with pytest.raises(ValueError, match="logprob_start_len 0: an encoder-decoder model's prompt is read by its encoder"):
        eng.generate(input_ids=ids(5, seed=1), sampling_params={"max_new_tokens": 2}, return_logprob=True,
                     logprob_start_len=0)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        engine(t5_dir, max_total_tokens=40).generate(input_ids=ids(39, seed=1), sampling_params={"max_new_tokens": 2})


# ---- a real server -----------------------------------------------------------------------------------
def test_a_server_answers_generate_streaming_the_openai_routes_and_score(start_server, t5_dir, hf_t5):
    """The default dtype, the radix cache on: /generate with input_ids and with text (the encoder's
    input), streamed and not, the OpenAI completions and chat routes through the openai client, and
    /v1/score; echo with logprobs is a 400 naming echo, and the server goes on serving."""
    import openai

    srv = start_server(t5_dir, "--dtype", "auto", "--max-total-tokens", "4096")
    enc = ids(19, seed=40)
    body = {"input_ids": enc, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    r = srv.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    from sgrec.model import cpu_caps

    dtype = torch.bfloat16 if cpu_caps.cpu_bf16_support().native else torch.float32
    tol, margin = (2e-3, 1e-2) if dtype == torch.float32 else (0.1, 0.2)
    check_against_transformers(hf_t5(t5_dir, dtype), enc, out, 0, tol, margin)

    with srv.client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[5:]) for ln in lines[:-1]]  # cumulative (tokens may share a chunk)
    assert all(b["output_ids"][: len(a["output_ids"])] == a["output_ids"] for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["output_ids"] == out["output_ids"] and chunks[-1]["text"] == out["text"]

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="m", prompt=enc, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == out["text"]
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == out["text"]
    text = srv.client.post("/generate", json={"text": "a user who liked", "sampling_params": {"max_new_tokens": 6,
                                              "temperature": 0}}).json()
    assert client.completions.create(model="m", prompt="a user who liked", max_tokens=6,
                                     temperature=0).choices[0].text == text["text"]
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")

    with pytest.raises(openai.BadRequestError, match="echo with logprobs"):
        client.completions.create(**kw, echo=True, logprobs=2)

    r = srv.client.post("/v1/score", json={"query": enc, "items": [[5, 6], [7]], "label_token_ids": [3, 4]})
    assert r.status_code == 200, r.text
    hf = hf_t5(t5_dir, dtype)
    for item, scores in zip([[5, 6], [7]], r.json()["scores"]):
        lp = hf_decoder_logprobs(hf, enc + item, [0])[0]
        assert scores == pytest.approx([float(lp[t].exp()) for t in (3, 4)], abs=1e-4 if dtype == torch.float32
                                       else 2e-2)
    assert srv.client.post("/generate", json=body).json()["output_ids"] == out["output_ids"]  # still serving
