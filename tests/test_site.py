"""The documentation site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a broken link or
anchor, a page missing from the navigation or a navigation entry without its page fails it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_site_builds_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "flags" / "index.html").exists()



def test_the_changelog_names_the_version():
    """CHANGELOG.md's newest version is the one pyproject.toml and sgrec.__version__ carry."""
    import re
    import tomllib

    import sgrec

    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        newest = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", f.read(), re.M).group(1)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["version"] == newest == sgrec.__version__
