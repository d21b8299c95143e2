"""In-process Engine: the scheduler without HTTP, with SGLang's native /generate shapes."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Iterator

from sgrec.runner import ModelRunner
from sgrec.sampling import SamplingParams
from sgrec.scheduler.req import LogprobSpec, Req
from sgrec.scheduler.scheduler import Scheduler
from sgrec.server_args import ServerArgs
from sgrec.tokenizer import Tokenizer


def _per_item(value: Any, count: int, name: str, is_batch: bool, scalar_is_list: bool = False) -> list:
    """Broadcasts a scalar argument, or checks a per-item list has one entry per prompt."""
    if is_batch and isinstance(value, list) and (not scalar_is_list or (value and isinstance(value[0], (list, type(None))))):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but the batch has {count} prompts")
        return list(value)
    return [value] * count


class Engine:
    """`sgrec.Engine(model_path=..., device="cpu", dtype="float32", **server_args)`.

    Thread-safe: concurrent callers' requests are batched together, since whichever caller
    holds the lock steps the scheduler for everyone.
    """

    def __init__(self, model_path: str | None = None, **kwargs):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        args = self.server_args
        self.tokenizer = Tokenizer(args.tokenizer_path or args.model_path)
        self.runner = ModelRunner(args)
        self.scheduler = Scheduler(args, self.runner)
        self.vocab_size = self.runner.config.vocab_size
        self.context_len = self.runner.context_len
        self.eos_ids = frozenset(self.runner.config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._lock = threading.Lock()

    # ---- public API ---------------------------------------------------------------------
    def generate(
        self,
        text: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        extra_key: str | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        reqs, is_list = self._make_reqs(
            text, input_ids, sampling_params, return_logprob, logprob_start_len,
            top_logprobs_num, token_ids_logprob, rid, extra_key,
        )
        with self._lock:
            for req in reqs:
                self.scheduler.add(req)
        if stream:
            return self._stream(reqs, is_list, return_text_in_logprobs)
        self._run_until(lambda: all(r.finished for r in reqs))
        outs = [self._output(r, return_text_in_logprobs) for r in reqs]
        return outs if is_list else outs[0]

    def flush_cache(self) -> bool:
        with self._lock:
            return self.scheduler.flush_cache()

    def check_memory(self) -> None:
        """Raises if the KV accounting does not balance (only meaningful when idle)."""
        with self._lock:
            self.scheduler.check_memory()

    def shutdown(self) -> None:
        """Nothing to release in-process; kept for SGLang's Engine API."""

    # ---- request building ---------------------------------------------------------------
    def _make_reqs(self, text, input_ids, sampling_params, return_logprob, logprob_start_len,
                   top_logprobs_num, token_ids_logprob, rid, extra_key) -> tuple[list[Req], bool]:
        if input_ids is not None and not (
            isinstance(input_ids, list) and all(isinstance(x, (int, list)) for x in input_ids)
        ):
            raise ValueError(
                "input_ids must be a list of token ids or a list of such lists "
                "(pass sampling_params by keyword: generate(text, sampling_params={...}))"
            )
        if text is not None:
            is_batch = isinstance(text, list)
            prompts = text if is_batch else [text]
            if not all(isinstance(t, str) for t in prompts):
                raise ValueError("text must be a string or a list of strings")
            if is_batch and not prompts:
                raise ValueError("text must not be an empty list")
            if any(t == "" for t in prompts):
                raise ValueError("Prompt cannot be empty")
            ids_list = [self.tokenizer.encode(t) for t in prompts]
        elif input_ids is not None:
            if not isinstance(input_ids, list):
                raise ValueError("input_ids must be a list of token ids or a list of such lists")
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids_list = input_ids if is_batch else [input_ids]
        else:
            raise ValueError("Either text or input_ids must be provided")
        count = len(ids_list)
        sps = _per_item(sampling_params, count, "sampling_params", is_batch)
        params = [SamplingParams.from_dict(sp, self.vocab_size) for sp in sps]
        n = params[0].n
        if any(p.n != n for p in params):
            raise ValueError("all prompts of a batch must use the same n")
        specs = [
            LogprobSpec(bool(rl), ls, tn, ti)
            for rl, ls, tn, ti in zip(
                _per_item(return_logprob, count, "return_logprob", is_batch),
                _per_item(logprob_start_len, count, "logprob_start_len", is_batch),
                _per_item(top_logprobs_num, count, "top_logprobs_num", is_batch),
                _per_item(token_ids_logprob, count, "token_ids_logprob", is_batch, scalar_is_list=True),
            )
        ]
        for ids, sp, spec in zip(ids_list, params, specs):
            self._validate(ids, sp, spec)
        rids = self._rids(rid, count * n, is_batch or n > 1)
        reqs = []
        for s in range(n):  # SGLang's order: every prompt for sample 0, then sample 1, ...
            for i, (ids, sp, spec) in enumerate(zip(ids_list, params, specs)):
                reqs.append(Req(
                    rid=rids[s * count + i], input_ids=list(ids), sampling=sp, logprob=spec,
                    extra_key=extra_key, eos_ids=self.eos_ids, stop_checker=self._stop_match,
                ))
        return reqs, is_batch or n > 1

    def _validate(self, ids: list, sp: SamplingParams, spec: LogprobSpec) -> None:
        if not ids:
            raise ValueError("Prompt cannot be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"input_ids must be integers in [0, {self.vocab_size})")
        if len(ids) >= self.context_len:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({self.context_len} tokens)."
            )
        pool = self.runner.kv_pool.size
        if len(ids) >= pool:
            raise ValueError(f"The input ({len(ids)} tokens) does not fit the KV cache ({pool} tokens).")
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - len(ids), pool - len(ids))
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        for name in ("logprob_start_len", "top_logprobs_num"):
            v = getattr(spec, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if spec.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 or non-negative, got {spec.logprob_start_len}")
        if spec.return_logprob and spec.logprob_start_len > len(ids):
            raise ValueError(
                f"logprob_start_len ({spec.logprob_start_len}) is greater than the prompt length ({len(ids)})"
            )
        if spec.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be non-negative, got {spec.top_logprobs_num}")
        if spec.token_ids_logprob is not None:
            t = spec.token_ids_logprob
            if not isinstance(t, list) or not all(isinstance(x, int) and 0 <= x < self.vocab_size for x in t):
                raise ValueError(f"token_ids_logprob must be a list of token ids in [0, {self.vocab_size})")

    @staticmethod
    def _rids(rid, total: int, is_list: bool) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(total)]
        if isinstance(rid, str):
            return [rid] if total == 1 and not is_list else [f"{rid}_{i}" for i in range(total)]
        if not isinstance(rid, list) or len(rid) != total or len(set(rid)) != total:
            raise ValueError("rid must be a string or a list of distinct strings, one per request")
        return list(rid)

    def _stop_match(self, req: Req) -> str | None:
        longest = max(len(s) for s in req.sampling.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 8) :], req.sampling.skip_special_tokens)
        return next((s for s in req.sampling.stop if s in tail), None)

    # ---- running ------------------------------------------------------------------------
    def _run_until(self, done) -> None:
        while not done():
            with self._lock:
                if done():
                    return
                try:
                    self.scheduler.step()
                except Exception:
                    self.scheduler.abort_all("Internal error while running the batch")
                    raise

    def _stream(self, reqs: list[Req], is_list: bool, text_in_logprobs: bool) -> Iterator[dict]:
        sent = [0] * len(reqs)  # output tokens already sent; -2 once the final chunk went out
        while True:
            for i, req in enumerate(reqs):
                if len(req.output_ids) != sent[i] or (req.finished and sent[i] != -2):
                    out = self._output(req, text_in_logprobs)
                    if is_list:
                        out["index"] = i
                    sent[i] = -2 if req.finished else len(req.output_ids)
                    yield out
            if all(r.finished for r in reqs):
                return
            self._run_until(lambda: any(r.finished or len(r.output_ids) != s for r, s in zip(reqs, sent) if s != -2))

    # ---- outputs ------------------------------------------------------------------------
    def _output(self, req: Req, text_in_logprobs: bool) -> dict:
        sp = req.sampling
        ids = req.output_ids
        fr = req.finish_reason
        decode_ids = ids[:-1] if fr and fr["type"] == "stop" and isinstance(fr["matched"], int) and not sp.no_stop_trim else ids
        text = self.tokenizer.decode(decode_ids, sp.skip_special_tokens, sp.spaces_between_special_tokens)
        if fr and fr["type"] == "stop" and isinstance(fr["matched"], str) and not sp.no_stop_trim:
            cut = text.find(fr["matched"])
            text = text[:cut] if cut >= 0 else text
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": fr,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": req.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": "default",
            "num_retractions": req.num_retractions,
        }
        if req.finished:
            meta["e2e_latency"] = (req.finish_time or time.monotonic()) - req.created
        lp = req.logprob
        if lp.return_logprob:
            fmt = self._logprob_formatter(text_in_logprobs)
            meta["input_token_logprobs"] = [fmt(v, t) for v, t in req.input_token_logprobs]
            meta["output_token_logprobs"] = [fmt(v, t) for v, t in req.output_token_logprobs]
            meta["output_token_logprobs_length"] = len(req.output_token_logprobs)
            nested = lambda rows: [None if r is None else [fmt(v, t) for v, t in r] for r in rows]  # noqa: E731
            if lp.top_logprobs_num > 0:
                meta["input_top_logprobs"] = nested(req.input_top_logprobs)
                meta["output_top_logprobs"] = nested(req.output_top_logprobs)
            if lp.token_ids_logprob:
                meta["input_token_ids_logprobs"] = nested(req.input_token_ids_logprobs)
                meta["output_token_ids_logprobs"] = nested(req.output_token_ids_logprobs)
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    def _logprob_formatter(self, with_text: bool):
        if not with_text:
            return lambda v, t: [v, t, None]
        return lambda v, t: [v, t, self.tokenizer.decode([t], skip_special_tokens=False)]
