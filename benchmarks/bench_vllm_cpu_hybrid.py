"""sgrec against vLLM's CPU backend on a hybrid model: bench_vllm_cpu.py's parts (saturated serving,
one client, beam retrieval) on Qwen3.5-0.8B's shape with random bf16 weights, recorded apart from the
dense model's runs.

    python benchmarks/bench_vllm_cpu_hybrid.py --vllm-python ~/vllm-cpu/bin/python
    python benchmarks/bench_vllm_cpu_hybrid.py --vllm-python ~/vllm-cpu/bin/python --model-path DIR --peer-beam-widths 32 256

The model is written to ~/.cache/sgrec/qwen3.5-0.8b-shape unless --model-path is given
(`python -m sgrec.tools.make_tiny_model DIR --shape qwen3.5-0.8b --dtype bfloat16`). vLLM's beam
search runs at BW 32 only unless --peer-beam-widths says otherwise: on two cores it took 48 s a
request at BW 32. Every other option is bench_vllm_cpu.py's (its docstring: the peer's environment,
the torchvision stand-in, the parts). Results: docs/performance.md, "bench_vllm_cpu_hybrid".
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_vllm_cpu  # noqa: E402

SHAPE_DIR = os.path.expanduser("~/.cache/sgrec/qwen3.5-0.8b-shape")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--model-path" not in argv and not any(a.startswith("--model-path=") for a in argv) \
            and not ({"-h", "--help"} & set(argv)):
        if not os.path.isfile(os.path.join(SHAPE_DIR, "config.json")):
            from sgrec.tools.make_tiny_model import make_tiny_model

            print(f"writing Qwen3.5-0.8B's shape (random bf16 weights) to {SHAPE_DIR}", flush=True)
            make_tiny_model(SHAPE_DIR, shape="qwen3.5-0.8b", dtype="bfloat16")
        argv += ["--model-path", SHAPE_DIR]
    if "--peer-beam-widths" not in argv:
        argv += ["--peer-beam-widths", "32"]
    bench_vllm_cpu.main(argv, benchmark="bench_vllm_cpu_hybrid",
                        title="sgrec against vLLM's CPU backend on a hybrid model (Qwen3.5-0.8B's shape)",
                        script="bench_vllm_cpu_hybrid.py")


if __name__ == "__main__":
    main()
