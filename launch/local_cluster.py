"""N sgrec servers on one host (loopback) sharing one Mooncake Store, with the front (sglang-router +
Caddy) before them: the one-host recipe, also what the tests and the scale-out benchmark use.

    python -m launch.local_cluster --servers 3 --dp-size 1 --port 8000 -- \
        --model-path MODEL --item-catalog catalog.jsonl --device cpu

It starts a `mooncake_master` (`pip install "sgrec[mooncake]"`; `--store none` for none) and every
server with `--enable-hierarchical-cache --hicache-storage-backend mooncake` on it, each adding
`--segment-mb` of memory to the store: users' prefixes and BAT's item KV computed on one server are
loaded by the others. Servers are listed in the servers file that the front reads; `add` more at run
time with `LocalCluster.add_server()` (the front admits them once healthy), and a killed server is
removed by the front after its health checks fail.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from launch.front import Front, free_port, healthy, read_servers, write_servers
from sgrec.tools.mooncake_master import MooncakeMaster

SERVER_READY_TIMEOUT_S = 180.0
DEFAULT_SEGMENT_MB = 512


class Server:
    def __init__(self, name: str, port: int, proc: subprocess.Popen, log: str):
        self.name, self.port, self.proc, self.log = name, port, proc, log
        self.url = f"http://127.0.0.1:{port}"

    def entry(self) -> dict:
        return {"name": self.name, "url": self.url}

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kills the server and its scheduler processes (its own process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


class LocalCluster:
    def __init__(self, server_flags: list[str], dp_size: int = 1, workdir: str | None = None,
                 store: str | None = "mooncake", segment_mb: int = DEFAULT_SEGMENT_MB, store_extra: dict | None = None):
        self.server_flags = list(server_flags)
        self.dp_size = dp_size
        self.store = store  # "mooncake": one master, every server on it; None: no storage tier
        self.segment_mb = segment_mb
        self.store_extra = dict(store_extra or {})  # more of --hicache-storage-backend-extra-config
        self.workdir = workdir or tempfile.mkdtemp(prefix="sgrec-cluster-")
        os.makedirs(self.workdir, exist_ok=True)
        self.servers_path = os.path.join(self.workdir, "servers.json")
        self.servers: list[Server] = []
        self.master: MooncakeMaster | None = None
        self.front: Front | None = None
        self._names = iter(range(1 << 30))

    def store_flags(self) -> list[str]:
        """The storage-tier flags every server gets (none when the server flags name a backend)."""
        if self.store is None or "--hicache-storage-backend" in self.server_flags:
            return []
        if self.master is None:
            try:
                self.master = MooncakeMaster(os.path.join(self.workdir, "mooncake_master.log")).start()
            except RuntimeError as e:
                raise RuntimeError(f"the servers' Mooncake Store: {e} (--store none runs them without one)") from None
        extra = {"master_server_address": self.master.address, "global_segment_size": self.segment_mb << 20,
                 **self.store_extra}
        hier = [] if "--enable-hierarchical-cache" in self.server_flags else ["--enable-hierarchical-cache"]
        return [*hier, "--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                json.dumps(extra)]

    def launch_server(self, dp_size: int | None = None) -> Server:
        """Starts one server (not yet in the servers file) and waits until it answers /health."""
        dp = dp_size or self.dp_size
        name = f"s{next(self._names)}"
        port = free_port()
        log = os.path.join(self.workdir, f"{name}.log")
        cmd = [sys.executable, "-m", "sgrec.launch_server", "--host", "127.0.0.1", "--port", str(port),
               "--dp-size", str(dp), *self.store_flags(), *self.server_flags]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        srv = Server(name, port, proc, log)
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while not healthy(srv.url, timeout=2):
            if proc.poll() is not None or time.monotonic() > deadline:
                srv.kill()
                with open(log) as f:
                    raise RuntimeError(f"server {name} did not start:\n{f.read()[-3000:]}")
            time.sleep(0.3)
        self.servers.append(srv)
        return srv

    def join(self, srv: Server) -> None:
        """Lists `srv` in the servers file: the front admits it."""
        listed = read_servers(self.servers_path) if os.path.exists(self.servers_path) else []
        write_servers(self.servers_path, [*listed, srv.entry()])

    def up(self, n: int, port: int | None = None, router_port: int | None = None, **front_kw) -> "LocalCluster":
        if not os.path.exists(self.servers_path):
            write_servers(self.servers_path, [])
        for _ in range(n):
            self.join(self.launch_server())
        self.front = Front(self.servers_path, port or free_port(), router_port, workdir=self.workdir, **front_kw).start()
        return self

    def add_server(self, dp_size: int | None = None) -> Server:
        srv = self.launch_server(dp_size)
        self.join(srv)
        return srv

    def close(self) -> None:
        if self.front is not None:
            self.front.stop()
        for s in self.servers:
            s.kill(signal.SIGTERM)
        if self.master is not None:
            self.master.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m launch.local_cluster",
                                 description="N sgrec servers on loopback behind sglang-router and Caddy.")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--dp-size", type=int, default=1, help="DP ranks of each server")
    ap.add_argument("--port", type=int, default=8000, help="Caddy (every route)")
    ap.add_argument("--router-port", type=int, default=8001, help="sglang-router (generation routes)")
    ap.add_argument("--store", choices=["mooncake", "none"], default="mooncake",
                    help="the storage tier the servers share (users' prefixes, item KV): a mooncake_master "
                    "started here, or none")
    ap.add_argument("--segment-mb", type=int, default=DEFAULT_SEGMENT_MB,
                    help="memory each server adds to the Mooncake Store (MiB)")
    ap.add_argument("server_flags", nargs=argparse.REMAINDER, help="-- then flags for every sgrec server")
    a = ap.parse_args(argv)
    flags = a.server_flags[1:] if a.server_flags[:1] == ["--"] else a.server_flags
    cluster = LocalCluster(flags, a.dp_size, store=None if a.store == "none" else a.store, segment_mb=a.segment_mb)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.up(a.servers, a.port, a.router_port)
        front = cluster.front
        print(f"ready: {front.url} (Caddy; /v1/rank, /v1/retrieve, /v1/score by X-User-Id), "
              f"{front.router_url} (sglang-router); servers file {cluster.servers_path}; logs in {cluster.workdir}",
              flush=True)
        while not stop.wait(1.0):
            front.reconcile()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
