import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sgrec.tools.make_tiny_model import make_tiny_model

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SENTENCE = "The user likes red shoes today. What is 42? (Next: cheap books!)"


def _weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_model_loads(tmp_path, arch):
    path = make_tiny_model(str(tmp_path / arch), arch=arch, seed=0)
    assert path == str(tmp_path / arch)
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert os.path.exists(os.path.join(path, f)), f

    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [ARCHS[arch]]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 512)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    if arch == "qwen3":
        assert config.head_dim == 32
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == ARCHS[arch]
    w = _weights(path)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in w.values())
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in w
    if arch == "qwen3":
        assert w["model.layers.0.self_attn.q_norm.weight"].shape == (32,)

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= config.vocab_size
    assert max(tok.get_vocab().values()) < config.vocab_size
    ids = tok.encode(SENTENCE)
    assert max(ids) < config.vocab_size
    assert tok.decode(ids, skip_special_tokens=True) == SENTENCE
    gen = json.load(open(os.path.join(path, "generation_config.json")))
    assert config.eos_token_id == gen["eos_token_id"] == tok.eos_token_id
    if arch == "llama":
        assert ids[0] == tok.bos_token_id == config.bos_token_id == 1
        assert tok.eos_token == "</s>" and tok.eos_token_id == 2
    else:
        assert tok.bos_token_id is None and ids[0] not in tok.all_special_ids
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
        assert config.pad_token_id == tok.pad_token_id
        assert tok.convert_tokens_to_ids("<|im_start|>") < config.vocab_size

    msgs = [{"role": "user", "content": "Hello there"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "Hello there" in text
    if arch != "llama":
        assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"

    out = model(torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), config.vocab_size) and torch.isfinite(out).all()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_model_seeds(tmp_path, arch):
    a = make_tiny_model(str(tmp_path / "a"), arch=arch, seed=1)
    b = make_tiny_model(str(tmp_path / "b"), arch=arch, seed=1)
    c = make_tiny_model(str(tmp_path / "c"), arch=arch, seed=2)
    read = lambda p, f: open(os.path.join(p, f), "rb").read()  # noqa: E731
    assert read(a, "model.safetensors") == read(b, "model.safetensors")
    assert read(a, "tokenizer.json") == read(c, "tokenizer.json")
    wa, wc = _weights(a), _weights(c)
    assert wa.keys() == wc.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


def test_tiny_model_overrides(tmp_path):
    path = make_tiny_model(
        str(tmp_path / "m"), arch="llama", num_hidden_layers=3, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["num_hidden_layers"] == 3 and cfg["tie_word_embeddings"] is True
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    assert rope["rope_type"] == "linear" and rope["factor"] == 2.0
    assert "lm_head.weight" not in _weights(path)


SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")


def test_smollm2_shape_is_the_real_models(tmp_path):
    """--shape smollm2-135m writes the real SmolLM2-135M's config (every shape key, rope theta) and
    tensors of exactly its names and shapes, in bfloat16 when asked, with random values; sgrec loads it."""
    from safetensors import safe_open

    from sgrec.runner import ModelRunner
    from sgrec.server_args import ServerArgs
    from sgrec.tools.prepare_smollm2 import prepare_smollm2

    real = prepare_smollm2()
    path = make_tiny_model(str(tmp_path / "s"), shape="smollm2-135m", dtype="bfloat16")
    got, want = (json.load(open(os.path.join(p, "config.json"))) for p in (path, real))
    assert {k: got.get(k) for k in SHAPE_KEYS} == {k: want.get(k) for k in SHAPE_KEYS}
    assert got["rope_parameters"]["rope_theta"] == want["rope_parameters"]["rope_theta"]

    def tensors(p):
        with safe_open(os.path.join(p, "model.safetensors"), "pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}

    mine, theirs = tensors(path), tensors(real)
    assert {k: s for k, (s, _) in mine.items()} == {k: s for k, (s, _) in theirs.items()}
    assert {d for _, d in mine.values()} == {"BF16"}
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32", max_total_tokens=64,
                                                disable_weight_packing=True))  # packed weights are not parameters
    assert sum(p.numel() for p in runner.model.parameters()) == 134_515_008


@pytest.mark.parametrize("shape,total,non_embedding", [("qwen3-0.6b", 0.6, 0.44), ("qwen3-1.7b", 1.7, 1.4)])
def test_qwen3_shapes_have_the_published_sizes(shape, total, non_embedding):
    """The Qwen3 shapes have the model cards' parameter counts (0.6B / 0.44B non-embedding, 1.7B /
    1.4B), counted on the meta device (no weights are made)."""
    import transformers

    from sgrec.tools.make_tiny_model import shape_config

    arch, cfg = shape_config(shape)
    assert arch == "qwen3"
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    n = sum(p.numel() for p in model.parameters())
    emb = model.model.embed_tokens.weight.numel()
    digits = len(str(non_embedding).split(".")[1])
    assert round(n / 1e9, 1) == total and round((n - emb) / 1e9, digits) == non_embedding
    with pytest.raises(ValueError, match="shape must be one of"):
        shape_config("qwen3-8b")


def test_gpu_bundle_plans_what_the_gpu_image_lacks(tmp_path):
    """sgrec.tools.gpu_bundle: sgrec's requirements closed over theirs, as installed here,
    less what the GPU machine has; the download itself (pip, the registry) is not run in CI."""
    from sgrec.tools import gpu_bundle as gb

    needed = gb.closure(gb.ROOTS)
    for name in ("pyzmq", "orjson", "fastapi", "uvicorn", "lightgbm", "torch", "numpy", "pytest", "starlette"):
        assert name in needed, name
    wants = gb.missing(needed, gb.read_have(None))
    assert {"pyzmq", "orjson", "fastapi", "uvicorn", "lightgbm", "starlette"} <= set(wants)
    assert not {"torch", "numpy", "transformers", "pytest", "triton", "sgrec"} & set(wants)
    assert all(wants[n] == needed[n] for n in wants)  # the versions installed here
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.11.0\nPyZMQ==26.0\norjson @ file:///x\n")
    assert gb.read_have(str(freeze)) == {"torch", "pyzmq", "orjson"}
    wants = gb.missing(needed, gb.read_have(str(freeze)))
    assert "pyzmq" not in wants and "numpy" in wants and "fastapi" in wants


def test_bench_gpu_runs_its_code_path_on_cpu(tmp_path):
    """benchmarks/bench_gpu.py (what scripts/gpu_suite.sh runs on a lent GPU), tiny and on CPU: every
    field of its results file is there and sane (a smoke run of the code, not a measurement)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_gpu.py"), "--device", "cpu", "--quick",
                        "--retrieve-variant", "interleave_rounds=true", "--out", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["gemm_peak_tflops"] > 0 and r["done"] == "families"
    assert [x["tokens"] for x in r["prefill"]] == [64, 128] and all(0 < x["mfu"] for x in r["prefill"])
    assert r["prefill"][-1]["profile"] and all(x["ms"] >= 0 and x["calls"] > 0 for x in r["prefill"][-1]["profile"])
    assert [(x["tokens"], x["backend"]) for x in r["prefill_torch_backend"]] == [(64, "TorchBackend"), (128, "TorchBackend")]
    pb = r["prefill_batch"]  # four prompts of --context tokens in one forward
    assert (pb["prompts"], pb["tokens"]) == (4, 64) and pb["seconds"] > 0 and pb["mfu"] > 0
    assert r["retrieve"]["requests"] == 2 and r["retrieve"]["median_s"] > 0
    conc = r["retrieve"]["concurrent"]
    assert conc["concurrency"] == 2 and conc["requests"] == 4 and conc["req_per_s"] > 0
    (var,) = r["retrieve_variants"]  # the retrieve part again on an engine with interleaved rounds
    assert var["engine_args"] == "interleave_rounds=true" and var["concurrent"]["req_per_s"] > 0
    assert sum(var["concurrent"]["breakdown"]["batch_sizes"].values()) == 4 and var["wide_beams"] == []
    wide = r["retrieve"]["wide_beams"]
    assert [(w["beam_width"], w["first_s"] > 0, w["seconds"] > 0) for w in wide] == [(16, True, True)]
    assert [(x["candidates"], x["prefix"]) for x in r["rank"]] == [(4, "item"), (4, "user"), (8, "item"), (8, "user")]
    hf = r["hf"]  # transformers is a test dependency
    assert [x["tokens"] for x in hf["prefill"]] == [64, 128] and [x["batch"] for x in hf["generate"]] == [1, 16]
    assert all(x["hf_s"] > 0 and x["sgrec_s"] > 0 for part in ("prefill", "generate", "rank") for x in hf[part])
    assert r["fp8"]["skipped"].startswith("FP8 needs a CUDA GPU")  # part 5 runs on FP8 GPUs only
    # FlashRec's matrix at small shapes: every cell, none failed, no invalid item, on a pool that holds
    # two of the largest cell's four requests at once (the others wait for later rounds)
    (fr,) = r["flashrec"]  # no FP8 on the CPU
    assert (fr["levels"], fr["quantization"], fr["pool_tokens"], fr["requests_per_thread"]) == (4, None, 200, 2)
    cells = fr["cells"]
    assert [(c["prompt_tokens"], c["beam_width"], c["concurrency"]) for c in cells] == [
        (p, b, c) for p in (24, 48) for b in (4, 8) for c in (1, 4)]
    for c in cells:
        assert c["requests"] == 2 * c["concurrency"] and c["failed"] == 0 and c["errors"] == [], c
        assert c["items_returned"] == c["requests"] * min(10, c["beam_width"]) and c["invalid_share"] == 0
        assert c["req_per_s"] > 0 and 0 < c["median_s"] <= c["p99_s"] and c["memory_gib"] > 0
        assert c["warmup_rounds"] == 2  # no graphs on CPU: the second round ends it
    assert 4 * (48 + 8 * 3) > fr["pool_tokens"]  # the largest cell's requests did not fit at once
    assert conc["warmup_rounds"] == 2
    # the other families on their own (here tiny) shapes: retrieve alone and at once, no wide beams
    assert [(f["family"], f.get("error")) for f in r["families"]] == [("hybrid linear attention", None),
                                                                       ("encoder-decoder", None)]
    for f in r["families"]:
        c = f["concurrent"]
        assert f["requests"] == 2 and f["median_s"] > 0 and f["wide_beams"] == [] and f["context"] in (64, 32)
        assert c["requests"] == 4 and c["req_per_s"] > 0 and sum(c["breakdown"]["batch_sizes"].values()) == 4
    from tests.test_fuzz import load_script

    bench = load_script("bench_gpu")
    assert bench.variant_args("interleave_rounds=true,num_streams=1,batch_wait_ms=2.5,x=y") == {
        "interleave_rounds": True, "num_streams": 1, "batch_wait_ms": 2.5, "x": "y"}
    rows = [x for x in bench.record_rows(r) if x["metric"].startswith("FlashRec's matrix")]
    assert len(rows) == 3 * len(cells) and not any(x["peer"] for x in rows)  # no cell at FlashRec's shape
    fam = [x for x in bench.record_rows(r) if x["params"].get("family")]
    assert {x["params"]["family"] for x in fam} == {"hybrid linear attention", "encoder-decoder"} and len(fam) == 6
    assert {x["params"]["invalid_share"] for x in rows} == {0}
    at = {"prompt_tokens": 300, "concurrency": 32}
    assert [bench.flashrec_peer(fr, {**at, "beam_width": b}) for b in (50, 128, 512, 1000, 64)] == [
        28.08, 19.91, 8.18, 4.62, None]
    assert bench.flashrec_peer(fr, {**at, "concurrency": 16, "beam_width": 50}) is None
    for part in (r["retrieve"], conc):  # where the time went, from the requests' meta_info
        b = part["breakdown"]
        assert b["prefill_s"] > 0 and b["beam_search_s"] > 0 and sum(b["batch_sizes"].values()) == part["requests"]
    assert r["prefill"][0]["host_s"] > 0 and r["prefill"][0]["host_profile"][0]["calls"] > 0


def test_bench_staged_kernel_runs_its_code_path_on_cpu(tmp_path):
    """benchmarks/bench_staged_kernel.py --quick under Triton's interpreter: every variant runs, the
    default first at 1.00x, each within float16's rounding of it (a smoke run, not a measurement)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_staged_kernel.py"), "--device", "cpu",
                        "--quick", "--repeats", "1", "--out", str(out)], cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [x["variant"] for x in rows][:2] == ["default", "16-bit tiles"] and len(rows) == 10
    assert rows[0]["vs_default"] == 1.0 and all("error" not in x and x["max_abs_diff"] <= 2e-3 for x in rows)


