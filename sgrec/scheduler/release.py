"""Frees what a catalog commit replaced off the step's thread: an old trie at 10^7 items
is a few dozen arrays of 10-80 MB, and dropping them all at once held the step for 34-54 ms.

`Releaser.drop(garbage)` queues it; a daemon thread takes it apart (the objects' attributes, then
containers' elements) and drops one part at a time, giving up the GIL after each, so the step's
thread waits for at most one array's free at a time. Freeing still holds the GIL (numpy and torch
free under it): what moves is the waiting, from one block to several short ones between which the
step runs. Only the objects handed over are taken apart, not what their attributes point to beyond
containers, so nothing shared is walked (the new trie shares unchanged arrays with the old one: a
shared array only loses a reference)."""

from __future__ import annotations

import queue
import threading
import time


CONTAINERS = (list, tuple, set, frozenset, dict)


def _is_object(x) -> bool:
    """An object whose attributes can be taken (not an array or tensor, which free as one)."""
    return hasattr(x, "__dict__") and not hasattr(x, "__array_interface__") and type(x).__module__ != "torch"


def take_apart(box: list, pause=lambda: time.sleep(0)) -> int:
    """Drops the parts of what `box` (a one-element list) holds one at a time, pausing after each;
    returns how many were dropped. The box is emptied first: an argument passed directly would stay
    referenced from the caller's frame until the call returned, and nothing would be freed before.
    What it holds: an object or a container of objects; each such object's attributes are taken (one
    level), and every container met is emptied element by element. Nothing else may reference it."""
    todo, count = [(box.pop(), True)], 0
    while todo:
        x, own = todo.pop()
        if isinstance(x, CONTAINERS):
            todo.extend((e, own) for e in (x.values() if isinstance(x, dict) else x))
        elif own and _is_object(x):
            todo.extend((a, False) for a in vars(x).values())
        del x
        count += 1
        pause()
    return count


class Releaser:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = 0  # handed over, not yet dropped
        self._idle = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="catalog-release").start()

    def drop(self, garbage) -> None:
        with self._idle:
            self._busy += 1
        self._queue.put(garbage)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once everything handed over has been dropped."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def _run(self) -> None:
        while True:
            take_apart([self._queue.get()])  # the queue held the only reference
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
