"""`python -m sgrec.launch_server` as a child process on loopback, for the reliability scripts.

    with LocalServer(["--max-queued-requests", "64"], log_path="server.log") as srv:
        httpx.get(srv.url + "/health")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

import sgrec

HOST = "127.0.0.1"  # loopback only


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server command as a child process (its own session) writing to log_path, ready once GET
    url + ready_path answers 200; an exit or ready_timeout before that raises with the log's tail."""

    def __init__(self, cmd: list[str], port: int, log_path: str, env: dict | None = None, cwd: str | None = None,
                 ready_path: str = "/ready", ready_timeout: float = 300.0):
        self.port = port
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()[-3000:]}")
            try:
                if httpx.get(self.url + ready_path, timeout=1, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready after {ready_timeout} s:\n{self.read_log()[-3000:]}")
            time.sleep(0.2)

    def read_log(self) -> str:
        if not self.log.closed:  # also after stop()
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalServer(ServerProcess):
    """`python -m sgrec.launch_server` with these flags, on a free loopback port."""

    def __init__(self, flags: list[str], log_path: str, ready_timeout: float = 300.0, root: str | None = None):
        port = free_port()
        # the sgrec this process imported, wherever it is installed; or the source tree at root (another
        # checkout, run from there so that `-m` imports it first)
        env = dict(os.environ)
        cwd, root = root, root or os.path.dirname(os.path.dirname(os.path.abspath(sgrec.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "sgrec.launch_server", "--host", HOST, "--port", str(port), *flags]
        super().__init__(cmd, port, log_path, env=env, cwd=cwd, ready_timeout=ready_timeout)
