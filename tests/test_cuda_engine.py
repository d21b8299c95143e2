"""The engine on CUDA against the same engine on CPU (run by scripts/gpu_suite.sh on a lent
GPU, skipped elsewhere): float32 greedy tokens, rank scores and retrieved items agree, with the torch
and the Triton attention backends, for the dense family, the hybrid one (Qwen3.5: on Triton its
Gated DeltaNet layers run sgrec.model.kernels.delta_rule) and the encoder-decoder one (T5)."""

import pytest
import torch

from tests.test_rec_server import write_catalog

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")]


def engines(tiny_model_dir, tmp_path_factory, arch: str, **model_kw):
    from sgrec import Engine

    model = tiny_model_dir(arch, **model_kw)
    cat = write_catalog(tmp_path_factory.mktemp("cuda") / "catalog.jsonl", n=30, semantic=True)
    kw = dict(dtype="float32", max_total_tokens=4096, item_catalog=cat)
    return Engine(model, device="cpu", **kw), kw, model


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    return engines(tiny_model_dir, tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def hybrid(tiny_model_dir, tmp_path_factory):
    return engines(tiny_model_dir, tmp_path_factory, "qwen3_5", seed=3)


@pytest.fixture(scope="module")
def encdec(tiny_model_dir, tmp_path_factory):
    return engines(tiny_model_dir, tmp_path_factory, "t5", seed=5)


def agree(cpu, gpu, prefixes) -> None:
    """Greedy tokens equal, rank scores (each prefix layout) and retrieved items and scores within
    float32 rounding."""
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = [o["output_ids"] for o in cpu.generate(input_ids=prompts, sampling_params=sp)]
    got = [o["output_ids"] for o in gpu.generate(input_ids=prompts, sampling_params=sp)]
    assert got == want
    user = {"id": "u1", "token_ids": list(range(30, 70))}
    for prefix in prefixes:
        a = {r["item"]: r["score"] for r in cpu.rank(user, ["i1", "i4", "i9", "i20"], prefix=prefix)["ranking"]}
        b = {r["item"]: r["score"] for r in gpu.rank(user, ["i1", "i4", "i9", "i20"], prefix=prefix)["ranking"]}
        assert b == pytest.approx(a, abs=1e-4)
    r_cpu = cpu.retrieve(user, beam_width=8, num_items=8)
    r_gpu = gpu.retrieve(user, beam_width=8, num_items=8)
    assert [x["item"] for x in r_gpu["items"]] == [x["item"] for x in r_cpu["items"]]
    assert [x["score"] for x in r_gpu["items"]] == pytest.approx([x["score"] for x in r_cpu["items"]], abs=1e-4)
    gpu.check_memory()


@pytest.mark.parametrize("backend,graphs", [("torch", False), ("triton", True), ("triton", False)])
def test_cuda_engine_agrees_with_cpu(setup, backend, graphs):
    """triton decodes through CUDA graphs by default (sgrec.model.cuda_graph) and runs the Triton glue
    (sgrec.model.kernels.glue); --disable-cuda-graph runs the same steps eagerly."""
    from sgrec import Engine
    from sgrec.model.kernels import glue

    cpu, kw, model = setup
    gpu = Engine(model, device="cuda", attention_backend=backend, disable_cuda_graph=not graphs, **kw)
    assert (gpu.runner.graphs is not None) == graphs
    assert (gpu.runner.model.norm.glue is glue) == (backend == "triton")
    agree(cpu, gpu, ("user", "item", "none"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_hybrid_engine_agrees_with_cpu(hybrid, backend):
    """The hybrid family on CUDA: on triton its recurrent layers run the Triton step (decode, beam
    steps with forks read from their parents' slots) and sequence (prefill) kernels, on torch the
    torch forms; the CPU engine runs sgrec's C kernels. Beams and rank forks included."""
    from sgrec import Engine
    from sgrec.model.kernels import glue

    cpu, kw, model = hybrid
    gpu = Engine(model, device="cuda", attention_backend=backend, **kw)
    layer = next(m for m in gpu.runner.model.layers if m.linear_attn is not None).linear_attn
    assert (layer.glue is glue) == (backend == "triton") and gpu.runner.graphs is None
    agree(cpu, gpu, ("user", "none"))


@pytest.mark.parametrize("L", [1, 70, 300])
def test_cuda_delta_rule_kernels_agree_with_the_torch_forms(L):
    """sgrec.model.kernels.delta_rule compiled for the GPU (the tests under Triton's interpreter run
    the same code on CPU): the sequence kernel against delta_rule.chunked on the GPU, the step kernel
    against delta_rule.step, and a beam step's forks reading their parent's slot (kernel_refs)."""
    from sgrec.model import delta_rule
    from sgrec.model.kernels.delta_rule import gdr_sequence, gdr_step
    from tests.kernel_refs import gdr_fork_case

    g = torch.Generator().manual_seed(L)
    H, dk, dv = 4, 128, 128
    q = (delta_rule.l2norm(torch.randn(H, L, dk, generator=g)) * dk**-0.5).cuda()
    k = delta_rule.l2norm(torch.randn(H, L, dk, generator=g)).cuda()
    v = torch.randn(H, L, dv, generator=g).cuda()
    decay, beta = (-torch.rand(H, L, generator=g) * 2).cuda(), torch.rand(H, L, generator=g).cuda()
    s0 = (torch.randn(H, dk, dv, generator=g) * 0.1).cuda()
    want, want_state = delta_rule.chunked(q, k, v, decay, beta, s0)
    got, state = gdr_sequence(q, k, v, decay, beta, s0)
    assert (got - want).abs().max() <= 1e-4 and (state - want_state).abs().max() <= 1e-4
    pool = s0[None].repeat(3, 1, 1, 1)
    o = gdr_step(q[:, 0][None].repeat(2, 1, 1), k[:, 0][None].repeat(2, 1, 1), v[:, 0][None].repeat(2, 1, 1),
                 decay[:, 0][None].repeat(2, 1), beta[:, 0][None].repeat(2, 1), pool, torch.tensor([0, 2]).cuda())
    ref, ref_state = delta_rule.step(q[:, 0][None], k[:, 0][None], v[:, 0][None], decay[:, 0][None],
                                     beta[:, 0][None], s0[None])
    assert (o[0] - ref[0]).abs().max() <= 1e-5 and (pool[2] - ref_state[0]).abs().max() <= 1e-5
    assert torch.equal(pool[1], s0)

    def on_gpu(q, k, v, g, beta, states, slots, sources):  # the CPU case, run on the device
        dev = states.cuda()
        o = gdr_step(q.cuda(), k.cuda(), v.cuda(), g.cuda(), beta.cuda(), dev, slots.cuda(), sources.cuda())
        states.copy_(dev.cpu())
        return o.cpu()

    gdr_fork_case(on_gpu)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_encoder_decoder_engine_agrees_with_cpu(encdec, backend):
    """The encoder-decoder family on CUDA: greedy generation and retrieve (the encoder's input in
    the tree, the decoder's beams over the catalog's LayeredTrie on the device) against the CPU."""
    from sgrec import Engine

    cpu, kw, model = encdec
    gpu = Engine(model, device="cuda", attention_backend=backend, **kw)
    assert gpu.scheduler.retriever.trie.leaves is not None  # the beam step's trie arrays on the GPU
    agree(cpu, gpu, ())
