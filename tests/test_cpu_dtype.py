"""--dtype auto on CPU: bfloat16 where the CPU multiplies it natively, float32 elsewhere;
a warning for an explicit half dtype without native matmuls; bf16 agrees with float32 on a tiny model.

Every decision is tested with injected CPU flags, so the verdicts do not depend on this machine."""

import logging

import pytest
import torch
import torch.nn.functional as F

from sgrec import Engine
from sgrec.model import cpu_caps, cpu_linear
from sgrec.model.config import ModelConfig, resolve_dtype
from sgrec.model.cpu_caps import NativeSupport, bf16_support, fp16_support, parse_cpuinfo
from tests.test_hf_equivalence import dists, full_logprob_request, random_ids

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16_TOL = 5e-2  # logprob max abs diff of bf16 against float32
MARGIN = 1e-2  # ... and the same greedy tokens wherever float32's top-2 margin exceeds this
PROMPT, NEW = 40, 16
AVX2_ONLY = {"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
SAPPHIRE_RAPIDS = AVX512_NO_BF16 | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}


def config(config_dtype=None) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                       mlp_bias=False, qk_norm=False, config_dtype=config_dtype)


@pytest.fixture
def no_detection(monkeypatch):
    """Fails any test that reaches the real CPU detection."""
    def boom():
        raise AssertionError("the real CPU was probed")
    monkeypatch.setattr(cpu_caps, "cpu_bf16_support", boom)
    monkeypatch.setattr(cpu_caps, "cpu_fp16_support", boom)


# ---- detection over injected flags ----------------------------------------------------------

@pytest.mark.parametrize("flags,native", [
    ({"avx2", "avx512f", "avx512_bf16"}, True),  # Zen 4, Cooper Lake
    ({"avx2", "amx_tile", "amx_bf16"}, True),  # AMX without the AVX-512 flag
    (SAPPHIRE_RAPIDS, True),
    (AVX2_ONLY, False),
    (AVX512_NO_BF16, False),  # Skylake-X: bf16 only emulated
    (set(), False),
])
def test_native_bf16_from_flags(flags, native):
    got = bf16_support(flags)
    assert got.native is native
    assert ("avx512_bf16" in got.reason or "amx_bf16" in got.reason)


def test_native_flags_need_onednn_bf16():
    got = bf16_support({"avx512_bf16"}, onednn_bf16=False)
    assert not got.native and "oneDNN" in got.reason


def test_native_fp16_from_flags():
    assert fp16_support(SAPPHIRE_RAPIDS).native
    assert not fp16_support({"avx512_bf16", "amx_bf16"}).native


def test_parse_cpuinfo():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n" \
          "flags\t\t: fpu\n"
    assert parse_cpuinfo(x86) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n"
    assert parse_cpuinfo(arm) == {"fp", "asimd", "bf16", "i8mm"}
    assert not bf16_support(parse_cpuinfo(arm)).native  # ARM's bf16 is not measured here: float32
    assert parse_cpuinfo("model name\t: x\n") == frozenset()


# ---- resolve_dtype --------------------------------------------------------------------------

@pytest.mark.parametrize("flags,want", [
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx2", "amx_tile", "amx_bf16"}, torch.bfloat16),
    (AVX2_ONLY, torch.float32),
    (AVX512_NO_BF16, torch.float32),
])
def test_auto_on_cpu_follows_native_bf16(no_detection, caplog, flags, want):
    with caplog.at_level(logging.INFO, logger="sgrec.model.config"):
        got = resolve_dtype("auto", config(torch.bfloat16), CPU, bf16=bf16_support(flags))
    assert got == want
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    (msg,) = [r.getMessage() for r in caplog.records if "--dtype auto on CPU" in r.getMessage()]
    assert str(want).removeprefix("torch.") in msg
    assert ("avx512_bf16" in msg) or ("amx_bf16" in msg)  # the flags seen (or missed) are named


