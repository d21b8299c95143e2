"""The scheduler loop: continuous batching over a radix prefix cache.

Each step either runs one prefill batch (new prompts, or the next chunk of a long one; at most
chunked_prefill_size tokens in all) or one decode batch of every running request. Admission checks
one budget (the tree's make_room): the KV slots (free plus evictable cache, minus a reserve for
running decodes) and, for a family with recurrent layers, a state slot a request; when decode
still runs out of slots, the newest request is retracted (its KV goes to the cache, its state is
freed) and re-queued.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass

import orjson
import torch

from sgrec import layout as L
from sgrec.model.attention import SeqLayout
from sgrec.model.registry import PREFIX_REUSE
from sgrec.radix.eviction import make_policy
from sgrec.radix.hicache import make_hicache, predicted_reuse
from sgrec.radix.tree import RadixCache
from sgrec.runner import ModelRunner
from sgrec.sampling import GREEDY_EPS, Sampler
from sgrec.catalog import image, load_catalog
from sgrec.catalog.sid import SidTokens
from sgrec.catalog.update import UpdateError
from sgrec.catalog.versions import Prepared, catalog_facts, replay
from sgrec.managers.io_struct import TaskReq, TokenizedGenerateReq, abort_reason
from sgrec.sampling import SamplingParams
from sgrec.policy.prefill_only import (
    jct_uncached_tokens, pick_prefill_only, profile_linear_jct,
)
from sgrec.scheduler.encoded import EncoderInputs
from sgrec.scheduler.reasoning import Reasoning, run_with_reasoning, then_task
from sgrec.scheduler.recommend import recommend_steps
from sgrec.scheduler.req import LogprobSpec, Req
from sgrec.scheduler.task import Task, TaskKind, TaskQueue, at_once, stage_units, stream_backend
from sgrec.server_args import ServerArgs
from sgrec.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
READY_WAIT_S = 900.0  # how long a rank waits for rank 0's catalog image (the launcher's start-up limit)

DECODE_RESERVE_RATIO = 0.3  # fraction of running requests' remaining tokens kept free at admission
DECODE_RESERVE_CLIP = 512
PREFETCH_POLL_S = 0.002  # how often an idle loop looks at storage reads that requests wait for


def load_rank_catalog(args: ServerArgs, dp_rank: int, tokenizer: Tokenizer, vocab: int, progress: bool):
    """This rank's catalog. With a catalog image folder (the launcher names one when --dp-size > 1:
    sgrec.catalog.image), rank 0 loads the catalog and writes it there, and every rank maps that one
    copy; else the rank loads its own."""
    folder = os.environ.get(image.ENV)
    sid = None if args.semantic_id_tokens is None else SidTokens(args.semantic_id_tokens, tokenizer)
    if not folder:
        return load_catalog(args.item_catalog, tokenizer, vocab, progress=progress, sid_tokens=sid)
    if dp_rank == 0:
        image.write(folder, load_catalog(args.item_catalog, tokenizer, vocab, progress=progress, sid_tokens=sid))
    else:
        image.wait(folder, READY_WAIT_S)
    logger.info("item catalog mapped from %s (shared by the DP ranks)", folder)
    return image.load(folder)


def shared_trie(key, build, device: torch.device | None):
    """build() -> (trie, catalog rows) of a catalog version (a RetrieveExecutor's build_trie or
    updated_trie, or (None, None)), made once for all DP ranks where they share a catalog image and
    the beam step reads the trie on the host (`device` None: sgrec.beam.executor.trie_device): the
    first rank to ask for key() (the version's name, made only then) builds it, every rank maps its
    arrays (sgrec.catalog.image.shared); ranks ask for the versions' keys in the same order. Else
    build()."""
    folder = os.environ.get(image.ENV)
    if not folder or device is not None:
        return build()
    return share_trie(folder, key, build)


def share_trie(folder: str, key, build):
    """shared_trie in an image folder. A LayeredTrie's base (its O(leaves) arrays) is written once
    per base ("triebase-<id>", by the maker of the first version on it, before that version's
    files), each version's own arrays beside (O(parents + what changed since the base))."""
    from sgrec.beam.layered import LayeredTrie
    from sgrec.beam.trie import SemanticIdTrie

    def make():
        trie, rows = build()
        if trie is None:
            return {}, None
        arrays, info = trie.arrays()
        if rows is None:  # a LayeredTrie
            image.shared(folder, "triebase", info["base"], trie.base_arrays)
            return arrays, info
        return {**arrays, "trie_rows": rows}, info

    def unmade():
        raise RuntimeError("a trie version's base is written before the version (by its maker)")

    arrays, info = image.shared(folder, "trie", key(), make)
    if info is None:
        return None, None
    if info.get("layered"):
        base, _ = image.shared(folder, "triebase", info["base"], unmade)
        return LayeredTrie.from_arrays({**arrays, **base}, info), None
    return SemanticIdTrie.from_arrays(arrays, info), arrays["trie_rows"]


@dataclass
class RowPlan:
    """The logit rows of one request in a prefill batch: rows row .. last_row hold the distributions
    after positions start .. stop - 1 (row None: it needs none); final: the batch ends its prompt."""

    req: Req
    final: bool
    row: int | None = None
    start: int | None = None
    stop: int | None = None

    @property
    def last_row(self) -> int:
        return self.row + (self.stop - self.start) - 1


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner, tokenizer: Tokenizer, show_progress: bool = False,
                 dp_rank: int = 0):
        self.args = args = runner.args  # the arguments the runner was built with, sized for its device
        self.runner = runner
        self.tokenizer = tokenizer
        eos = set(runner.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.allocator = runner.memory.allocator
        self.states_per_request = runner.memory.states_per_request  # admitted with the tokens, one budget
        reuse = runner.capabilities.prefix_reuse
        # the tree cuts a match at any token; an encoder's inputs are cached under whole keys (beam/encdec.py)
        if reuse == "exact" and not runner.capabilities.encoder and not args.disable_radix_cache:
            raise ValueError(f"the {runner.family.name} family's cached prefixes are reusable {PREFIX_REUSE[reuse]}, "
                             f"while the radix cache cuts a match at any token; start with --disable-radix-cache")
        # a match resumes from the deepest cached state (RadixCache.match_snapshot), kept at every
        # prefill chunk's end and with every finished request
        self.snapshots = reuse == "snapshot" and not args.disable_radix_cache
        if self.snapshots and args.enable_hierarchical_cache and args.hicache_storage_backend:
            raise ValueError(f"--hicache-storage-backend: the storage tier keeps KV pages, not the "
                             f"{runner.family.name} family's state snapshots, without which its prefixes "
                             f"are not reusable; leave it out (the host tier keeps both)")
        self.hicache = None if args.disable_radix_cache else make_hicache(args, runner.memory, runner.weights())
        if self.hicache is not None and self.snapshots:
            self.hicache.keep_states(runner.memory.states)  # snapshots go down a tier with their nodes
        self.tree = RadixCache(self.allocator, policy=make_policy(args.radix_eviction_policy, args.radix_eviction_policy_config),
                               disable=args.disable_radix_cache, hicache=self.hicache,
                               states=runner.memory.states if runner.memory.states.size else None)
        if self.hicache is not None:
            self.hicache.reuse = predicted_reuse(self.tree.policy)
        self.prefetching: list[tuple[list[Future], float, Req | Task, int]] = []  # held back while storage pages come up
        self.sampler = Sampler(args.random_seed, runner.device)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a prompt in the middle of chunked prefill
        self.prefill_only: list[Req] = []  # max_new_tokens 0: hybrid prefilling, suffix KV discarded
        self.prefill_only_policy = args.schedule_policy if args.schedule_policy.startswith("srjf") else "fcfs"
        self.jct = jct_uncached_tokens
        if args.jct_model == "linear" and not runner.capabilities.encoder:  # profiled on decoder-only prefills
            longest = max(2, min(runner.max_input_len, runner.memory.size, 4096))
            self.jct = profile_linear_jct(runner, [longest * i // 4 or 2 for i in range(1, 5)]).in_tokens()
            logger.info("JCT model fitted on profiled prefills: %s", self.jct)
        self.clock = time.monotonic
        backend = stream_backend(args, runner.device)
        self.catalog = self.rank_executor = self.retriever = self.versions = None
        kinds = self._catalog_paths(dp_rank, backend, show_progress) if args.item_catalog else {}
        self.tasks = TaskQueue(args, kinds, backend, clock=lambda: self.clock())
        self.commits: list[tuple[str, tuple]] = []  # catalog commits waiting for the task batches under way
        self.reasoned: dict[str, Task] = {}  # rid -> the task a finished reasoning became (taken by the caller)
        # an encoder-decoder family's generate and score requests: their inputs through the encoder
        self.inputs = EncoderInputs(runner, self.tree) if runner.capabilities.encoder else None
        self.chunk_size = args.prefill_chunk
        self.last_was_prefill = False
        self.last_ran_tasks = False  # the last step ran rank / retrieve batches

    def _catalog_paths(self, dp_rank: int, backend, show_progress: bool) -> dict[str, TaskKind]:
        """--item-catalog: the catalog (its journal replayed), the rank and retrieve executors over
        it, and the task kinds they serve (rank, retrieve, recommend)."""
        from sgrec.beam.encdec import make_retriever
        from sgrec.beam.executor import build_trie, trie_device
        from sgrec.rank.executor import RankExecutor

        args, runner, tokenizer = self.args, self.runner, self.tokenizer
        vocab = runner.config.vocab_size
        catalog = load_rank_catalog(args, dp_rank, tokenizer, vocab, show_progress)
        self.versions = replay(catalog, args.journal_path, args.catalog_history, vocab)
        self.catalog = self.versions.current
        built = shared_trie(lambda: f"v{self.versions.version}-start",
                            lambda: build_trie(self.catalog, vocab, trie_device(runner)), trie_device(runner))
        tiers = self.hicache if self.hicache is not None and self.hicache.storage is not None else None
        # item KV shared through the storage tier, where there is one
        self.rank_executor = RankExecutor(runner, self.tree, self.catalog, args, dp_rank=dp_rank, tiers=tiers)
        self.rank_executor.precompute(progress=show_progress)
        self.retriever = make_retriever(runner, self.tree, self.catalog, max_beam_width=args.max_beam_width,
                                          units=stage_units(args, backend),
                                          built=built)

        def versioned(results: list) -> list:  # every answer names the catalog version it was served on
            for r in results:
                if isinstance(r, dict):
                    r["meta_info"]["catalog_version"] = self.versions.version
            return results

        def retrieve(payloads: list[dict]) -> Generator:  # its round's phases
            results = yield from self.retriever.run_steps(payloads)
            return versioned([r if isinstance(r, Exception) else {"items": r.items, "meta_info": r.meta}
                              for r in results])

        def recommend(payloads: list[dict]) -> Generator:
            return versioned((yield from recommend_steps(self.retriever, self.rank_executor, payloads)))

        def reasoned(kind: str, steps: Callable) -> Callable:  # a batch where some requests reasoned first
            return lambda payloads: run_with_reasoning(kind, steps, payloads, tokenizer.decode)

        def recommend_tokens(p: dict) -> int:  # the retrieve stage, then about the rank stage's prompt
            ranked = len(p["rank"]["user_ids"]) + len(p["rank"]["instruction_ids"])
            per_item = self.catalog.total_tokens / len(self.catalog)
            return self.retriever.tokens(p["retrieve"]) + ranked + round(p["retrieve"]["num_items"] * per_item)

        return {  # batched by kind; with --interleave-rounds a round's phases alternate with other batches' (task.py)
            "rank": TaskKind(at_once(lambda p: versioned(self.rank_executor.run_batch(p))), self.rank_executor.tokens),
            "retrieve": TaskKind(reasoned("retrieve", retrieve), self.retriever.tokens),
            "recommend": TaskKind(reasoned("recommend", recommend), recommend_tokens),
        }

    # ---- public -------------------------------------------------------------------------
    def add_request(self, msg: TokenizedGenerateReq) -> Req:
        req = Req(
            rid=msg.rid,
            input_ids=msg.input_ids,
            sampling=SamplingParams.from_wire(msg.sampling_params),
            logprob=LogprobSpec(msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num, msg.token_ids_logprob,
                                msg.label_columns_only),
            extra_key=msg.extra_key,
            eos_ids=self.eos_ids,
            stop_checker=self._stop_match,
            cache_prefix_len=msg.cache_prefix_len,
            arrival=self.clock(),
        )
        if self.inputs is not None:
            self.inputs.prepare(req)
        if self._hold(req, [self._lookup_key(req)]):
            return req
        self._queue(req)
        return req

    def _queue(self, req: Req) -> None:
        if req.is_prefill_only:
            req.cached_on_arrival = self._peek_cached(req)
            self.prefill_only.append(req)
        else:
            self.waiting.append(req)

    def add_task(self, msg: TaskReq) -> Task | Req:
        """Queues a rank / retrieve / recommend task (once its prefixes are up from storage, see _hold);
        one with `reason` starts as its reasoning, a generation request (scheduler/reasoning.py)."""
        if msg.payload.get("reason") is not None and msg.kind in ("retrieve", "recommend"):
            return self._add_reasoning(msg)
        task = Task(msg)
        if self._hold(task, self._task_prefixes(msg), self._task_items(msg)):
            return task
        return self.tasks.add(msg, task)

    def _add_reasoning(self, msg: TaskReq) -> Req:
        if msg.kind not in self.tasks.kinds:
            return self.tasks.add(msg)  # refused as any task of the kind (no catalog)
        reason = msg.payload["reason"]
        payload = msg.payload["retrieve"] if msg.kind == "recommend" else msg.payload
        req = Req(rid=msg.rid, input_ids=list(msg.input_ids), sampling=SamplingParams.from_wire(reason["sampling_params"]),
                  extra_key=payload.get("extra_key"), eos_ids=self.eos_ids, stop_checker=self._stop_match,
                  arrival=self.clock(), reasoning=Reasoning(msg, reason["marker"], reason["also_without"]))
        if not self._hold(req, [self._lookup_key(req)]):
            self._queue(req)
        return req

    def _reasoned(self, reqs: list) -> list:
        """A step's requests less the reasonings: a finished one becomes its task, queued now (and
        put in `reasoned`, rid -> task, for the caller that tracks live requests); an aborted one is
        reported (its task's error)."""
        out = []
        for r in reqs:
            if getattr(r, "reasoning", None) is None or (r.finished and r.finish_reason.get("type") == "abort"):
                out.append(r)
            elif r.finished:
                self.reasoned[r.rid] = self.tasks.add(then_task(r.reasoning, r.output_ids, r.finish_reason))
        return out

    # ---- the storage tier's prefetch (--hicache-storage-backend) ----------------------------
    def _task_prefixes(self, msg: TaskReq) -> list[tuple[list[int], str | None]]:
        """The prefixes a task may look up in the radix tree: retrieve's prompt, rank's user (unless
        its layout is item-as-prefix or none)."""
        p = msg.payload if isinstance(msg.payload, dict) else {}
        out = []
        for kind, part in ((msg.kind, p), ("retrieve", p.get("retrieve")), ("rank", p.get("rank"))):
            if not isinstance(part, dict):
                continue
            if kind == "retrieve" and isinstance(part.get("input_ids"), list) and self.retriever is not None:
                out.append(self.retriever.cache_key(part))
            elif kind == "rank" and isinstance(part.get("user_ids"), list) and self.rank_executor is not None \
                    and self.rank_executor.may_use(part, L.USER_PREFIX):
                out.append(self.rank_executor.cache_key(part))
        return out

    def _task_items(self, msg: TaskReq) -> list[tuple[str, int]]:
        """The rank candidates' item KV to look for in storage ((key, tokens), see RankExecutor.stored_items)."""
        if msg.kind != "rank" or self.rank_executor is None or not isinstance(msg.payload, dict):
            return []
        return self.rank_executor.stored_items(msg.payload)

    def _hold(self, item, prefixes: list[tuple[list[int], str | None]], items: list[tuple[str, int]] = ()) -> bool:
        """Starts reading the prefixes' pages (and the items' KV) from storage; True when `item` waits
        for them (policy timeout or wait_complete) in `prefetching`, never in a step."""
        h = self.hicache
        if h is None or h.storage is None or self.tree.disable:
            return False
        futures = [f for ids, key in prefixes
                   if all(isinstance(t, int) for t in ids)
                   and (f := h.prefetch(ids, key, self.tree.peek_prefix_len(ids, key))) is not None]
        if items and (f := h.prefetch_items(items)) is not None:
            futures.append(f)
        if not futures or h.prefetch_policy == "best_effort":
            return False
        tokens = sum(len(ids) for ids, _ in prefixes) + sum(n for _, n in items)
        deadline = float("inf") if h.prefetch_policy == "wait_complete" else self.clock() + h.timeout(tokens)
        self.prefetching.append((futures, deadline, item, h.storage_stats.failures))  # a new failure releases it
        return True

    def _release_prefetched(self) -> None:
        """Queues what waited for storage and whose reads are done (or past their deadline)."""
        now, keep = self.clock(), []
        for entry in self.prefetching:
            futures, deadline, item, failures = entry
            if (now < deadline and not all(f.done() for f in futures) and self.hicache.storage_up()
                    and self.hicache.storage_stats.failures == failures):
                keep.append(entry)
            elif isinstance(item, Req):
                self._queue(item)
            else:
                self.tasks.add(item.msg, item)  # a refused task is reported by the next run, as on arrival
        self.prefetching = keep

    def num_queued(self) -> int:
        """Requests not yet started: generate prompts, prefill-only requests and tasks."""
        return len(self.waiting) + len(self.prefill_only) + len(self.tasks) + len(self.prefetching)

    def cached_size(self) -> int:
        """KV slots held by the caches: the radix tree and the item store."""
        return self.tree.total_size() + (self.rank_executor.total_size() if self.rank_executor else 0)

    def _lookup_key(self, req: Req) -> tuple[list[int], str | None]:
        """What the request looks up in the tree first (and the storage tier reads ahead): its
        prefix, or an encoder-decoder's input."""
        if self.inputs is not None:
            return self.inputs.storage_key(req)
        return req.fill_ids[: req.prefix_match_limit()], req.extra_key

    def _peek_cached(self, req: Req) -> int:
        if self.inputs is not None:
            return self.inputs.peek_cached(req)
        return self.tree.peek_prefix_len(req.fill_ids[: req.prefix_match_limit()], req.extra_key)

    def _encoder_tokens(self, req: Req) -> int:
        """Input tokens the encoder still reads for the request (0 for a decoder-only model)."""
        return 0 if self.inputs is None else self.inputs.pending_tokens(req)

    def _encoder_slots(self, reqs: list[Req]) -> list | None:
        """The batch's encoder slots, one entry a request (an encoder-decoder family), else None."""
        return None if self.inputs is None else self.inputs.slots(reqs)

    def _stop_match(self, req: Req) -> str | None:
        longest = max(len(s) for s in req.sampling.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 8) :], req.sampling.skip_special_tokens)
        return next((s for s in req.sampling.stop if s in tail), None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.prefill_only or self.tasks
                    or self.tasks.in_flight or self.prefetching)

    def idle_wait(self) -> float | None:
        """Seconds until a step has something to run: 0 when it has now, the time left until the
        next rank / retrieve batch falls due when only those wait, None when there is no work."""
        if self.waiting or self.running or self.chunked or self.prefill_only:
            return 0.0
        due = self.tasks.next_deadline()
        wait = None if due is None else max(0.0, due - self.clock())
        if self.prefetching:  # poll the storage reads
            wait = PREFETCH_POLL_S if wait is None else min(wait, PREFETCH_POLL_S)
        return wait

    def step(self) -> list[Req | Task]:
        """Runs one batch; returns the requests that got a new token or finished (a reasoning only
        once its task ends)."""
        return self._reasoned(self._step())

    def _step(self) -> list[Req | Task]:
        """One batch (see step).

        Prefill goes first, but never twice in a row while requests are decoding: a running
        request waits at most one prefill batch (at most chunked_prefill_size tokens) per token.
        Due rank / retrieve batches go before prompts, but not twice in a row while prompts or
        prefill-only requests wait: a steady stream of rank / retrieve requests cannot starve them."""
        if self.prefetching:
            self._release_prefetched()
        if not (self.last_was_prefill and self.running):
            due = self.tasks.next_deadline()
            after_tasks, self.last_ran_tasks = self.last_ran_tasks, False
            if due is not None and due <= self.clock() and not (after_tasks and (self.waiting or self.prefill_only)):
                ran, done = self.tasks.run_step()  # a batch is under way, full or at its quota
                if ran:
                    self.last_was_prefill = self.last_ran_tasks = True
                    return done
            prefill = self._schedule_prefill()
            if not prefill and self.prefill_only:
                prefill = self._schedule_prefill_only()
            if prefill:
                self.last_was_prefill = True
                return self._run_prefill(prefill)
        self.last_was_prefill = False
        if self.running:
            return self._run_decode()
        return []

    def _all_reqs(self) -> list[Req]:
        return [*self.waiting, *self.prefill_only, *self.tasks.tasks(), *self.running,
                *([self.chunked] if self.chunked else []), *(e[2] for e in self.prefetching)]

    def abort(self, rid: str, message: str = "Request aborted", status_code: int = 400) -> Req | None:
        """Ends a queued or running request; returns it (to report), or None if unknown."""
        for req in self._all_reqs():
            if req.rid == rid:
                if req is self.chunked:
                    self.chunked = None
                elif any(e[2] is req for e in self.prefetching):
                    self.prefetching = [e for e in self.prefetching if e[2] is not req]
                elif req in self.running:
                    self.running.remove(req)
                elif req in self.prefill_only:
                    self.prefill_only.remove(req)
                elif isinstance(req, Task):
                    if self.tasks.remove(rid) is None:
                        return None  # in flight or already finished: its answer is on its way
                else:
                    self.waiting.remove(req)
                self._finish_abort(req, message, status_code)
                return req
        return None

    def abort_all(self, message: str, status_code: int = 500) -> list[Req]:
        reqs = self._all_reqs()
        for req in reqs:
            self._finish_abort(req, message, status_code)
        self.waiting, self.running, self.chunked, self.prefill_only = [], [], None, []
        self.prefetching = []
        self.tasks.clear()
        return reqs

    def retract_running(self) -> None:
        """Every running request back to the front of the queue, in order, its KV to the cache."""
        for req in reversed(list(self.running)):
            self._retract(req)

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        self.tree.reset()
        if self.rank_executor is not None:
            self.rank_executor.store.reset()
        return True

    # ---- catalog versions -------------------------------------------------------
    def prepare_catalog(self, record: dict) -> tuple[Prepared, tuple]:
        """The next catalog version from a journal record and its trie, built without touching what
        is served (safe on another thread while steps run). UpdateError / UnknownVersionError: the
        record does not apply."""
        if self.versions is None:
            raise UpdateError("this server has no item catalog (--item-catalog)")
        prepared = self.versions.prepare(record, self.runner.config.vocab_size)
        applied = prepared.applied
        if applied.catalog is self.versions.current:  # nothing changed (unknown ids deleted)
            return prepared, self.retriever.built
        def key() -> str:  # the version and its record: an aborted prepare never serves another record's trie
            return f"v{prepared.version}-{hashlib.sha1(orjson.dumps(record, option=orjson.OPT_SORT_KEYS)).hexdigest()}"

        if prepared.op == "rollback":  # another line of rows: the version's trie from scratch
            build = lambda: self.retriever.build_trie(applied.catalog)  # noqa: E731
        else:
            build = lambda: self.retriever.updated_trie(applied)  # noqa: E731
        return prepared, shared_trie(key, build, self.retriever.trie_device)

    def queue_commit(self, uid: str, prepared: tuple) -> None:
        """A committed update (its uid, and prepare_catalog's result) to serve once no rank / retrieve
        batch is under way, since a batch runs on one version from its first phase to its last;
        until then no new batch starts, so the commit waits for the batches under way only."""
        self.commits.append((uid, prepared))
        self.tasks.hold = True

    def due_commits(self) -> list[tuple[str, tuple]]:
        """The queued commits, in order, once no batch is under way (new batches may start again
        after them; serve each with commit_catalog before the next step), else []."""
        if not self.commits or self.tasks.in_flight:
            return []
        out, self.commits = self.commits, []
        self.tasks.hold = False
        return out

    def commit_catalog(self, prepared: Prepared, trie) -> tuple:
        """Serves the prepared version from the next step on (call between steps): the executors
        switch catalogs and the item store drops the KV of changed items. Returns what the switch
        replaced (the old trie and its parts), which a server frees off the step (release.py)."""
        self.versions.commit(prepared)
        self.catalog = self.versions.current
        old = self.retriever.use_catalog(self.catalog, trie)
        self.rank_executor.use_catalog(self.catalog, prepared.applied.changed)
        return old

    def catalog_info(self) -> dict | None:
        """GET /v1/catalog's facts about the current version."""
        if self.versions is None:
            return None
        return catalog_facts(self.catalog, self.versions)

    def check_memory(self) -> None:
        """When idle: every token slot and every state slot is either free or held by the cache."""
        if self.has_work():
            return
        self.tree.check_integrity()
        free, cached = self.allocator.available_size(), self.cached_size()
        if free + cached != self.allocator.size or self.tree.protected_size():
            raise RuntimeError(
                f"KV accounting broken: free {free} + cached {cached} != {self.allocator.size} "
                f"(protected {self.tree.protected_size()})"
            )
        states = self.runner.memory.states
        if states.available_size() + self.tree.state_count != states.size:
            raise RuntimeError(f"state accounting broken: free {states.available_size()} + cached "
                               f"{self.tree.state_count} != {states.size}")

    # ---- admission ----------------------------------------------------------------------
    def _decode_reserve(self, extra: list[Req]) -> int:
        rem = sum(
            min(r.sampling.max_new_tokens - len(r.output_ids), DECODE_RESERVE_CLIP) for r in [*self.running, *extra]
        )
        return int(rem * DECODE_RESERVE_RATIO)

    def _match(self, req: Req) -> None:
        limit = req.prefix_match_limit()
        match = self.tree.match_snapshot if self.snapshots else self.tree.match_prefix
        res = match(req.fill_ids[:limit], req.extra_key)
        req.kv_indices, req.cache_protected_len, req.last_node = res.indices, res.indices.numel(), res.last_node
        self.tree.inc_lock_ref(res.last_node)
        if self.snapshots and res.last_node.state is not None:  # kept until admission copies it
            self.tree.lock_state(res.last_node)
            req.snapshot = res.last_node
        if self.inputs is not None:
            self.inputs.hold(req)

    def _running_state(self, req: Req) -> torch.Tensor:
        """An admitted request's running state: a copy of the snapshot its match ends at, else a
        zero state (make_room has made room for one)."""
        states, node = self.runner.memory.states, req.snapshot
        if node is None:
            return states.alloc(1)
        self.tree.unlock_state(node)
        req.snapshot = None
        return states.fork(node.state)

    def _snapshot(self, req: Req, node) -> None:
        """Keeps a copy of the request's running state on `node` (the end of the tokens it has
        consumed), evicting an older unlocked snapshot if the state pool is full; none when every
        state is in use."""
        if self.snapshots and req.state_slot is not None and node is not self.tree.root and self.tree.make_room(0, 1):
            self.tree.attach_state(node, self.runner.memory.states.fork(req.state_slot))

    def _order_waiting(self) -> list[Req]:
        if self.args.schedule_policy == "lpm" and len(self.waiting) <= 128:
            return sorted(self.waiting, key=lambda r: -self._peek_cached(r))
        return list(self.waiting)

    def _schedule_prefill(self) -> list[tuple[Req, int, torch.Tensor]]:
        budget = min(self.args.max_prefill_tokens, self.chunk_size)  # one prefill batch, all prompts together
        items: list[tuple[Req, int, torch.Tensor]] = []
        candidates = ([self.chunked] if self.chunked else []) + self._order_waiting()
        for req in candidates:
            continuing = req is self.chunked
            if not continuing and len(self.running) + len(items) >= self.args.max_running_requests:
                break
            if req.last_node is None:
                self._match(req)
            remaining = len(req.fill_ids) - req.kv_len
            # an encoder's input is read whole, in the request's first batch (alone when over the budget)
            encoder = self._encoder_tokens(req)
            take = min(remaining, budget - encoder if items else max(budget - encoder, 1))
            fresh = self.inputs.missing_slots(req) if self.inputs is not None else 0  # the input's, on a miss
            reserve = self._decode_reserve([r for r, _, _ in items] + [req])
            alone = not self.running and not items  # nothing else can free memory: admit without reserve
            states = 0 if continuing else self.states_per_request  # a chunk goes on with the state it has
            fits = take > 0 and (self.tree.make_room(take + fresh + reserve, states)
                                 or (alone and self.tree.make_room(take + fresh, states)))
            if not fits:
                if not continuing:
                    self._release(req, cache=False)
                break
            if fresh:
                self.inputs.alloc(req)
            slots = self.allocator.alloc(take)
            if states:
                req.state_slot = self._running_state(req)
            items.append((req, take, slots))
            if not continuing:
                self.waiting.remove(req)
                if not req.num_retractions:
                    req.cached_tokens = req.kv_len
                    if self.inputs is not None:
                        self.inputs.admitted(req)
            budget -= take + encoder
            if take < remaining:
                self.chunked = req
                break
            if continuing:
                self.chunked = None
        return items

    def _schedule_prefill_only(self) -> list[tuple[Req, int, torch.Tensor]]:
        """The next prefill-only request by the policy (Algorithm 1), or several packed up to
        --prefill-only-batch-tokens. Each keeps KV only for its cache_prefix_len leading tokens (as
        much as fits); the rest of its KV lives only while its layer runs (slot 0 = discarded)."""
        budget, total = self.args.prefill_only_batch_tokens, 0
        items: list[tuple[Req, int, torch.Tensor]] = []
        now = self.clock()
        while self.prefill_only:
            i = pick_prefill_only(self.prefill_only, self.prefill_only_policy, now, self._peek_cached,
                                  self.args.jct_fairness, self.jct)
            req = self.prefill_only[i]
            n = len(req.fill_ids)
            cost = n + self._encoder_tokens(req)
            if items and total + cost > budget:
                break
            states = self.states_per_request
            if states and not self.tree.make_room(0, states):  # waits for a running request's state
                break
            self.prefill_only.pop(i)
            self._match(req)
            fresh = self.inputs.missing_slots(req) if self.inputs is not None else 0
            if fresh:  # an encoder's input is kept while the decoder reads it: room for all of it, or wait
                if not self.tree.make_room(fresh):
                    self._release(req, cache=False)
                    self.prefill_only.insert(i, req)
                    break
                self.inputs.alloc(req)
            m = req.kv_len
            keep = max(m, min(n if req.cache_prefix_len is None else req.cache_prefix_len, n))
            if keep > m and not self.tree.make_room(keep - m):
                keep = m + self.allocator.available_size()  # keep what fits, discard the rest
            kept = self.allocator.alloc(keep - m)
            if states:
                req.state_slot = self._running_state(req)
            slots = torch.cat([kept, torch.zeros(n - keep, dtype=torch.int64, device=kept.device)])
            req.kv_keep, req.cached_tokens = keep, m
            if self.inputs is not None:
                self.inputs.admitted(req)
            items.append((req, n - m, slots))
            total += cost
        return items

    def _state_slots(self, reqs: list[Req]) -> list[torch.Tensor] | None:
        """The batch's state slots, one a request (a family with recurrent layers), else None."""
        return [req.state_slot for req in reqs] if self.states_per_request else None

    # ---- prefill ------------------------------------------------------------------------
    def _plan_rows(self, items: list[tuple[Req, int, torch.Tensor]]):
        """A prefill batch's tokens, sequences and the rows each request needs: (ids, positions,
        seqs, logit rows, one RowPlan a request, label rows: id(req) -> its last row, for the
        requests whose labels alone are scored, label_columns_only)."""
        ids, pos, seqs, rows, plans = [], [], [], [], []
        label_rows: dict[int, int] = {}
        for req, take, slots in items:
            start, fill = req.kv_len, req.fill_ids
            q_start = len(ids)
            ids += fill[start : start + take]
            pos += range(start, start + take)
            seqs.append(SeqLayout(q_start, take, torch.cat([req.kv_indices, slots])))
            final = start + take == len(fill)
            lp_from = self._input_logprob_from(req)
            first_row = max(lp_from, start) if lp_from is not None else None
            if final and first_row is None and self._labels_only(req):
                label_rows[id(req)] = q_start + take - 1
                plans.append(RowPlan(req, final))
                continue
            if final:  # the last position's distribution is always needed
                first_row = start + take - 1 if first_row is None else min(first_row, start + take - 1)
            if first_row is not None and first_row < start + take:
                plans.append(RowPlan(req, final, len(rows), first_row, start + take))
                rows += range(q_start + first_row - start, q_start + take)
            else:
                plans.append(RowPlan(req, final))
        return ids, pos, seqs, rows, plans, label_rows

    def _run_prefill(self, items: list[tuple[Req, int, torch.Tensor]]) -> list[Req]:
        ids, pos, seqs, rows, plans, label_rows = self._plan_rows(items)
        out_loc = torch.cat([s for _, _, s in items])
        reqs = [req for req, _, _ in items]
        if self.inputs is not None:
            self.inputs.encode(reqs)
        batch = self.runner.make_batch(ids, pos, out_loc, seqs, self._state_slots(reqs),
                                       encoder_slots=self._encoder_slots(reqs))
        hidden_of = self.runner.hidden_prefill_only if all(req.kv_keep is not None for req, _, _ in items) \
            else self.runner.hidden
        hidden = hidden_of(batch, rows + list(label_rows.values()))  # rows may be empty: a middle chunk only fills KV
        logits = self.runner.compute_logits(hidden[: len(rows)])
        label_hidden = dict(zip(label_rows, hidden[len(rows):]))

        progressed, to_sample, sample_rows = [], [], []
        for seq, plan in zip(seqs, plans):
            req = plan.req
            req.kv_indices = seq.kv_indices if req.kv_keep is None else seq.kv_indices[: req.kv_keep]
            if plan.row is not None and self._input_logprob_from(req) is not None:
                self._record_input_logprobs(req, logits[plan.row : plan.last_row + 1], plan.start)
            if req.kv_keep is None:
                self._cache_unfinished(req)
            if not plan.final:
                continue
            req.input_logprobs_done = True
            if req.sampling.max_new_tokens == 0 or len(req.output_ids) >= req.sampling.max_new_tokens:
                if id(req) in label_hidden:
                    self._record_label_distribution(req, label_hidden[id(req)])
                elif req.logprob.return_logprob and not req.output_ids:
                    self._record_next_token_distribution(req, logits[plan.last_row])
                req.finish_reason = {"type": "length", "length": req.sampling.max_new_tokens}
                self._release(req)
                progressed.append(req)
                continue
            to_sample.append(req)
            sample_rows.append(plan.last_row)
        if to_sample:
            self._sample_and_append(to_sample, logits[sample_rows])
            for req in to_sample:
                if not req.finished:
                    self.running.append(req)
            progressed += to_sample
        return progressed

    def _input_logprob_from(self, req: Req) -> int | None:
        """The prompt position from which the request's input logprobs are still to be recorded, or
        None (an encoder-decoder's input has none: the front refuses to ask)."""
        lp = req.logprob
        if lp.return_logprob and lp.logprob_start_len >= 0 and not req.input_logprobs_done and req.decoder_start is None:
            return lp.logprob_start_len
        return None

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor, p0: int) -> None:
        """logits[i] is the distribution after position p0 + i; entries cover tokens k..n-1."""
        k, n = req.logprob.logprob_start_len, len(req.input_ids)
        if k >= n:
            return
        if p0 == k:
            req.input_token_logprobs.append((None, req.input_ids[k]))
            req.input_top_logprobs.append(None)
            req.input_token_ids_logprobs.append(None)
        count = min(logits.shape[0], n - 1 - p0)
        if count <= 0:
            return
        logprobs = self._logprobs(logits[:count], [req] * count)
        targets = torch.tensor(req.input_ids[p0 + 1 : p0 + 1 + count], device=logprobs.device)
        vals = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        req.input_token_logprobs += list(zip(vals, targets.tolist()))
        self._record_extra_logprobs(req, logprobs, req.input_top_logprobs, req.input_token_ids_logprobs)

    def _record_next_token_distribution(self, req: Req, row: torch.Tensor) -> None:
        """Prefill-only requests: the distribution after the prompt (what scoring reads)."""
        logprobs = self._logprobs(row[None], [req])
        self._record_extra_logprobs(req, logprobs, req.output_top_logprobs, req.output_token_ids_logprobs)

    @staticmethod
    def _labels_only(req: Req) -> bool:
        """A prefill-only request that reads nothing of the distribution after its prompt but its
        token_ids_logprob, normalised over those (TokenizedGenerateReq.label_columns_only)."""
        lp = req.logprob
        return (lp.label_columns_only and lp.return_logprob and bool(lp.token_ids_logprob) and lp.top_logprobs_num == 0
                and req.sampling.max_new_tokens == 0)

    def _record_label_distribution(self, req: Req, hidden: torch.Tensor) -> None:
        """The logprobs of req's token_ids_logprob normalised over those ids, from the output layer's
        rows of those ids only: log_softmax over the labels of the full logprobs, within float32."""
        ids = req.logprob.token_ids_logprob
        cols = torch.tensor(ids, dtype=torch.int64, device=hidden.device)
        vals = self._logprobs(self.runner.compute_logits(hidden[None], cols), [req])[0].tolist()
        req.output_token_ids_logprobs.append(list(zip(vals, ids)))

    def _logprobs(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        temps = torch.tensor(
            [r.sampling.temperature if r.sampling.temperature >= GREEDY_EPS else 1.0 for r in reqs],
            device=logits.device,
        )
        return torch.log_softmax(logits / temps[:, None], dim=-1)

    @staticmethod
    def _record_extra_logprobs(req: Req, logprobs: torch.Tensor, top_out: list, ids_out: list) -> None:
        lp = req.logprob
        if lp.top_logprobs_num > 0:
            vals, idx = logprobs.topk(min(lp.top_logprobs_num, logprobs.shape[-1]), dim=-1)
            top_out += [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
        if lp.token_ids_logprob:
            ids = lp.token_ids_logprob
            vals = logprobs[:, ids].tolist()
            ids_out += [list(zip(v, ids)) for v in vals]

    # ---- decode -------------------------------------------------------------------------
    def _run_decode(self) -> list[Req]:
        while not self.tree.make_room(len(self.running)):
            if len(self.running) == 1:
                req = self.running.pop()
                self._finish_abort(req, "Out of KV cache memory", status_code=503)
                return [req]
            self._retract(self.running[-1])
        reqs = self.running
        slots = self.allocator.alloc(len(reqs))
        seqs, ids, pos = [], [], []
        for i, req in enumerate(reqs):
            ids.append(req.output_ids[-1])
            pos.append(req.kv_len)
            seqs.append(SeqLayout(i, 1, torch.cat([req.kv_indices, slots[i : i + 1]])))
        batch = self.runner.make_batch(ids, pos, slots, seqs, self._state_slots(reqs),
                                       encoder_slots=self._encoder_slots(reqs))
        logits = self.runner.forward(batch, list(range(len(reqs))))
        for req, seq in zip(reqs, seqs):
            req.kv_indices = seq.kv_indices
        self._sample_and_append(reqs, logits)
        self.running = [r for r in reqs if not r.finished]
        return list(reqs)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        result = self.sampler(logits, reqs)
        next_ids = result.next_ids.tolist()
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            req.output_ids.append(tok)
            if req.logprob.return_logprob:
                row = result.logprobs[i : i + 1]
                req.output_token_logprobs.append((float(row[0, tok]), tok))
                self._record_extra_logprobs(req, row, req.output_top_logprobs, req.output_token_ids_logprobs)
            req.check_finished()
            if req.finished:
                self._release(req)

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_retractions += 1
        self.waiting.insert(0, req)
        logger.info("retracted request %s", req.rid)

    # ---- KV ownership -------------------------------------------------------------------
    def _cache_unfinished(self, req: Req) -> None:
        """Moves the request's computed KV into the tree and re-locks its (longer) path."""
        if self.tree.disable:
            return
        n = req.kv_len
        res = self.tree.hand_off(req.fill_ids[:n], req.kv_indices, req.extra_key, req.cache_protected_len, req.last_node)
        req.kv_indices, req.cache_protected_len, req.last_node = res.indices, n, res.last_node
        self._snapshot(req, res.last_node)

    def _release(self, req: Req, cache: bool = True) -> None:
        """Drops the request's lock, its state slot and its KV: into the cache (cache=True and the
        tree is on; the state too, as the snapshot of what the KV covers, where it covers the
        tokens the state consumed), else back to the allocator. Slots the tree already holds stay
        with the tree."""
        if req.last_node is not None:
            key = req.fill_ids[: req.kv_len]
            if cache and not self.tree.disable:
                self.tree.insert_owned(key, req.kv_indices, req.extra_key, req.cache_protected_len)
                # a prefill-only request's state has read its whole prompt, its KV only what it keeps
                consumed = req.kv_keep is None or req.kv_keep == len(req.fill_ids)
                if self.snapshots and key and req.state_slot is not None and consumed:
                    self.tree.attach_state(self.tree.match_prefix(key, req.extra_key).last_node, req.state_slot)
                    req.state_slot = None
            else:
                self.allocator.free(req.kv_indices[req.cache_protected_len :])
            if req.snapshot is not None:  # matched, never admitted
                self.tree.unlock_state(req.snapshot)
                req.snapshot = None
            self.tree.dec_lock_ref(req.last_node)
            req.kv_indices, req.cache_protected_len, req.last_node = req.kv_indices[:0], 0, None
        if req.state_slot is not None:
            self.runner.memory.states.free(req.state_slot)
            req.state_slot = None
        if self.inputs is not None:
            self.inputs.release(req)

    def _finish_abort(self, req: Req, message: str, status_code: int = 400) -> None:
        self._release(req, cache=False)  # an aborted request's KV is not cached
        req.finish_reason = abort_reason(message, status_code)
