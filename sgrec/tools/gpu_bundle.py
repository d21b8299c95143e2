"""`python -m sgrec.tools.gpu_bundle DIR`: the wheels a CUDA + PyTorch machine without a package
registry lacks to run sgrec and its CUDA tests, downloaded here for Python 3.12 on
manylinux x86_64, with their total size (what travels with the repository is capped at 64 MiB).

What is needed: sgrec's requirements and the CUDA tests' (pytest), closed over their own
requirements as this environment resolved them (the versions installed here). What the GPU
machine already has is left out: by default the package names of this workplace's GPU image
(`GPU_IMAGE`, read off such a machine in 2026-11), or `--have FILE` with that machine's
`pip list --format=freeze`. Each wheel is fetched with `--no-deps` at the version installed here.
On the GPU machine: `scripts/gpu_suite.sh` installs them into a target folder.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOTS = ["sgrec", "pytest"]  # what the suite imports: sgrec with its dependencies, and the test runner
# distributions the GPU image has (this workplace's 'cuda' image, as read on 2026-11-17)
GPU_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux_2_39_x86_64", "manylinux1_x86_64"]
LIMIT_MB = 64.0


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], python: str = "3.12") -> dict[str, str]:
    """{normalized name: installed version} of `roots` and everything they require (no extras), as
    installed in this environment, with environment markers evaluated for the target Python."""
    env = {**default_environment(), "python_version": python, "python_full_version": python + ".0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"error: {name} is not installed here; install sgrec first (pip install -e .)") from None
        seen[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return seen


def missing(needed: dict[str, str], have: set[str]) -> dict[str, str]:
    """The needed distributions the target lacks (sgrec itself travels as source, not as a wheel)."""
    return {n: v for n, v in sorted(needed.items()) if n not in have and n != "sgrec"}


def read_have(path: str | None) -> set[str]:
    if path is None:
        return {norm(n) for n in GPU_IMAGE}
    with open(path) as f:  # pip list --format=freeze, or one name per line
        return {norm(re.split(r"[=<>~ @]", line.strip(), maxsplit=1)[0]) for line in f if line.strip()}


def download(wants: dict[str, str], out: str, python: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "-d", out, "-q"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    pinned = subprocess.run(cmd + [f"{n}=={v}" for n, v in wants.items()])
    if pinned.returncode == 0:
        return
    for n, v in wants.items():  # one at a time: a version with no wheel for that Python takes the newest
        if subprocess.run(cmd + [f"{n}=={v}"], capture_output=True).returncode != 0:
            print(f"{n}=={v} has no wheel for Python {python} there; taking the newest that has", flush=True)
            subprocess.run(cmd + [n], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sgrec.tools.gpu_bundle", description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="where the wheels go (e.g. .whl in the repository root, ignored by git)")
    ap.add_argument("--have", help="the GPU machine's `pip list --format=freeze` (default: its image's list)")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument("--dry-run", action="store_true", help="list what would be downloaded, fetch nothing")
    a = ap.parse_args(argv)
    wants = missing(closure(ROOTS, a.python), read_have(a.have))
    print("needed there:", ", ".join(f"{n}=={v}" for n, v in wants.items()) or "nothing")
    if a.dry_run or not wants:
        return 0
    os.makedirs(a.dir, exist_ok=True)
    download(wants, a.dir, a.python)
    wheels = [f for f in sorted(os.listdir(a.dir)) if f.endswith(".whl")]
    total = sum(os.path.getsize(os.path.join(a.dir, f)) for f in wheels) / 2**20
    for f in wheels:
        print(f"  {os.path.getsize(os.path.join(a.dir, f)) / 2**20:7.2f} MiB  {f}")
    print(f"{len(wheels)} wheels, {total:.1f} MiB in {a.dir} (the repository travels too; limit {LIMIT_MB:.0f} MiB)")
    return 0 if total < LIMIT_MB else 1


if __name__ == "__main__":
    raise SystemExit(main())
