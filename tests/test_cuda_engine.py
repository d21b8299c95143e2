"""The engine on CUDA against the same engine on CPU (run by scripts/gpu_suite.sh on a lent
GPU, skipped elsewhere): float32 greedy tokens, rank scores and retrieved items agree, with the torch
and the Triton attention backends."""

import pytest
import torch

from tests.test_rec_server import write_catalog

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from sgrec import Engine

    model = tiny_model_dir("llama")
    cat = write_catalog(tmp_path_factory.mktemp("cuda") / "catalog.jsonl", n=30, semantic=True)
    kw = dict(dtype="float32", max_total_tokens=4096, item_catalog=cat)
    return Engine(model, device="cpu", **kw), kw, model


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
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = [o["output_ids"] for o in cpu.generate(input_ids=prompts, sampling_params=sp)]
    got = [o["output_ids"] for o in gpu.generate(input_ids=prompts, sampling_params=sp)]
    assert got == want
    user = {"id": "u1", "token_ids": list(range(30, 70))}
    for prefix in ("user", "item", "none"):
        a = {r["item"]: r["score"] for r in cpu.rank(user, ["i1", "i4", "i9", "i20"], prefix=prefix)["ranking"]}
        b = {r["item"]: r["score"] for r in gpu.rank(user, ["i1", "i4", "i9", "i20"], prefix=prefix)["ranking"]}
        assert b == pytest.approx(a, abs=1e-4)
    r_cpu = cpu.retrieve(user, beam_width=8, num_items=8)
    r_gpu = gpu.retrieve(user, beam_width=8, num_items=8)
    assert [x["item"] for x in r_gpu["items"]] == [x["item"] for x in r_cpu["items"]]
    assert [x["score"] for x in r_gpu["items"]] == pytest.approx([x["score"] for x in r_cpu["items"]], abs=1e-4)
    gpu.check_memory()
