"""The suite's verdicts do not depend on what a user did with a server before: a demo catalog journal
left in the user's state folder (what catalog updates on the demo server leave there) changes no
test's verdict, and the suite writes nothing there (tests/conftest.py gives every run a state folder
of its own). docs/reliability.md, "The same verdict on every machine"."""

import json
import os
import re
import subprocess
import sys

from sgrec import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOURNAL = os.path.join(".local", "state", "sgrec", "demo", "ml100k", "catalog.jsonl.journal")
# three items the packaged catalog lacks, without its MovieLens fields (movie_id, title): the demo's
# tests would see 1,685 items and rows without a movie_id
NEW_ITEMS = [{"id": f"user-added-{i}", "token_ids": [1024 + i]} for i in range(3)]
REPLAYED = ("import logging; logging.basicConfig(level=logging.INFO); import sgrec.demo as d; "
            "from sgrec.catalog.versions import replay; from sgrec.catalog.loader import load_catalog; "
            "from sgrec.server_args import default_journal_path; p = d.catalog_path(); "
            "print(len(replay(load_catalog(p), default_journal_path(p)).current))")


def users_home(tmp_path) -> tuple[dict, str]:
    """A user's home whose state folder holds a demo journal; the environment of a process that user
    starts (no XDG_STATE_HOME: the default ~/.local/state), the built kernels' cache kept."""
    home = tmp_path / "home"
    journal = home / JOURNAL
    journal.parent.mkdir(parents=True)
    journal.write_text(json.dumps({"version": 1, "op": "upsert", "items": NEW_ITEMS}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "XDG_STATE_HOME"}
    env["XDG_CACHE_HOME"] = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env["HOME"] = str(home)
    return env, str(journal)


def test_the_suite_runs_in_a_state_folder_of_its_own():
    from sgrec.server_args import state_dir

    assert os.environ["XDG_STATE_HOME"] != os.path.join(os.path.expanduser("~"), ".local", "state")
    assert state_dir().startswith(os.environ["XDG_STATE_HOME"])


def test_a_demo_journal_in_the_users_state_changes_no_verdict(tmp_path):
    env, journal = users_home(tmp_path)
    before = open(journal, "rb").read()
    # outside the suite the journal is the user's demo catalog: 1,685 items, not the packaged 1,682
    out = subprocess.run([sys.executable, "-c", REPLAYED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1685"
    assert f"catalog journal {journal}: replaying 1 update record(s)" in out.stderr
    # the demo's tests, run by that user, see the packaged catalog and leave the journal as it was
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_demo.py::test_loads_offline", "tests/test_demo.py::test_every_retrieved_item_exists"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]
    assert re.search(r"^\d+ passed", run.stdout, re.M) and "failed" not in run.stdout, run.stdout[-3000:]
    assert open(journal, "rb").read() == before
    assert sorted(os.listdir(os.path.dirname(journal))) == ["catalog.jsonl.journal"]
    assert demo.available()
