"""What each level sends, by workload; every server at a level gets the same.

standard: the default prompts, --prompt-file, or --prompt-tokens synthetic ones.
shared-prefix: one long document, each request with its own question after it.
mixed: prompt lengths log-uniform from 16 to 4,000 tokens, all different.
multi-turn: conversations over the chat endpoint; each turn resends the whole history, with the
server's own replies, so a server that reuses its cache answers later turns sooner.
structured: the default prompts as support tickets to triage over the chat endpoint; each server
is measured free (ignore_eos) and constrained by prompts.TICKET_SCHEMA (response_format)."""
from __future__ import annotations

import argparse
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

from . import prompts as prompt_sets
from .loadgen import Prompt, RequestResult, Sender, run_jobs, run_level
from .stats import by_turn

WORKLOADS = ("standard", "shared-prefix", "multi-turn", "mixed", "structured")
MIXED_TOKENS = (16, 4000)
SKIPPED = "not sent: an earlier turn of its conversation failed"


@dataclass(slots=True)
class Conversation:
    system: str
    users: list[str]

    async def run(self, send: Sender) -> list[RequestResult]:
        """One result per turn. Turn k sends system, user 1, reply 1, ..., user k, the replies
        being this server's own. A failed turn leaves no reply to build on: the turns after it
        are recorded as failures, not sent."""
        messages = [_message("system", self.system)]
        results: list[RequestResult] = []
        for user in self.users:
            messages.append(_message("user", user))
            r = await send(list(messages))  # a copy: the history grows after the send
            results.append(r)
            if not r.ok:
                break
            messages.append(_message("assistant", r.text))
        skipped = len(self.users) - len(results)
        results += [RequestResult(start=r.end, end=r.end, error=SKIPPED) for _ in range(skipped)]
        return results


@dataclass(slots=True)
class LevelPlan:
    """One level's requests: warm-up ones, whose results are dropped, then the measured ones,
    either single prompts or conversations."""
    warmup: list[Prompt]
    prompts: list[Prompt] = field(default_factory=list)
    conversations: list[Conversation] = field(default_factory=list)

    async def run(self, send: Sender, concurrency: int,
                  desc: str = "") -> tuple[list[RequestResult], float, dict]:
        """The measured requests: their results, the wall time, and for conversations the
        figures of each turn (stats.by_turn)."""
        if not self.conversations:
            results, duration = await run_level(send, self.prompts, concurrency, desc)
            return results, duration, {}
        # The concurrency is the number of conversations in flight; each runs turn after turn.
        jobs = [partial(c.run, send) for c in self.conversations]
        per_conversation, duration = await run_jobs(jobs, concurrency, desc)
        return [r for c in per_conversation for r in c], duration, by_turn(per_conversation)


def plans(args: argparse.Namespace) -> Iterator[LevelPlan]:
    """One plan per concurrency level, in order. Each level gets its own prompts (seeded by
    the level's position), so no level starts with what an earlier one left in a cache."""
    if args.workload in ("standard", "structured"):
        yield from _standard(args)
        return
    for index, level in enumerate(args.concurrency):
        if args.workload == "multi-turn":
            yield _multi_turn(args, level, seed=index)
            continue
        count = args.requests + args.warmup
        texts = (prompt_sets.shared_prefix(args.prefix_tokens, count, seed=index)
                 if args.workload == "shared-prefix"
                 else prompt_sets.mixed(count, *MIXED_TOKENS, seed=index))
        yield _split(texts, args.warmup)


def _standard(args: argparse.Namespace) -> Iterator[LevelPlan]:
    n_prompts = args.requests + args.warmup
    if args.prompt_tokens:
        texts = prompt_sets.synthetic(args.prompt_tokens, n_prompts * len(args.concurrency))
    elif args.prompt_file:
        texts = prompt_sets.from_file(args.prompt_file)
    else:
        texts = list(prompt_sets.DEFAULT_PROMPTS)
    if args.workload == "structured":
        texts = [prompt_sets.ticket(t) for t in texts]
    for index in range(len(args.concurrency)):
        # A synthetic set has every prompt different; a short list cycles on from level to level.
        yield _split(prompt_sets.for_requests(texts, n_prompts, offset=index * n_prompts),
                     args.warmup)


def _split(texts: list[str], warmup: int) -> LevelPlan:
    """The first `warmup` prompts warm the server up (and, for a shared prefix, its cache)."""
    return LevelPlan(warmup=list(texts[:warmup]), prompts=list(texts[warmup:]))


def _multi_turn(args: argparse.Namespace, level: int, seed: int) -> LevelPlan:
    """About --requests requests in --turns-turn conversations, and at least one conversation
    for each slot of the level. The warm-up sends the first turns of other conversations."""
    rng = random.Random(seed)
    count = max(level, math.ceil(args.requests / args.turns))
    conversations = [_conversation(rng, args.turns) for _ in range(count)]
    warm = [_conversation(rng, 1) for _ in range(args.warmup)]
    return LevelPlan(warmup=[[_message("system", c.system), _message("user", c.users[0])]
                             for c in warm],
                     conversations=conversations)


def _conversation(rng: random.Random, turns: int) -> Conversation:
    return Conversation(prompt_sets.system_prompt(rng),
                        [prompt_sets.user_message(rng) for _ in range(turns)])


def _message(role: str, content: str) -> dict:
    return {"role": role, "content": content}
