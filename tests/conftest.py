import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch, **overrides) -> path of a random-weight HF model, cached per session."""
    from sgrec.tools.make_tiny_model import make_tiny_model

    made: dict = {}

    def get(arch: str = "llama", seed: int = 0, **overrides) -> str:
        key = (arch, seed, repr(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny_{arch}")
            made[key] = make_tiny_model(str(out), arch=arch, seed=seed, **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> HF transformers model in float32 (cached)."""
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def get(path: str):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return cache[path]

    return get


# ---- a real server process on loopback ---------------------------------------------------
import httpx  # noqa: E402

from sgrec.tools.local_server import LocalServer  # noqa: E402


class ServerProcess(LocalServer):
    """`python -m sgrec.launch_server --device cpu --dtype float32` as a subprocess; .url, .client
    (httpx), .stop(). float32 unless `extra` names a --dtype: `--dtype auto` picks bfloat16 on CPUs
    with native bf16 matmuls, and the tests' verdicts must not depend on the machine."""

    def __init__(self, model_path: str, *extra: str, log_path: str, timeout: float = 600.0):
        # timeout: until /ready, a bound on a hung start-up only (a slow machine takes minutes)
        dtype = [] if "--dtype" in extra else ["--dtype", "float32"]
        super().__init__(["--model-path", model_path, "--device", "cpu", *dtype, *extra], log_path=log_path,
                         ready_timeout=timeout)
        self.client = httpx.Client(base_url=self.url, timeout=60)


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(model_path, *flags) -> ServerProcess; a test file's servers are stopped when the
    file's tests are done (so at most one file's servers, about 1 GB each, live at once: the whole
    suite fits a small machine, and idle servers do not slow the files after them)."""
    servers = []

    def start(model_path: str, *flags: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        srv = ServerProcess(model_path, *flags, log_path=str(log))
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()
