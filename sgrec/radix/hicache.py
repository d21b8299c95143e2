"""The radix tree's lower tiers (--enable-hierarchical-cache): a node that leaves the KV pool goes
down to the host tier instead of vanishing, a match that reaches past the pool loads pages back from
the host tier, and a storage backend (shared by servers) sits below the host tier.

Write policies (SGLang's names) decide when a page is written down early:
- write_through: every page, when the tree takes it (the storage tier too, off the step);
- write_through_selective: a page when its node is hit for the second time (SGLang's threshold), or
  when the tree takes it if the eviction policy's predictor (laru, fpb, hf) expects it to be used
  again within its horizon;
- write_back: nothing early.
Whatever the policy, a node the tree evicts is written to the host tier first, and a page the host
tier pushes out is written to storage if it is not there yet. A policy that guesses wrong (writes
too little early) therefore costs a copy at eviction, never a lost page: the same rule that keeps
LARU within a bound of LRU (its LRU fallback) keeps selective writing within write_back's hits.

Loads from the host tier are copies of pool rows (bit for bit) done in the match that needs them.
Reads from storage never run on the step: `prefetch` starts them when a request arrives, in a
thread, into the host tier; the scheduler holds the request back while its prefetch runs (policy
`timeout` or `wait_complete`), or not at all (`best_effort`). A failing storage tier (an error, a
missing or corrupt object, a timeout) only costs a recompute.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sgrec.mem.cost import LinearCost
from sgrec.mem.kv_pool import KVPool
from sgrec.mem.tiers import (
    FileStorage, HostTier, Page, StateSnapshot, TierStats, decode, encode, page_keys, read_pages, snapshot_key,
)
from sgrec.radix.node import TreeNode
from sgrec.radix.predictor import UNKNOWN

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_BACKOFF_S = 2.0  # after a storage error, reads and writes skip the storage tier this long
STORAGE_STALL_S = 2.0  # a read in flight this long sets the storage tier aside as an error does
ISA_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"})
READERS = 4  # storage reads in flight for one prefetch (a backend without batch reads of its own)
WRITE_BATCH = 64  # pages written down in one batch call
ITEM_READ_ALPHA = 0.2  # weight of the newest storage read in the item read cost's fit
SELECTIVE_HITS = 2  # write_through_selective writes a node down at its second hit
WRITE_QUEUE = 4096  # pages waiting for the storage writer; beyond that a write is dropped (counted)


def model_fingerprint(weights: dict[str, torch.Tensor], kv_dtype: torch.dtype, extra: str = "") -> str:
    """Names the KV a model computes from its weights (ModelRunner.weights): every tensor's name,
    shape, dtype and leading bytes, and the KV dtype. Servers with the same weights get the same name
    on any machine; other weights (even of the same shape) get another, so their pages never mix."""
    h = hashlib.blake2b(f"{kv_dtype}\0{extra}".encode(), digest_size=16)
    for name, p in weights.items():
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        head = p.detach().reshape(-1)[:1024].cpu().contiguous()
        h.update(head.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def predicted_reuse(policy) -> Callable[[TreeNode], bool | None] | None:
    """For an eviction policy with a next-access predictor: node -> whether its next access is
    predicted within the predictor's reuse horizon (None while the predictor has no model)."""
    predictor = getattr(policy, "predictor", None)
    if predictor is None:
        return None

    def reuse(node: TreeNode) -> bool | None:
        horizon = predictor.reuse_horizon()
        t = predictor.predict(predictor.snapshot([node], [policy.key(node)]))[0]
        if horizon is None or not t > UNKNOWN:
            return None
        return t - node.last_access_time < horizon

    return reuse


def machine_kind(device: torch.device) -> str:
    """What else decides the KV's bits besides the weights: the device type, the CPU's vector ISA
    (the kernels and GEMMs differ by it) and torch's version. Servers of another kind get another
    namespace, so a load always equals what a local recompute would give."""
    kind = f"{device.type} torch {torch.__version__}"
    if device.type == "cpu":
        from sgrec.model.cpu_caps import cpu_flags

        kind += " " + " ".join(sorted(f for f in cpu_flags() if f in ISA_FLAGS))
    return kind


