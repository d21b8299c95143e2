"""Sampler pieces against hand-computed references."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from sgrec.sampling import SamplingParams, apply_penalties, sample_row


def req(input_ids, output_ids, **sp):
    return SimpleNamespace(
        sampling=SamplingParams.from_dict(sp), input_ids=input_ids, output_ids=output_ids,
        stop_ids=lambda: {0},
    )


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    row = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0])
    apply_penalties(row, req([1, 2], [3], repetition_penalty=2.0))
    assert row.tolist() == [1.0, -2.0, 1.0, -4.0, 3.0]


def test_frequency_and_presence_penalties_count_output_only():
    row = torch.zeros(5)
    apply_penalties(row, req([4, 4], [1, 1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25))
    assert row.tolist() == pytest.approx([0.0, -1.75, -0.75, 0.0, 0.0])


def test_logit_bias_and_min_new_tokens_block_stop_ids():
    row = torch.zeros(4)
    apply_penalties(row, req([1], [2], logit_bias={"3": 1.5}, min_new_tokens=2, max_new_tokens=5))
    assert row[3] == 1.5 and row[0] == float("-inf") and row[1] == 0


def draws(probs, n=3000, **sp):
    params = SamplingParams.from_dict(sp)
    g = torch.Generator().manual_seed(0)
    return Counter(sample_row(torch.tensor(probs), params, g) for _ in range(n))


def test_top_k_top_p_min_p_truncation():
    probs = [0.05, 0.5, 0.2, 0.25]
    assert set(draws(probs, top_k=2)) == {1, 3}
    # top_p keeps the smallest prefix whose mass reaches top_p: 0.5, then 0.25 (mass before 0.2 is 0.75).
    assert set(draws(probs, top_p=0.6)) == {1, 3}
    assert set(draws(probs, top_p=0.8)) == {1, 3, 2}
    assert set(draws(probs, min_p=0.45)) == {1, 3}  # keeps p >= 0.45 * 0.5
    counts = draws(probs, n=20000)
    assert set(counts) == {0, 1, 2, 3}
    for tok, p in enumerate(probs):
        assert abs(counts[tok] / 20000 - p) < 0.02


def test_sampling_params_defaults_and_normalisation():
    sp = SamplingParams.from_dict({"stop": "x", "top_k": -1, "logit_bias": {"5": 1}})
    assert sp.stop == ["x"] and sp.top_k == 1 << 30 and sp.logit_bias == {5: 1.0}
    assert sp.max_new_tokens == 128 and sp.temperature == 1.0 and not sp.greedy
    assert SamplingParams.from_dict({"temperature": 0}).greedy
    # The keys SGLang's frontend always sends are accepted at their defaults.
    SamplingParams.from_dict({
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
        "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 1.0,
        "top_p": 1.0, "top_k": -1, "min_p": 0, "frequency_penalty": 0, "presence_penalty": 0,
        "ignore_eos": False, "regex": None, "json_schema": None,
    })
