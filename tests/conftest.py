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
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m sgrec.launch_server` as a subprocess; .url, .client (httpx), .stop()."""

    def __init__(self, model_path: str, *extra: str, log_path: str, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "sgrec.launch_server", "--model-path", model_path, "--port", str(self.port),
               "--device", "cpu", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready after {timeout} s:\n{self.read_log()}")
            time.sleep(0.2)
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(model_path, *flags) -> ServerProcess; every server is stopped at session end."""
    servers = []

    def start(model_path: str, *flags: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        srv = ServerProcess(model_path, *flags, log_path=str(log))
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()
