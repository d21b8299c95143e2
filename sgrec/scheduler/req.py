"""A generation request's state inside the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from sgrec.managers.io_struct import ReqOutput
from sgrec.sampling import SamplingParams


@dataclass
class LogprobSpec:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    label_columns_only: bool = False  # TokenizedGenerateReq.label_columns_only


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    logprob: LogprobSpec = field(default_factory=LogprobSpec)
    extra_key: str | None = None
    eos_ids: frozenset[int] = frozenset()
    stop_checker: Callable[["Req"], str | None] | None = None  # the matched stop string, if any
    cache_prefix_len: int | None = None  # prefill-only: keep KV for this many leading tokens at most
    arrival: float = 0.0  # time.monotonic() when queued

    output_ids: list[int] = field(default_factory=list)
    # KV of fill_ids[:kv_len] lives in kv_indices; the first cache_protected_len slots belong to the tree.
    kv_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    cache_protected_len: int = 0
    last_node: object = None  # locked radix node covering kv_indices[:cache_protected_len]
    cached_tokens: int = 0  # prefix-cache hit on admission
    num_retractions: int = 0
    input_logprobs_done: bool = False
    cached_on_arrival: int = 0  # prefill-only: cached prefix when queued (plain SRJF's estimate)
    kv_keep: int | None = None  # prefill-only: KV kept for fill_ids[:kv_keep]; the rest is discarded
    state_slot: torch.Tensor | None = None  # a family with recurrent layers: the request's running state
    snapshot: object = None  # the radix node whose state (locked) the running state is copied from on admission
    # an encoder-decoder family (scheduler/encoded.py): input_ids are the encoder's, the decoder reads
    # decoder_start and then the outputs; `encoded` is the input's entry (beam.encdec.Encoded) while admitted
    decoder_start: int | None = None
    encoder_key: str | None = None  # the caller's extra_key, the input's namespace (extra_key is the decoder's)
    encoded: object = None
    reasoning: object = None  # a retrieve / recommend request's reasoning (scheduler/reasoning.py): not streamed

    finish_reason: dict | None = None
    generator: torch.Generator | None = None

    # Logprob results: values aligned with their token ids; None = no value (first input entry).
    input_token_logprobs: list = field(default_factory=list)  # [(logprob|None, token_id)]
    input_top_logprobs: list = field(default_factory=list)  # [None | [(logprob, token_id)]]
    input_token_ids_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    output_token_ids_logprobs: list = field(default_factory=list)
    sent: dict = field(default_factory=dict)  # how much of each list went out in ReqOutputs

    def __post_init__(self) -> None:
        if self.sampling.sampling_seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.sampling.sampling_seed)

    @property
    def prompt_ids(self) -> list[int]:
        """What the model's decoder reads before the outputs: the prompt, or an encoder-decoder's
        start token (its input goes to the encoder)."""
        return self.input_ids if self.decoder_start is None else [self.decoder_start]

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_prefill_only(self) -> bool:
        return self.sampling.max_new_tokens == 0

    @property
    def n_input(self) -> int:
        return len(self.input_ids)

    @property
    def kv_len(self) -> int:
        return self.kv_indices.numel()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def stop_ids(self) -> set[int]:
        ids = set(self.sampling.stop_token_ids)
        if not self.sampling.ignore_eos:
            ids |= self.eos_ids
        return ids

    def prefix_match_limit(self) -> int:
        """How many leading tokens may come from the cache: at least one token is always computed,
        and prompt logprobs from logprob_start_len on need their logits."""
        limit = len(self.fill_ids) - 1
        lp = self.logprob
        if lp.return_logprob and lp.logprob_start_len >= 0 and not self.input_logprobs_done:
            limit = min(limit, lp.logprob_start_len)
        return max(limit, 0)

    def check_finished(self) -> None:
        """Called after each appended output token."""
        sp = self.sampling
        last = self.output_ids[-1]
        if len(self.output_ids) >= sp.min_new_tokens and last in self.stop_ids():
            self.finish_reason = {"type": "stop", "matched": last}
        elif sp.stop and self.stop_checker is not None and (matched := self.stop_checker(self)) is not None:
            self.finish_reason = {"type": "stop", "matched": matched}
        elif len(self.output_ids) >= sp.max_new_tokens:
            self.finish_reason = {"type": "length", "length": sp.max_new_tokens}

    def make_output(self) -> ReqOutput:
        """The changes since the previous make_output() call."""
        delta = {}
        for name in ("output_ids", *LOGPROB_FIELDS):
            items = getattr(self, name)
            delta[name] = items[self.sent.get(name, 0) :]
            self.sent[name] = len(items)
        return ReqOutput(
            rid=self.rid,
            new_output_ids=delta.pop("output_ids"),
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.input_ids),
            cached_tokens=self.cached_tokens,
            num_retractions=self.num_retractions,
            **delta,
        )


LOGPROB_FIELDS = (
    "input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
    "input_token_ids_logprobs", "output_token_ids_logprobs",
)