def path_of(node: TreeNode) -> tuple[list[int], torch.Tensor]:
    """Tokens and KV slots from the root down to node's end."""
    keys, values = [], []
    while node.parent is not None:
        keys.append(node.key)
        values.append(node.value)
        node = node.parent
    tokens = [t for k in reversed(keys) for t in k]
    return tokens, torch.cat(values[::-1]) if values else torch.empty(0, dtype=torch.int64)


@dataclass
class LoadPlan:
    """Rows to load back: tokens up to `end`, their K and V ([layers, tokens, heads, dim]), the pages'
    keys, and how many of the tokens a storage prefetch brought up."""

    end: int
    k: torch.Tensor
    v: torch.Tensor
    keys: list[str]
    from_storage: int


class HiCache:
    def __init__(self, pool: KVPool, namespace: str, host_pages: int, page_size: int,
                 write_policy: str = "write_through", storage=None, prefetch_policy: str = "timeout",
                 timeout_base: float = 1.0, timeout_per_ki_token: float = 0.25, item_reads: str = "cost"):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy must be one of {', '.join(PREFETCH_POLICIES)}, "
                             f"got {prefetch_policy!r}")
        if page_size < 1:
            raise ValueError(f"--hicache-page-size must be positive, got {page_size}")
        self.pool, self.namespace, self.page_size = pool, namespace, page_size
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self.timeout_base, self.timeout_per_ki_token = timeout_base, timeout_per_ki_token
        self.host = HostTier(host_pages)
        # write_through_selective with a learned eviction policy (laru, fpb, hf): its predictor says at
        # insert whether a node will be used again (predicted_reuse); it is then written early
        self.reuse: Callable[[TreeNode], bool | None] | None = None
        self.storage = storage
        self.storage_stats = TierStats()
        self._down_until = 0.0  # storage failed: skipped until then (a recompute, never a wait)
        self._reading: dict[object, float] = {}  # reads in flight -> when each started
        self._stalled: set[object] = set()  # reads in flight counted as timed out
        self._calling: dict[object, float | None] = {}  # storage calls in flight (reads and writes)
        self.loaded_tokens = {"host": 0, "storage": 0}  # tokens loaded back into the pool, by the tier they came from
        # BAT item KV (rank): tokens written down, taken from the tiers, and not read from storage
        # because recomputing them was cheaper (see RankExecutor.stored_items)
        self.item_tokens = {"stored": 0, "loaded": 0, "not_read": 0}
        self.item_read = LinearCost(ITEM_READ_ALPHA)  # what a storage read of item KV takes: fixed + per token
        self.item_reads = item_reads  # "cost": only where reading beats recomputing; "always"
        self._from_storage: set[str] = set()  # host pages that a prefetch brought up (not yet loaded)
        self._shape = (pool.num_layers, *pool.k_buffer[0].shape[1:])  # layers, heads, head dim
        self._dtype = pool.dtype
        self._like = self.like(page_size)
        self._upload_stream = None  # on a GPU: the stream loads copy on (made at the first)
        self._writes: queue.Queue | None = None
        self._fetcher: ThreadPoolExecutor | None = None
        # a recurrent family's state snapshots (keep_states): the StatePool they come from, and the
        # host tier's snapshots by anchor (where each one's tail starts) -> {key: tail tokens}
        self.states = None
        self._snapshots: dict[str, dict[str, tuple[int, ...]]] = {}
        self.snapshot_counts = {"saved": 0, "loaded": 0}
        if storage is not None:
            self._writes = queue.Queue(WRITE_QUEUE)
            threading.Thread(target=self._write_loop, name="hicache-writer", daemon=True).start()
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="hicache-prefetch")
            self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="hicache-read")

    # ---- the tree's hooks -------------------------------------------------------------------
    def on_insert(self, node: TreeNode) -> None:
        if self.write_policy == "write_through" or (
                self.write_policy == "write_through_selective" and self.reuse is not None and self.reuse(node)):
            self._save(node, through=True)

    def on_hit(self, node: TreeNode) -> None:
        if self.write_policy == "write_through_selective" and node.access_count == SELECTIVE_HITS:
            self._save(node, through=True)

    def on_evict(self, node: TreeNode) -> None:
        """node (still linked to its parent) leaves the pool: its pages go down to the host tier, and
        its state snapshot with them."""
        self._save(node, through=False)
        self.save_snapshot(node)

    def reset(self) -> None:
        self.host.clear()
        self._snapshots.clear()

    def _save(self, node: TreeNode, through: bool) -> None:
        """Writes the full pages that end inside node's edge and are not in the host tier yet."""
        P, depth = self.page_size, node.depth
        first, last = (depth - len(node.key)) // P, depth // P  # pages first .. last-1 end inside the edge
        if last <= first:
            return
        tokens, slots = path_of(node)
        keys = page_keys(self.namespace, node.extra_key, tokens, P)
        todo = [k for k in range(first, last) if keys[k] not in self.host]
        if not todo:
            return
        rows = torch.cat([slots[k * P : (k + 1) * P] for k in todo])
        for k, page in zip(todo, read_pages(self.pool, rows, P)):
            self._host_put(keys[k], page, through)

    def _host_put(self, key: str, page: Page, through: bool, weight: int = 1) -> None:
        pushed = self.host.put(key, page, weight)
        for k, p in pushed:
            if isinstance(p, StateSnapshot):  # gone: the host tier keeps snapshots, storage does not
                self._unindex(k, p)
        if self._writes is None:
            return
        if through:
            self._write(key, page)
        for k, p in pushed:  # leaving the host tier: down to storage unless it is there
            if isinstance(p, Page):
                self._from_storage.discard(k)
                self._write(k, p)

    # ---- state snapshots (a recurrent family: keep_states) ------------------------------------
    def keep_states(self, states) -> None:
        """Snapshots go down with their nodes and come back with their prefixes (match_snapshot):
        `states` is the StatePool their slots belong to."""
        self.states = states

    def save_snapshot(self, node: TreeNode) -> None:
        """node's state snapshot (if it has one) into the host tier, with the KV of its prefix's
        tokens past the last full page; it weighs its bytes in pages."""
        if self.states is None or node.state is None:
            return
        tokens, slots = path_of(node)
        key = snapshot_key(self.namespace, node.extra_key, tokens)
        if key in self.host:
            return
        P = self.page_size
        base = len(tokens) // P * P
        anchor = self._anchor(node.extra_key, tokens, base)
        if base < len(tokens):
            k, v = self.pool.read_rows(slots[base:])
        else:
            k, v = (self._like.k[:, :0], self._like.v[:, :0])
        snap = StateSnapshot(self.states.read(node.state), k, v, tuple(tokens[base:]), anchor)
        self._snapshots.setdefault(anchor, {})[key] = snap.tail
        self.snapshot_counts["saved"] += 1
        self._host_put(key, snap, through=False, weight=-(-snap.nbytes // self._like.nbytes))
        if key not in self.host:  # heavier than the whole tier
            self._unindex(key, snap)

    def load_snapshot(self, slots: torch.Tensor | None, state: torch.Tensor, snap: StateSnapshot) -> None:
        """A snapshot back into the pool: the last len(slots) tokens of its tail into `slots` (the
        ones before are in the pool already), its state into the state slot `state`."""
        if slots is not None:
            n = len(slots)
            self.write_rows(slots, snap.k[:, len(snap.tail) - n:], snap.v[:, len(snap.tail) - n:])
            self.loaded_tokens["host"] += n
        self.states.write_(state, snap.state)
        self.snapshot_counts["loaded"] += 1

    def _anchor(self, extra_key: str | None, tokens: list[int], base: int) -> str:
        """Where a tail starting at `base` hangs: the key of the page ending there, or the root."""
        if base == 0:
            return f"{self.namespace}\0{extra_key!r}\0root"
        return page_keys(self.namespace, extra_key, tokens[:base], self.page_size)[-1]

    def _unindex(self, key: str, snap: StateSnapshot) -> None:
        tails = self._snapshots.get(snap.anchor)
        if tails is not None:
            tails.pop(key, None)
            if not tails:
                del self._snapshots[snap.anchor]

    def plan_snapshot(self, key: list[int], extra_key: str | None, reach: int, floor: int
                      ) -> tuple[int, StateSnapshot] | None:
        """The deepest snapshot of the host tier on `key` past depth `floor` whose tail starts
        within `reach` (the tokens the pool holds): (its depth, the snapshot), or None."""
        if not self._snapshots:
            return None
        P = self.page_size
        anchors = [self._anchor(extra_key, key, 0),
                   *page_keys(self.namespace, extra_key, key[: reach // P * P], P)]
        best = None
        for j, anchor in enumerate(anchors):
            base = j * P
            for skey, tail in self._snapshots.get(anchor, {}).items():
                d = base + len(tail)
                if floor < d <= len(key) and (best is None or d > best[0]) and tuple(key[base:d]) == tail:
                    best = (d, skey)
        if best is None:
            return None
        snap = self.host.get(best[1])
        return None if snap is None else (best[0], snap)

    # ---- loading back -----------------------------------------------------------------------
    def plan_load(self, key: list[int], extra_key: str | None, start: int) -> LoadPlan | None:
        """The host tier's pages continuing key past `start` (tokens the pool holds), or None when
        the next page is not in the host tier."""
        P = self.page_size
        if (start // P + 1) * P > len(key):
            return None
        keys = page_keys(self.namespace, extra_key, key, P)
        pages, k0 = [], start // P
        for k in range(k0, len(keys)):
            page = self.host.get(keys[k])
            if page is None:
                break
            pages.append((keys[k], page))
        if not pages:
            return None
        off = start - k0 * P
        k = torch.cat([p.k for _, p in pages], dim=1)[:, off:]
        v = torch.cat([p.v for _, p in pages], dim=1)[:, off:]
        stored = sum(P - (off if i == 0 else 0) for i, (name, _) in enumerate(pages) if name in self._from_storage)
        return LoadPlan((k0 + len(pages)) * P, k, v, [name for name, _ in pages], stored)

    def load(self, slots: torch.Tensor, plan: LoadPlan) -> None:
        """Copies the plan's rows into `slots` (as many as the plan has tokens past its start)."""
        self.write_rows(slots, plan.k, plan.v)
        self._from_storage.difference_update(plan.keys)
        self.loaded_tokens["storage"] += plan.from_storage
        self.loaded_tokens["host"] += len(slots) - plan.from_storage

    def write_rows(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Host rows from a tier into the pool's `slots` (KVPool.write_rows). On a GPU the
        host-to-device copy runs on a stream of its own (`_upload`), so loading never waits for the
        step the GPU is still running."""
        if self.pool.device.type == "cuda":
            k, v = self._upload(k, v)
        self.pool.write_rows(slots, k, v)

    def _upload(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host rows on the pool's GPU without the host waiting for the copy: staged in pinned memory
        and copied on a stream of their own, which the current stream waits for on the device before
        anything reads them. A copy from pageable memory on the current stream would wait for every
        kernel queued before it (the step still running) and hold the host meanwhile; this one
        overlaps them (SGLang's HiCache loads on a stream of its own too). The pinned buffers go back
        to torch's caching host allocator, which reuses them only once their copies are done."""
        dev = self.pool.device
        if self._upload_stream is None:
            self._upload_stream = torch.cuda.Stream(dev)
        pinned = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x) for x in (k, v)]
        current = torch.cuda.current_stream(dev)
        with torch.cuda.stream(self._upload_stream):
            out = [x.to(dev, non_blocking=True) for x in pinned]
        current.wait_stream(self._upload_stream)
        for x in out:
            x.record_stream(current)  # made on the upload stream, used on this one
        return out[0], out[1]

    def like(self, tokens: int) -> Page:
        """An empty page of `tokens` rows: the shape and dtype a stored object must have."""
        L, H, D = self._shape
        return Page(torch.empty(L, tokens, H, D, dtype=self._dtype), torch.empty(L, tokens, H, D, dtype=self._dtype))

    # ---- BAT's item KV ----------------------------------------------------------------------
    def save_item(self, key: str, slots: torch.Tensor) -> None:
        """An item's freshly computed KV (at `slots`): into the host tier and through to storage."""
        if key in self.host:
            return
        self._host_put(key, read_pages(self.pool, slots, len(slots))[0], through=True)
        self.item_tokens["stored"] += len(slots)

    def has_item(self, key: str) -> bool:
        """Whether an item's KV is in the host tier (a rank request's prefetch brought it up)."""
        return key in self.host

    def item(self, key: str) -> Page | None:
        """An item's KV from the host tier (where prefetch_items put what storage had), or None."""
        page = self.host.get(key)
        if page is not None:
            self._from_storage.discard(key)
            self.item_tokens["loaded"] += page.k.shape[1]
        return page

    def prefetch_items(self, wanted: list[tuple[str, int]]) -> Future | None:
        """Starts reading these items' KV ((key, tokens)) from storage into the host tier, each on
        its own (a missing one does not stop the others); None when there is nothing to read."""
        wanted = [(k, n) for k, n in wanted if k not in self.host]
        if self._fetcher is None or not wanted or not self.storage_up():
            return None
        return self._fetcher.submit(self._fetch_items, [k for k, _ in wanted], [n for _, n in wanted])

    def _fetch_items(self, keys: list[str], sizes: list[int]) -> int:
        """_fetch of items, timed: item_read fits the seconds a prefetch of item KV takes to the tokens
        asked for (what the rank executor weighs against recomputing them)."""
        t = time.perf_counter()
        try:
            return self._fetch(keys, sizes)
        finally:
            self.item_read.observe(sum(sizes), time.perf_counter() - t)

    # ---- the storage tier -------------------------------------------------------------------
    def prefetch(self, key: list[int], extra_key: str | None, cached: int) -> Future | None:
        """Starts reading, from storage into the host tier, the pages of key past `cached` tokens
        that the host tier lacks; None when there is nothing to read (or no storage tier)."""
        if self._fetcher is None or not self.storage_up():
            return None
        P = self.page_size
        keys = page_keys(self.namespace, extra_key, key, P)[cached // P :]
        while keys and keys[0] in self.host:
            keys = keys[1:]
        if not keys:
            return None
        return self._fetcher.submit(self._fetch, keys)

    def timeout(self, tokens: int) -> float:
        return self.timeout_base + self.timeout_per_ki_token * tokens / 1024

    def _read(self, keys: list[str]) -> list:
        """Objects from storage (one batch call): per key its bytes, None when missing, or the
        exception that the read raised (at once while the storage tier is set aside after an error)."""
        if not self.storage_up():
            return [OSError("the storage tier is set aside after an error")] * len(keys)
        token = object()
        self._reading[token] = self._calling[token] = time.monotonic()
        try:
            return self.storage.get_many(keys)
        except Exception as e:  # noqa: BLE001 - any storage failure costs a recompute
            return [e] * len(keys)
        finally:
            del self._reading[token], self._calling[token]
            self._stalled.discard(token)

    def _fetch(self, keys: list[str], sizes: list[int] | None = None) -> int:
        """Reads the objects into the host tier (in one batch call, or READERS of them at once where
        the backend reads one object at a time): consecutive pages up to the first that is missing,
        corrupt or unreadable, or, given `sizes`, each item of that many tokens on its own. Returns
        the objects now in the host tier."""
        chained = sizes is None
        todo = [i for i, k in enumerate(keys) if k not in self.host]
        names = [keys[i] for i in todo]
        got = {}
        if names and self.storage_up():
            step = -(-len(names) // READERS) if self.storage.parallel_reads else len(names)
            chunks = [names[j : j + step] for j in range(0, len(names), step)]
            got = dict(zip(todo, (d for part in self._readers.map(self._read, chunks) for d in part)))
        n = 0
        for i, key in enumerate(keys):
            if i not in todo:
                n += 1
                continue
            data = got.get(i)
            if isinstance(data, Exception):
                self._storage_failed("read", key, data)
                return n
            page = None if data is None else decode(data, self._like if chained else self.like(sizes[i]))
            if data is None:
                self.storage_stats.misses += 1
            elif page is None:
                self.storage_stats.failures += 1
                logger.warning("hicache storage object %s is corrupt; it is recomputed and written again", key)
                try:
                    self.storage.remove(key)
                except Exception:  # noqa: BLE001 - still counted; the next write replaces it
                    pass
            if page is None:
                if chained:
                    return n
                continue
            self.storage_stats.hits += 1
            self.storage_stats.bytes_read += len(data)
            self._from_storage.add(key)
            self._host_put(key, page, through=False)
            n += 1
        return n

    def _write(self, key: str, page: Page) -> None:
        try:
            self._writes.put_nowait((key, page))
        except queue.Full:
            self._count("dropped_writes")

    def _count(self, what: str, n: int = 1) -> None:
        self.storage_stats.extra[what] = self.storage_stats.extra.get(what, 0) + n

    def storage_up(self) -> bool:
        """False for a while after a storage error, and while a read has taken longer than
        STORAGE_STALL_S (a master gone quiet; counted as a failure): requests then stop waiting."""
        now = time.monotonic()
        for token, t in list(self._reading.items()):
            if now - t > STORAGE_STALL_S and token not in self._stalled:  # a timeout: counted as a failure
                self._stalled.add(token)
                self._storage_failed("read", "(in flight)", TimeoutError(f"no answer in {STORAGE_STALL_S} s"))
        return now >= self._down_until

    def _storage_failed(self, op: str, key: str, e: Exception) -> None:
        self.storage_stats.failures += 1
        self._down_until = time.monotonic() + STORAGE_BACKOFF_S
        logger.warning("hicache storage %s of %s failed (%s); the storage tier is skipped for %.0f s",
                       op, key, e, STORAGE_BACKOFF_S)

    def _write_loop(self) -> None:
        """Writes queued pages down, up to WRITE_BATCH at a time: which are stored already (one batch
        call), then the others, encoded, in one more."""
        while True:
            batch = [self._writes.get()]
            while len(batch) < WRITE_BATCH:
                try:
                    batch.append(self._writes.get_nowait())
                except queue.Empty:
                    break
            token = object()
            self._calling[token] = None
            try:
                if not self.storage_up():
                    self._count("dropped_writes", len(batch))
                    continue
                stored = self.storage.exists_many([k for k, _ in batch])
                todo = [(k, encode(page)) for (k, page), there in zip(batch, stored) if not there]
                for (key, data), err in zip(todo, self.storage.put_many(todo)):
                    if err is not None:
                        self._storage_failed("write", key, err)
                        break
                    self.storage_stats.writes += 1
                    self.storage_stats.bytes_written += len(data)
            except Exception as e:  # noqa: BLE001 - a lost write costs a later recompute
                self._storage_failed("write", batch[0][0], e)
            finally:
                del self._calling[token]
                for _ in batch:
                    self._writes.task_done()

    def close(self, wait_s: float = 5.0) -> None:
        """Stops using the storage tier (pending writes are dropped) and closes its client once no
        call is in flight (within wait_s; a call stuck on a dead master leaves the client open:
        closing it under the call would crash the process)."""
        if self.storage is None:
            return
        self._down_until = float("inf")
        deadline = time.monotonic() + wait_s
        while self._calling and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._calling:
            logger.warning("hicache: a storage call is still in flight; the storage client is left open")
        else:
            self.storage.close()

    def flush(self) -> None:
        """Waits until every queued storage write has been done (or has failed)."""
        if self._writes is not None:
            self._writes.join()

    def pending_writes(self) -> int:
        return 0 if self._writes is None else self._writes.unfinished_tasks

    def stats(self) -> dict:
        out = {"as_of": time.time(),  # when these counters were read (the server reports them every 0.5 s)
               "page_size": self.page_size, "write_policy": self.write_policy,
               "loaded_tokens": dict(self.loaded_tokens), "item_tokens": dict(self.item_tokens),
               "item_read": self.item_read.as_dict(),  # storage reads of item KV: fixed + per-token seconds
               "host": self.host.stats.as_dict() | {"pages": len(self.host), "used_pages": self.host.used,
                                                    "capacity_pages": self.host.capacity}}
        if self.states is not None:
            out["snapshots"] = self.snapshot_counts | {"held": sum(len(t) for t in self._snapshots.values())}
        if self.storage is not None:
            out["storage"] = self.storage_stats.as_dict() | {"backend": self.storage.name,
                                                             "pending_writes": self.pending_writes()}
        return out


def make_storage(backend: str | None, extra: dict):
    if backend is None:
        return None
    if backend == "file":
        import os

        path = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or extra.get("file_storage_path") or "/tmp/hicache"
        return FileStorage(path)
    if backend == "mooncake":
        from sgrec.mem.mooncake import MooncakeStorage

        return MooncakeStorage(extra)
    raise ValueError(f"--hicache-storage-backend {backend!r} is not supported (choose file or mooncake)")


def host_pages(pool_tokens: int, page_bytes: int, page_size: int, ratio: float | None, size_gb: int,
               available: int | None = None) -> int:
    """Pages of the host tier: --hicache-size GB when given, else --hicache-ratio (2.0) times the pool.
    ValueError naming the flag when that does not fit the memory available (or holds no page)."""
    import os

    want = size_gb * 10**9 // page_bytes if size_gb > 0 else int((ratio or 2.0) * pool_tokens) // page_size
    flag = "--hicache-size" if size_gb > 0 else "--hicache-ratio"
    if want < 1:
        raise ValueError(f"{flag} leaves the host tier less than one page ({page_bytes} bytes)")
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if want * page_bytes > available:
        raise ValueError(f"{flag}: the host tier needs {want * page_bytes / 1e9:.2f} GB but "
                         f"{available / 1e9:.2f} GB of memory is available")
    return want


def make_hicache(args, memory, weights: dict[str, torch.Tensor]) -> HiCache | None:
    """The tiers the server arguments ask for (None without --enable-hierarchical-cache), over a
    runner's memory (mem.memory.Memory: its KV pool and bytes per token); `weights` name the KV
    (model_fingerprint)."""
    if not args.enable_hierarchical_cache:
        return None
    extra = args.hicache_extra_config()
    P = args.hicache_page_size
    pool, page_bytes = memory.kv, memory.bytes_per_token * P
    pages = host_pages(pool.size, page_bytes, P, args.hicache_ratio, args.hicache_size)
    return HiCache(pool, model_fingerprint(weights, pool.dtype, machine_kind(pool.device)), pages, P, args.hicache_write_policy,
                   make_storage(args.hicache_storage_backend, extra), args.hicache_storage_prefetch_policy,
                   extra.get("prefetch_timeout_base", 1.0), extra.get("prefetch_timeout_per_ki_token", 0.25),
                   extra.get("item_reads", "cost"))
