"""Turning a /generate request into scheduler messages, and scheduler outputs back into
SGLang-shaped response dicts. Shared by the in-process Engine and the server's TokenizerManager."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sgrec.catalog.item import plain_token_ids
from sgrec.managers.io_struct import ReqOutput, TokenizedGenerateReq, abort_reason
from sgrec.sampling import SamplingParams
from sgrec.tokenizer import Tokenizer


def _per_item(value: Any, count: int, name: str, scalar_is_list: bool = False) -> list:
    """Broadcasts a scalar argument, or checks a per-item list has one entry per prompt (a single
    prompt takes a list of one)."""
    per_item = isinstance(value, list) and (not scalar_is_list or (value and isinstance(value[0], (list, type(None)))))
    if per_item:
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but the request has {count} prompt(s)")
        return list(value)
    return [value] * count


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def wrong_type_field(obj: dict, fields: dict[str, tuple]) -> str | None:
    """The first field of `obj` whose JSON type is not among its allowed types (bool is not an int
    unless bool is allowed), or None."""
    for name, types in fields.items():
        if name in obj:
            v = obj[name]
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                return name
    return None


@dataclass
class Limits:
    vocab_size: int
    context_len: int
    pool_size: int
    max_input_len: int  # prompts longer than this get a 400
    max_batch_size: int  # prompts per batch request (and items per score request)
    max_n: int
    # an encoder-decoder model: a prompt goes to the encoder and stays in the pool while the decoder
    # reads it, the decoder's outputs have the whole context, and the prompt has no token logprobs
    encoder: bool = False

    def prompt_slots(self, n: int) -> int:
        """KV slots a prompt of n tokens holds before its first output token (an encoder's input: its
        tokens, the whole key's digest and the decoder's start token)."""
        return n + 2 if self.encoder else n

    def max_new_tokens(self, n: int) -> int:
        """The most output tokens a prompt of n tokens may ask for: what the context and the pool leave."""
        if self.encoder:
            return min(self.context_len - 1, self.pool_size - self.prompt_slots(n))
        return min(self.context_len - n, self.pool_size - n)


ENCODER_LOGPROBS = ("an encoder-decoder model's prompt is read by its encoder, which gives its tokens no "
                    "logprobs; leave it at -1 (the output tokens' logprobs)")


class RequestBuilder:
    """Validates and tokenizes a native /generate request; expands batches and n > 1."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits):
        self.tokenizer = tokenizer
        self.limits = limits

    def build(
        self,
        text=None,
        input_ids=None,
        sampling_params=None,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        rid=None,
        extra_key=None,
        sampling_where: str = "sampling_params",
    ) -> tuple[list[TokenizedGenerateReq], list[SamplingParams], bool]:
        """Returns (messages, their sampling params, whether the response is a list). Raises ValueError.
        Every given field is checked, also those that another one makes unused (text wins over
        input_ids, as in SGLang, but bad input_ids beside it are still a 400). Errors name a
        sampling parameter by its full path: `sampling_params.top_p`, `sampling_params[1].top_p`,
        or, with `sampling_where` "" (a body whose sampling fields are top-level), `top_p`."""
        if input_ids is not None:
            id_batch, id_lists = self._input_ids(input_ids)
        if text is not None:
            is_batch = isinstance(text, list)
            prompts = text if is_batch else [text]
            if not all(isinstance(t, str) for t in prompts):
                raise ValueError("text must be a string or a list of strings")
            if is_batch and not prompts:
                raise ValueError("text must not be an empty list")
            if any(t == "" for t in prompts):
                raise ValueError("Prompt cannot be empty (an empty string in `text`)")
            self._check_batch_size(len(prompts), "text")
            ids_list = [self.tokenizer.encode(t) for t in prompts]
        elif input_ids is not None:
            is_batch, ids_list = id_batch, id_lists
        else:
            raise ValueError("Either text or input_ids must be provided")
        if extra_key is not None and not isinstance(extra_key, str):
            raise ValueError("extra_key must be a string")
        count = len(ids_list)
        sps = _per_item(sampling_params, count, "sampling_params")
        if isinstance(sampling_params, list) and not all(isinstance(sp, dict) for sp in sps):
            raise ValueError("sampling_params must be an object or a list of objects, one per prompt")
        wheres = ([f"{sampling_where}[{i}]" for i in range(count)] if isinstance(sampling_params, list)
                  and sampling_where else [sampling_where] * count)
        params = [SamplingParams.from_dict(sp, self.limits.vocab_size, where) for sp, where in zip(sps, wheres)]
        n_at = (lambda i: f"{wheres[i]}.n") if sampling_where else (lambda i: "n")
        n = params[0].n
        if n > self.limits.max_n:
            raise ValueError(f"{n_at(0)} = {n} exceeds --max-n {self.limits.max_n}")
        if (odd := next((i for i, p in enumerate(params) if p.n != n), None)) is not None:
            raise ValueError(f"{n_at(odd)}: all prompts of a batch must use the same n")
        lp_args = zip(
            _per_item(return_logprob, count, "return_logprob"),
            _per_item(logprob_start_len, count, "logprob_start_len"),
            _per_item(top_logprobs_num, count, "top_logprobs_num"),
            _per_item(token_ids_logprob, count, "token_ids_logprob", scalar_is_list=True),
        )
        protos = []
        for ids, sp, (rl, ls, tn, ti) in zip(ids_list, params, lp_args):
            self._validate(ids, sp, rl, ls, tn, ti)
            protos.append((ids, sp, bool(rl), ls, tn, ti))
        is_list = is_batch or n > 1
        rids = self._rids(rid, count * n, is_list)
        msgs, out_params = [], []
        for s in range(n):  # SGLang's order: every prompt for sample 0, then sample 1, ...
            for i, (ids, sp, rl, ls, tn, ti) in enumerate(protos):
                msgs.append(TokenizedGenerateReq(
                    rid=rids[s * count + i], input_ids=list(ids), sampling_params=sp.to_wire(),
                    return_logprob=rl, logprob_start_len=ls, top_logprobs_num=tn, token_ids_logprob=ti,
                    extra_key=extra_key,
                ))
                out_params.append(sp)
        return msgs, out_params, is_list

    def _input_ids(self, input_ids) -> tuple[bool, list[list[int]]]:
        """(is_batch, the prompts) of an input_ids field: a non-empty list of token ids, or a
        non-empty list of such lists."""
        shape = ("input_ids must be a non-empty list of token ids or a non-empty list of such lists "
                 "(pass sampling_params by keyword: generate(text, sampling_params={...}))")
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError(shape)
        is_batch = isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        if not all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompts):
            raise ValueError(shape)
        vocab = self.limits.vocab_size
        bad = next((t for p in prompts for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"input_ids: token id {bad} is out of the vocabulary range [0, {vocab})")
        self._check_batch_size(len(prompts), "input_ids")
        return is_batch, prompts

    def _check_batch_size(self, count: int, name: str) -> None:
        if count > self.limits.max_batch_size:
            raise ValueError(f"{count} prompts in `{name}` exceed --max-batch-size {self.limits.max_batch_size}")

    def check_prompt(self, ids) -> None:
        """Token ids in the vocabulary; length within the context and --max-input-len."""
        lim = self.limits
        if not ids:
            raise ValueError("Prompt cannot be empty")
        if not (plain_token_ids(ids, lim.vocab_size) or all(is_int(t) and 0 <= t < lim.vocab_size for t in ids)):
            raise ValueError(f"input_ids must be integers in [0, {lim.vocab_size})")
        if len(ids) >= lim.context_len:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({lim.context_len} tokens)."
            )
        if len(ids) > lim.max_input_len:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the maximum input length ({lim.max_input_len} tokens)."
            )
        if lim.encoder and lim.prompt_slots(len(ids)) > lim.pool_size:  # held while the decoder reads it
            raise ValueError(f"The input ({len(ids)} tokens) does not fit the KV cache ({lim.pool_size} tokens).")

    def _validate(self, ids, sp: SamplingParams, return_logprob, start, top_num, token_ids) -> None:
        lim = self.limits
        self.check_prompt(ids)
        if sp.max_new_tokens > 0:  # prefill-only prompts are not bounded by the pool: their suffix KV is discarded
            if lim.prompt_slots(len(ids)) >= lim.pool_size:
                raise ValueError(f"The input ({len(ids)} tokens) does not fit the KV cache ({lim.pool_size} tokens).")
            sp.max_new_tokens = min(sp.max_new_tokens, lim.max_new_tokens(len(ids)))
            sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        self._validate_logprob_args(ids, return_logprob, start, top_num, token_ids)

    def _validate_logprob_args(self, ids, return_logprob, start, top_num, token_ids) -> None:
        lim = self.limits
        if not isinstance(return_logprob, bool):
            raise ValueError(f"return_logprob must be a boolean, got {return_logprob!r}")
        for name, v in (("logprob_start_len", start), ("top_logprobs_num", top_num)):
            if not is_int(v):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if start < -1:
            raise ValueError(f"logprob_start_len must be -1 or non-negative, got {start}")
        if lim.encoder and return_logprob and start >= 0:
            raise ValueError(f"logprob_start_len {start}: {ENCODER_LOGPROBS}")
        if return_logprob and start > len(ids):
            raise ValueError(f"logprob_start_len ({start}) is greater than the prompt length ({len(ids)})")
        if top_num < 0:
            raise ValueError(f"top_logprobs_num must be non-negative, got {top_num}")
        if token_ids is not None and not (
            isinstance(token_ids, list) and all(is_int(x) and 0 <= x < lim.vocab_size for x in token_ids)
        ):
            raise ValueError(f"token_ids_logprob must be a list of token ids in [0, {lim.vocab_size})")

    @staticmethod
    def _rids(rid, total: int, is_list: bool) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(total)]
        if rid == "" or (isinstance(rid, list) and "" in rid):
            raise ValueError("rid must not be an empty string")
        if isinstance(rid, str):
            return [rid] if total == 1 and not is_list else [f"{rid}_{i}" for i in range(total)]
        if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
            raise ValueError("rid must be a string or a list of strings")
        if len(rid) != total or len(set(rid)) != total:
            raise ValueError("rid must be a string or a list of distinct strings, one per request")
        return list(rid)


