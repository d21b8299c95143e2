"""TokenizerManager: the asyncio side of the server.

Validates and tokenizes requests (RequestBuilder), routes them to a scheduler rank over ZMQ,
and gathers the ReqOutputs coming back into per-request states that HTTP handlers await.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from sgrec.catalog.item import CatalogError
from sgrec.managers import io_struct as io
from sgrec.managers.catalog import CatalogAdmin
from sgrec.managers.generate import Limits, ReqState, RequestBuilder, stream_updates, wrong_type_field
from sgrec.managers.rec import (
    build_beam_generate_task, build_rank_task, build_recommend_task, build_retrieve_task, check_no_filters,
)
from sgrec.managers.score import ScorePlan, build_score_request
from sgrec.sampling import SamplingParams, SchemaError
from sgrec.server_args import ServerArgs
from sgrec.tokenizer import Tokenizer

logger = logging.getLogger("sgrec.tokenizer_manager")

# Top-level /generate fields and their JSON types; unknown top-level keys are ignored (as SGLang).
GENERATE_FIELDS = {
    "text": (str, list, type(None)),
    "input_ids": (list, type(None)),
    "sampling_params": (dict, list, type(None)),
    "return_logprob": (bool, list),
    "logprob_start_len": (int, list),
    "top_logprobs_num": (int, list),
    "token_ids_logprob": (list, type(None)),
    "return_text_in_logprobs": (bool,),
    "stream": (bool,),
    "rid": (str, list, type(None)),
    "extra_key": (str, type(None)),
    "routing_key": (str, type(None)),
    "constrain_to_catalog": (bool,),
    "exclude_items": (list, type(None)),
    "include_items": (list, type(None)),
    "filter": (dict, type(None)),
}
UNSUPPORTED_INPUTS = ("input_embeds", "image_data", "video_data", "audio_data", "lora_path")


@dataclass(eq=False)  # identity semantics: submissions are hashed into sets
class Submission:
    states: list[ReqState]
    is_list: bool
    text_in_logprobs: bool
    rank: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)


def check_generate_types(obj: dict) -> None:
    if not isinstance(obj, dict):
        raise SchemaError("the request body must be a JSON object")
    if (name := wrong_type_field(obj, GENERATE_FIELDS)) is not None:
        raise SchemaError(f"invalid type for `{name}`: {type(obj[name]).__name__}")
    for name in UNSUPPORTED_INPUTS:
        if obj.get(name) not in (None, [], ""):
            raise ValueError(f"`{name}` is not supported by sgrec")


class QueueFull(RuntimeError):
    """503: the rank already holds as many requests as it may (running + --max-queued-requests)."""

    def __init__(self):
        super().__init__(io.QUEUE_FULL)


class TokenizerManager:
    def __init__(self, args: ServerArgs, in_addrs: list[str], out_addr: str):
        self.args = args
        self.tokenizer = Tokenizer(args.tokenizer_path or args.model_path)
        self.ctx = zmq.asyncio.Context(1)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(out_addr)
        self.send_socks = []
        for addr in in_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.bind(addr)
            self.send_socks.append(sock)
        self.builder: RequestBuilder | None = None
        self.catalog: CatalogAdmin | None = None  # catalog updates (set once the ranks are ready)
        self.ready: dict[int, io.SchedulerReady] = {}
        self.stats: dict[int, io.SchedulerStats] = {}
        self.subs: dict[str, Submission] = {}  # rid -> submission
        self.rank_load = [0] * len(in_addrs)  # requests sent to each rank and not yet done there
        self._at_rank: set[str] = set()  # the rids counted in rank_load
        self.replies: list[list[asyncio.Future]] = [[] for _ in in_addrs]  # per rank: control replies awaited, in order
        self.paused: str | None = None  # the mode of /pause_generation until /continue_generation
        self.dead: str | None = None
        self.metrics = None  # set by the server when --enable-metrics
        self.listener: asyncio.Task | None = None
        self.last_output_at = 0.0  # monotonic time of the last request output from any scheduler
        self._output_event: asyncio.Event | None = None  # created in the running loop when first awaited

    # ---- start-up -----------------------------------------------------------------------
    async def wait_ready(self, timeout: float, alive) -> None:
        """Waits for every rank's SchedulerReady; `alive()` returns an error string if a child died."""
        deadline = time.monotonic() + timeout
        while len(self.ready) < len(self.send_socks):
            if (err := alive()) is not None:
                raise RuntimeError(err)
            if time.monotonic() > deadline:
                raise RuntimeError(f"schedulers not ready after {timeout:.0f} s")
            if await self.recv_sock.poll(200):
                msg = io.decode(await self.recv_sock.recv())
                if isinstance(msg, io.SchedulerReady):
                    self.ready[msg.dp_rank] = msg
        first = self.ready[0]
        pool = min(r.max_total_num_tokens for r in self.ready.values())
        self.builder = RequestBuilder(
            self.tokenizer, Limits(first.vocab_size, first.context_len, pool, first.max_input_len,
                                   self.args.max_batch_size, self.args.max_n, first.encoder))
        versions = {None if r.catalog is None else r.catalog["version"] for r in self.ready.values()}
        if len(versions) > 1:
            raise RuntimeError(f"the ranks loaded different catalog versions {sorted(versions)}")
        try:
            self.catalog = CatalogAdmin(self.send_socks, self.tokenizer, first.vocab_size,
                                        self.args.journal_path if first.catalog else None, first.catalog,
                                        self.args.semantic_id_tokens, self.args.semantic_id_codebooks)
        except (CatalogError, ValueError) as e:
            raise RuntimeError(str(e)) from None
        self.listener = asyncio.create_task(self._listen())

    @property
    def context_len(self) -> int:
        return self.ready[0].context_len

    @property
    def max_total_num_tokens(self) -> int:
        return min(r.max_total_num_tokens for r in self.ready.values())

    # ---- requests -----------------------------------------------------------------------
    def admit(self, obj: dict | None) -> None:
        """Fast 503 before validation or tokenization (raises QueueFull) when the rank the request would
        go to already has --max-running-requests + --max-queued-requests requests outstanding (sent and
        not yet answered): at most the running ones can be in progress, so the rest fill the queue and
        the scheduler would reject it anyway, only later and after the work of tokenizing it. The
        scheduler's own check stays for what this count cannot see (a queue that fills while running
        requests wait for KV, several prompts in one request)."""
        limit = self.args.max_queued_requests
        if limit is None or self.dead:
            return
        key = obj.get("routing_key") if isinstance(obj, dict) else None
        rank = self._pick_rank(key if isinstance(key, str) else None)  # no key: the least loaded rank
        if self.rank_load[rank] >= self.args.max_running_requests + limit:
            raise QueueFull()

    def submit(self, obj: dict, sampling_where: str = "sampling_params") -> Submission:
        """Validates, tokenizes and sends a native /generate request. Raises ValueError on bad input,
        QueueFull (a RuntimeError) when the rank is full. `sampling_where`: how errors name the
        sampling parameters ("" where the client sent them as top-level fields: the OpenAI routes)."""
        self.admit(obj)
        check_generate_types(obj)
        msgs, params, is_list = self.builder.build(
            obj.get("text"), obj.get("input_ids"), obj.get("sampling_params"),
            obj.get("return_logprob", False), obj.get("logprob_start_len", -1),
            obj.get("top_logprobs_num", 0), obj.get("token_ids_logprob"), obj.get("rid"), obj.get("extra_key"),
            sampling_where,
        )
        check_no_filters(obj)
        return self._send(msgs, params, is_list, bool(obj.get("return_text_in_logprobs", False)),
                          obj.get("routing_key"))

    def submit_score(self, obj: dict) -> tuple[Submission, ScorePlan]:
        """A /v1/score request: one prefill-only request per item. Raises ValueError on bad input."""
        self.admit(obj)
        plan = build_score_request(obj, self.tokenizer, self.builder)
        msgs = plan.messages(uuid.uuid4().hex)
        return self._send(msgs, [SamplingParams(max_new_tokens=0)] * len(msgs), True, False,
                          obj.get("routing_key")), plan

    def submit_rank(self, obj: dict) -> Submission:
        """A /v1/rank request (one task). Raises ValueError on bad input."""
        self.admit(obj)
        return self._send_task(build_rank_task(obj, self.tokenizer, self.builder, self.args.max_rank_candidates,
                                               self.args.max_filter_items),
                               obj)

    def submit_retrieve(self, obj: dict, native_beam: bool = False) -> Submission:
        """A /v1/retrieve request, or a native /generate with beam_width (one task each). Raises
        ValueError on bad input."""
        self.admit(obj)
        build = build_beam_generate_task if native_beam else build_retrieve_task
        return self._send_task(build(obj, self.tokenizer, self.builder, self.args.max_beam_width,
                                     self.args.max_filter_items), obj)

    def submit_recommend(self, obj: dict) -> Submission:
        """A /v1/recommend request: retrieve then rank, one task. Raises ValueError on bad input."""
        self.admit(obj)
        a = self.args
        return self._send_task(build_recommend_task(obj, self.tokenizer, self.builder, a.max_beam_width,
                                                    a.max_rank_candidates, a.max_filter_items), obj)

    def _send_task(self, msg: io.TaskReq, obj: dict) -> Submission:
        return self._send([msg], [SamplingParams(max_new_tokens=0)], False, False, obj.get("routing_key"))

    def _send(self, msgs, params, is_list: bool, text_in_logprobs: bool, routing_key: str | None) -> Submission:
        if self.dead:
            raise RuntimeError(self.dead)
        dup = next((m.rid for m in msgs if m.rid in self.subs), None)
        if dup is not None:
            raise ValueError(f"Duplicate request id {dup!r}")
        rank = self._pick_rank(routing_key)
        sub = Submission([ReqState(m, sp) for m, sp in zip(msgs, params)], is_list, text_in_logprobs, rank)
        for m in msgs:  # send first: no output can arrive before this coroutine yields
            self.send_socks[rank].send(io.encode(m))
        for m in msgs:
            self.subs[m.rid] = sub
        self.rank_load[rank] += len(msgs)
        self._at_rank.update(m.rid for m in msgs)
        return sub

    def _pick_rank(self, routing_key: str | None) -> int:
        n = len(self.send_socks)
        if n == 1:
            return 0
        if routing_key is not None:  # the same user always lands on the same rank (its caches)
            return zlib.crc32(routing_key.encode()) % n
        return min(range(n), key=lambda r: self.rank_load[r])

    async def wait(self, sub: Submission) -> list[dict]:
        states = await self.wait_states(sub)
        return [s.to_dict(self.tokenizer, sub.text_in_logprobs) for s in states]

    async def wait_states(self, sub: Submission) -> list[ReqState]:
        while not sub.finished:
            sub.event.clear()
            if not sub.finished:
                await sub.event.wait()
        self._forget(sub)
        return sub.states

    async def stream(self, sub: Submission) -> AsyncIterator[tuple[int, dict]]:
        """Yields (index, cumulative chunk) whenever a request of the submission progressed."""
        sent = [0] * len(sub.states)  # -1 once the final chunk went out
        try:
            while True:
                sub.event.clear()
                for i in stream_updates(sub.states, sent):
                    yield i, sub.states[i].to_dict(self.tokenizer, sub.text_in_logprobs)
                if all(x == -1 for x in sent):
                    return
                await sub.event.wait()
        finally:
            self.abort(sub)

    def abort(self, sub: Submission, message: str = "Request aborted by the client") -> None:
        """Aborts the unfinished requests of a submission (client left); frees their KV."""
        for s in sub.states:
            if not s.finished and not self.dead:
                self.send_socks[sub.rank].send(io.encode(io.AbortReq(s.msg.rid, message)))
        self._forget(sub)

    def _forget(self, sub: Submission) -> None:
        for s in sub.states:
            if self.subs.get(s.msg.rid) is sub:
                del self.subs[s.msg.rid]
                self._release(sub.rank, s.msg.rid)

    def _release(self, rank: int, rid: str) -> None:
        """A request leaves the rank's load once the rank is done with it (its final output arrived, or
        it was aborted), not when its client has read it: a slow reader holds no place in the queue."""
        if rid in self._at_rank:
            self._at_rank.discard(rid)
            self.rank_load[rank] -= 1

    async def outputs_since(self, t0: float, timeout: float) -> bool:
        """Whether some scheduler sends a request output after monotonic time t0 (waits up to
        `timeout`): a busy server that keeps answering, as SGLang's health check counts it."""
        deadline = time.monotonic() + timeout
        if self._output_event is None:
            self._output_event = asyncio.Event()
        while self.last_output_at <= t0:
            left = deadline - time.monotonic()
            if left <= 0 or self.dead:
                return False
            self._output_event.clear()
            try:
                await asyncio.wait_for(self._output_event.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    async def _ask_all(self, msg) -> list:
        """Sends a control message to every rank; their replies (each rank answers its control
        messages in order). RuntimeError when a scheduler died or did not answer within 30 s."""
        if self.dead:
            raise RuntimeError(self.dead)
        futs = []
        for sock, waiting in zip(self.send_socks, self.replies):
            fut = asyncio.get_running_loop().create_future()
            waiting.append(fut)
            futs.append(fut)
            sock.send(io.encode(msg))
        try:
            return await asyncio.wait_for(asyncio.gather(*futs), timeout=30)
        except asyncio.TimeoutError:
            raise RuntimeError(f"a scheduler did not answer {type(msg).__name__} within 30 s") from None

    async def flush_cache(self) -> bool:
        return all(r.success for r in await self._ask_all(io.FlushCacheReq()))

    async def pause(self, mode: str | None) -> None:
        """/pause_generation (a mode of io.PAUSE_MODES) or /continue_generation (None); returns once
        every rank has stopped (or resumed) running batches."""
        await self._ask_all(io.PauseReq(mode))
        self.paused = mode

    def fail_all(self, message: str, status_code: int = 500) -> None:
        self.dead = message
        if self.catalog is not None:
            self.catalog.fail_all(message)
        for waiting in self.replies:
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(RuntimeError(message))
            waiting.clear()
        for sub in set(self.subs.values()):
            for s in sub.states:
                if not s.finished:
                    s.fail(message, status_code)
            sub.event.set()

    # ---- outputs ------------------------------------------------------------------------
    async def _listen(self) -> None:
        while True:
            data = await self.recv_sock.recv()
            try:
                msg = io.decode(data)
            except ValueError as e:
                logger.warning("dropped a malformed message from a scheduler: %s", e)
                continue
            try:
                self._handle(msg)
            except Exception as e:  # one bad message must not stop the loop every request waits on
                logger.warning("dropped a %s message that could not be applied: %r", type(msg).__name__, e)

    def _handle(self, msg) -> None:
        if isinstance(msg, io.BatchReqOutput):
            self.last_output_at = time.monotonic()
            if self._output_event is not None:
                self._output_event.set()
            for out in msg.outputs:
                self._on_output(out)
        elif isinstance(msg, io.SchedulerStats):
            if 0 <= msg.dp_rank < len(self.send_socks):
                self.stats[msg.dp_rank] = msg
                if self.metrics:
                    self.metrics.on_stats(self.stats)
        elif isinstance(msg, io.CatalogReply):
            if self.catalog is not None:
                self.catalog.on_reply(msg)
        elif isinstance(msg, (io.FlushCacheResult, io.PauseResult)):
            waiting = self.replies[msg.dp_rank]
            fut = waiting.pop(0) if waiting else None
            if fut is not None and not fut.done():  # (done: its caller timed out)
                fut.set_result(msg)
        else:
            logger.warning("dropped an unexpected %s message from a scheduler", type(msg).__name__)

    def _on_output(self, out: io.ReqOutput) -> None:
        sub = self.subs.get(out.rid)
        if sub is None:
            return  # the client already left
        state = next(s for s in sub.states if s.msg.rid == out.rid)
        had_first = state.first_token_time is not None
        state.apply(out)
        if state.finished:
            self._release(sub.rank, out.rid)
        if self.metrics:
            self.metrics.on_output(state, out, had_first)
        sub.event.set()
