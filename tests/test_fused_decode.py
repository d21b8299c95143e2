"""The fused decode step (sgrec.model.fused_decode, native/decode.c), bfloat16 and float32, against the
slow, obviously right references: its matrix-vector product against float64 in every ISA build this CPU
runs, and whole decode steps against HF's float32 model, held to invariant 1's bounds (bfloat16: no
further from HF-float32 than HF's own bf16; float32: within 2e-3, the same greedy tokens)."""

import pytest
import torch

from sgrec import Engine
from sgrec.model import fused_decode, native
from sgrec.model.cpu_caps import cpu_flags
from sgrec.model.fused_decode import FusedDecode
from tests.test_native_kernels import isa_builds, isa_id

LIB = native.load()
HAS_FUSED = fused_decode.available(torch.device("cpu"), torch.bfloat16, LIB)
HAS_FUSED_F32 = fused_decode.available(torch.device("cpu"), torch.float32, LIB)
needs_fused = pytest.mark.skipif(not HAS_FUSED, reason="the bf16 fused decode step needs a CPU with avx512_bf16 "
                                                       "(and a C compiler): this one runs the layer-by-layer path")
needs_fused_f32 = pytest.mark.skipif(not HAS_FUSED_F32, reason="the float32 fused decode step needs AVX2 + FMA or "
                                                               "AVX-512 (and a C compiler)")
F32_BUILDS = [m for m in isa_builds() if m]  # the x86-64-v3 / v4 builds this CPU runs (the float32 step's)


def built_dtypes(march: list[str]) -> set:
    """The dtypes decode.c runs in a build with these flags: float32 from AVX2 + FMA (x86-64-v3) up,
    bfloat16 with -mavx512bf16 (never a dtype whose instructions the build was not given)."""
    return ({torch.float32} if march else set()) | ({torch.bfloat16} if "-mavx512bf16" in march else set())


def gemv(w, x, bias=None, lib=LIB):
    B, K = x.shape
    y = torch.empty(B, w.shape[0], dtype=w.dtype)
    assert lib.sgrec_gemv(w.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(), K, y.data_ptr(),
                          w.shape[0], w.shape[0], K, B, int(w.dtype == torch.bfloat16)) == 0
    return y


@pytest.mark.parametrize("march", isa_builds(), ids=isa_id)
def test_each_build_runs_the_dtypes_its_flags_give(march):
    lib = native.library(march)
    assert {dt for dt, bit in fused_decode.DTYPE_BITS.items() if lib.sgrec_fused_decode() & bit} == built_dtypes(march)
    if lib.sgrec_fused_decode() == 1:  # float32 only: a bf16 product is refused, not run on missing instructions
        w, x = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.bfloat16)
        y = torch.empty(1, 4, dtype=torch.bfloat16)
        assert lib.sgrec_gemv(w.data_ptr(), None, x.data_ptr(), 8, y.data_ptr(), 4, 4, 8, 1, 1) == 2


