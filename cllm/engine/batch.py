"""One engine step's batch as the flat int arrays the core takes: Context.step's rows (any
chunks) or Context.decode_run's rows (decodes only)."""
from __future__ import annotations

from array import array

from cllm.engine.scheduler import Scheduler, SchedulerOutput


class StepRows:
    """One step's batch as the flat int arrays Context.step takes."""
    __slots__ = ("seq_ids", "positions", "n_tokens", "sample", "tokens", "top_logprobs")

    @classmethod
    def build(cls, out: SchedulerOutput) -> StepRows:
        rows = cls()
        chunks = out.chunks
        rows.seq_ids = array("i", [c.seq.seq_id for c in chunks])
        rows.positions = array("i", [c.start for c in chunks])
        rows.n_tokens = array("i", [c.length for c in chunks])
        rows.sample = array("i", [c.samples for c in chunks])
        tokens = array("i")
        for c in chunks:
            tokens.extend(c.seq.token_ids(c.start, c.length))
        rows.tokens = tokens
        wanted = [-1 if c.seq.sampling.logprobs is None else c.seq.sampling.logprobs
                  for c in chunks]
        rows.top_logprobs = array("i", wanted) if max(wanted) >= 0 else None
        return rows


class RunRows:
    """A decode run's rows as the flat int arrays Context.decode_run takes."""
    __slots__ = ("seq_ids", "positions", "last_tokens", "budgets")

    @classmethod
    def build(cls, out: SchedulerOutput, scheduler: Scheduler) -> RunRows:
        rows = cls()
        seqs = [c.seq for c in out.chunks]
        rows.seq_ids = array("i", [s.seq_id for s in seqs])
        rows.positions = array("i", [c.start for c in out.chunks])
        rows.last_tokens = array("i", [s.token_ids(c.start, 1)[0]
                                       for s, c in zip(seqs, out.chunks)])
        rows.budgets = array("i", [scheduler.decode_budget(s) for s in seqs])
        return rows