def test_explicit_bf16_without_native_warns(no_detection, caplog):
    with caplog.at_level(logging.INFO, logger="sgrec.model.config"):
        assert resolve_dtype("bfloat16", config(), CPU, bf16=bf16_support(AVX2_ONLY)) == torch.bfloat16
    (warn,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "100x slower" in warn.getMessage() and "bfloat16" in warn.getMessage()


def test_explicit_half_with_native_is_quiet(no_detection, caplog):
    with caplog.at_level(logging.INFO, logger="sgrec.model.config"):
        assert resolve_dtype("bfloat16", config(), CPU, bf16=bf16_support(SAPPHIRE_RAPIDS)) == torch.bfloat16
        assert resolve_dtype("float16", config(), CPU, fp16=fp16_support(SAPPHIRE_RAPIDS)) == torch.float16
        assert resolve_dtype("float32", config(), CPU) == torch.float32  # float32 never probes the CPU
    assert not caplog.records


def test_explicit_fp16_without_native_warns(no_detection, caplog):
    with caplog.at_level(logging.WARNING, logger="sgrec.model.config"):
        assert resolve_dtype("float16", config(), CPU, fp16=fp16_support({"avx512_bf16"})) == torch.float16
    (warn,) = caplog.records
    assert "float16" in warn.getMessage() and "slower" in warn.getMessage()


@pytest.mark.parametrize("config_dtype,dtype,want", [
    (None, "auto", torch.bfloat16),
    (torch.float32, "auto", torch.bfloat16),
    (torch.bfloat16, "auto", torch.bfloat16),
    (torch.float16, "auto", torch.float16),
    (torch.float16, "float32", torch.float32),
    (None, "bfloat16", torch.bfloat16),
    (None, "half", torch.float16),
])
def test_cuda_resolution_unchanged(no_detection, caplog, config_dtype, dtype, want):
    with caplog.at_level(logging.INFO, logger="sgrec.model.config"):
        assert resolve_dtype(dtype, config(config_dtype), CUDA) == want
    assert not caplog.records


def test_unknown_dtype_is_rejected(no_detection):
    with pytest.raises(ValueError, match="Unknown dtype"):
        resolve_dtype("int8", config(), CPU)


# ---- what follows the dtype -----------------------------------------------------------------

@pytest.mark.parametrize("native", [False, True])
def test_bf16_weights_are_packed_only_with_native_bf16(monkeypatch, native):
    monkeypatch.setattr(cpu_linear, "cpu_bf16_support", lambda: NativeSupport(native, "injected"))
    fp32 = cpu_linear.packing_available(CPU, torch.float32)
    assert cpu_linear.packing_available(CPU, torch.bfloat16) == (native and fp32)
    assert not cpu_linear.packing_available(CPU, torch.float16)
    assert not cpu_linear.packing_available(CUDA, torch.bfloat16)


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                    reason="this CPU/torch has no oneDNN bf16 matmul (packing is never chosen for bf16 here)")
def test_packed_bf16_linear_matches_plain():
    torch.manual_seed(0)
    w, b = (torch.randn(768, 512) * 0.05).bfloat16(), torch.randn(768).bfloat16()
    layer = cpu_linear.PackedLinear(w, b)
    for rows in (1, 16, 100):
        x = torch.randn(rows, 512).bfloat16()
        got, want = layer(x), F.linear(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        # Both accumulate in float32 and round once to bf16: at most a few bf16 ulps apart (|y| < 8).
        assert (got.float() - want.float()).abs().max().item() <= 0.1


def test_auto_engine_on_this_cpu(tiny_model_dir, caplog):
    """Whatever auto picks on this machine, the KV pool follows it, the choice is logged and the
    output agrees with float32's (within bf16's tolerance, below)."""
    path = tiny_model_dir("llama", initializer_range=0.02)
    with caplog.at_level(logging.INFO, logger="sgrec.model.config"):
        engine = Engine(path, device="cpu", dtype="auto", max_total_tokens=512)
    want = torch.bfloat16 if cpu_caps.cpu_bf16_support().native else torch.float32
    assert engine.runner.dtype == want and engine.runner.kv_pool.k_buffer[0].dtype == want
    assert any("--dtype auto on CPU" in r.getMessage() for r in caplog.records)
    prompt = list(range(10, 30))
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0},
                          return_logprob=True)
    lp, tok = out["meta_info"]["output_token_logprobs"][0][:2]
    ref = Engine(path, device="cpu", dtype="float32", max_total_tokens=512).generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 1}, return_logprob=True, token_ids_logprob=[tok])
    assert abs(ref["meta_info"]["output_token_ids_logprobs"][0][0][0] - lp) <= BF16_TOL


# ---- bfloat16 agrees with float32 -----------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_agrees_with_float32(tiny_model_dir, arch):
    """At HF's init scale (0.02): the default tiny model's 0.2 makes activations so large that bf16
    is off by up to 0.6 in logprob, as it is in HF transformers (and on SmolLM2-135M, 0.5)."""
    path = tiny_model_dir(arch, initializer_range=0.02)
    engines = {dt: Engine(path, device="cpu", dtype=dt, max_total_tokens=1024) for dt in ("float32", "bfloat16")}
    assert engines["bfloat16"].runner.kv_pool.k_buffer[0].dtype == torch.bfloat16
    for seed in range(3):
        ids = random_ids(PROMPT, engines["float32"].vocab_size, seed=seed)
        # rows 0..PROMPT-2: the prompt's next-token distributions; PROMPT-1+i: output step i's
        res = {}
        for dt, e in engines.items():
            meta = (out := full_logprob_request(e, ids, start=0, max_new_tokens=NEW))["meta_info"]
            res[dt] = (torch.cat([dists(meta["input_token_ids_logprobs"][1:]),
                                  dists(meta["output_token_ids_logprobs"])]), out["output_ids"])
        (ref, ref_out), (got, got_out) = res["float32"], res["bfloat16"]
        assert ref.dtype == got.dtype == torch.float32
        # Free-running greedy tokens agree until float32's first near-tie ...
        top2 = ref.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > MARGIN
        stop = next((i for i in range(NEW) if not clear[PROMPT - 1 + i]), NEW)
        assert got_out[:stop] == ref_out[:stop], (seed, stop)
        # ... and over identical contexts (the prompt, the outputs up to the first differing token)
        # the logprobs agree within BF16_TOL, and so do the greedy picks where float32's margin is clear.
        same = next((i for i in range(NEW) if got_out[i] != ref_out[i]), NEW - 1)
        rows = PROMPT + same
        diff = (got[:rows] - ref[:rows]).abs().max().item()
        assert 0 < diff <= BF16_TOL, (seed, diff)  # > 0: bf16 really ran
        picks = clear[:rows]
        assert picks.sum().item() >= PROMPT // 2  # the greedy check compares real positions
        assert torch.equal(got[:rows][picks].argmax(-1), ref[:rows][picks].argmax(-1)), seed
