"""WorkPool (cllm/http/pool.py): blocking calls on threads of their own, dropped when their caller
leaves before a thread takes them, bounded by a deadline, answered at once when the pool closes.
No model needed."""
from __future__ import annotations

import asyncio
import threading

import pytest

from cllm.http.pool import Overdue, PoolClosed, WorkPool


async def _until_busy(pool: WorkPool) -> None:
    while not pool.busy:
        await asyncio.sleep(0.01)


def test_a_call_runs_on_a_thread_of_the_pool():
    pool = WorkPool(1, "cllm-test")
    try:
        assert asyncio.run(pool.run(lambda: threading.current_thread().name)).startswith(
            "cllm-test")
    finally:
        pool.close()


def test_a_call_whose_caller_left_before_its_turn_never_runs():
    pool, gate, ran = WorkPool(1, "cllm-test"), threading.Event(), []

    async def main():
        running = asyncio.ensure_future(pool.run(gate.wait))
        queued = asyncio.ensure_future(pool.run(ran.append, "left"))
        await _until_busy(pool)
        queued.cancel()  # its client left
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        await running
        await pool.run(ran.append, "next")

    try:
        asyncio.run(main())
    finally:
        pool.close()
    assert ran == ["next"]


def test_a_call_past_its_deadline_is_overdue_and_finishes_on_its_thread():
    pool, gate = WorkPool(1, "cllm-test"), threading.Event()

    async def main():
        with pytest.raises(Overdue):
            await pool.run(gate.wait, timeout=0.05)
        assert pool.busy  # C work cannot be interrupted: it runs on, its result dropped
        gate.set()
        while pool.busy:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        pool.close()


def test_closing_answers_every_waiting_call_at_once_and_refuses_new_ones():
    pool, gate, ran = WorkPool(1, "cllm-test"), threading.Event(), []

    async def main():
        calls = [asyncio.ensure_future(pool.run(gate.wait)),
                 asyncio.ensure_future(pool.run(ran.append, "queued"))]
        await _until_busy(pool)
        pool.close()
        for call in calls:
            with pytest.raises(PoolClosed):
                await call
        with pytest.raises(PoolClosed):
            await pool.run(ran.append, "after")

    try:
        asyncio.run(main())
    finally:
        gate.set()
        pool.close()
    assert ran == []
