"""What reading or recomputing KV costs, measured: seconds = fixed + per_token x tokens, fitted online
to timed calls. Storage reads of item KV (`sgrec.radix.hicache`) and the forwards that
would recompute it (`sgrec.rank.executor`) each keep one fit; a rank request reads its candidates
from storage only where the read's whole predicted time (round trips included) is below what its
tokens add to a forward that runs anyway (the slope: the forward's own fixed cost is paid either way).

A per-token mean (seconds / tokens) charges the fixed cost to every token. With a small model, where
the fixed cost of a forward dominates, that made recomputing look dearer per token than it is, and
reading won where it lost (docs/performance.md; the store's item phase on 3 servers).

The fit is least squares over exponentially weighted moments (weight `alpha` for the newest call).
Until the calls seen differ in size enough to tell a slope (relative spread MIN_SPREAD), the fit is
the mean seconds per token with no fixed part, as before.
"""

from __future__ import annotations

MIN_SPREAD = 0.05  # the sizes' standard deviation, relative to their mean, that a slope needs


class LinearCost:
    __slots__ = ("alpha", "calls", "_m")

    def __init__(self, alpha: float = 0.1):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.calls = 0
        self._m: tuple[float, float, float, float] | None = None  # weighted means of x, y, x*x, x*y

    def observe(self, tokens: int, seconds: float) -> None:
        x, y = float(max(tokens, 1)), float(seconds)
        m = (x, y, x * x, x * y)
        a = self.alpha
        self._m = m if self._m is None else tuple((1 - a) * o + a * v for o, v in zip(self._m, m))
        self.calls += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), both >= 0; None before the first call."""
        if self._m is None:
            return None
        mx, my, mxx, mxy = self._m
        var = mxx - mx * mx
        if var <= (MIN_SPREAD * mx) ** 2:
            return 0.0, my / mx
        slope = (mxy - mx * my) / var
        if slope <= 0:  # noise larger than the size effect: all of it fixed
            return my, 0.0
        fixed = my - slope * mx
        if fixed < 0:  # a line through the origin fits better than a negative fixed part
            return 0.0, my / mx
        return fixed, slope

    @property
    def per_token(self) -> float | None:
        """Seconds one more token adds to a call (the slope); None before the first call."""
        f = self.fit()
        return None if f is None else f[1]

    def predict(self, tokens: int) -> float | None:
        """Seconds a call of `tokens` takes; None before the first call."""
        f = self.fit()
        return None if f is None else f[0] + f[1] * tokens

    def as_dict(self) -> dict:
        """For /server_info: the calls seen and the fit (None before the first call)."""
        f = self.fit()
        return {"calls": self.calls, "fixed_s": None if f is None else f[0], "per_token_s": None if f is None else f[1]}
