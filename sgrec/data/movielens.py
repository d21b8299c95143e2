"""MovieLens-100K, read from the `recbole==1.2.1` wheel (it ships `dataset_example/ml-100k/`).

The wheel is fetched once with `pip download --no-deps` into the cache directory
(`$SGREC_CACHE_DIR` or `~/.cache/sgrec`); the raw files are read straight from the zip and never
copied into the repository.
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass

from sgrec.server_args import cache_dir

RECBOLE = "recbole==1.2.1"
_PREFIX = "recbole/dataset_example/ml-100k/ml-100k."


@dataclass(frozen=True)
class Interaction:
    user: int
    item: int
    rating: float
    timestamp: int


@dataclass(frozen=True)
class Movie:
    id: int
    title: str
    year: int | None
    genres: tuple[str, ...]


@dataclass
class MovieLens100K:
    interactions: list[Interaction]  # sorted by (timestamp, user, item)
    movies: dict[int, Movie]

    @property
    def num_users(self) -> int:
        return len({x.user for x in self.interactions})

    def histories(self) -> dict[int, list[Interaction]]:
        """Each user's interactions in time order."""
        out: dict[int, list[Interaction]] = {}
        for x in self.interactions:
            out.setdefault(x.user, []).append(x)
        return out


def wheel_path(download: bool = True) -> str:
    """Path of the recbole wheel in the cache, downloading it when missing (and allowed)."""
    d = os.path.join(cache_dir(), "wheels")
    found = sorted(glob.glob(os.path.join(d, "recbole-1.2.1-*.whl")))
    if found:
        return found[0]
    if not download:
        raise FileNotFoundError(f"{RECBOLE} wheel not found in {d}")
    os.makedirs(d, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", RECBOLE, "-d", d]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(glob.glob(os.path.join(d, "recbole-1.2.1-*.whl")))
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"could not download {RECBOLE} (needed for MovieLens-100K): {proc.stderr.strip()[-500:]}")
    return found[0]


def _rows(zf: zipfile.ZipFile, suffix: str) -> list[list[str]]:
    text = zf.read(_PREFIX + suffix).decode("utf-8", errors="replace")
    lines = text.splitlines()[1:]  # the first line is recbole's typed header
    return [line.split("\t") for line in lines if line.strip()]


@functools.lru_cache(maxsize=1)
def load_ml100k() -> MovieLens100K:
    """All 100,000 ratings of 943 users on 1,682 movies, with titles, years and genres."""
    with zipfile.ZipFile(wheel_path()) as zf:
        inter = [Interaction(int(u), int(i), float(r), int(float(t))) for u, i, r, t in _rows(zf, "inter")]
        movies = {}
        for row in _rows(zf, "item"):
            row += [""] * (4 - len(row))
            mid, title, year, genres = row[:4]
            movies[int(mid)] = Movie(int(mid), title, int(year) if year.strip().isdigit() else None,
                                     tuple(genres.split()))
    inter.sort(key=lambda x: (x.timestamp, x.user, x.item))
    return MovieLens100K(inter, movies)
