"""sgrec.mem.cost.LinearCost: the online fit of seconds = fixed + per_token x tokens that weighs a
storage read of item KV against recomputing it, against exact lines and least squares."""

import numpy as np
import pytest

from sgrec.mem.cost import MIN_SPREAD, LinearCost


def test_an_exact_line_is_recovered_with_its_fixed_part():
    c = LinearCost(alpha=0.3)
    assert c.fit() is None and c.per_token is None and c.predict(10) is None
    for n in (8, 40, 200, 8, 64):
        c.observe(n, 0.005 + 2e-6 * n)
    fixed, slope = c.fit()
    assert fixed == pytest.approx(0.005, rel=1e-6) and slope == pytest.approx(2e-6, rel=1e-6)
    assert c.predict(1000) == pytest.approx(0.007, rel=1e-6) and c.calls == 5


def test_the_fit_is_weighted_least_squares_with_the_newest_call_weighing_alpha():
    rng = np.random.default_rng(0)
    x = rng.integers(1, 500, 30).astype(float)
    y = 0.01 + 3e-5 * x + rng.normal(0, 1e-3, 30)
    a = 0.2
    c = LinearCost(alpha=a)
    for xi, yi in zip(x, y):
        c.observe(int(xi), float(yi))
    w = np.array([(1 - a) ** (len(x) - 1)] + [a * (1 - a) ** (len(x) - 1 - i) for i in range(1, len(x))])
    slope, fixed = np.polyfit(x, y, 1, w=np.sqrt(w))
    assert c.fit() == pytest.approx((fixed, slope), rel=1e-6)


def test_without_spread_in_sizes_it_is_the_mean_per_token():
    c = LinearCost()
    for _ in range(5):
        c.observe(100, 0.02)
    assert c.fit() == (0.0, pytest.approx(2e-4))
    c = LinearCost()
    c.observe(100, 0.02)
    c.observe(100 * (1 + MIN_SPREAD), 0.03)  # a spread of MIN_SPREAD / 2 around the mean: still too little
    assert c.fit()[0] == 0.0


def test_a_fit_never_goes_negative():
    c = LinearCost(alpha=0.5)
    c.observe(10, 0.05)
    c.observe(100, 0.01)  # bigger and faster: noise, not a negative cost per token
    assert c.fit() == (pytest.approx(c._m[1]), 0.0)
    c = LinearCost(alpha=0.5)
    c.observe(10, 1e-6)
    c.observe(100, 0.05)  # the line would cross zero before 10 tokens: fitted through the origin instead
    fixed, slope = c.fit()
    assert fixed == 0.0 and slope == pytest.approx(c._m[1] / c._m[0])


def test_bad_alpha_is_refused():
    for a in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="alpha"):
            LinearCost(alpha=a)
