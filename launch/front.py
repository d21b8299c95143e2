"""The front of a scale-out deployment: sglang-router and Caddy, kept in line with the servers file.

The servers file (JSON, `{"servers": [{"name": "a", "url": "http://10.0.0.1:30000"}, ...]}`) is the
one list of servers. `Front` starts sglang-router (generation routes) and Caddy (recommendation
routes, rendezvous hashing of `X-User-Id`; everything else to the router) for the servers listed
there, and `reconcile()` (once a second under `run()`) keeps them in line with it:

- a listed server that answers `GET /health` joins the router (`POST /workers`) and Caddy (config
  reload): admission without restarting anything;
- a listed server that failed `fail_threshold` health checks in a row is removed from the servers
  file, the router (`DELETE /workers/{id}`) and Caddy. Until then Caddy's own health checks and
  retries already route around it.

The servers themselves need no list: they share users' prefixes and item KV through the storage
tier (`--hicache-storage-backend mooncake`, one master for all). Nothing here is on the request
path: requests go client -> Caddy -> sgrec server (or -> router -> sgrec server).

    python -m launch.front --servers servers.json --port 8000 --router-port 8001
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
import urllib.error
import urllib.request

from launch import caddy_config
from sgrec.tools.local_server import free_port  # noqa: F401 (launch.local_cluster imports it from here)

START_TIMEOUT_S = 60.0
# A worker that refused two requests in a row is skipped (circuit open) for 10 s, so the router's own
# retries of a request that could not reach a dead worker go to another one: nothing is lost while
# the health checks catch up. (The router's default, 10 failures, lets those requests fail.)
ROUTER_ARGS = ("--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "10")


def read_servers(path: str) -> list[dict]:
    """The entries of the servers file at `path`; ValueError on a malformed file."""
    with open(path) as f:
        data = json.load(f)
    servers = data.get("servers") if isinstance(data, dict) else None
    if not isinstance(servers, list) or not all(isinstance(s, dict) and isinstance(s.get("url"), str)
                                                for s in servers):
        raise ValueError(f'{path}: expected {{"servers": [{{"name": ..., "url": ...}}, ...]}}')
    return servers


def write_servers(path: str, servers: list[dict]) -> None:
    """Writes the servers file atomically (readers never see half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"servers": list(servers)}, f, indent=1)
    os.replace(tmp, path)


def router_cmd(host: str, port: int, urls: list[str], policy: str = "manual", extra: tuple[str, ...] = ()) -> list[str]:
    """sglang-router's command line for `urls` (`policy`: manual pins a routing key to a worker, random
    spreads requests as a random router does)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", policy,
            "--log-level", "warn", *ROUTER_ARGS, *extra, "--worker-urls", *urls]


def router_workers(router_url: str) -> dict[str, str]:
    """url -> worker id of a running router's workers ({} while it does not answer)."""
    code, body = http("GET", router_url + "/workers")
    if code != 200:
        return {}
    return {w["url"].rstrip("/"): w["id"] for w in json.loads(body).get("workers", [])}


