"""The installed package stays read-only: the embedded default demo (`python -m
sgrec.launch_server` with no --model-path) serves catalog updates from a read-only install, keeping
their journal in the state directory ($XDG_STATE_HOME/sgrec, default ~/.local/state/sgrec), from
where a restart serves them again."""

import hashlib
import json
import os
import shutil
import stat

import httpx
import pytest

import sgrec
from sgrec.server_args import PACKAGE_DIR, default_journal_path, state_dir
from sgrec.tools.local_server import LocalServer

FLAGS = ["--device", "cpu", "--dtype", "float32", "--context-length", "256", "--max-total-tokens", "8192"]
JOURNAL = os.path.join("sgrec", "demo", "ml100k", "catalog.jsonl.journal")  # under the state directory


def snapshot(root) -> dict:
    """Every file and folder under `root`: (mode, size, sha256) by relative path."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size if digest else None, digest)
    return out


def read_only_copy(dest) -> str:
    """The sgrec package copied under `dest` and made read-only (a site-packages of its own)."""
    shutil.copytree(os.path.dirname(sgrec.__file__), dest / "sgrec", ignore=shutil.ignore_patterns("__pycache__"))
    for d, dirs, files in os.walk(dest, topdown=False):
        for p in [os.path.join(d, n) for n in files + dirs] + [d]:
            os.chmod(p, os.lstat(p).st_mode & ~0o222)
    return str(dest)


@pytest.fixture
def install(tmp_path, monkeypatch):
    root = read_only_copy(tmp_path / "site")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # built CPU kernels and the like: a cache
    monkeypatch.delenv("SGREC_CACHE_DIR", raising=False)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # Python's own caches are not sgrec's state
    yield root
    for d, dirs, files in os.walk(root):  # writable again, so that pytest can remove it
        for p in [d] + [os.path.join(d, n) for n in dirs]:
            os.chmod(p, os.lstat(p).st_mode | 0o200)


def test_demo_catalog_updates_go_to_the_state_dir_not_the_install(install, tmp_path):
    before = snapshot(install)
    with LocalServer(FLAGS, log_path=str(tmp_path / "first.log"), root=install) as srv:
        model = httpx.get(srv.url + "/get_model_info", timeout=60).json()["model_path"]
        assert os.path.commonpath([model, install]) == install  # the copy serves, not this checkout
        facts = httpx.get(srv.url + "/v1/catalog", timeout=60).json()
        assert (facts["version"], facts["num_items"]) == (0, 1682)
        r = httpx.post(srv.url + "/v1/catalog/delete", json={"ids": ["m1"]}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json() == {"version": 1, "inserted": 0, "replaced": 0, "deleted": 1, "unknown_ids": 0}
    assert snapshot(install) == before  # nothing written into the install, nothing created there
    with open(tmp_path / "state" / JOURNAL) as f:
        assert [(rec["version"], rec["op"], rec["ids"]) for rec in map(json.loads, f)] == [(1, "delete", ["m1"])]
    assert not os.path.exists(tmp_path / "home")  # state goes to XDG_STATE_HOME, caches to XDG_CACHE_HOME, not ~
    with LocalServer(FLAGS, log_path=str(tmp_path / "again.log"), root=install) as again:  # a restart
        facts = httpx.get(again.url + "/v1/catalog", timeout=60).json()
        assert (facts["version"], facts["num_items"]) == (1, 1681)
        r = httpx.post(again.url + "/v1/rank", json={"user": {"token_ids": [1025]}, "items": ["m1", "m2"]},
                       timeout=120)
        assert r.status_code == 400 and "m1" in r.json()["message"], r.text
    assert snapshot(install) == before


def test_the_journal_of_a_packaged_catalog_defaults_to_the_state_dir(monkeypatch, tmp_path):
    catalog = os.path.join(PACKAGE_DIR, "demo", "ml100k", "catalog.jsonl")
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert state_dir() == str(tmp_path / ".local" / "state" / "sgrec")
    assert default_journal_path(catalog) == str(tmp_path / ".local" / "state" / JOURNAL)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_journal_path(catalog) == str(tmp_path / "xdg" / JOURNAL)
    assert default_journal_path(str(tmp_path / "mine.jsonl")) == str(tmp_path / "mine.jsonl") + ".journal"
