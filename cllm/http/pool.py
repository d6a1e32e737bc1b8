"""Blocking work of requests on threads of its own kind (tokenizing client text, rendering chat
templates), bounded: a call waits with a deadline, a call whose client left before a thread took
it never runs, and closing the pool (the server stopping) answers every waiting call at once."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor


class PoolClosed(Exception):
    """The pool was closed: the server is stopping."""


class Overdue(Exception):
    """A call did not end within its deadline, its wait for a thread included."""


class WorkPool(ThreadPoolExecutor):
    """A thread pool whose calls requests await with `run`. Work that runs in C cannot be
    interrupted: a call its request gave up on (deadline, client gone, pool closed) finishes on
    its thread and its result is dropped; `busy` says whether any call still runs."""

    def __init__(self, workers: int, name: str) -> None:
        super().__init__(workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._closed = False
        self._waiters: set[asyncio.Future] = set()  # one a waiting call, woken by close()
        self._running = 0

    async def run(self, fn, *args, timeout: float | None = None):
        """fn(*args) on one of the pool's threads. Raises PoolClosed once the pool closes (at
        once, even while the call runs on), Overdue past `timeout` seconds. A call whose caller
        is cancelled (its client left) before a thread takes it never runs."""
        loop = asyncio.get_running_loop()
        closing = loop.create_future()
        with self._lock:  # close() marks the pool closed before it shuts the executor down
            if self._closed:
                raise PoolClosed()
            call = self.submit(self._counted, fn, args)
            self._waiters.add(closing)
        work = asyncio.wrap_future(call)
        try:
            done, _ = await asyncio.wait((work, closing), timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            with self._lock:
                self._waiters.discard(closing)
            call.cancel()  # not started: now it never will (at once, not a loop turn later)
            work.cancel()  # running: its result is dropped
        if work in done and not work.cancelled():
            return work.result()
        if self._closed:  # its queued work may have been dropped before `closing` woke
            raise PoolClosed()
        raise Overdue()

    @property
    def busy(self) -> bool:
        """Whether a call is running on one of the threads."""
        with self._lock:
            return self._running > 0

    def close(self, wait: bool = False) -> None:
        """Answer every waiting call with PoolClosed and drop the queued ones; idempotent,
        from any thread; with `wait`, return once the threads have ended."""
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            waiter.get_loop().call_soon_threadsafe(_wake, waiter)
        self.shutdown(wait=wait, cancel_futures=True)

    def _counted(self, fn, args):
        with self._lock:
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running -= 1


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
