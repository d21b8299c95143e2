"""A `mooncake_master` (Mooncake Store's master, from the mooncake-transfer-engine-non-cuda package) as a
child process on loopback, for tests and benchmarks of `--hicache-storage-backend mooncake`.

    with MooncakeMaster() as m:
        flags = ["--hicache-storage-backend", "mooncake",
                 "--hicache-storage-backend-extra-config", json.dumps({"master_server_address": m.address})]
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import socket
import subprocess
import time

from sgrec.tools.local_server import HOST, free_port


def missing() -> str | None:
    """Why a Mooncake master and client cannot run here, or None when they can."""
    try:
        import mooncake
    except ImportError as e:
        return f"the Mooncake client does not import: pip install 'sgrec[mooncake]' ({e})"
    if ctypes.util.find_library("ibverbs") is None:
        return "libibverbs.so.1 is missing (Debian/Ubuntu: apt-get install libibverbs1)"
    if binary() is None:
        return f"no mooncake_master beside {os.path.dirname(mooncake.__file__)} or on PATH"
    return None


def binary() -> str | None:
    import mooncake

    inside = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return inside if os.access(inside, os.X_OK) else shutil.which("mooncake_master")


class MooncakeMaster:
    def __init__(self, log_path: str = os.devnull, port: int | None = None):
        self.port = port or free_port()
        self.address = f"{HOST}:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "MooncakeMaster":
        why = missing()
        if why:
            raise RuntimeError(why)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [binary(), f"--rpc_port={self.port}", f"--metrics_port={free_port()}",
             "--enable_http_metadata_server=false"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:  # ready when it accepts connections
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                socket.create_connection((HOST, self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"mooncake_master did not listen on {self.address} within {timeout} s")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
