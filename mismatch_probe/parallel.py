"""Work on every core, results in a fixed order: ``ordered_map``.

A stage that splits its input into a fixed sequence of pieces (a store's batches of whole
sequences, an export's rank files) computes each piece on a pool of threads and consumes the
results in the pieces' order, never more than ``ahead`` pieces in flight (memory stays a few
pieces, whatever the input's size). Because the pieces and their order do not depend on the
number of workers, neither does any result combined from them in that order. The heavy kernels
(numpy, Arrow, the JSON parser) release the GIL, so threads share the cores without copies.

This module knows nothing of what the pieces are.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

A = TypeVar("A")
T = TypeVar("T")
WORKERS_ENV = "MISMATCH_PROBE_WORKERS"  # the number of workers, where set (1: all serial)


def workers() -> int:
    """The workers to use: ``MISMATCH_PROBE_WORKERS`` where set, else the cores this process
    may run on."""
    given = os.environ.get(WORKERS_ENV, "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def ordered_map(
    fn: Callable[[A], T],
    items: Iterable[A],
    width: int | None = None,
    ahead: int | None = None,
    cost: Callable[[A], int] | None = None,
    budget: int | None = None,
) -> Iterator[T]:
    """``fn(item)`` for each item, in the items' order, on ``width`` threads (default
    ``workers()``; 1 runs in the caller's thread), at most ``ahead`` (default ``2 * width``)
    items in flight, and (with ``cost`` and ``budget``) no new item started while those in
    flight cost ``budget`` or more together. An exception is raised when its item's turn comes;
    the items after it are cancelled or waited for."""
    width = workers() if width is None else max(1, width)
    if width == 1:
        yield from map(fn, items)
        return
    limit = ahead or 2 * width
    window: deque[tuple[Future[T], int]] = deque()
    held = 0  # the cost of the items in flight
    pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="probe-worker")
    try:
        for item in items:
            price = cost(item) if cost is not None else 0
            window.append((pool.submit(fn, item), price))
            held += price
            while window and (len(window) >= limit or (budget is not None and held >= budget)):
                future, price = window.popleft()
                held -= price
                yield future.result()
        while window:
            yield window.popleft()[0].result()
    finally:
        for future, _ in window:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
