"""sgrec's C kernels for CPU (sgrec.model.native): the decode attention kernel against the float64
reference, the backend that uses it against the torch backend, and the build's fallback."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from sgrec.mem.kv_pool import KVPool
from sgrec.model import native
from sgrec.model.attention import ForwardBatch, NativeBackend, SeqLayout, TorchBackend, make_backend
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs
from tests.kernel_refs import case, decode_logits, reference

needs_kernels = pytest.mark.skipif(native.compiler() is None and not os.environ.get("CI"),
                                   reason="no C compiler on this machine")


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 16), (9, 3, 64), (8, 1, 24), (14, 2, 96)])
@pytest.mark.parametrize("lens", [[1], [5, 16, 17, 40], [3, 300, 1, 33, 129]])
def test_decode_attention_equals_reference(hq, hkv, d, lens):
    """GQA ratios 1, 3, 8, 7; head dims that are and are not multiples of the vector width; one-token
    and long sequences in one batch; slots scattered over the pool."""
    q, k_buf, v_buf, idx, ptr = case(hq, hkv, d, lens, torch.float32, seed=len(lens) + hq)
    out = native.decode_attention(q, k_buf, v_buf, idx, ptr, d ** -0.5)
    assert out.shape == (len(lens), hq * d) and out.dtype == torch.float32
    assert (out.double() - reference(q, k_buf, v_buf, idx, ptr, d ** -0.5)).abs().max() <= 1e-5


@needs_kernels
def test_decode_attention_bfloat16_and_a_wrong_input_is_caught():
    q, k_buf, v_buf, idx, ptr = case(6, 2, 16, [9, 31, 64], torch.bfloat16, seed=5)
    out = native.decode_attention(q, k_buf, v_buf, idx, ptr, 0.25)
    want = reference(q.float(), k_buf.float(), v_buf.float(), idx, ptr, 0.25)
    assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() <= 2e-2
    wrong = native.decode_attention(q, k_buf, v_buf, idx.flip(0), ptr, 0.25)  # other slots
    assert (wrong.double() - want).abs().max() > 1e-1


@needs_kernels
def test_a_sequence_gets_the_same_bits_in_any_batch():
    """Each (sequence, KV head) is one task whatever else the batch holds: no padding, no batch
    dependence (SDPA over a padded batch gives no such guarantee)."""
    q, k_buf, v_buf, idx, ptr = case(6, 2, 32, [7, 200, 3], torch.float32, seed=11)
    together = native.decode_attention(q, k_buf, v_buf, idx, ptr, 0.2)
    for b in range(3):
        alone = native.decode_attention(q[b : b + 1], k_buf, v_buf, idx[ptr[b] : ptr[b + 1]],
                                        torch.tensor([0, int(ptr[b + 1] - ptr[b])]), 0.2)
        assert torch.equal(alone[0], together[b])


@needs_kernels
def test_bad_inputs_are_refused_before_the_kernel():
    q, k_buf, v_buf, idx, ptr = case(6, 2, 16, [4, 5], torch.float32, seed=1)
    with pytest.raises(TypeError, match="one dtype"):
        native.decode_attention(q.double(), k_buf, v_buf, idx, ptr, 0.25)
    with pytest.raises(ValueError, match="shapes"):
        native.decode_attention(q[:, :5], k_buf, v_buf, idx, ptr, 0.25)  # 5 query heads over 2 KV heads
    with pytest.raises(ValueError, match="shapes"):
        native.decode_attention(q, k_buf, v_buf, idx, ptr[:2], 0.25)


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_backend_decode_equals_torch_backend(dtype, tol):
    """K/V written into one pool, then read by slot: the same outputs as the torch backend's decode."""
    hq, hkv, d, lens = 6, 2, 16, [1, 13, 4, 30]
    pool = KVPool(200, 1, hkv, d, dtype)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]))
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]))
    slots = (torch.randperm(200)[: sum(lens)] + 1).split(lens)
    seqs = [SeqLayout(i, 1, sl) for i, sl in enumerate(slots)]
    new = torch.stack([sl[-1] for sl in slots])
    q, k, v = (torch.randn(len(lens), h, d).to(dtype) for h in (hq, hkv, hkv))
    outs = []
    for backend in (TorchBackend(), NativeBackend()):
        batch = ForwardBatch(torch.zeros(len(lens), dtype=torch.int64), torch.zeros(len(lens), dtype=torch.int64),
                             new, seqs, pool)
        backend.prepare(batch)
        outs.append(backend.forward(q, k, v, 0, batch, d ** -0.5).float())
    assert (outs[0] - outs[1]).abs().max() <= tol


@needs_kernels
def test_runner_with_the_native_backend_decodes_like_torch(tiny_model_dir):
    """A tiny qwen3 (GQA, q/k norms): prefill, then 4 decode steps of two sequences of different
    lengths; the native-backend runner's logits == the torch-backend runner's within 1e-5."""
    path = tiny_model_dir("qwen3")
    runners = [ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32", max_total_tokens=256,
                                                  attention_backend=name)) for name in ("torch", "native")]
    assert type(runners[0].backend) is TorchBackend and isinstance(runners[1].backend, NativeBackend)
    logits = [decode_logits(r) for r in runners]
    assert (logits[0] - logits[1]).abs().max() <= 1e-5


def test_without_a_compiler_native_is_a_clear_error(monkeypatch, tmp_path, caplog):
    """No compiler on PATH and none in CC: one warning, auto is still the torch backend, native is a
    clear error, and nothing is cached."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SGREC_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="sgrec.model.native"):
        assert native.load() is None
        assert type(make_backend("auto", "cpu")) is TorchBackend
    assert [r.getMessage() for r in caplog.records].count(
        "CPU kernels unavailable, using the pure-torch paths: no C compiler found (set CC, or install cc/gcc/clang)") == 1
    with pytest.raises(ValueError, match="needs a C compiler"):
        make_backend("native", "cpu")
    assert not (tmp_path / "cache").exists()


def test_a_compiler_that_fails_is_a_fallback_too(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CC", "false")  # exists, fails every build
    monkeypatch.setenv("SGREC_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sgrec.model.native"):
        assert native.load() is None
    assert any("false could not build decode_attention.c" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "native").iterdir()) == []  # no half-written library left behind


@needs_kernels
def test_the_build_command_caches_the_library(tmp_path):
    """`python -m sgrec.model.native` builds into $SGREC_CACHE_DIR/native and prints the path; a second
    run loads the same file without rebuilding it."""
    env = {**os.environ, "SGREC_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-m", "sgrec.model.native"], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip()
    assert os.path.dirname(path) == str(tmp_path / "native") and os.path.exists(path)
    mtime = os.stat(path).st_mtime_ns
    second = subprocess.run([sys.executable, "-m", "sgrec.model.native"], env=env, capture_output=True, text=True)
    assert second.stdout.strip() == path and os.stat(path).st_mtime_ns == mtime