def http(method: str, url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def healthy(url: str, timeout: float = 5.0) -> bool:
    return http("GET", url.rstrip("/") + "/health", timeout=timeout)[0] == 200


def wait_until(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.2)


class Front:
    def __init__(self, servers_path: str, port: int, router_port: int | None = None, host: str = "127.0.0.1",
                 workdir: str | None = None, fail_threshold: int = 3, router_args: tuple[str, ...] = ()):
        self.servers_path = servers_path
        self.host = host
        self.port = port
        self.router_port = router_port or free_port(host)
        self.admin = f"127.0.0.1:{free_port()}"
        self.workdir = workdir or tempfile.mkdtemp(prefix="sgrec-front-")
        self.fail_threshold = fail_threshold
        self.router_args = tuple(router_args)
        self.url = f"http://{host}:{port}"
        self.router_url = f"http://{host}:{self.router_port}"
        self.fails: dict[str, int] = {}
        self.in_lb: list[str] = []  # server urls the router and Caddy have now
        self.removed: list[str] = []  # servers taken out of the servers file as dead
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = threading.Event()

    # ---- processes ------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.workdir, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, **(env or {})})
        log.close()
        self.procs[name] = p
        return p

    def start(self) -> "Front":
        urls = [s["url"] for s in read_servers(self.servers_path) if healthy(s["url"])]
        if not urls:
            raise RuntimeError("no listed server answers /health")
        router = self._spawn("router", router_cmd(self.host, self.router_port, urls, extra=self.router_args))
        wait_until(lambda: len(self._router_workers()) == len(urls), START_TIMEOUT_S, "sglang-router", router)
        cfg_path = os.path.join(self.workdir, "caddy.json")
        with open(cfg_path, "w") as f:
            json.dump(self._caddy_config(urls), f)
        caddy_env = {"XDG_CONFIG_HOME": self.workdir, "XDG_DATA_HOME": self.workdir, "HOME": self.workdir}
        caddy = self._spawn("caddy", ["caddy", "run", "--config", cfg_path], env=caddy_env)
        wait_until(lambda: http("GET", f"http://{self.admin}/config/")[0] == 200, START_TIMEOUT_S, "caddy", caddy)
        self.in_lb = urls
        return self

    def _caddy_config(self, urls: list[str]) -> dict:
        return caddy_config.config(f"{self.host}:{self.port}", self.admin, urls, self.router_url)

    def _router_workers(self) -> dict[str, str]:
        return router_workers(self.router_url)

    # ---- keeping in line with the servers file -------------------------------------------------
    def reconcile(self) -> dict:
        """One pass; returns {"added": [...], "removed": [...]} (server urls)."""
        servers = read_servers(self.servers_path)
        want, dead = [], []
        for s in servers:
            url = s["url"].rstrip("/")
            if healthy(url):
                self.fails[url] = 0
                want.append(url)
                continue
            self.fails[url] = self.fails.get(url, 0) + 1
            if self.fails[url] >= self.fail_threshold:
                dead.append(url)
            elif url in self.in_lb:
                want.append(url)  # not yet judged dead: Caddy's own checks route around it meanwhile
        if dead:
            write_servers(self.servers_path, [s for s in servers if s["url"].rstrip("/") not in dead])
            self.removed += dead
        added = [u for u in want if u not in self.in_lb]
        gone = [u for u in self.in_lb if u not in want]
        if added or gone:
            workers = self._router_workers()
            for u in added:
                if u not in workers:
                    http("POST", self.router_url + "/workers", {"url": u})
            for u in gone:
                if u in workers:
                    http("DELETE", f"{self.router_url}/workers/{workers[u]}")
            caddy_config.load(self.admin, self._caddy_config(want))
            self.in_lb = want
        return {"added": added, "removed": gone}

    def wait_router(self, timeout: float = 30.0) -> None:
        """Blocks until the router's workers are exactly the servers in Caddy (after a reconcile)."""
        wait_until(lambda: sorted(self._router_workers()) == sorted(self.in_lb), timeout, "router worker update")

    def run(self, interval: float = 1.0) -> None:
        while not self._stop.wait(interval):
            try:
                self.reconcile()
            except (OSError, ValueError) as e:
                print(f"front: reconcile failed: {e}", file=sys.stderr)

    def stop(self) -> None:
        self._stop.set()
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m launch.front", description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", required=True, help='the servers file: {"servers": [{"name", "url"}, ...]}')
    ap.add_argument("--host", default="127.0.0.1", help="address the router and Caddy listen on")
    ap.add_argument("--port", type=int, default=8000, help="Caddy: every route, clients come here")
    ap.add_argument("--router-port", type=int, default=8001, help="sglang-router (generation routes)")
    ap.add_argument("--fail-threshold", type=int, default=3, help="failed health checks before removal")
    a, router_args = ap.parse_known_args(argv)
    front = Front(a.servers, a.port, a.router_port, a.host, fail_threshold=a.fail_threshold,
                  router_args=tuple(router_args)).start()
    print(f"front ready: {front.url} (rec routes by X-User-Id, the rest via sglang-router {front.router_url}); "
          f"logs in {front.workdir}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: front._stop.set())
    try:
        front.run()
    except KeyboardInterrupt:
        pass
    finally:
        front.stop()


if __name__ == "__main__":
    main()
