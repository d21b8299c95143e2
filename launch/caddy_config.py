"""Caddy's JSON config for the recommendation routes, and loading it into a running Caddy.

`/v1/rank`, `/v1/retrieve` and `/v1/score` go to the sgrec servers, picked by rendezvous (highest
random weight) hashing of the `X-User-Id` header (Caddy's `header` selection policy): a user stays on
one server while it is up, and only the users of a server that leaves (or some users, to a server
that joins) move. A request without the header goes to the least busy server. A server that refuses
the connection is retried on the next one, so a request that had not reached a dead server is not
lost; active health checks (`GET /health` every second) take a dead server out of the hash. Every
other route goes to sglang-router (which proxies the generation routes), with `X-User-Id` copied to
the router's `X-SMG-Routing-Key`, so one header pins a user on every route.
"""

from __future__ import annotations

import json
import urllib.request

REC_ROUTES = ["/v1/rank", "/v1/retrieve", "/v1/score"]
USER_HEADER = "X-User-Id"
ROUTER_KEY_HEADER = "X-SMG-Routing-Key"


def _hostport(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def rec_proxy(server_urls: list[str], health_interval: str = "1s") -> dict:
    return {
        "handler": "reverse_proxy",
        "upstreams": [{"dial": _hostport(u)} for u in server_urls],
        "load_balancing": {
            "selection_policy": {"policy": "header", "field": USER_HEADER, "fallback": {"policy": "least_conn"}},
            "retries": 3, "try_duration": "10s", "try_interval": "100ms",
        },
        "health_checks": {
            "active": {"uri": "/health", "interval": health_interval, "timeout": "5s"},
            "passive": {"fail_duration": "5s", "max_fails": 1},
        },
    }


def config(listen: str, admin: str, server_urls: list[str], router_url: str | None) -> dict:
    """Caddy's whole config: `listen` (host:port) for clients, `admin` (host:port) for updates."""
    routes = [{"match": [{"path": REC_ROUTES}], "handle": [rec_proxy(server_urls)], "terminal": True}]
    if router_url:
        to_router = {"handler": "reverse_proxy", "upstreams": [{"dial": _hostport(router_url)}],
                     "flush_interval": -1}
        keyed = {**to_router, "headers": {"request": {"set": {
            ROUTER_KEY_HEADER: ["{http.request.header.%s}" % USER_HEADER]}}}}
        routes += [{"match": [{"header": {USER_HEADER: ["*"]}}], "handle": [keyed], "terminal": True},
                   {"handle": [to_router], "terminal": True}]
    return {
        "admin": {"listen": admin, "config": {"persist": False}},
        "logging": {"logs": {"default": {"level": "ERROR"}}},
        "apps": {"http": {"servers": {"front": {
            "listen": [listen], "routes": routes, "automatic_https": {"disable": True},
        }}}},
    }


def load(admin: str, cfg: dict, timeout: float = 10.0) -> None:
    """Replaces the running Caddy's config (a graceful reload: connections in flight finish)."""
    req = urllib.request.Request(f"http://{admin}/load", data=json.dumps(cfg).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