def test_bench_roofline_counts_the_work_it_ran(tmp_path, tiny_model_dir):
    """benchmarks/bench_roofline.py --quick on a tiny model: the counted work of its prefill equals the
    arithmetic (N tokens through the projections, N(N+1)/2 causal pairs, one row of logits), every
    path is there with positive work, rate and limit, and a cold rank counts more work than a warm one
    (a smoke run of the timing code, not a measurement)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from sgrec.model.config import ModelConfig

    model = tiny_model_dir("llama", vocab_size=1024)
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_roofline.py"), "--quick", "--model-path", model,
                        "--codes", "16", "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    cfg = ModelConfig.from_dir(model)
    q, kv, n = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, 128
    nonembed = cfg.num_layers * (cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size)
    want = (2 * nonembed * n + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * n * (n + 1) // 2
            + 2 * cfg.hidden_size * cfg.vocab_size) / 1e9
    assert abs(r["paths"][f"prefill {n}"]["gflop"] - want) <= 1e-12
    assert set(r["paths"]) == {"prefill 128", "decode batch 1", "decode batch 16", "rank 10x16, item-prefix, cold",
                               "rank 10x16, item-prefix, warm", "retrieve 64 tok, BW 16"}
    assert all(x["gflops"] > 0 and x["limit"] > 0 and x["gflop"] > 0 for x in r["paths"].values())
    assert r["paths"]["rank 10x16, item-prefix, cold"]["gflop"] > r["paths"]["rank 10x16, item-prefix, warm"]["gflop"]


def test_profile_retrieve_runs_its_code_path_on_cpu():
    """benchmarks/profile_retrieve.py, tiny and on CPU: it times warm requests and prints both profiles
    (the sync count is CUDA's only)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "profile_retrieve.py"), "--device", "cpu", "--quick"],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"^timed: \[[\d.]+, [\d.]+, [\d.]+\] ms$", p.stdout, re.M)
    for part in ("--- cProfile by tottime", "--- cProfile by cumulative", "--- torch profiler by self_cpu_time_total"):
        assert part in p.stdout
    assert "engine.py" in p.stdout.split("--- cProfile by cumulative")[1]  # the request's own frames were profiled
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "profile_retrieve.py"), "--device", "cpu", "--quick",
                        "--concurrency", "2"], cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    batches = re.findall(r"^(warm-up|timed) batch of 2: wall [\d.]+ ms, [\d.]+ req/s, latencies \[[\d.]+, [\d.]+\] ms$",
                         p.stdout, re.M)
    assert batches == ["warm-up", "warm-up", "timed", "timed"] and "--- torch profiler by self_cpu_time_total" in p.stdout


