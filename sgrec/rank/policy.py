"""Hotness-aware prefix selection for rank requests (BAT §5.3) and the cache meta service.

`CacheMeta` tracks, without holding any KV:
- each user's request frequency f_u over a sliding window of W seconds, kept as an exponentially
  decayed count (time constant W): every access first decays the stored estimate to the current
  time, then adds one (§5.3: the meta service decays a user's sliding-window frequency whenever it
  is accessed). Reads decay to the time asked, so estimates of different users compare at one time.
- which users' prefixes are cached (the deepest radix node of their tokens; a node detached by
  eviction or reset means "no longer cached"),
- per-item access counts (hotness for the item store and for HRCS placement), optionally seeded
  with a past period's counts,
- per user, what its last request could reuse (prefix length, item tokens item-as-prefix would
  have read), for `user_value`: f_u weighted by the share of the prefix that caching it saves over
  item-as-prefix, the quantity RankExecutor's `auto` compares and replaces by.

`select_prefix` is a pure function of the quantities in the §5.3 rule.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sgrec.layout import ITEM_PREFIX, USER_PREFIX

PREFIX_POLICIES = ("auto", "user", "item", "none", "greedy")
NONE = "none"  # recompute: user-as-prefix layout, no cache read or write
DEFAULT_WINDOW_S = 300.0  # §5.3 analyses 5- and 60-minute windows


def select_prefix(policy: str, user_tokens: int, item_tokens: int, f_user: float = 0.0,
                  cached_freqs: Iterable[float] = (), user_cached: bool = False,
                  fits_without_eviction: bool = False, replaced_freqs: Iterable[float] | None = None,
                  cacheable: bool = True) -> str:
    """The prefix of one request: "user", "item" or "none".

    auto (§5.3): user-as-prefix when tau_u >= tau_i and f_u > min over cached users' f_p, else
    item-as-prefix. With no cached user the minimum is over an empty set (-inf). One reading of
    the rule's intent is explicit: a user whose prefix is already cached replaces nobody, so it
    keeps user-as-prefix when tau_u >= tau_i (`user_cached`). `fits_without_eviction` (room for the
    user without replacing anyone) is the same kind of exception: RankExecutor passes it when the
    user fits under its hard user-cache cap, or, with no cap, in free pool slots beyond a reserve
    for the other requests' working room. RankExecutor's f_u counts the user's requests before
    this one.
    With a bounded user cache the executor knows which cached users the new prefix would replace
    (the lowest-frequency ones, until it fits): `replaced_freqs` are their frequencies and f_u must
    beat every one of them (with one victim this is the rule's min); `cacheable=False` (the prefix
    is longer than the whole user cache, so it could never be reused) means item-as-prefix.
    greedy (cache-agnostic, §5.3): the longer side is the prefix. user/item/none: fixed.
    """
    if policy == "user":
        return USER_PREFIX
    if policy == "item":
        return ITEM_PREFIX
    if policy == NONE:
        return NONE
    if policy == "greedy":
        return USER_PREFIX if user_tokens >= item_tokens else ITEM_PREFIX
    if policy != "auto":
        raise ValueError(f"unknown prefix policy {policy!r}; expected one of {PREFIX_POLICIES}")
    if user_tokens < item_tokens:
        return ITEM_PREFIX
    if user_cached or fits_without_eviction:
        return USER_PREFIX
    if not cacheable:
        return ITEM_PREFIX
    if replaced_freqs is not None:
        return USER_PREFIX if f_user > max(replaced_freqs, default=-math.inf) else ITEM_PREFIX
    lowest = min(cached_freqs, default=-math.inf)
    return USER_PREFIX if f_user > lowest else ITEM_PREFIX


@dataclass
class _UserStat:
    freq: float = 0.0  # decayed count at time `at`
    at: float = 0.0
    node: object | None = None  # deepest radix node of the cached prefix, if any
    cached_len: int = 0
    tokens_hash: int = 0  # hash of the tokens that prefix was cached for
    tokens: int = 0  # the user's prefix length at its last request
    item_reuse: int = 0  # tokens item-as-prefix would have reused at its last request


class CacheMeta:
    """The cache meta service: user window frequencies, cached-user index, item access counts."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.clock = clock
        self.users: dict[str, _UserStat] = {}
        self.item_counts: Counter[str] = Counter()

    # ---- users ----------------------------------------------------------------------------
    def _decayed(self, st: _UserStat, now: float) -> float:
        return st.freq * math.exp(-max(0.0, now - st.at) / self.window_s)

    def record_user(self, user: str, now: float | None = None) -> float:
        """One request of `user`: decay its estimate to now, add one; returns the new f_u."""
        now = self.clock() if now is None else now
        st = self.users.setdefault(user, _UserStat(at=now))
        st.freq, st.at = self._decayed(st, now) + 1.0, now
        return st.freq

    def user_freq(self, user: str, now: float | None = None) -> float:
        st = self.users.get(user)
        return 0.0 if st is None else self._decayed(st, self.clock() if now is None else now)

    def note_reuse(self, user: str, tokens: int, item_reuse: int) -> None:
        """What the user's last request could reuse: its prefix length and the tokens item-as-prefix
        would have read from the item store (for `user_value`)."""
        st = self.users.setdefault(user, _UserStat(at=self.clock()))
        st.tokens, st.item_reuse = int(tokens), int(item_reuse)

    def user_value(self, user: str, now: float | None = None, tokens: int | None = None,
                   item_reuse: int | None = None) -> float:
        """Tokens a cached prefix of this user saves per window per cached token: f_u times the share
        of its prefix that item-as-prefix would not reuse anyway, (tau_u - reused item tokens) / tau_u
        (the last request's, unless given). With the whole catalog cached and tau_u >> tau_i this is
        about f_u; a user whose requests item-as-prefix serves nearly as well is worth less."""
        st = self.users.get(user)
        if st is None:
            return 0.0
        tau = st.tokens if tokens is None else tokens
        reuse = st.item_reuse if item_reuse is None else item_reuse
        share = max(0, tau - reuse) / tau if tau > 0 else 1.0
        return self._decayed(st, self.clock() if now is None else now) * share

    def set_cached(self, user: str, node: object | None, length: int, tokens: Sequence[int] = ()) -> None:
        """The user's prefix (`length` tokens of `tokens`) now ends at radix node `node` (None: not cached)."""
        st = self.users.setdefault(user, _UserStat(at=self.clock()))
        st.node, st.cached_len = node, length if node is not None else 0
        st.tokens_hash = hash(tuple(tokens))

    @staticmethod
    def _alive(st: _UserStat) -> bool:
        node = st.node
        return node is not None and getattr(node, "parent", None) is not None

    def is_cached(self, user: str, length: int, tokens: Sequence[int] | None = None) -> bool:
        """Whether the user's first `length` tokens are still cached (for these `tokens`, if given)."""
        st = self.users.get(user)
        if st is None or not self._alive(st) or st.cached_len < length:
            return False
        return tokens is None or st.tokens_hash == hash(tuple(tokens))

    def cached_users(self) -> list[str]:
        """Users whose prefix is still in the tree (forgets the ones evicted since)."""
        out = []
        for user, st in self.users.items():
            if st.node is None:
                continue
            if self._alive(st):
                out.append(user)
            else:
                st.node, st.cached_len = None, 0
        return out

    def cached_freqs(self, exclude: str | None = None, now: float | None = None, value: bool = False) -> list[float]:
        """f_p of the cached users (`value`: their user_value instead)."""
        now = self.clock() if now is None else now
        if value:
            return [self.user_value(u, now) for u in self.cached_users() if u != exclude]
        return [self._decayed(self.users[u], now) for u in self.cached_users() if u != exclude]

    # ---- items ----------------------------------------------------------------------------
    def record_items(self, item_ids: Iterable[str]) -> None:
        self.item_counts.update(item_ids)

    def seed_items(self, counts: Mapping[str, float]) -> None:
        """Adds a past period's access counts (Algorithm 1's F) to the item counts, so the item store's
        replacement ranks items by past plus live accesses rather than live ones alone."""
        self.item_counts.update(counts)

    def item_count(self, item_id: str) -> int:
        return self.item_counts.get(item_id, 0)