@dataclass
class ReqState:
    """A request's accumulated outputs on the client-facing side."""

    msg: TokenizedGenerateReq
    sampling: SamplingParams
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    lp: dict = field(default_factory=lambda: {k: [] for k in _LOGPROB_FIELDS})
    result: dict | None = None  # a task's (rank / retrieve) answer

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: ReqOutput) -> None:
        now = time.monotonic()
        if out.new_output_ids and self.first_token_time is None:
            self.first_token_time = now
        self.output_ids += out.new_output_ids
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.num_retractions = out.num_retractions
        for k in _LOGPROB_FIELDS:
            self.lp[k] += getattr(out, k)
        if out.result is not None:
            self.result = out.result
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.finish_time = now

    def fail(self, message: str, status_code: int) -> None:
        self.finish_reason = abort_reason(message, status_code)
        self.finish_time = time.monotonic()

    def text(self, tokenizer: Tokenizer) -> str:
        sp, fr = self.sampling, self.finish_reason
        ids = self.output_ids
        if fr and fr["type"] == "stop" and isinstance(fr.get("matched"), int) and not sp.no_stop_trim and ids:
            ids = ids[:-1]
        text = tokenizer.decode(ids, sp.skip_special_tokens, sp.spaces_between_special_tokens)
        if fr and fr["type"] == "stop" and isinstance(fr.get("matched"), str) and not sp.no_stop_trim:
            cut = text.find(fr["matched"])
            text = text[:cut] if cut >= 0 else text
        return text

    def to_dict(self, tokenizer: Tokenizer, text_in_logprobs: bool = False) -> dict:
        meta: dict[str, Any] = {
            "id": self.msg.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens or len(self.msg.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": "default",
            "num_retractions": self.num_retractions,
        }
        if self.finished:
            meta["e2e_latency"] = self.finish_time - self.created
        if self.msg.return_logprob:
            if text_in_logprobs:
                def fmt(v, t):
                    return [v, t, tokenizer.decode([t], skip_special_tokens=False)]
            else:
                def fmt(v, t):
                    return [v, t, None]

            def rows(entries):
                return [None if r is None else [fmt(v, t) for v, t in r] for r in entries]

            meta["input_token_logprobs"] = [fmt(v, t) for v, t in self.lp["input_token_logprobs"]]
            meta["output_token_logprobs"] = [fmt(v, t) for v, t in self.lp["output_token_logprobs"]]
            meta["output_token_logprobs_length"] = len(self.lp["output_token_logprobs"])
            if self.msg.top_logprobs_num > 0:
                meta["input_top_logprobs"] = rows(self.lp["input_top_logprobs"])
                meta["output_top_logprobs"] = rows(self.lp["output_top_logprobs"])
            if self.msg.token_ids_logprob:
                meta["input_token_ids_logprobs"] = rows(self.lp["input_token_ids_logprobs"])
                meta["output_token_ids_logprobs"] = rows(self.lp["output_token_ids_logprobs"])
        return {"text": self.text(tokenizer), "output_ids": list(self.output_ids), "meta_info": meta}


_LOGPROB_FIELDS = (
    "input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
    "input_token_ids_logprobs", "output_token_ids_logprobs",
)


def stream_updates(states: list[ReqState], sent: list[int]) -> list[int]:
    """Indices of the states with something new for a stream, updating `sent` (output tokens
    already sent per state; -1 once its final chunk went out)."""
    ready = []
    for i, s in enumerate(states):
        if sent[i] != -1 and (len(s.output_ids) != sent[i] or s.finished):
            sent[i] = -1 if s.finished else len(s.output_ids)
            ready.append(i)
    return ready
