"""Splitting one KV budget between the item store and the user-prefix cache (BAT §5.2, §5.3).

BAT allocates the item pool at initialisation and gives the rest of the memory to user caches
(§5.2). When the whole catalog fits and items are hot, the item pool holds the catalog. When it
does not (a catalog larger than the memory, as in §6.6 where BAT keeps only the hottest items and
sends more requests to user-as-prefix), the split decides how much of the catalog is worth keeping:
§5.3's objective is to reuse as many tokens as possible per unit of cache, so an item token is only
worth its space while the items it belongs to are hotter than the hottest users left out.

`split_budget` chooses the item budget by replaying a past period (the same kind of data as
Algorithm 1's F: recent requests, each a user, its profile length and its candidates) under a static
model of the two caches, for a grid of item budgets:
- the item store holds the hottest items (past candidate frequency per token), then
- the user cache holds the users whose cached profile would save the most tokens per token of
  space: a user saves, on each past request after its first (the first is a compulsory miss),
  its profile length minus what item-as-prefix would have reused for that request;
- each request reuses the larger of the two (the per-request choice of §5.3).
The item budget with the most reused tokens wins (ties: the larger item budget). The model ignores
order and eviction: it is a plan, not a simulation of the online rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence


def hottest_items(item_tokens: Mapping[str, int], freqs: Mapping[str, float]) -> list[str]:
    """Item ids, hottest first: past frequency per token (ties: frequency, then id)."""
    return sorted(item_tokens, key=lambda i: (-freqs.get(i, 0.0) / max(1, item_tokens[i]), -freqs.get(i, 0.0), i))


def reused_tokens(total: int, item_budget: int, header_tokens: int, item_tokens: Mapping[str, int],
                  past: Sequence[tuple[str, int, Sequence[str]]], order: Sequence[str] | None = None) -> int:
    """Tokens the static model reuses over `past` ((user, user tokens, candidate ids) per request)
    with `item_budget` of `total` for items (header included) and the rest for users."""
    if order is None:
        order = hottest_items(item_tokens, Counter(c for _, _, cands in past for c in cands))
    cached, used = set(), header_tokens
    if item_budget >= header_tokens:
        for i in order:
            n = item_tokens[i]
            if used + n > item_budget:
                break
            cached.add(i)
            used += n
    header = header_tokens if item_budget >= header_tokens else 0
    item_reuse = [header + sum(item_tokens[c] for c in cands if c in cached) if item_budget >= header_tokens else 0
                  for _, _, cands in past]
    length: dict[str, int] = {}
    gain: Counter[str] = Counter()
    for (user, tau_u, _), h in zip(past, item_reuse):
        if user in length:
            gain[user] += max(0, tau_u - h)
        length[user] = tau_u
    room = total - item_budget
    users = set()
    for user in sorted(gain, key=lambda u: (-gain[u] / max(1, length[u]), u)):
        if gain[user] > 0 and length[user] <= room:
            users.add(user)
            room -= length[user]
    seen, reused = set(), 0
    for (user, tau_u, _), h in zip(past, item_reuse):
        reused += max(h, tau_u if user in users and user in seen else 0)
        seen.add(user)
    return reused


def split_budget(total: int, header_tokens: int, item_tokens: Mapping[str, int],
                 past: Sequence[tuple[str, int, Sequence[str]]], steps: int = 40) -> int:
    """The item budget (header included) out of `total` tokens that reuses the most over `past`;
    never more than the catalog (header + every item)."""
    catalog = header_tokens + sum(item_tokens.values())
    top = min(total, catalog)
    if not past or top <= 0:
        return max(0, top)
    order = hottest_items(item_tokens, Counter(c for _, _, cands in past for c in cands))
    grid = sorted({top, *(round(top * k / steps) for k in range(steps))})
    best = max(grid, key=lambda b: (reused_tokens(total, b, header_tokens, item_tokens, past, order), b))
    return best
