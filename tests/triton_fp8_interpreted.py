"""FP8 on CPU under Triton's interpreter: the activation kernel against the float32
quantize-dequantize reference, bit for bit; the layer (the kernel, then torch._scaled_mm, which
runs on CPU too) against linear_ref; a model with its linear layers in FP8 against the same model in
bfloat16. Run by tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_kernels.py with TRITON_INTERPRET=1", allow_module_level=True)

from sgrec.model.fp8 import FP8, FP8_MAX, Fp8Linear, linear_ref, quantize_rows, quantize_rows_ref  # noqa: E402


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 16), (5, 64), (3, 1000), (2, 4096), (2, 8208)])
def test_quantize_rows_equals_the_reference(dtype, m, k):
    """Rows within one block and over several (4096 columns a block); every element and scale the
    reference's, bit for bit."""
    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]).to(dtype)
    q, s = quantize_rows(x)
    qr, sr = quantize_rows_ref(x)
    assert q.dtype == FP8 and same_bits(q, qr) and torch.equal(s, sr)
    deq = q.float() * s[:, None]
    assert ((deq - x.float()).abs() <= x.float().abs().amax(1, keepdim=True) / 16).all()  # within e4m3's step


def test_quantize_rows_edges():
    """A zero row (finite scale, zeros out); the row's max maps to 448 exactly; values that round up
    across a power of two (where the interpreter's own cast halves them); the subnormal range; a
    strided view; no rows."""
    x = torch.zeros(5, 32)
    x[1, :4] = torch.tensor([448.0, -448.0, 125.9, -31.85])
    x[2] = torch.linspace(-1, 1, 32) * 1e-4
    x[2, 0] = 1.0  # the rest lands in e4m3's subnormals
    x[3] = torch.linspace(-3, 3, 32)
    x[4, ::2] = 7.0
    x[4, 1:6] = torch.tensor([-1e-9, 1e-9, -0.0, -3e-3, 2e-3])  # round to -0, +0, -0, and e4m3's least values
    q, s = quantize_rows(x)
    qr, sr = quantize_rows_ref(x)
    assert same_bits(q, qr) and torch.equal(s, sr)
    assert s[0] > 0 and (q[0].float() == 0).all()
    assert q[1, 0].float() == FP8_MAX and q[1, 1].float() == -FP8_MAX and q[1, 2].float() == 128
    assert q[4, 1:4].view(torch.uint8).tolist() == [0x80, 0, 0x80]
    wide = torch.randn(4, 96)
    q2, s2 = quantize_rows(wide[:, 8:72])  # rows 96 apart
    qr2, sr2 = quantize_rows_ref(wide[:, 8:72])
    assert same_bits(q2, qr2) and torch.equal(s2, sr2)
    q0, s0 = quantize_rows(torch.empty(0, 32))
    assert q0.shape == (0, 32) and s0.shape == (0,)


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_the_quantize_dequantize_reference(bias):
    torch.manual_seed(1)
    lin = torch.nn.Linear(256, 96, bias=bias).to(torch.bfloat16)
    layer = Fp8Linear(lin)
    x = torch.randn(3, 7, 256).to(torch.bfloat16)
    out = layer(x)
    ref = linear_ref(x, layer.qweight, layer.wscale, layer.bias)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 7, 96)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2  # the bf16 output's rounding
    exact = lin(x).float()
    assert ((out.float() - exact).norm() / exact.norm()).item() < 0.06  # what FP8 costs


def test_a_model_in_fp8_follows_its_bf16_self(tiny_model_dir):
    """The tiny Qwen3 with its decoder's linear layers in FP8: every projection replaced, the output
    layer kept; its last-token logits close to the bf16 model's."""
    from sgrec.model.attention import SeqLayout, TorchBackend
    from sgrec.model.config import ModelConfig
    from sgrec.model.loader import load_model
    from sgrec.mem.kv_pool import KVPool
    from sgrec.runner import ModelRunner
    from sgrec.server_args import ServerArgs

    path = tiny_model_dir("qwen3", seed=3)
    cfg = ModelConfig.from_dir(path)
    cpu = torch.device("cpu")
    ref_runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="bfloat16", max_total_tokens=256,
                                        attention_backend="torch"))
    fp8 = load_model(path, cfg, cpu, torch.bfloat16, quantization="fp8")
    layers = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * cfg.num_layers and not isinstance(fp8.lm_head, Fp8Linear)
    ids = list(range(5, 45))
    n = len(ids)

    def last_logits(model) -> torch.Tensor:
        pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, cpu)
        slots = torch.arange(1, n + 1)
        batch = ref_runner.make_batch(ids, list(range(n)), slots, [SeqLayout(0, n, slots)])
        batch.kv_pool = pool
        with torch.inference_mode():
            hidden = model(batch, TorchBackend())
        return model.compute_logits(hidden[-1:]).float()[0]

    want, got = last_logits(ref_runner.model), last_logits(fp8)
    assert ((got - want).norm() / want.norm()).item() < 0.2  # measured 0.13 (a transposed weight: ~1.4)
    assert torch.topk(got, 1).indices[0] in torch.topk(want, 5).indices


