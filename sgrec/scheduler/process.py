"""The scheduler process: a ZMQ loop around Scheduler, one per data-parallel rank.

It pulls requests from its own socket, runs scheduler steps while there is work, and pushes
ReqOutputs (and periodic SchedulerStats) to the tokenizer manager. It exits when its parent dies.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import sys
import threading
import time
import traceback

import torch
import zmq
from tqdm import tqdm

from sgrec.catalog import CatalogError
from sgrec.catalog.update import UpdateError
from sgrec.catalog.versions import UnknownVersionError
from sgrec.managers import io_struct as io
from sgrec.runner import ModelRunner
from sgrec.sampling import SamplingParams
from sgrec.scheduler.release import Releaser
from sgrec.scheduler.scheduler import Scheduler
from sgrec.scheduler.threads import ForwardThreads, update_reserve
from sgrec.server_args import DEVICE_SIZED, ServerArgs
from sgrec.tokenizer import Tokenizer

logger = logging.getLogger("sgrec.scheduler")

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
INTERNAL_ERROR = "Internal error while running the batch"
PAUSE_ABORTED = "Aborted by /pause_generation"
PREPARE_SWITCH_S = 0.0005  # GIL switch interval while a catalog version is built beside the steps (default 5 ms)


def freeze_startup_objects() -> None:
    """Moves everything start-up made (model, catalog, caches: ~400k objects) out of the cyclic
    GC's reach: a full collection scanned them all, a pause of ~100-200 ms in the middle of a step
    whenever enough new objects (e.g. catalog versions) had piled up. Garbage is still freed by
    reference counting; only cycles among start-up objects would never be collected."""
    gc.collect()
    gc.freeze()


class SchedulerLoop:
    def __init__(self, args: ServerArgs, dp_rank: int, in_addr: str, out_addr: str,
                 item_addrs: list[str] | None = None):
        self.args = args
        self.dp_rank = dp_rank
        self.parent = os.getppid()
        ctx = self.ctx = zmq.Context(1)
        self.out_addr = out_addr
        self.recv_sock = ctx.socket(zmq.PULL)
        self.recv_sock.connect(in_addr)
        self.send_sock = ctx.socket(zmq.PUSH)
        self.send_sock.connect(out_addr)
        self.catalog_prepared: dict[str, tuple] = {}  # update uid -> (Prepared, trie), awaiting commit
        self.releaser = Releaser()
        tokenizer = Tokenizer(args.tokenizer_path or args.model_path)
        show = dp_rank == 0
        self.runner = ModelRunner(args, show_progress=show)
        self.scheduler = Scheduler(args, self.runner, tokenizer, show_progress=True, dp_rank=dp_rank)
        self.item_pool = self._start_item_fetch(ctx, item_addrs)
        self.poller = zmq.Poller()  # idle: wake for a request (peers' item-KV fetches have their own thread)
        self.poller.register(self.recv_sock, zmq.POLLIN)
        self.warm_up(show)
        freeze_startup_objects()
        self.last_stats = 0.0
        self.live: dict = {}  # rid -> Req or Task accepted and not yet reported finished
        self.paused = False  # /pause_generation: requests are taken, no batch runs
        self.gen_tokens = 0
        self.gen_since = time.monotonic()
        self.threads = ForwardThreads(torch.get_num_threads(), update_reserve(args, self.runner.device.type))

    def warm_up(self, show_progress: bool) -> None:
        """One short generation through every code path (prefill, decode, sampling; an encoder-decoder
        family's encoder too), then a clean cache."""
        steps = 8
        msg = io.TokenizedGenerateReq(
            rid="warmup", input_ids=list(range(min(16, self.runner.config.vocab_size))),
            sampling_params={**SamplingParams().to_wire(), "max_new_tokens": steps, "ignore_eos": True},
        )
        req = self.scheduler.add_request(msg)
        with tqdm(total=steps, desc="Warming up", unit="step", disable=not show_progress) as bar:
            while not req.finished:
                self.scheduler.step()
                bar.n = len(req.output_ids)
                bar.refresh()
        self.scheduler.flush_cache()

    def send(self, msg) -> None:
        self.send_sock.send(io.encode(msg))

    def _start_item_fetch(self, ctx, item_addrs: list[str] | None):
        """HRCS across ranks: serve this rank's item KV to the others (from the pool's server thread),
        and fetch cold items this rank does not own from their owner or recompute them (a dead or slow
        owner: recomputed). Returns the ItemPool, or None without one."""
        ex = self.scheduler.rank_executor
        if ex is None or not item_addrs or self.args.dp_size < 2:
            return None
        from sgrec.items.pool import ItemPool

        return ItemPool(ex, self.runner, ctx, item_addrs, self.dp_rank)

    def run(self) -> None:
        sizes = {k: getattr(self.scheduler.args, k) for k in DEVICE_SIZED}
        sizes["cpu_threads"] = torch.get_num_threads()  # what --cpu-threads resolved to (/server_info)
        if self.runner.memory.states.size:  # what --max-mamba-cache-size resolved to, and a state's bytes
            sizes["max_mamba_cache_size"] = self.runner.memory.states.size
            sizes["state_bytes_per_request"] = self.runner.memory.bytes_per_state
        self.send(io.SchedulerReady(self.dp_rank, self.runner.memory.size, self.runner.context_len,
                                    self.runner.config.vocab_size, self.runner.max_input_len,
                                    self.scheduler.catalog_info(), sizes, self.runner.capabilities.encoder))
        while True:
            wait = None if self.paused else self.scheduler.idle_wait()  # rank / retrieve batches wait for their quota
            ready = dict(self.poller.poll(IDLE_POLL_MS if wait is None else min(IDLE_POLL_MS, math.ceil(wait * 1000))))
            if self.item_pool is not None:
                self.item_pool.refresh()  # its share computed at the first call; fetch counters logged
            if self.recv_sock in ready:
                self.drain()
            if os.getppid() != self.parent:
                logger.error("parent process died; scheduler %d exits", self.dp_rank)
                return
            self._set_threads()
            if self.scheduler.has_work() and not self.paused:
                self.step()
            if self.scheduler.commits:
                self.commit_catalogs()
            if time.monotonic() - self.last_stats >= STATS_INTERVAL_S:
                self.send_stats()

    def drain(self) -> None:
        while True:
            try:
                data = self.recv_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = io.decode(data)
            except ValueError as e:
                logger.warning("dropped a malformed message on the scheduler socket: %s", e)
                continue
            try:
                self.handle(msg)
            except Exception as e:  # a well-typed message with impossible values: drop it, keep serving
                logger.warning("dropped a %s message that could not be handled: %r", type(msg).__name__, e)

    def _reject(self, msg, message: str, status_code: int) -> None:
        fr = io.abort_reason(message, status_code)
        self.send(io.BatchReqOutput([io.ReqOutput(msg.rid, [], fr, len(msg.input_ids))]))

    def queue_full(self) -> bool:
        """--max-queued-requests: the requests not started yet, less those the free running places
        take at the next step (so a burst that arrives between two steps is not judged as if
        nothing could start, and the limit agrees with the tokenizer manager's running + queued)."""
        limit = self.args.max_queued_requests
        if limit is None:
            return False
        sched = self.scheduler
        free = max(0, self.args.max_running_requests - len(sched.running) - (1 if sched.chunked else 0))
        return sched.num_queued() >= limit + free

    def handle(self, msg) -> None:
        sched = self.scheduler
        if isinstance(msg, (io.TokenizedGenerateReq, io.TaskReq)):
            if self.queue_full():
                return self._reject(msg, io.QUEUE_FULL, 503)
            try:
                self.live[msg.rid] = (sched.add_task if isinstance(msg, io.TaskReq) else sched.add_request)(msg)
            except (TypeError, ValueError) as e:
                self._reject(msg, f"Invalid request: {e}", 400)
        elif isinstance(msg, io.AbortReq):
            req = sched.abort(msg.rid, msg.message)
            self.live.pop(msg.rid, None)
            if req is not None:
                self.send(io.BatchReqOutput([req.make_output()]))
        elif isinstance(msg, io.FlushCacheReq):
            flushed = sched.flush_cache()
            self.send_stats()  # ahead of the answer: /server_info shows the flushed pool once the flush returns
            self.send(io.FlushCacheResult(flushed, self.dp_rank))
        elif isinstance(msg, io.PauseReq):
            self.pause(msg.mode)
        elif isinstance(msg, io.CatalogTraffic):
            self.threads.update_seen()
        elif isinstance(msg, io.CatalogUpdateReq):
            self.threads.update_seen()
            threading.Thread(target=self._prepare_catalog, args=(msg,), daemon=True, name="catalog-prepare").start()
        elif isinstance(msg, io.CatalogCommitReq):
            self.threads.update_seen()
            prepared = self.catalog_prepared.pop(msg.uid, None)
            if msg.commit and prepared is not None:
                sched.queue_commit(msg.uid, prepared)
                self.commit_catalogs()
        else:
            logger.warning("dropped an unexpected %s message", type(msg).__name__)

    def commit_catalogs(self) -> None:
        """Serves the queued catalog commits, here between two steps, once the scheduler lets them
        (Scheduler.due_commits), and answers each."""
        sched = self.scheduler
        for uid, prepared in sched.due_commits():
            try:
                self.releaser.drop(sched.commit_catalog(*prepared))  # the old trie freed off the step
                reply = io.CatalogReply(uid, self.dp_rank, "committed", info=sched.catalog_info())
            except Exception as e:  # journaled but not served: only a restart brings the ranks together
                logger.error("catalog commit failed:\n%s", traceback.format_exc())
                reply = io.CatalogReply(uid, self.dp_rank, "failed", 500,
                                        f"the update is journaled but rank {self.dp_rank} failed to serve it "
                                        f"({e!r}); restart the server")
            self.send(reply)

    def pause(self, mode: str | None) -> None:
        """/pause_generation between two steps: "in_place" keeps every request and its KV, "retract"
        moves the running ones back to the queue (their KV to the cache), "abort" ends them all (503);
        mode None (/continue_generation) resumes. Answers once done, so the caller knows no batch runs."""
        sched = self.scheduler
        if mode == "abort":
            reqs = sched.abort_all(PAUSE_ABORTED, 503)
            for r in reqs:
                self.live.pop(r.rid, None)
            if reqs:
                self.send(io.BatchReqOutput([r.make_output() for r in reqs]))
        elif mode == "retract":
            sched.retract_running()
        elif mode is not None and mode != "in_place":
            raise ValueError(f"unknown pause mode {mode!r}")
        self.paused = mode is not None
        self.send_stats()  # ahead of the answer: /server_info shows the held (or resumed) state once it returns
        self.send(io.PauseResult(self.dp_rank, self.paused))

    def _prepare_catalog(self, msg: io.CatalogUpdateReq) -> None:
        """Phase one of a catalog update, on its own thread while steps go on: builds the next
        version and its trie and reports back (from its own socket: ZMQ sockets are not shared
        across threads)."""
        switch = sys.getswitchinterval()
        sys.setswitchinterval(PREPARE_SWITCH_S)  # the step's thread gets the GIL back within this
        try:
            self.catalog_prepared[msg.uid] = self.scheduler.prepare_catalog(msg.record)
            reply = io.CatalogReply(msg.uid, self.dp_rank, "prepared",
                                    info=self.catalog_prepared[msg.uid][0].applied.counts())
        except UpdateError as e:
            reply = io.CatalogReply(msg.uid, self.dp_rank, "failed", 400, str(e))
        except UnknownVersionError as e:
            reply = io.CatalogReply(msg.uid, self.dp_rank, "failed", 404, str(e))
        except Exception as e:
            logger.error("catalog update failed:\n%s", traceback.format_exc())
            reply = io.CatalogReply(msg.uid, self.dp_rank, "failed", 500, f"catalog update failed: {e!r}")
        finally:
            sys.setswitchinterval(switch)
        sock = self.ctx.socket(zmq.PUSH)
        try:
            sock.connect(self.out_addr)
            sock.send(io.encode(reply))
        finally:
            sock.close(linger=5000)

    def _set_threads(self) -> None:
        """The forward's threads for the next step (--catalog-update-cores: fewer while updates arrive)."""
        n = self.threads.now()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def step(self) -> None:
        try:
            reqs = self.scheduler.step()
        except Exception:
            logger.error("batch failed; aborting its requests:\n%s", traceback.format_exc())
            reqs = self._abort_after_failure()
        self.live.update(self.scheduler.reasoned)  # a reasoning's request lives on as its task
        self.scheduler.reasoned.clear()
        for r in reqs:
            if r.finished:
                self.live.pop(r.rid, None)
        if reqs:
            outs = [r.make_output() for r in reqs]
            self.gen_tokens += sum(len(o.new_output_ids) for o in outs)
            self.send(io.BatchReqOutput(outs))

    def _abort_after_failure(self) -> list:
        """Ends every request after a failed batch: the queued and running ones (abort_all) and those
        the batch had taken out of the queues (no request may hang); when that leaves the scheduler
        idle, the cache is flushed and KV slots no one holds any more are returned to the pool."""
        reqs = self.scheduler.abort_all(INTERNAL_ERROR, 500)
        lost = [r for r in self.live.values() if not r.finished]
        for r in lost:
            r.finish_reason = io.abort_reason(INTERNAL_ERROR, 500)
        if not self.scheduler.has_work() and self.scheduler.flush_cache():
            alloc = self.runner.memory.allocator
            leaked = alloc.used_size() - self.scheduler.cached_size()
            if leaked > 0 and self.scheduler.cached_size() == 0:
                logger.error("reclaiming %d KV slots left allocated by the failed batch", leaked)
                alloc.clear()
        return reqs + lost

    def _hicache_stats(self) -> dict:
        """The tiers' stats, with what a token adds to this rank's forwards beside the storage reads'
        fit: the two sides of the read-or-recompute choice for candidates' item KV."""
        out = self.scheduler.hicache.stats()
        ex = self.scheduler.rank_executor
        if ex is not None:
            out["item_recompute"] = ex.forward_cost.as_dict()
        return out

    def send_stats(self) -> None:
        now = time.monotonic()
        sched = self.scheduler
        pool = self.runner.memory
        used = pool.allocator.used_size()
        self.send(io.SchedulerStats(
            dp_rank=self.dp_rank,
            num_running_reqs=len(sched.running) + (1 if sched.chunked else 0) + sched.tasks.num_running(),
            num_queue_reqs=sched.num_queued(),
            token_usage=used / pool.size,
            kv_used=used,
            kv_total=pool.size,
            kv_cached=sched.cached_size(),
            last_gen_throughput=self.gen_tokens / max(now - self.gen_since, 1e-9),
            forward_threads=torch.get_num_threads(),
            hicache=None if sched.hicache is None else self._hicache_stats(),
        ))
        self.gen_tokens, self.gen_since, self.last_stats = 0, now, now


def run_scheduler_process(args_dict: dict, dp_rank: int, in_addr: str, out_addr: str,
                          item_addrs: list[str] | None = None) -> None:
    """Entry point of a scheduler process (multiprocessing spawn target)."""
    args = ServerArgs(**args_dict)
    logging.basicConfig(level=args.log_level.upper(), format=f"[%(asctime)s DP{dp_rank}] %(message)s")
    try:
        torch.set_num_threads(args.forward_threads())
        SchedulerLoop(args, dp_rank, in_addr, out_addr, item_addrs).run()
    except KeyboardInterrupt:
        pass
    except CatalogError as e:  # a bad --item-catalog: the message names file:line, no traceback needed
        logger.error("start-up failed: %s", e)
        raise SystemExit(2)
    except Exception:
        logger.error("scheduler %d crashed:\n%s", dp_rank, traceback.format_exc())
        raise SystemExit(1)