def test_bench_hicache_runs_on_a_tiny_model(tmp_path, tiny_model_dir):
    """benchmarks/bench_hicache.py, tiny: the configurations without Mooncake run on the same requests
    and print their rows (a smoke run of the code, not a measurement)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    model = tiny_model_dir("llama", vocab_size=32768)  # gr-users' token ids reach 31,7xx
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_hicache.py"), "--model", model,
                        "--requests", "12", "--configs", "none", "host", "file", "--no-two-servers",
                        "--no-item-fetch"], cwd=root, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {m[0]: float(m[1]) for m in re.findall(r"^\| (none|host|file) \| ([\d.]+)% \|", p.stdout, re.M)}
    assert set(rows) == {"none", "host", "file"} and all(0 <= h <= 100 for h in rows.values())
    assert "file tiers: loaded" in p.stdout and "rerun: python benchmarks/bench_hicache.py" in p.stdout


def test_bench_hicache_two_servers_behind_the_router(tiny_model_dir):
    """benchmarks/bench_hicache.py's part 2, tiny: two servers behind a real sglang-router (random
    policy), without and with a Mooncake Store; every return visit is counted as moving or staying."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from sgrec.tools.mooncake_master import missing

    if missing():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"needs Mooncake: {missing()}")
    root = Path(__file__).resolve().parents[1]
    model = tiny_model_dir("llama", vocab_size=32768)
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_hicache.py"), "--model", model,
                        "--requests", "12", "--configs", "--no-item-fetch", "--mooncake-segment-gb", "0.0625"],
                       cwd=root, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = re.findall(r"^\| (no hierarchy|mooncake) \| [\d.]+% \((\d+)\) \| [\d.]+% \((\d+)\) \|", p.stdout, re.M)
    users = int(re.search(r"12 visits of (\d+) users", p.stdout).group(1))
    assert [r[0] for r in rows] == ["no hierarchy", "mooncake"]
    assert all(int(m) + int(s) == 12 - users for _, m, s in rows)  # every return visit, moving or staying