# ---- the FP8 KV pool (--kv-cache-dtype fp8_e4m3) ----------------------------------------------------
def fp8_pool(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the e4m3 buffer, the same values in float32) of a random float32 buffer, saturated as KVPool does."""
    q = buf.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, q.float()


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_reads_an_fp8_pool_as_its_values(splits):
    """The decode kernel on an e4m3 pool gives the bits it gives on a float32 pool of the same values."""
    from sgrec.model.kernels.decode_attention import decode_attention
    from tests.kernel_refs import case

    q, k_buf, v_buf, idx, ptr = case(8, 2, 32, [5, 40, 17], torch.float32, seed=11)
    k8, kf = fp8_pool(k_buf * 30)
    v8, vf = fp8_pool(v_buf)
    got = decode_attention(q, k8, v8, idx, ptr, 0.2, splits=splits)
    assert torch.equal(got, decode_attention(q, kf, vf, idx, ptr, 0.2, splits=splits))


def test_beam_and_rank_kernels_read_an_fp8_pool_as_its_values():
    """The staged beam-step kernel and the bipartite (rank / extend) kernel likewise."""
    from sgrec.beam.attention import BeamStepMeta, beams_as_blocks
    from sgrec.model.kernels.bipartite_attention import bipartite_attention
    from sgrec.model.kernels.staged_attention import staged_attention

    g = torch.Generator().manual_seed(5)
    buf = torch.randn(200, 2, 32, generator=g) * 4
    (k8, kf), (v8, vf) = fp8_pool(buf), fp8_pool(buf.flip(0))
    q = torch.randn(6, 8, 32, generator=g)
    shared, unshared = torch.arange(1, 101), torch.arange(101, 119).view(6, 3)
    assert torch.equal(staged_attention(q, k8, v8, shared, unshared, 0.2), staged_attention(q, kf, vf, shared, unshared, 0.2))
    c = beams_as_blocks(BeamStepMeta(shared, unshared))
    new = torch.randn(6, 2, 32, generator=g)
    args = (c.q_start, c.q_end, c.q_order, c.q_block, c.c_idx, c.c_ptr, c.c_order, c.c_block, 0.2)
    assert torch.equal(bipartite_attention(q, new, new, k8, v8, *args), bipartite_attention(q, new, new, kf, vf, *args))


def test_pool_saturates_what_it_stores():
    from sgrec.mem.kv_pool import KVPool

    pool = KVPool(8, 1, 1, 4, FP8, attn_dtype=torch.float32)
    k = torch.tensor([[[1000.0, -1000.0, 0.3, -2.0]]])
    pool.set_kv(0, torch.tensor([3]), k, -k)
    assert pool.k_buffer[0][3, 0].float().tolist() == [448.0, -448.0, 0.3125, -2.0]
    assert pool.v_buffer[0][3, 0].float().tolist() == [-448.0, 448.0, -0.3125, 2.0]
    assert KVPool.bytes_per_token(2, 4, 8, FP8) * 2 == KVPool.bytes_per_token(2, 4, 8, torch.bfloat16)


@pytest.fixture(scope="module")
def kv_engines(tiny_model_dir, tmp_path_factory):
    """tests/test_fp8.py's pair on CPU: float32 model, triton backend, FP8's GPU check waived."""
    import sgrec.model.fp8 as fp8
    from tests.test_fp8 import fp8_kv_engines

    mp = pytest.MonkeyPatch()
    mp.setattr(fp8, "fp8_unsupported", lambda device: None)
    yield fp8_kv_engines(mp, tiny_model_dir("qwen3", seed=6), tmp_path_factory, dtype="float32", device="cpu",
                         attention_backend="triton")
    mp.undo()


def test_an_fp8_kv_engine_equals_one_that_rounds_its_kv(kv_engines):
    from tests.test_fp8 import assert_same_outputs

    assert_same_outputs(*kv_engines)
