"""Request traces for the radix-cache simulator: token-id prompts in arrival order.

- `gr-users`: GR ranking requests replaying MovieLens-100K in timestamp order. Every interaction is a
  request of that user: a shared system prompt, the user's profile (a user token, then the user's
  earlier items with their ratings, so it grows with the history) and the candidate items to rank.
  `build_gr_requests` gives the same requests as structured records for other benchmarks.
- `multiturn`: conversations averaging 3.6 turns; each prompt extends the previous turn with the
  model's answer and a new user message; the number of other requests between two turns of one
  conversation is lognormal (mean 266, std 77.5), as in LCR §5.2.
- `scan`: a looping scan over more data than the cache, mixed with a hot set.
- `zipf`: independent items requested with Zipf popularity.

Token ids of different roles live in disjoint ranges, so unrelated prompts never share prefixes by
accident. A trace file is JSON lines: {"tokens": [...], "extra_key": null, "time": 0.0}.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

SYSTEM_BASE = 1  # shared system prompts
USER_BASE = 10_000
ITEM_BASE = 20_000
RATING_BASE = 30_000  # + rating (1..5)
TEXT_BASE = 40_000  # free text of conversations and synthetic items
RANK_TOKEN = 9_999


@dataclass
class TraceRequest:
    tokens: list[int]
    extra_key: str | None = None
    time: float = 0.0  # the source's timestamp (informative; the simulator's clock is the index)


Trace = list[TraceRequest]


# ---- gr-users ------------------------------------------------------------------------------------
@dataclass
class GRRequest:
    """One ranking request: user `user` interacted with `item` at `timestamp`."""

    user: int
    item: int
    timestamp: int
    profile: list[int]  # system prompt + user token + (item, rating) tokens of the shown history
    candidates: list[int] = field(default_factory=list)  # item ids to rank; the true item among them

    def tokens(self) -> list[int]:
        return self.profile + [ITEM_BASE + i for i in self.candidates] + [RANK_TOKEN]


def profile_tokens(user: int, history: list[tuple[int, float]], max_history: int = 50, block: int = 10,
                   system_len: int = 16) -> list[int]:
    """A user's prompt prefix. At most `max_history` most recent (item, rating) pairs are shown; the
    oldest are dropped `block` at a time, so the prefix only changes every `block` interactions
    once the history is full."""
    start = 0
    if len(history) > max_history:
        start = block * math.ceil((len(history) - max_history) / block)
    toks = list(range(SYSTEM_BASE, SYSTEM_BASE + system_len)) + [USER_BASE + user]
    for item, rating in history[start:]:
        toks += [ITEM_BASE + item, RATING_BASE + int(round(rating))]
    return toks


def build_gr_requests(max_requests: int | None = 20000, start: int = 0, max_history: int = 50, block: int = 10,
                      num_candidates: int = 8, seed: int = 0) -> list[GRRequest]:
    """Requests of MovieLens-100K interactions [start, start + max_requests) in time order; each
    user's history counts all of that user's earlier interactions (also those before `start`)."""
    from sgrec.data.movielens import load_ml100k

    ml = load_ml100k()
    items = sorted(ml.movies)
    rng = random.Random(seed)
    end = len(ml.interactions) if max_requests is None else min(len(ml.interactions), start + max_requests)
    seen: dict[int, list[tuple[int, float]]] = {}
    out: list[GRRequest] = []
    for idx, x in enumerate(ml.interactions[:end]):
        hist = seen.setdefault(x.user, [])
        if idx >= start:
            cands = [x.item] + rng.sample(items, num_candidates - 1) if num_candidates > 0 else []
            rng.shuffle(cands)
            out.append(GRRequest(x.user, x.item, x.timestamp, profile_tokens(x.user, hist, max_history, block), cands))
        hist.append((x.item, x.rating))
    return out


def gr_users(max_requests: int | None = 20000, start: int = 0, max_history: int = 50, block: int = 10,
             num_candidates: int = 8, seed: int = 0) -> Trace:
    reqs = build_gr_requests(max_requests, start, max_history, block, num_candidates, seed)
    return [TraceRequest(r.tokens(), None, float(r.timestamp)) for r in reqs]


# ---- multiturn -----------------------------------------------------------------------------------
def lognormal_params(mean: float, std: float) -> tuple[float, float]:
    sigma2 = math.log(1.0 + (std / mean) ** 2)
    return math.log(mean) - sigma2 / 2.0, math.sqrt(sigma2)


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def multiturn(num_conversations: int = 500, mean_turns: float = 3.6, gap_mean: float = 266.0,
              gap_std: float = 77.5, system_prompts: int = 4, system_len: int = 32, first_len: tuple[int, int] = (64, 256),
              answer_len: int = 64, followup_len: tuple[int, int] = (16, 128), seed: int = 0) -> Trace:
    """Conversations of 1 + Poisson(mean_turns - 1) turns; turn j's prompt is turn j-1's prompt plus
    the answer and a new message. A conversation's first turn arrives at a uniform position in the
    stream and each later turn a lognormal number of requests after the previous one."""
    rng = random.Random(seed)
    mu, sigma = lognormal_params(gap_mean, gap_std)
    systems = [[TEXT_BASE + 1000 * s + i for i in range(system_len)] for s in range(system_prompts)]
    text = TEXT_BASE + 10_000

    def words(n: int) -> list[int]:
        return [text + rng.randrange(50_000) for _ in range(n)]

    convs = [1 + _poisson(rng, mean_turns - 1.0) for _ in range(num_conversations)]
    total = sum(convs)
    events: list[tuple[float, int, list[int]]] = []
    for c, turns in enumerate(convs):
        prompt = rng.choice(systems) + words(rng.randint(*first_len))
        pos = rng.uniform(0, total)
        for turn in range(turns):
            if turn:
                prompt = prompt + words(answer_len) + words(rng.randint(*followup_len))
                pos += 1.0 + rng.lognormvariate(mu, sigma)
            events.append((pos, c, prompt))
    events.sort(key=lambda e: (e[0], e[1]))
    return [TraceRequest(p, None, t) for t, _, p in events]


# ---- scan and zipf -------------------------------------------------------------------------------
def _items(rng: random.Random, n: int, length: int, prefix: list[int], base: int) -> list[list[int]]:
    return [prefix + [base + rng.randrange(1 << 30) for _ in range(length)] for _ in range(n)]


def scan(num_requests: int = 20000, hot_items: int = 64, scan_items: int = 512, item_len: int = 32,
         hot_prob: float = 0.5, prefix_len: int = 8, seed: int = 0) -> Trace:
    """With probability hot_prob a uniformly chosen hot item, else the next item of a loop over
    scan_items (prompt = shared prefix + the item's tokens)."""
    rng = random.Random(seed)
    prefix = list(range(SYSTEM_BASE, SYSTEM_BASE + prefix_len))
    hot = _items(rng, hot_items, item_len, prefix, TEXT_BASE)
    loop = _items(rng, scan_items, item_len, prefix, TEXT_BASE)
    out, j = [], 0
    for t in range(num_requests):
        if rng.random() < hot_prob:
            toks = rng.choice(hot)
        else:
            toks, j = loop[j], (j + 1) % scan_items
        out.append(TraceRequest(list(toks), None, float(t)))
    return out


def zipf(num_requests: int = 5000, num_items: int = 200, item_len: int = 16, alpha: float = 1.0,
         prefix_len: int = 0, seed: int = 0) -> Trace:
    """Independent items of item_len tokens with P(rank r) proportional to r^-alpha."""
    rng = random.Random(seed)
    prefix = list(range(SYSTEM_BASE, SYSTEM_BASE + prefix_len))
    items = _items(rng, num_items, item_len, prefix, TEXT_BASE)
    weights = [1.0 / (r + 1) ** alpha for r in range(num_items)]
    picks = rng.choices(range(num_items), weights=weights, k=num_requests)
    return [TraceRequest(list(items[i]), None, float(t)) for t, i in enumerate(picks)]


TRACES: dict[str, Callable[..., Trace]] = {"gr-users": gr_users, "multiturn": multiturn, "scan": scan, "zipf": zipf}


def make_trace(name: str, **kw) -> Trace:
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
    return TRACES[name](**kw)


def save_trace(path: str, trace: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps(asdict(r)) + "\n")


def load_trace(path: str) -> Trace:
    with open(path) as f:
        return [TraceRequest(list(d["tokens"]), d.get("extra_key"), float(d.get("time", 0.0)))
                for d in map(json.loads, f) if d]
