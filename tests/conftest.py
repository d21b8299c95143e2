import atexit
import os
import shutil
import tempfile
import time

import httpx
import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite's own state folder, for the whole run and every server it starts: what a user did with a
# server before (the demo's catalog journal under ~/.local/state/sgrec) changes no verdict, and no
# test writes into the user's state (docs/reliability.md, "The same verdict on every machine").
_STATE = tempfile.mkdtemp(prefix="sgrec-test-state-")
os.environ["XDG_STATE_HOME"] = _STATE
os.environ["SGREC_RESULTS_DIR"] = os.path.join(_STATE, "benchmark-results")  # benchmarks run by tests record nothing
atexit.register(shutil.rmtree, _STATE, True)


def _slow_the_clients_clock(k: float) -> None:
    """The fast-machine check (benchmarks/fast_machine.sh): every client timeout and every sleep in the
    test process lasts k times longer, so the servers under test, their models and their own clocks
    unchanged, look k times faster to the tests. A test that needs the work to be slower than a client
    (a timeout shorter than a generation, "not finished yet" after a sleep) fails under it as it would
    on a machine k times faster."""
    init, sleep = httpx.Timeout.__init__, time.sleep

    def timeout_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        given = args[0] if args else kwargs.get("timeout")
        if not isinstance(given, httpx.Timeout):  # else a copy of one already slowed
            for name in ("connect", "read", "write", "pool"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name) * k)

    httpx.Timeout.__init__ = timeout_init
    default = httpx._config.DEFAULT_TIMEOUT_CONFIG  # made at import: the default of every client and call
    for name in ("connect", "read", "write", "pool"):
        setattr(default, name, getattr(default, name) * k)
    time.sleep = lambda seconds: sleep(seconds * k)


if float(os.environ.get("SGREC_TEST_CLIENT_SLOWDOWN", "1")) != 1:
    _slow_the_clients_clock(float(os.environ["SGREC_TEST_CLIENT_SLOWDOWN"]))
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
