"""Triton kernels against their torch references on CPU, under Triton's interpreter. Run by
tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1 set before triton is imported (the
interpreter replaces triton.language's own jitted helpers at import, so it cannot be switched on
inside a process that already imported triton). Not collected by a plain `pytest` run."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_kernels.py with TRITON_INTERPRET=1", allow_module_level=True)

from sgrec.mem.kv_pool import KVPool  # noqa: E402
from sgrec.model.attention import ForwardBatch, SeqLayout, TorchBackend, TritonBackend  # noqa: E402
from sgrec.beam import RetrieveExecutor, naive_retrieve  # noqa: E402
from sgrec.beam.attention import staged_attention as torch_staged  # noqa: E402
from sgrec.model.kernels.decode_attention import decode_attention  # noqa: E402
from sgrec.model.kernels.staged_attention import staged_attention  # noqa: E402
from sgrec.radix.tree import RadixCache  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
from tests.kernel_refs import case, decode_logits, reference  # noqa: E402
from tests.test_beam import assert_same, random_catalog  # noqa: E402


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 16), (9, 3, 32), (8, 1, 24)])
@pytest.mark.parametrize("lens,block_n", [([1], 16), ([5, 16, 17, 40], 16), ([3, 70, 1, 33], 32)])
def test_decode_attention_equals_reference(hq, hkv, d, lens, block_n):
    """GQA ratios 1, 3, 3, 8; head dims that are and are not powers of two; lengths below, at
    and across block boundaries; slots scattered over the pool."""
    q, k_buf, v_buf, idx, ptr = case(hq, hkv, d, lens, torch.float32, seed=len(lens) + hq)
    scale = d ** -0.5
    out = decode_attention(q, k_buf, v_buf, idx, ptr, scale, block_n=block_n)
    assert out.shape == (len(lens), hq * d) and out.dtype == torch.float32
    assert (out.double() - reference(q, k_buf, v_buf, idx, ptr, scale)).abs().max() <= 1e-5


def test_decode_attention_bfloat16():
    q, k_buf, v_buf, idx, ptr = case(6, 2, 16, [9, 31, 64], torch.bfloat16, seed=5)
    out = decode_attention(q, k_buf, v_buf, idx, ptr, 0.25)
    assert out.dtype == torch.bfloat16
    assert (out.double() - reference(q, k_buf, v_buf, idx, ptr, 0.25)).abs().max() <= 2e-2


def test_the_comparison_can_fail():
    """A kernel reading one slot off (each sequence's first slot skipped) is caught."""
    q, k_buf, v_buf, idx, ptr = case(4, 2, 16, [6, 9], torch.float32, seed=2)
    wrong = decode_attention(q, k_buf, v_buf, idx, ptr + torch.tensor([1, 1, 0]), 0.25)
    assert (wrong.double() - reference(q, k_buf, v_buf, idx, ptr, 0.25)).abs().max() > 1e-3


def test_triton_backend_decode_equals_torch_backend():
    """The backend a runner uses with --attention-backend triton: same outputs as the torch
    backend's decode on one pool and batch (K/V written first, then read by slot)."""
    hq, hkv, d, lens = 6, 2, 16, [1, 13, 4, 30]
    pool = KVPool(200, 1, hkv, d, torch.float32)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]))
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]))
    slots = (torch.randperm(200)[: sum(lens)] + 1).split(lens)
    seqs = [SeqLayout(i, 1, sl) for i, sl in enumerate(slots)]
    new = torch.stack([sl[-1] for sl in slots])
    q, k, v = torch.randn(len(lens), hq, d), torch.randn(len(lens), hkv, d), torch.randn(len(lens), hkv, d)
    outs = []
    for backend in (TorchBackend(), TritonBackend()):
        batch = ForwardBatch(torch.zeros(len(lens), dtype=torch.int64), torch.zeros(len(lens), dtype=torch.int64),
                             new, seqs, pool)
        backend.prepare(batch)
        outs.append(backend.forward(q, k, v, 0, batch, d ** -0.5))
    assert (outs[0] - outs[1]).abs().max() <= 1e-5


