"""`python -m sgrec.demo.client`: asks a running sgrec server (by default the embedded demo,
`python -m sgrec.launch_server`) for one MovieLens user's recommendations and prints them with
titles: the user's recent history, /v1/rank over 100 candidates (the held-out movie and 99
others, as in `sgrec.demo.evaluate`) and /v1/retrieve over the whole catalog. The held-out movie
(the user's real next one) is marked with `*`.

    python -m sgrec.demo.client --user 42 --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from sgrec.demo import item_id
from sgrec.demo.data import eval_candidates, load_split, retrieve_text, user_text


def post(url: str, path: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--user", type=int, default=42, help="MovieLens-100K user id (1..943)")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--beam-width", type=int, default=32)
    ap.add_argument("--prefix", default="auto", choices=["auto", "user", "item", "none", "greedy"])
    ap.add_argument("--history", type=int, default=10, help="history items to print")
    a = ap.parse_args(argv)
    split = load_split()
    if a.user not in split.sequences:
        print(f"unknown user {a.user}; MovieLens-100K users are 1..{max(split.users)}", file=sys.stderr)
        return 2
    movies = split.data.movies
    hist, target = split.test_case(a.user)

    def title(m: int) -> str:
        mv = movies[m]
        return f"{mv.title} ({mv.year})  [{', '.join(mv.genres)}]"

    def mark(m: int) -> str:
        return "*" if m == target else " "

    print(f"user {a.user}: {len(split.sequences[a.user]) - 1} movies rated before the held-out one; the last {a.history}:")
    for m in hist[-a.history:]:
        print(f"    {title(m)}")
    cands = eval_candidates(split, a.user, "popular")
    try:
        out = post(a.url, "/v1/rank", {"user": {"id": f"u{a.user}", "text": user_text(hist)},
                                       "items": [item_id(c) for c in cands], "prefix": a.prefix, "top_k": a.top_k})
    except (RuntimeError, OSError) as e:
        print(f"cannot reach the server at {a.url}: {e}", file=sys.stderr)
        return 1
    print(f"\n/v1/rank: top {a.top_k} of {len(cands)} candidates ({out['meta_info']['prefix']}-as-prefix; "
          f"* = the held-out next movie):")
    for r in out["ranking"]:
        m = int(r["item"][1:])
        print(f"  {mark(m)} {r['score']:.3f}  {title(m)}")
    try:
        seen = [item_id(m) for m in split.sequences[a.user][:-1]]  # never recommend a rated movie again
        out = post(a.url, "/v1/retrieve", {"user": {"id": f"u{a.user}", "text": retrieve_text(hist)},
                                           "beam_width": a.beam_width, "num_items": a.top_k, "exclude_items": seen})
    except (RuntimeError, OSError) as e:
        print(f"\n/v1/retrieve failed: {e}")
        return 1
    print(f"\n/v1/retrieve: top {a.top_k} of all {len(movies)} movies (xBeam, beam width {a.beam_width}; "
          f"the {len(seen)} movies the user rated excluded):")
    for r in out["items"]:
        m = int(r["item"][1:])
        print(f"  {mark(m)} {r['score']:8.3f}  {title(m)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