def test_bench_vllm_cpu_runs_sgrecs_side_on_a_tiny_model(tiny_model_dir):
    """benchmarks/bench_vllm_cpu.py with --vllm-python none (no vLLM here): sgrec's half of every part
    (the same client and requests the peer would get: bench_serving over /v1/completions, beams through
    /v1/retrieve) on a tiny model, every request served, and the table says there is no peer."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    model = tiny_model_dir("llama", vocab_size=512)
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_vllm_cpu.py"), "--vllm-python", "none",
                        "--model-path", model, "--dtype", "float32", "--num-prompts", "4", "--single-prompts", "2",
                        "--input-len", "16", "--output-len", "4", "--beam-widths", "4", "--beam-prompt-len", "12",
                        "--beam-repeats", "2", "--num-items", "300", "--codes", "16"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in p.stdout.splitlines() if line.startswith("| ")}
    assert rows["saturated serving: failed requests"][:2] == ["-", "0"]
    assert rows["one client: failed requests"][:2] == ["-", "0"]
    assert float(rows["saturated serving: out tok/s"][1]) > 0 and rows["saturated serving: out tok/s"][2] == "- |"
    assert float(rows["beam BW 4, 12-token prompt: median ms"][1]) > 0


def test_bench_catalog_server_runs_its_parts(tmp_path):
    """benchmarks/bench_catalog_server.py on a small catalog (a smoke run of the code, not a measurement):
    both dp sizes with and without the catalog, each server's upserts acknowledged, a new item
    retrieved (the script asserts it), the verdict lines printed."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_catalog_server.py"), "--items", "20000",
                        "--updates", "2", "--workdir", str(tmp_path)], cwd=root, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert [m for m in re.findall(r"^\| (\d) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", p.stdout, re.M)] == ["1", "2"]
    acks = re.findall(r"^  dp-size (\d), update \d: acknowledged in [\d.]+ s$", p.stdout, re.M)
    assert acks == ["1", "1", "2", "2"]
    assert p.stdout.count("versions kept: [0, 1, 2]") == 2
    for line in ("an update acknowledged in under 0.5 s:", "kept versions within 10% of one version's:",
                 "the catalog's memory at dp-size 2 within 1.2x of dp-size 1's, at start:",
                 "the catalog's memory at dp-size 2 within 1.2x of dp-size 1's, after 2 updates:",
                 "rerun: python benchmarks/"):
        assert line in p.stdout


def test_bench_fresh_memory_prints_its_table():
    """benchmarks/bench_fresh_memory.py, small and without pauses (a smoke run, not a measurement): one
    row per touch with its time and the kernel's fault counters, and the page-reporting line."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_fresh_memory.py"), "--gb", "0.01",
                        "--back-to-back", "2", "--after-idle", "1", "--idle", "0"], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "kernel page reporting: " in p.stdout and "rerun: python benchmarks/bench_fresh_memory.py" in p.stdout
    rows = re.findall(r"^\| (back to back|after 0 s idle) \| (\d) \| [\d.]+ \| [\d.]+ \| \d+ \| \d+ \| \d+ \| \d+ \|$",
                      p.stdout, re.M)
    assert rows == [("back to back", "1"), ("back to back", "2"), ("after 0 s idle", "1")]
