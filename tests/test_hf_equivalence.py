"""sgrec's logits equal HF transformers' (float32, max abs diff <= 1e-4) on every cached path."""

import random

import pytest
import torch

from sgrec import Engine

TOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CONFIGS = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("qwen2", {}, id="qwen2"),
    pytest.param("qwen3", {}, id="qwen3"),
    pytest.param("llama", {"tie_word_embeddings": True}, id="llama-tied"),
    pytest.param("llama", {"rope_scaling": LLAMA3_ROPE}, id="llama-rope-llama3"),
    pytest.param("qwen2", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, id="qwen2-rope-linear"),
]


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] next-token log-probabilities after each position."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def dists(entries) -> torch.Tensor:
    """Rows of full-vocabulary logprobs from *_token_ids_logprobs entries (asked for every id in order)."""
    return torch.tensor([[e[0] for e in row] for row in entries])


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def make_engine(path, **kw):
    return Engine(path, device="cpu", dtype="float32", max_total_tokens=4096, **kw)


def full_logprob_request(engine, ids, start, max_new_tokens=1, **kw):
    return engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=start,
        token_ids_logprob=list(range(engine.vocab_size)),
        **kw,
    )


def check_against_hf(out, ref: torch.Tensor, ids: list[int], start: int) -> None:
    """Input entries start..n-1 (first null) and the first output distribution equal HF's."""
    meta = out["meta_info"]
    n = len(ids)
    entries = meta["input_token_ids_logprobs"]
    assert len(entries) == n - start and entries[0] is None
    got = dists(entries[1:])
    assert got.shape == (n - start - 1, ref.shape[1])
    assert (got - ref[start : n - 1]).abs().max().item() <= TOL
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[start:]
    vals = torch.tensor([e[0] for e in meta["input_token_logprobs"][1:]])
    want = ref[torch.arange(start, n - 1), torch.tensor(ids[start + 1 :])]
    assert (vals - want).abs().max().item() <= TOL
    first_out = dists(meta["output_token_ids_logprobs"][:1])[0]
    assert (first_out - ref[n - 1]).abs().max().item() <= TOL


