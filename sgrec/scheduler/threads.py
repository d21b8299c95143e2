"""How many threads a scheduler's forward runs on: all of its threads, except while catalog
updates arrive, when it leaves `reserve` of them (keeping at least one) to the work an update brings
beside the steps: the HTTP process parsing and validating the bodies, the version's build on the
catalog-prepare thread, the update's clients. On a machine with few cores that work otherwise takes a
core from one of the forward's OpenMP threads, and a parallel region waits for the thread that lost
its core (docs/performance.md: on 2 cores the steps of update phases took 15% longer with 2 threads, 4% with 1).

Plain arithmetic over a clock, so it is tested without a server; the scheduler loop asks it before
every step and sets torch's intra-op threads when the answer changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

UPDATE_WINDOW_S = 2.0  # an update's reserve lasts this long after the last update message


def update_reserve(args, device_type: str) -> int:
    """The threads a scheduler leaves to update traffic: --catalog-update-cores on CPU; none on a GPU
    (the forward's CPU threads only launch kernels there) nor under --enable-deterministic-inference
    (its check of the linear layers' bits ran at the start-up thread count: sgrec.model.batch_invariant)."""
    if device_type != "cpu" or args.enable_deterministic_inference:
        return 0
    return args.catalog_update_cores


class ForwardThreads:
    def __init__(self, threads: int, reserve: int, window: float = UPDATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        if threads < 1 or reserve < 0:
            raise ValueError("threads must be at least 1 and reserve non-negative")
        self.threads, self.reserve, self.window, self.clock = threads, reserve, window, clock
        self.last_update: float | None = None

    def update_seen(self) -> None:
        """Catalog update traffic reached the scheduler: a request seen by the front (valid or not:
        io.CatalogTraffic), a version to build, a commit."""
        self.last_update = self.clock()

    def now(self) -> int:
        """The forward's threads for a step starting now."""
        if self.last_update is not None and self.clock() - self.last_update < self.window:
            return max(1, self.threads - self.reserve)
        return self.threads