@pytest.mark.parametrize("march", [m for m in isa_builds() if torch.bfloat16 in built_dtypes(m)], ids=isa_id)
@pytest.mark.parametrize("N,K", [(96, 64), (101, 77), (7, 15), (960, 576), (33, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_is_float64_rounded_to_bfloat16_and_rows_are_independent(march, N, K, with_bias):
    lib = native.library(march)
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(9, K, generator=g).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16() if with_bias else None
    y = gemv(w, x, bias, lib)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # float32 sums of exact bf16 products, rounded once: within one bf16 step of float64's value
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5 * K).all()
    # a row's values do not depend on the other rows of the batch
    for b in (0, 4, 8):
        assert torch.equal(gemv(w, x[b : b + 1].contiguous(), bias, lib)[0], y[b])


@pytest.mark.parametrize("march", F32_BUILDS, ids=isa_id)
@pytest.mark.parametrize("N,K", [(96, 64), (101, 77), (7, 15), (960, 576), (33, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_gemv_is_within_float32_summation_error_and_rows_are_independent(march, N, K, with_bias):
    lib = native.library(march)
    g = torch.Generator().manual_seed(N + K)
    w, x = torch.randn(N, K, generator=g), torch.randn(9, K, generator=g)
    bias = torch.randn(N, generator=g) if with_bias else None
    y = gemv(w, x, bias, lib)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # any order of K float32 multiply-adds (and the bias): within (K + 1) units of 2^-24 of the sum of |terms|
    scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    assert ((y.double() - ref).abs() <= (K + 1) * 2**-24 * scale).all()
    for b in (0, 1, 4, 8):  # every pass width (1, 2, 4 rows) gives a row the same bits
        assert torch.equal(gemv(w, x[b : b + 1].contiguous(), bias, lib)[0], y[b])
        assert torch.equal(gemv(w, x[b : b + 3].contiguous(), bias, lib)[0], y[b])


def decode_logprobs(engine, prompt, n):
    """[n, vocab] logprobs of n greedy decode steps (the first one comes from the prefill)."""
    out = engine.generate(input_ids=prompt, return_logprob=True, token_ids_logprob=list(range(engine.vocab_size)),
                          sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    rows = out["meta_info"]["output_token_ids_logprobs"]
    return torch.tensor([[e[0] for e in row] for row in rows]), out["output_ids"]


def fused_decode_logprobs(engine, prompt, n):
    """decode_logprobs of a fresh engine, then (logprobs, output ids, the batch size of every call of its
    fused step); the engine is shut down."""
    taken = []
    run = engine.runner.fused.run
    engine.runner.fused.run = lambda batch: taken.append(len(batch.seqs)) or run(batch)
    got, out_ids = decode_logprobs(engine, prompt, n)
    engine.shutdown()
    return got, out_ids, taken


@needs_fused
@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                            ("llama", {"tie_word_embeddings": True})])
def test_fused_decode_is_as_close_to_float32_as_hf_bfloat16(tiny_model_dir, arch, overrides):
    """Greedy decode steps of the default bf16 engine (the fused step on this CPU) against HF's float32
    logprobs over the same tokens: within invariant 1's bf16 bound (mean abs within 1.15x of HF-bf16's,
    max within 1.5x), as the prefill is held in test_hf_equivalence."""
    from transformers import AutoModelForCausalLM

    from tests.test_hf_equivalence import hf_logprobs, random_ids

    path = tiny_model_dir(arch, **overrides)
    engine = Engine(path, device="cpu", dtype="bfloat16", max_total_tokens=1024)
    assert engine.runner.fused is not None
    prompt = random_ids(40, engine.vocab_size, seed=11)
    n = 24
    got, out_ids, taken = fused_decode_logprobs(engine, prompt, n)
    assert taken == [1] * (n - 1)  # every decode step went through the fused path
    ids = prompt + out_ids
    ref32, ref16 = (hf_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="sdpa").eval(),
                                ids)[len(prompt) : len(prompt) + n - 1] for dt in (torch.float32, torch.bfloat16))
    ours, hfs = (got[1:] - ref32).abs(), (ref16 - ref32).abs()
    assert ours.mean() <= 1.15 * hfs.mean() and ours.max() <= 1.5 * hfs.max()


@needs_fused_f32
@pytest.mark.parametrize("march", F32_BUILDS, ids=isa_id)
@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                            ("llama", {"tie_word_embeddings": True})])
def test_float32_fused_decode_agrees_with_hf_float32(tiny_model_dir, march, arch, overrides):
    """Greedy decode steps of the float32 engine through the fused step of each build this CPU runs (the
    x86-64-v3 one included: what AVX2-only CPUs run under --attention-backend native) against HF's float32
    model over the same tokens: within invariant 1's 2e-3, and the layer-by-layer path's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from tests.test_hf_equivalence import hf_logprobs, random_ids

    path = tiny_model_dir(arch, **overrides)
    engine = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024)
    assert engine.runner.fused is not None  # float32 on the C kernels: the fused step is the default here
    engine.runner.fused = FusedDecode(engine.runner.model, native.library(march))
    prompt = random_ids(40, engine.vocab_size, seed=11)
    n = 24
    got, out_ids, taken = fused_decode_logprobs(engine, prompt, n)
    assert taken == [1] * (n - 1)
    plain = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024, disable_fused_decode=True)
    assert decode_logprobs(plain, prompt, n)[1] == out_ids
    plain.shutdown()
    ref = hf_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval(),
                      prompt + out_ids)[len(prompt) : len(prompt) + n - 1]
    assert (got[1:] - ref).abs().max() <= 2e-3


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=needs_fused, id="bfloat16"),
    pytest.param(torch.float32, marks=needs_fused_f32, id="float32")])
def test_fused_and_layer_by_layer_decode_agree_at_every_batch_size(tiny_model_dir, dtype):
    """Decode batches of 1 .. MAX_BATCH + 1 sequences (the last: past MAX_BATCH, the layer-by-layer path)
    give each sequence the tokens the layer-by-layer path gives it, and logprobs within the dtype's
    rounding of them (bf16: 0.1; float32: 1e-4, another summation order of the products)."""
    path = tiny_model_dir("llama")
    name = str(dtype).removeprefix("torch.")
    fused = Engine(path, device="cpu", dtype=name, max_total_tokens=2048)
    plain = Engine(path, device="cpu", dtype=name, max_total_tokens=2048, disable_fused_decode=True)
    assert plain.runner.fused is None
    from tests.test_hf_equivalence import random_ids

    most, tol = fused_decode.MAX_BATCH[dtype], 0.1 if dtype == torch.bfloat16 else 1e-4
    taken = []
    run = fused.runner.fused.run
    fused.runner.fused.run = lambda batch: taken.append(len(batch.seqs)) or run(batch)
    for b in sorted({1, 2, 3, most, most + 1}):
        prompts = [random_ids(10 + 7 * i, fused.vocab_size, seed=100 + i) for i in range(b)]
        params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        outs = [e.generate(input_ids=prompts, sampling_params=params, return_logprob=True) for e in (fused, plain)]
        for f, p in zip(*outs):
            lp_f = torch.tensor([e[0] for e in f["meta_info"]["output_token_logprobs"]])
            lp_p = torch.tensor([e[0] for e in p["meta_info"]["output_token_logprobs"]])
            if f["output_ids"] == p["output_ids"]:
                assert (lp_f - lp_p).abs().max() <= tol
            else:  # a near-tie flipped by bf16 rounding: the logprobs agree up to the flip
                assert dtype == torch.bfloat16
                k = next(i for i, (a, c) in enumerate(zip(f["output_ids"], p["output_ids"])) if a != c)
                assert (lp_f[: k + 1] - lp_p[: k + 1]).abs().max() <= tol
    assert taken and max(taken) == most  # up to MAX_BATCH, and no further
    fused.shutdown()
    plain.shutdown()


def test_fused_decode_is_off_where_its_contract_does_not_hold(tiny_model_dir):
    """The torch backend, --enable-deterministic-inference and --disable-fused-decode run the
    layer-by-layer path in both dtypes; on the default backend the fused step runs exactly where the
    kernels were built for the dtype: bf16 on avx512_bf16, float32 on AVX2 + FMA or AVX-512 (never a
    default on a feature not detected)."""
    from sgrec.model.attention import NativeBackend

    path = tiny_model_dir("llama")
    for dtype, has in (("bfloat16", HAS_FUSED), ("float32", HAS_FUSED_F32)):
        for kw in ({"attention_backend": "torch"}, {"enable_deterministic_inference": True},
                   {"disable_fused_decode": True}):
            engine = Engine(path, device="cpu", max_total_tokens=512, dtype=dtype, **kw)
            assert engine.runner.fused is None, (dtype, kw)
            engine.shutdown()
        engine = Engine(path, device="cpu", dtype=dtype, max_total_tokens=512)
        on_kernels = isinstance(engine.runner.backend, NativeBackend)
        assert (engine.runner.fused is not None) == (on_kernels and has), dtype
        engine.shutdown()
    flags = native.march_flags(cpu_flags())
    assert LIB is None or (HAS_FUSED, HAS_FUSED_F32) == (torch.bfloat16 in built_dtypes(flags), torch.float32 in built_dtypes(flags))


@needs_fused
def test_bench_fused_decode_runs_both_paths(tiny_model_dir):
    """benchmarks/bench_fused_decode.py on a tiny model (a smoke run of the script, not a measurement):
    a row per batch size, both paths timed, greedy outputs compared."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_fused_decode.py"), "--model-path",
                        tiny_model_dir("llama"), "--batch-sizes", "1", "3", "--steps", "3", "--repeats", "1",
                        "--prompt-len", "12"], cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[0] for r in rows] == ["| 1", "| 3"]
    for r in rows:  # times parse (their values are the machine's: not checked); outputs compared per sequence
        cells = r.strip("| ").split(" | ")
        float(cells[1]), float(cells[3])
        assert cells[-1] in ("0/1", "1/1") if cells[0] == "1" else cells[-1].endswith("/3")
