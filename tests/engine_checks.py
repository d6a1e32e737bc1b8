"""Helpers the engine's tests share: one request run to its end, the idle engine's KV accounting
checked against llama.cpp's, a context that fails on demand, and a step-timer call."""
from array import array

import pytest

from cllm.config import SamplingParams
from cllm.llama import _core


def assert_idle(engine):
    """Nothing runs and what is left is the prefix cache, counted alike by the scheduler and by
    llama.cpp. Only call it with the engine thread idle: a unified cache is probed."""
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert not any(slot.live for slot in engine.scheduler.cache.slots)
    used = llama_cells_used(engine)  # first: probing may evict a cached prefix
    assert engine.scheduler.kv_used == engine.cached_cells == used



def llama_cells_used(engine):
    """The KV cells llama.cpp holds. Split streams share no cell, so its count per sequence is
    exact. A unified pool is measured by what fits: with the scheduler's count right, exactly
    the free cells take a batch of an unused seq id, and one more token finds no room."""
    ctx = engine.ctx
    if not engine.kv_unified:
        return ctx.kv_cells_used()
    cache = engine.scheduler.cache
    empty = [slot for slot in cache.slots if not slot.runs]
    if not empty:  # every slot holds a prefix: evict one, as the scheduler would
        empty = cache.eviction_order()[:1]
        cache.evict(empty[0])
        ctx.remove_sequence(empty[0].id)
    probe = empty[0].id
    free = ctx.n_ctx - engine.scheduler.kv_used
    fed = 0
    while fed < free:
        n = min(ctx.n_batch, free - fed)
        ctx.step(array("i", [probe]), array("i", [fed]), array("i", [n]), array("i", [0]),
                 array("i", [1] * n))
        fed += n
    with pytest.raises(_core.KVCacheFullError):
        ctx.step(array("i", [probe]), array("i", [fed]), array("i", [1]), array("i", [0]),
                 array("i", [1]))
    ctx.remove_sequence(probe)
    return ctx.n_ctx - free



async def run_tokens(engine, tokens, cache_prompt=True, **sampling):
    """(text, token ids, final delta) of one request for `tokens`."""
    stream = engine.submit(tokens, SamplingParams(**sampling), cache_prompt=cache_prompt)
    text, ids = "", []
    async for delta in stream:
        text += delta.text
        ids += delta.token_ids
    return text, ids, delta



class FaultyContext:
    """The engine's llama.cpp context, whose `method` raises `fault` on the calls whose
    arguments `when` accepts: after `after` such calls, `times` times (-1: every time)."""

    def __init__(self, ctx, fault, after=0, times=1, method="step", when=lambda *args: True):
        self._ctx, self.fault, self.after, self.times = ctx, fault, after, times
        self.method, self.when = method, when

    def _maybe_fail(self, method, args):
        if method != self.method or self.times == 0 or not self.when(*args):
            return
        self.after -= 1
        if self.after < 0:
            self.times -= 1
            raise self.fault

    def step(self, *args):
        self._maybe_fail("step", args)
        return self._ctx.step(*args)

    def decode_run(self, *args, **kwargs):
        self._maybe_fail("decode_run", args)
        return self._ctx.decode_run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def call(timer, *phases, rows=1, forward_steps=1, graphs_reused=0):
    """One call into the core, as the engine times it."""
    timer.start()
    for phase in phases:
        timer.lap(phase)
    timer.end(rows, forward_steps, graphs_reused)
