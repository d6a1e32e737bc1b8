"""What each level sends, by workload; every server at a level gets the same.

standard: the default prompts, --prompt-file, or --prompt-tokens synthetic ones.
shared-prefix: long documents (one by default), each request with its own question after one.
mixed: prompt lengths log-uniform from 16 to 4,000 tokens, all different.
sharegpt: prompt and output lengths shaped like ShareGPT's chats (or taken from a ShareGPT-style
file), each request with its own max_tokens.
multi-turn: conversations over the chat endpoint; each turn resends the whole history, with the
server's own replies, so a server that reuses its cache answers later turns sooner.
structured: the default prompts as support tickets to triage over the chat endpoint; each server
is measured free (ignore_eos), constrained by prompts.TICKET_SCHEMA (response_format), then free
with each reply as long as its constrained one (loadgen.ReplyLengths).
mixed-users: two users on one server, each with its own API key; its plans are users.py's."""
from __future__ import annotations

import argparse
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

from . import prompts as prompt_sets
from .loadgen import Level, Prompt, RequestResult, Sender, Sized, run_jobs, run_level, run_open_loop
from .stats import by_turn

WORKLOADS = ("standard", "shared-prefix", "multi-turn", "mixed", "sharegpt", "structured",
             "mixed-users")
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

    async def run(self, send: Sender, level: Level, seed: int = 0,
                  desc: str = "") -> tuple[list[RequestResult], float, dict]:
        """The measured requests: their results, the wall time, and for conversations the
        figures of each turn (stats.by_turn). An open-loop level's arrivals are seeded."""
        if level.rate is not None:
            results, duration = await run_open_loop(send, self.prompts, level.rate,
                                                    level.concurrency, seed, desc)
            return results, duration, {}
        if not self.conversations:
            results, duration = await run_level(send, self.prompts, level.concurrency, desc)
            return results, duration, {}
        # The concurrency is the number of conversations in flight; each runs turn after turn.
        jobs = [partial(c.run, send) for c in self.conversations]
        per_conversation, duration = await run_jobs(jobs, level.concurrency, desc)
        return [r for c in per_conversation for r in c], duration, by_turn(per_conversation)


def plans(args: argparse.Namespace) -> Iterator[LevelPlan]:
    """One plan per level and run (--runs), in order, a level's runs together. Each gets its
    own prompts (seeded by its position), so none starts with what an earlier one left in a
    cache."""
    levels = [level for level in args.levels for _ in range(args.runs)]
    if args.workload in ("standard", "structured"):
        yield from _standard(args, len(levels))
        return
    for index, level in enumerate(levels):
        seed = level_seed(args, index)
        if args.workload == "multi-turn":
            yield _multi_turn(args, level.concurrency, seed=seed)
            continue
        count = args.requests + args.warmup
        if args.workload == "sharegpt":
            yield _split(_sharegpt(args, count, seed=seed), args.warmup)
            continue
        texts = (prompt_sets.shared_prefix(args.prefix_tokens, count, seed=seed,
                                           documents=args.documents)
                 if args.workload == "shared-prefix"
                 else prompt_sets.mixed(count, *MIXED_TOKENS, seed=seed))
        yield _split(texts, args.warmup)


def level_seed(args: argparse.Namespace, index: int) -> int:
    """The seed of the index-th level run: each --seed has a series of its own, and --seed 0
    is the series every run before the option had."""
    return args.seed * len(args.levels) * args.runs + index


def _sharegpt(args: argparse.Namespace, count: int, seed: int) -> list[Sized]:
    """Prompts with their own output lengths: synthetic, or a seeded sample of the file's
    conversations (cycled through if it holds fewer)."""
    if args.dataset_path is None:
        pairs = prompt_sets.sharegpt_synthetic(count, seed)
    else:
        pool = prompt_sets.sharegpt_file(args.dataset_path)
        random.Random(seed).shuffle(pool)
        pairs = [pool[i % len(pool)] for i in range(count)]
    return [Sized(prompt, n_out) for prompt, n_out in pairs]


def _standard(args: argparse.Namespace, n_plans: int) -> Iterator[LevelPlan]:
    n_prompts = args.requests + args.warmup
    if args.prompt_tokens:
        texts = prompt_sets.synthetic(args.prompt_tokens, n_prompts * n_plans, seed=args.seed)
    elif args.prompt_file:
        texts = prompt_sets.from_file(args.prompt_file)
    else:
        texts = list(prompt_sets.DEFAULT_PROMPTS)
    if args.workload == "structured":
        texts = [prompt_sets.ticket(t) for t in texts]
    for index in range(n_plans):
        # A synthetic set has every prompt different; a short list cycles on from level to level.
        yield _split(prompt_sets.for_requests(texts, n_prompts, offset=index * n_prompts),
                     args.warmup)


def _split(texts: list[Prompt], warmup: int) -> LevelPlan:
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
