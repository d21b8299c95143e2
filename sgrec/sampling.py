"""Sampling parameters with SGLang 0.5.23's keys, defaults and ranges, and the batched sampler."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

import torch

TOP_K_ALL = 1 << 30


class SchemaError(ValueError):
    """A wrong JSON type or unknown field (SGLang answers these with a plain-string error)."""

GREEDY_EPS = 1e-6
# Bounds that keep any accepted sampling_params finite in float32: penalised logits are capped at
# LOGIT_CAP and temperatures at TEMPERATURE_CAP (1e6 already makes a distribution uniform), so
# LOGIT_CAP / GREEDY_EPS stays below float32's max (3.4e38) and no row turns NaN.
LOGIT_CAP = 1e30
TEMPERATURE_CAP = 1e6

# Keys SGLang accepts but sgrec does not implement yet: accepted only at their "unset" value.
_UNSUPPORTED = {
    "regex": (None, ""),
    "json_schema": (None, ""),
    "ebnf": (None, ""),
    "structural_tag": (None, ""),
    "stop_regex": (None, "", []),
    "custom_params": (None, {}),
    "watermark": (None, False),
    "choice": (None,),
    "beam_width": (None, 0, 1),
    "stream_interval": None,  # any value: only affects streaming granularity
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    def to_wire(self) -> dict:
        """JSON-safe fields for a scheduler message (logit_bias keys become strings)."""
        d = dataclasses.asdict(self)
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "SamplingParams":
        """Inverse of to_wire; the fields were validated before they were sent."""
        return cls(**{**d, "logit_bias": {int(k): v for k, v in d.get("logit_bias", {}).items()}})

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int | None = None,
                  where: str = "sampling_params") -> "SamplingParams":
        """Validates a JSON sampling_params dict; raises ValueError with a clear message naming the
        field by its full path: `where` is the dict's own (`sampling_params`, `sampling_params[1]`,
        or "" where its fields are the body's top-level ones)."""
        at = (lambda name: f"{where}.{name}") if where else (lambda name: name)
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise SchemaError(f"{where or 'sampling_params'} must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if k not in known and k not in _UNSUPPORTED)
        if unknown:
            raise SchemaError(
                f"unknown field `{unknown[0]}`{f' in {where} ({at(unknown[0])})' if where else ''}, expected one of "
                f"{sorted(known | set(_UNSUPPORTED))}"
            )
        for key, unset in _UNSUPPORTED.items():  # type-exact: 0 is not False, 1.0 is not 1
            if unset is not None and key in d and not any(type(d[key]) is type(u) and d[key] == u for u in unset):
                raise ValueError(f"{at(key)} is not supported by sgrec yet")
        interval = d.get("stream_interval")
        if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool)):
            raise SchemaError(f"{at('stream_interval')} must be an integer, got {interval!r}")
        kw = {k: v for k, v in d.items() if k in known}
        p = cls(**kw)
        p._check_types(d, at)
        p._check_ranges(vocab_size, at)
        return p

    def _check_types(self, raw: dict, at) -> None:
        def need(name, ok, what):
            if name in raw and not ok(raw[name]):
                raise SchemaError(f"{at(name)} must be {what}, got {raw[name]!r}")

        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        is_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        for name in ("max_new_tokens", "min_new_tokens", "n", "top_k"):
            need(name, is_int, "an integer")
        need("sampling_seed", lambda v: v is None or is_int(v), "an integer")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            need(name, is_num, "a number")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            need(name, lambda v: isinstance(v, bool), "a boolean")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        need("stop", lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)), "a string or a list of strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        need("stop_token_ids", lambda v: v is None or (isinstance(v, list) and all(is_int(t) for t in v)), "a list of integers")
        if self.logit_bias is None:
            self.logit_bias = {}
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"{at('logit_bias')} must be an object mapping token ids to biases")
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) and str(k).isascii() and str(k).isdigit()
                   and is_num(v) for k, v in self.logit_bias.items()):  # no "+5", " 5", "٥", "1.5" or false
            raise ValueError(f"{at('logit_bias')} must map integer token ids to numbers")
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    def _check_ranges(self, vocab_size: int | None, at) -> None:
        def bad(msg):
            raise ValueError(msg)

        if self.max_new_tokens < 0:
            bad(f"{at('max_new_tokens')} must be at least 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            bad(f"{at('min_new_tokens')} must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.n < 1:
            bad(f"{at('n')} must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad(f"{at('temperature')} must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"{at('top_p')} must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        if self.top_k < 1:
            bad(f"{at('top_k')} must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"{at('min_p')} must be in [0, 1], got {self.min_p}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"{at('frequency_penalty')} must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"{at('presence_penalty')} must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            bad(f"{at('repetition_penalty')} must be in (0, 2], got {self.repetition_penalty}")
        if len(self.stop) > 32:
            bad(f"{at('stop')} holds at most 32 strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            bad(f"{at('stop')} must not hold an empty string")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
                for t in ids:
                    if not 0 <= t < vocab_size:
                        bad(f"{at(name)}: token id {t} is out of the vocabulary range [0, {vocab_size})")


@dataclass
class SampleResult:
    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B, V] float32: log-probabilities reported to clients


class Sampler:
    """Applies penalties, logit bias and min_new_tokens, then samples each row.

    The reported logprobs are the log-softmax of the penalised logits divided by the temperature
    (for greedy rows, of the penalised logits), before top-k/top-p/min-p truncation, as SGLang does.
    """

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list) -> SampleResult:
        """logits [B, V] float32; reqs expose .sampling, .input_ids, .output_ids, .stop_ids(), .generator."""
        logits = logits.clone()
        for i, r in enumerate(reqs):
            if needs_penalties(r):
                apply_penalties(logits[i], r)
                logits[i].clamp_(max=LOGIT_CAP)  # e.g. repetition_penalty 1e-300 or a 1e38 bias: no +inf
        temps = torch.tensor([min(max(r.sampling.temperature, GREEDY_EPS), TEMPERATURE_CAP) for r in reqs],
                             device=logits.device)
        greedy = [r.sampling.greedy for r in reqs]
        scaled = torch.where(torch.tensor(greedy, device=logits.device)[:, None], logits, logits / temps[:, None])
        logprobs = torch.log_softmax(scaled, dim=-1)
        next_ids = logits.argmax(dim=-1)
        if not all(greedy):
            probs = logprobs.exp()
            for i, r in enumerate(reqs):
                if not greedy[i]:
                    next_ids[i] = sample_row(probs[i], r.sampling, r.generator or self.generator)
        return SampleResult(next_ids, logprobs)


def needs_penalties(req) -> bool:
    sp: SamplingParams = req.sampling
    return bool(
        sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty or sp.logit_bias
        or len(req.output_ids) < sp.min_new_tokens
    )


def apply_penalties(row: torch.Tensor, req) -> None:
    """In-place on one row of logits [V]."""
    sp: SamplingParams = req.sampling
    out = req.output_ids
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.input_ids) | set(out)), dtype=torch.int64, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if out and (sp.frequency_penalty or sp.presence_penalty):
        ids, counts = torch.tensor(out, device=row.device).unique(return_counts=True)
        row[ids] -= sp.frequency_penalty * counts.to(row.dtype) + sp.presence_penalty
    for tid, bias in sp.logit_bias.items():
        row[tid] += bias
    if len(out) < sp.min_new_tokens:
        stop_ids = req.stop_ids()
        if stop_ids:
            row[list(stop_ids)] = float("-inf")


def sample_row(probs: torch.Tensor, sp: SamplingParams, generator: torch.Generator) -> int:
    """Top-k, then top-p (keep the smallest prefix whose mass reaches top_p), then min-p, then sample."""
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if sp.top_k < sorted_p.numel():
        keep[sp.top_k :] = False
    if sp.top_p < 1.0:
        mass_before = sorted_p.cumsum(0) - sorted_p
        keep &= mass_before <= sp.top_p
    if sp.min_p > 0:
        keep &= sorted_p >= sorted_p[0] * sp.min_p
    keep[0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    total = kept.sum()
    if not torch.isfinite(total) or total <= 0:  # every token banned (min_new_tokens + stop ids = vocab)
        return int(order[0])
    choice = torch.multinomial(kept, 1, generator=generator)
    return int(order[choice])