@pytest.mark.parametrize("arch,overrides", CONFIGS)
def test_plain_prefill(tiny_model_dir, hf_model, arch, overrides):
    path = tiny_model_dir(arch, **overrides)
    engine = make_engine(path)
    ids = random_ids(70, engine.vocab_size, seed=1)  # past 32 so llama3 scaling's bands all matter
    out = full_logprob_request(engine, ids, start=0)
    check_against_hf(out, hf_logprobs(hf_model(path), ids), ids, 0)
    assert out["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("arch,overrides", CONFIGS[:3])
def test_prefill_after_radix_hit(tiny_model_dir, hf_model, arch, overrides):
    path = tiny_model_dir(arch, **overrides)
    engine = make_engine(path)
    ids = random_ids(50, engine.vocab_size, seed=2)
    engine.generate(input_ids=ids[:30], sampling_params={"max_new_tokens": 0})
    prompt = ids[:20] + random_ids(17, engine.vocab_size, seed=3)
    out = full_logprob_request(engine, prompt, start=20)
    assert out["meta_info"]["cached_tokens"] == 20
    check_against_hf(out, hf_logprobs(hf_model(path), prompt), prompt, 20)
    # Without prompt logprobs the whole shared part is reused; the next token is unchanged.
    again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert again["output_ids"][0] == out["output_ids"][0]
    engine.check_memory()


@pytest.mark.parametrize("arch,overrides", CONFIGS[:3])
def test_chunked_prefill(tiny_model_dir, hf_model, arch, overrides):
    path = tiny_model_dir(arch, **overrides)
    engine = make_engine(path, chunked_prefill_size=7)
    ids = random_ids(45, engine.vocab_size, seed=4)
    ref = hf_logprobs(hf_model(path), ids)
    check_against_hf(full_logprob_request(engine, ids, start=0), ref, ids, 0)
    # A chunked prefill that starts after a radix hit, with logprobs from the middle of a chunk.
    engine.flush_cache()
    engine.generate(input_ids=ids[:12], sampling_params={"max_new_tokens": 0})
    out = full_logprob_request(engine, ids, start=16)
    assert out["meta_info"]["cached_tokens"] == 12
    check_against_hf(out, ref, ids, 16)
    engine.check_memory()


@pytest.mark.parametrize("arch,overrides", CONFIGS[:3])
def test_batched_decode_mixed_lengths(tiny_model_dir, hf_model, arch, overrides):
    path = tiny_model_dir(arch, **overrides)
    engine = make_engine(path)
    prompts = [random_ids(n, engine.vocab_size, seed=10 + n) for n in (3, 11, 26, 40)]
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        token_ids_logprob=list(range(engine.vocab_size)),
    )
    model = hf_model(path)
    for prompt, out in zip(prompts, outs):
        gen = out["output_ids"]
        assert len(gen) == 16
        full = prompt + gen
        ref = hf_logprobs(model, full)[len(prompt) - 1 : len(full) - 1]
        got = dists(out["meta_info"]["output_token_ids_logprobs"])
        assert (got - ref).abs().max().item() <= TOL
        assert gen == ref.argmax(dim=-1).tolist()  # greedy picks HF's argmax at every step
        assert out["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1
    engine.check_memory()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_generation_equals_hf(tiny_model_dir, hf_model, arch):
    path = tiny_model_dir(arch)
    engine = make_engine(path)
    model = hf_model(path)
    prompts = ["the quick brown fox", "what is the best movie of the year", "hello"]
    for text in prompts:
        out = engine.generate(text, sampling_params={"max_new_tokens": 24, "temperature": 0})
        ids = engine.tokenizer.encode(text)
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=24, pad_token_id=engine.tokenizer.eos_token_id,
            )
        assert out["output_ids"] == hf[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_hf_same_dtype(tiny_model_dir, arch, dtype):
    """On the torch attention backend (torch's SDPA and element-wise ops, as HF runs them), sgrec's
    half-precision logprobs equal HF's in the same dtype up to that dtype's rounding. The default
    backend's bfloat16 (sgrec's own kernels) is held to HF's float32 in the test below."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    torch_dtype = getattr(torch, dtype)
    engine = Engine(path, device="cpu", dtype=dtype, max_total_tokens=1024, attention_backend="torch")
    assert engine.runner.kv_pool.k_buffer[0].dtype == torch_dtype
    ids = random_ids(30, engine.vocab_size, seed=5)
    out = full_logprob_request(engine, ids, start=0, max_new_tokens=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa").eval()
    ref = hf_logprobs(hf, ids)
    got = dists(out["meta_info"]["input_token_ids_logprobs"][1:])
    # Same dtype, same op order: equal up to the dtype's rounding (measured: bit-equal on x86 CPUs).
    assert (got - ref[:-1]).abs().max().item() <= (1e-2 if dtype == "bfloat16" else 2e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bfloat16_defaults_are_as_close_to_float32_as_hf_bfloat16(tiny_model_dir, arch):
    """Invariant 1's agreement with HF in bfloat16, on the default backend (sgrec's C kernels on CPUs
    with AVX-512: bf16 dot products where avx512_bf16 is reported; torch's SDPA elsewhere): bfloat16
    rounds differently in every implementation (HF's own bfloat16 is 0.3-0.8 from its float32 in max abs
    logprob on these random models; two bfloat16 implementations are 0.13-0.28 apart), so sgrec's
    bfloat16 is held to HF's float32 reference no less closely than HF's bfloat16 is: mean abs within
    1.15x of HF-bf16's, max abs within 1.5x (measured 0.95-1.06x and 0.87-1.19x over 24 prompts of
    30 and 200 tokens on the three architectures)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    engine = Engine(path, device="cpu", dtype="bfloat16", max_total_tokens=1024)
    ids = random_ids(200, engine.vocab_size, seed=5)
    got = dists(full_logprob_request(engine, ids, start=0)["meta_info"]["input_token_ids_logprobs"][1:])
    engine.shutdown()
    ref32, ref16 = (hf_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="sdpa").eval(),
                                ids)[:-1] for dt in (torch.float32, torch.bfloat16))
    ours, hfs = (got - ref32).abs(), (ref16 - ref32).abs()
    assert ours.mean() <= 1.15 * hfs.mean() and ours.max() <= 1.5 * hfs.max()


@pytest.mark.parametrize("tied", [False, True])
def test_packed_cpu_weights_match_plain_weights(tiny_model_dir, tied):
    # Large enough that every matrix is packed (small ones stay plain: see cpu_linear.MIN_PACKED_NUMEL).
    path = tiny_model_dir("llama", hidden_size=512, intermediate_size=1024, tie_word_embeddings=tied)
    plain = make_engine(path, disable_weight_packing=True)
    packed = make_engine(path)  # the default on CPU
    assert packed.runner.packed and not plain.runner.packed
    model = packed.runner.model
    assert {type(m).__name__ for m in (model.layers[0].mlp.down_proj, model.layers[1].self_attn.qkv_proj,
                                       model.lm_head)} == {"PackedLinear"}
    ids = random_ids(40, packed.vocab_size, seed=9)
    a = full_logprob_request(packed, ids, start=0, max_new_tokens=8)
    b = full_logprob_request(plain, ids, start=0, max_new_tokens=8)
    assert a["output_ids"] == b["output_ids"]
    diff = (dists(a["meta_info"]["input_token_ids_logprobs"][1:]) - dists(b["meta_info"]["input_token_ids_logprobs"][1:]))
    # Measured 9e-4 here (logits up to ~40): a different float32 summation order, not a bug, within the
    # 2e-3 agreement with HF (ARCHITECTURE.md, invariant 1). A loading or layout bug would be off by whole units.
    assert diff.abs().max().item() <= 5e-3
