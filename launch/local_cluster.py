"""N sgrec servers on one host (loopback) sharing one item pool, with the front (sglang-router +
Caddy) before them: the one-host recipe, also what the tests and the scale-out benchmark use.

    python -m launch.local_cluster --servers 3 --dp-size 1 --port 8000 -- \
        --model-path MODEL --item-catalog catalog.jsonl --device cpu

Each server gets its HTTP port, item-KV ports (`--item-kv-port`, one per DP rank) and the shared peer
file (`--item-peers`); `add` more at run time with `LocalCluster.add_server()` (the front admits them
once healthy), and a killed server is removed by the front after its health checks fail.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from launch.front import Front, free_port, healthy
from sgrec.items.peers import read_servers, write_peer_file

SERVER_READY_TIMEOUT_S = 180.0


def free_port_run(n: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port p with p .. p+n-1 all free (item-KV endpoints of n DP ranks)."""
    for _ in range(tries):
        p = free_port(host)
        if p + n > 65535:
            continue
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p + k))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


class Server:
    def __init__(self, name: str, port: int, item_kv_port: int, dp_size: int, proc: subprocess.Popen, log: str):
        self.name, self.port, self.item_kv_port, self.proc, self.log = name, port, item_kv_port, proc, log
        self.url = f"http://127.0.0.1:{port}"
        self.item_kv = [f"tcp://127.0.0.1:{item_kv_port + r}" for r in range(dp_size)]

    def entry(self) -> dict:
        return {"name": self.name, "url": self.url, "item_kv": self.item_kv}

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
                 item_fetch: str | None = None):
        self.server_flags = list(server_flags)
        self.dp_size = dp_size
        self.item_fetch = item_fetch  # the peer file's fetch policy (cost, always, never); None: cost
        self.workdir = workdir or tempfile.mkdtemp(prefix="sgrec-cluster-")
        os.makedirs(self.workdir, exist_ok=True)
        self.peers_path = os.path.join(self.workdir, "peers.json")
        self.servers: list[Server] = []
        self.front: Front | None = None
        self._names = iter(range(1 << 30))

    def launch_server(self, dp_size: int | None = None) -> Server:
        """Starts one server (not yet in the peer file) and waits until it answers /health."""
        dp = dp_size or self.dp_size
        name = f"s{next(self._names)}"
        port, kv_port = free_port(), free_port_run(dp)
        log = os.path.join(self.workdir, f"{name}.log")
        cmd = [sys.executable, "-m", "sgrec.launch_server", "--host", "127.0.0.1", "--port", str(port),
               "--dp-size", str(dp), "--item-kv-port", str(kv_port), "--item-peers", self.peers_path,
               *self.server_flags]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        srv = Server(name, port, kv_port, dp, proc, log)
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
        """Lists `srv` in the peer file: the servers re-plan the item pool, the front admits it."""
        listed = read_servers(self.peers_path) if os.path.exists(self.peers_path) else []
        write_peer_file(self.peers_path, [*listed, srv.entry()])

    def up(self, n: int, port: int | None = None, router_port: int | None = None, **front_kw) -> "LocalCluster":
        if not os.path.exists(self.peers_path):
            write_peer_file(self.peers_path, [], **({"item_fetch": self.item_fetch} if self.item_fetch else {}))
        for _ in range(n):
            self.join(self.launch_server())
        self.front = Front(self.peers_path, port or free_port(), router_port, workdir=self.workdir, **front_kw).start()
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m launch.local_cluster",
                                 description="N sgrec servers on loopback behind sglang-router and Caddy.")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--dp-size", type=int, default=1, help="DP ranks of each server")
    ap.add_argument("--port", type=int, default=8000, help="Caddy (every route)")
    ap.add_argument("--router-port", type=int, default=8001, help="sglang-router (generation routes)")
    ap.add_argument("--item-fetch", choices=["cost", "always", "never"], default=None,
                    help="the item pool's fetch policy, written to the peer file (default: cost)")
    ap.add_argument("server_flags", nargs=argparse.REMAINDER, help="-- then flags for every sgrec server")
    a = ap.parse_args(argv)
    flags = a.server_flags[1:] if a.server_flags[:1] == ["--"] else a.server_flags
    cluster = LocalCluster(flags, a.dp_size, item_fetch=a.item_fetch)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.up(a.servers, a.port, a.router_port)
        front = cluster.front
        print(f"ready: {front.url} (Caddy; /v1/rank, /v1/retrieve, /v1/score by X-User-Id), "
              f"{front.router_url} (sglang-router); peer file {cluster.peers_path}; logs in {cluster.workdir}",
              flush=True)
        while not stop.wait(1.0):
            front.reconcile()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