def test_runner_with_the_triton_backend_decodes_like_torch(tiny_model_dir):
    """A tiny qwen3 (GQA, q/k norms): prefill, then 4 decode steps of two sequences of different
    lengths; logits of the triton-backend runner == the torch-backend runner's within 1e-4."""
    path = tiny_model_dir("qwen3")
    runners = [ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32", max_total_tokens=256,
                                                  attention_backend=name)) for name in ("torch", "triton")]
    assert isinstance(runners[1].backend, TritonBackend)
    logits = [decode_logits(r) for r in runners]
    assert (logits[0] - logits[1]).abs().max() <= 1e-4


def staged_case(hq, hkv, d, P, n, s, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    size = P + n * s + 9
    k_buf, v_buf = (torch.randn(size, hkv, d, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(size, generator=g)
    return (torch.randn(n, hq, d, generator=g).to(dtype), k_buf, v_buf, perm[:P], perm[P : P + n * s].view(n, s))


@pytest.mark.parametrize("hq,hkv,d,P,n,s,block_b", [
    (6, 2, 16, 40, 7, 2, 4),  # GQA 3, beams not a multiple of the block
    (4, 4, 32, 1, 5, 1, 2),  # a one-token prompt
    (8, 1, 24, 70, 9, 0, 4),  # prompt only (no own token)
    (6, 3, 16, 0, 3, 2, 8),  # no prompt KV: own tokens only
    (9, 3, 64, 33, 16, 3, 16),
])
def test_staged_kernel_equals_torch_staged_attention(hq, hkv, d, P, n, s, block_b):
    """The kernel == sgrec.beam.attention.staged_attention (the torch stages and merge)."""
    q, k_buf, v_buf, sh, un = staged_case(hq, hkv, d, P, n, s, torch.float32, seed=P + n)
    out = staged_attention(q, k_buf, v_buf, sh, un, d ** -0.5, block_b=block_b, block_n=16)
    assert out.shape == (n, hq * d)
    assert (out - torch_staged(q, k_buf, v_buf, sh, un, d ** -0.5)).abs().max() <= 1e-5


def test_staged_kernel_bfloat16_and_a_wrong_input_is_caught():
    q, k_buf, v_buf, sh, un = staged_case(6, 2, 16, 50, 6, 2, torch.bfloat16, seed=3)
    out = staged_attention(q, k_buf, v_buf, sh, un, 0.25)
    want = torch_staged(q.float(), k_buf.float(), v_buf.float(), sh, un, 0.25)
    assert out.dtype == torch.bfloat16 and (out.float() - want).abs().max() <= 2e-2
    wrong = staged_attention(q, k_buf, v_buf, sh, un[:, :1], 0.25)  # each beam's current token left out
    assert (wrong.float() - want).abs().max() > 1e-1


@pytest.mark.parametrize("bw,top_k", [(8, 8), (24, 5)])
def test_retrieve_with_the_triton_backend_equals_naive_and_torch(tiny_model_dir, bw, top_k):
    """RetrieveExecutor on a runner with --attention-backend triton (the staged kernel in beam
    steps) == naive_retrieve on it (the decode kernel) == RetrieveExecutor on the torch backend."""
    import random

    path = tiny_model_dir("qwen2")
    runners = {name: ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32",
                                                        max_total_tokens=4000, attention_backend=name))
               for name in ("torch", "triton")}
    V = runners["torch"].config.vocab_size
    rng = random.Random(bw)
    cat = random_catalog(rng, 300, 3, V, codes=40)
    ids = [rng.randrange(V) for _ in range(21)]
    got = {name: RetrieveExecutor(r, RadixCache(r.kv_pool.allocator), cat).run(ids, bw, top_k, 6)
           for name, r in runners.items()}
    assert_same(got["triton"], naive_retrieve(runners["triton"], cat, ids, bw, top_k, 6))
    assert_same(got["triton"], got["torch"])
