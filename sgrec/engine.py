"""In-process Engine: the scheduler without HTTP, with SGLang's native /generate shapes."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Iterator

from sgrec.managers.generate import Limits, ReqState, RequestBuilder, stream_updates
from sgrec.managers.rec import (
    beam_generate_response, build_beam_generate_task, build_rank_task, build_recommend_task, build_retrieve_task,
    check_no_filters,
    is_beam_generate, task_response,
)
from sgrec.managers.io_struct import TaskReq
from sgrec.managers.score import ScoreResult, build_score, check_plan
from sgrec.sampling import SamplingParams
from sgrec.runner import ModelRunner
from sgrec.scheduler.scheduler import Scheduler
from sgrec.server_args import ServerArgs
from sgrec.tokenizer import Tokenizer

IDLE_SLEEP_S = 0.005  # longest nap of a caller waiting for a rank / retrieve batch's quota


class Engine:
    """`sgrec.Engine(model_path=..., device="cpu", dtype="float32", **server_args)`.

    Thread-safe: concurrent callers' requests are batched together, since whichever caller
    holds the lock steps the scheduler for everyone.
    """

    def __init__(self, model_path: str | None = None, **kwargs):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        args = self.server_args
        if args.cpu_threads is not None:  # in-process: torch's own count unless asked (the caller's process)
            import torch

            torch.set_num_threads(args.cpu_threads)
        self.tokenizer = Tokenizer(args.tokenizer_path or args.model_path)
        self.runner = ModelRunner(args)
        self.scheduler = Scheduler(args, self.runner, self.tokenizer)
        self.vocab_size = self.runner.config.vocab_size
        self.context_len = self.runner.context_len
        self.builder = RequestBuilder(
            self.tokenizer,
            Limits(self.vocab_size, self.context_len, self.runner.memory.size, self.runner.max_input_len,
                   args.max_batch_size, args.max_n, self.runner.capabilities.encoder),
        )
        self._states: dict[str, ReqState] = {}
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
        constrain_to_catalog: bool = False,
        exclude_items: list[str] | None = None,
        include_items: list[str] | None = None,
        filter: dict | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        filters = {"exclude_items": exclude_items, "include_items": include_items, "filter": filter}
        if is_beam_generate({"sampling_params": sampling_params}):
            obj = {"text": text, "input_ids": input_ids, "sampling_params": sampling_params, "rid": rid,
                   "constrain_to_catalog": constrain_to_catalog, "stream": stream, "return_logprob": return_logprob,
                   **filters}
            task = build_beam_generate_task(obj, self.tokenizer, self.builder, self.server_args.max_beam_width,
                                            self.server_args.max_filter_items)
            return beam_generate_response(self._run_task(task), self.tokenizer)
        check_no_filters(filters)
        msgs, params, is_list = self.builder.build(
            text, input_ids, sampling_params, return_logprob, logprob_start_len,
            top_logprobs_num, token_ids_logprob, rid, extra_key,
        )
        states = self._add([ReqState(m, sp) for m, sp in zip(msgs, params)])
        if stream:
            return self._stream(states, is_list, return_text_in_logprobs)
        self._wait(states)
        outs = [s.to_dict(self.tokenizer, return_text_in_logprobs) for s in states]
        return outs if is_list else outs[0]

    def score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | list[list[int]] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        temperature: float = 1.0,
        return_token_logprobs: bool = False,
    ) -> ScoreResult:
        """SGLang's Engine.score: the probability of each label token after query + item (or the
        softmax over the labels), one prefill-only request per item."""
        plan = build_score(self.tokenizer, self.vocab_size, query, items, label_token_ids, apply_softmax,
                           item_first, temperature, return_token_logprobs)
        check_plan(plan, self.builder)
        states = self._run([ReqState(m, SamplingParams(max_new_tokens=0)) for m in plan.messages(uuid.uuid4().hex)])
        return plan.result([s.lp["output_token_ids_logprobs"][0] for s in states])

    def rank(
        self,
        user: dict,
        items: list[str],
        instruction: str | list[int] | None = None,
        prefix: str | None = None,
        top_k: int | None = None,
        score_by: str | None = None,
        exclude_items: list[str] | None = None,
        include_items: list[str] | None = None,
        filter: dict | None = None,
    ) -> dict:
        """Ranks candidate catalog items for a user with bipartite attention (needs item_catalog):
        {"ranking": [{"item", "score"}, ...], "meta_info": {"prefix", "prompt_tokens", ...}}.
        score_by: "id_token", "semantic_id" (path log-likelihood) or "auto" (the default).
        exclude_items / include_items / filter drop candidates (see retrieve)."""
        obj = {"user": user, "items": items, "prefix": prefix, "top_k": top_k, "score_by": score_by,
               "exclude_items": exclude_items, "include_items": include_items, "filter": filter}
        if instruction is not None:
            obj["instruction"] = instruction
        msg = build_rank_task(obj, self.tokenizer, self.builder, self.server_args.max_rank_candidates,
                              self.server_args.max_filter_items)
        return task_response(self._run_task(msg))

    def retrieve(self, user: dict, beam_width: int = 128, top_k: int | None = None, num_items: int = 10,
                 exclude_items: list[str] | None = None, include_items: list[str] | None = None,
                 filter: dict | None = None, reason: dict | None = None) -> dict:
        """Generative retrieval with xBeam over the catalog's semantic IDs (needs item_catalog):
        {"items": [{"item", "semantic_id", "score"}, ...], "meta_info": {...}}. exclude_items (ids
        never returned; unknown ones are counted in meta_info.ignored_exclusions), include_items (only
        these) and filter ({attribute: {op: value}}) act inside the beam search;
        meta_info.exhausted: fewer than num_items allowed items exist. reason {"max_tokens", "until",
        "also_without", sampling fields}: decode first, then retrieve after the reasoning and the marker
        (meta_info.reasoning; items_without_reasoning with also_without)."""
        obj = {"user": user, "beam_width": beam_width, "num_items": num_items, "exclude_items": exclude_items,
               "include_items": include_items, "filter": filter, "reason": reason}
        if top_k is not None:
            obj["top_k"] = top_k
        return task_response(self._run_task(build_retrieve_task(
            obj, self.tokenizer, self.builder, self.server_args.max_beam_width, self.server_args.max_filter_items)))

    def recommend(self, user: dict, retrieve: dict | None = None, rank: dict | None = None, top_k: int | None = None,
                  exclude_items: list[str] | None = None, include_items: list[str] | None = None,
                  filter: dict | None = None, reason: dict | None = None) -> dict:
        """Retrieve then rank in one task (/v1/recommend): `retrieve` {"beam_width", "num_candidates",
        "top_k"}, `rank` {"instruction", "prefix", "score_by"}; the filters act in the retrieve stage.
        {"items": [{"item", "score", "retrieve_score", "semantic_id"}, ...], "meta_info": {"retrieve",
        "rank", "catalog_version"}}, equal to retrieve() and then rank() of its items. reason: as
        retrieve()'s, for the retrieve stage (the rank stage reads the user as given)."""
        obj = {"user": user, "retrieve": retrieve, "rank": rank, "top_k": top_k, "exclude_items": exclude_items,
               "include_items": include_items, "filter": filter, "reason": reason}
        a = self.server_args
        return task_response(self._run_task(build_recommend_task(
            obj, self.tokenizer, self.builder, a.max_beam_width, a.max_rank_candidates, a.max_filter_items)))

    def _run_task(self, msg: TaskReq) -> ReqState:
        return self._run([ReqState(msg, SamplingParams(max_new_tokens=0))])[0]

    def _run(self, states: list[ReqState]) -> list[ReqState]:
        """Runs requests to the end; an aborted one raises (ValueError for a 400, else RuntimeError)."""
        self._wait(self._add(states))
        for s in states:
            fr = s.finish_reason or {}
            if fr.get("type") == "abort":
                raise (ValueError if fr.get("status_code") == 400 else RuntimeError)(fr.get("message") or "aborted")
        return states

    def flush_cache(self) -> bool:
        with self._lock:
            return self.scheduler.flush_cache()

    def check_memory(self) -> None:
        """Raises if the KV accounting does not balance (only meaningful when idle)."""
        with self._lock:
            self.scheduler.check_memory()

    def shutdown(self) -> None:
        """SGLang's Engine API: lets go of the storage tier's client (--hicache-storage-backend), the
        one thing an in-process engine holds outside itself."""
        if self.scheduler.hicache is not None:
            self.scheduler.hicache.close()

    # ---- running ------------------------------------------------------------------------
    def _add(self, states: list[ReqState]) -> list[ReqState]:
        with self._lock:
            clash = [s.msg.rid for s in states if s.msg.rid in self._states]
            if clash:
                raise ValueError(f"Duplicate request id {clash[0]!r}")
            for s in states:
                self._states[s.msg.rid] = s
                (self.scheduler.add_task if isinstance(s.msg, TaskReq) else self.scheduler.add_request)(s.msg)
        return states

    def _wait(self, states: list[ReqState]) -> None:
        try:
            self._run_until(lambda: all(s.finished for s in states))
        finally:
            self._forget(states)

    def _step(self) -> list:
        """One scheduler step (lock held): routes each progressed request's output to its state;
        returns the requests that progressed."""
        try:
            reqs = self.scheduler.step()
        except Exception:
            reqs = self.scheduler.abort_all("Internal error while running the batch")
            self._deliver(reqs)
            raise
        self.scheduler.reasoned.clear()  # states are found by rid: a reasoning's task needs no tracking
        self._deliver(reqs)
        return reqs

    def _deliver(self, reqs) -> None:
        for req in reqs:
            state = self._states.get(req.rid)
            if state is not None:
                state.apply(req.make_output())

    def _run_until(self, done) -> None:
        while not done():
            with self._lock:
                if done():
                    return
                wait = None if self._step() else self.scheduler.idle_wait()
            if wait:  # only rank / retrieve requests wait, for their batch's quota: sleep, lock released
                time.sleep(min(wait, IDLE_SLEEP_S))

    def _forget(self, states: list[ReqState]) -> None:
        with self._lock:
            for s in states:
                if not s.finished:  # the caller went away (e.g. a stream closed early)
                    self._deliver([r] if (r := self.scheduler.abort(s.msg.rid)) else [])
                self._states.pop(s.msg.rid, None)

    def _stream(self, states: list[ReqState], is_list: bool, text_in_logprobs: bool) -> Iterator[dict]:
        sent = [0] * len(states)  # output tokens already sent; -1 once the final chunk went out
        try:
            while True:
                for i in stream_updates(states, sent):
                    out = states[i].to_dict(self.tokenizer, text_in_logprobs)
                    if is_list:
                        out["index"] = i
                    yield out
                if all(x == -1 for x in sent):
                    return
                self._run_until(
                    lambda: any(x != -1 and (s.finished or len(s.output_ids) != x) for s, x in zip(states, sent))
                )
        finally:
            self._forget(states)
