"""The mixed-users workload: two users on one server, each sending its own API key.

batch-chat: a batch user keeps BATCH_PER_SLOT requests a slot in flight (--requests prompts of
--prompt-tokens, --max-tokens each) while a person sends a short chat turn every CHAT_EVERY
seconds. Measured in turn: the batch alone; the batch with the person beside it; then as many
of the person's turns, one at a time, on the idle server.
backlogged: a big user sends --requests requests at once, then a small user a tenth as many,
all alike; each user's share of the output tokens that reached it while both still had
requests waiting.

A cllm started here gets a key file with one named key a user and its --weights, so its fair
shares apply; a server without keys (llama-server) takes the same requests and ignores them."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from . import prompts as prompt_sets
from .loadgen import Prompt, RequestResult, Sender, Sized, run_level
from .stats import summarize, tokens_by

SHAPES = ("batch-chat", "backlogged")
USER_NAMES = {"batch-chat": ("batch", "chat"), "backlogged": ("big", "small")}
SLOTS = 4  # --parallel unless given: a small machine's server
BATCH_PROMPT_TOKENS = 512
BATCH_MAX_TOKENS = 256
BATCH_PER_SLOT = 4  # the batch user's requests in flight, per slot: it saturates the server
CHAT_EVERY = 2.0  # seconds from one of the person's turns to the next
CHAT_TOKENS = 32  # each chat reply; the person's figure is its first token
VOLUMES = 10  # backlogged: the big user's requests over the small one's
# The targets: the person's TTFT p99 beside the batch at most twice its idle value plus one
# decode step of the batch (its TPOT alone), the batch keeping 90% of its throughput alone;
# each backlogged user's token share within 5 points of its weight's share (10% of an equal
# share; 25% / 75% ± 5 points at weights 1:3).
TTFT_TIMES_IDLE = 2.0
THROUGHPUT_KEPT = 0.9
SHARE_POINTS = 0.05


@dataclass(frozen=True, slots=True)
class User:
    name: str
    weight: float = 1.0

    @property
    def key(self) -> str:
        return f"cllm-bench-{self.name}"


def users(shape: str, weights: Sequence[float]) -> tuple[User, ...]:
    """The shape's users, in the order --weights names them."""
    return tuple(User(name, weight) for name, weight in zip(USER_NAMES[shape], weights))


def key_file(people: Sequence[User]) -> str:
    """cllm's --api-key-file: a named key a user, with its weight in the fair shares."""
    return "".join(f"{u.key} name={u.name} weight={u.weight:g}\n" for u in people)


def volumes(requests: int) -> tuple[int, int]:
    """backlogged: the big user's requests and the small one's, VOLUMES times fewer."""
    small = max(1, requests // VOLUMES)
    return small * VOLUMES, small


def in_flight(args: argparse.Namespace) -> int:
    """The most requests a run has in flight at once."""
    if args.users_shape == "batch-chat":
        return BATCH_PER_SLOT * args.parallel + 1
    return sum(volumes(args.requests))


def plan(args: argparse.Namespace, seed: int) -> BatchChat | Backlogged:
    """The run's requests, all different (seeded: each --runs repeat has its own)."""
    people = users(args.users_shape, args.weights)
    warmup = [chat_turn(seed, "warmup", i) for i in range(args.warmup)]
    if args.users_shape == "batch-chat":
        batch = prompt_sets.synthetic(args.prompt_tokens, 2 * args.requests, seed=seed)
        return BatchChat(people, warmup, batch[:args.requests], batch[args.requests:],
                         BATCH_PER_SLOT * args.parallel, seed)
    big, small = volumes(args.requests)
    texts = prompt_sets.synthetic(args.prompt_tokens, big + small, seed=seed)
    return Backlogged(people, warmup, texts[:big], texts[big:])


def chat_turn(seed: int, phase: str, index: int) -> Sized:
    """The person's turn: a few sentences and a question, each turn its own."""
    rng = random.Random(f"{seed} {phase} {index}")
    return Sized([{"role": "user", "content": prompt_sets.user_message(rng)}], CHAT_TOKENS)


@dataclass(slots=True)
class BatchChat:
    users: tuple[User, User]  # the batch user, the person
    warmup: list[Prompt]
    batch_alone: list[Prompt]
    batch_beside: list[Prompt]
    concurrency: int  # the batch's requests in flight
    seed: int

    async def measure(self, send: Mapping[str, Sender]) -> dict:
        """The batch alone, the batch beside the person, the person's turns idle: each
        user's figures by phase, and the targets."""
        batch, chat = (send[u.name] for u in self.users)
        warm = [await chat(p) for p in self.warmup]
        alone = await run_level(batch, self.batch_alone, self.concurrency)
        beside, turns = await self._beside(batch, chat)
        idle_turns = [chat_turn(self.seed, "idle", i) for i in range(max(1, len(turns)))]
        idle = [await chat(p) for p in idle_turns]
        phases = {self.users[0]: {"alone": alone, "beside": beside},
                  self.users[1]: {"idle": (idle, _span(idle)), "beside": (turns, _span(turns))}}
        figures = by_user(phases)
        batch_figures, chat_figures = (figures[u.name]["phases"] for u in self.users)
        return {"warmup_failed": sum(not r.ok for r in warm), "users": figures,
                "targets": batch_chat_targets(batch_figures, chat_figures)}

    async def _beside(self, batch: Sender, chat: Sender
                      ) -> tuple[tuple[list[RequestResult], float], list[RequestResult]]:
        done = asyncio.Event()

        async def run_batch() -> tuple[list[RequestResult], float]:
            try:
                return await run_level(batch, self.batch_beside, self.concurrency)
            finally:
                done.set()

        turns = (chat_turn(self.seed, "beside", i) for i in itertools.count())
        return await asyncio.gather(run_batch(), chat_while(chat, turns, done, CHAT_EVERY))


async def chat_while(chat: Sender, turns: Iterator[Prompt], done: asyncio.Event,
                     every: float) -> list[RequestResult]:
    """The person's turns until `done`: the first `every` seconds in, each next one `every`
    seconds after the last was sent, or as its reply ends if that is later (a person reads
    the reply before the next turn)."""
    results: list[RequestResult] = []
    due = time.perf_counter() + every
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), max(0.0, due - time.perf_counter()))
        if done.is_set():
            return results
        due = time.perf_counter() + every
        results.append(await chat(next(turns)))


@dataclass(slots=True)
class Backlogged:
    users: tuple[User, User]  # the big user, the small one
    warmup: list[Prompt]
    big: list[Prompt]
    small: list[Prompt]

    async def measure(self, send: Mapping[str, Sender]) -> dict:
        """Every request at once, the big user's first: each user's figures, its share of the
        tokens while both had requests waiting, and the target."""
        big, small = (send[u.name] for u in self.users)
        warm = [await small(p) for p in self.warmup]
        start = time.perf_counter()
        results = await asyncio.gather(*(big(p) for p in self.big),
                                       *(small(p) for p in self.small))
        duration = time.perf_counter() - start
        split = {self.users[0]: results[:len(self.big)], self.users[1]: results[len(self.big):]}
        figures = by_user({u: {"backlogged": (rs, duration)} for u, rs in split.items()})
        window = backlog_window(list(split.values()))
        for u, share in token_shares(split, window).items():
            figures[u.name] |= share
        return {"warmup_failed": sum(not r.ok for r in warm), "users": figures,
                "window_s": window[1] - window[0] if window else None,
                "targets": {"share_points": SHARE_POINTS, "shares_met": shares_met(figures)}}


def by_user(phases: Mapping[User, Mapping[str, tuple[list[RequestResult], float]]]) -> dict:
    """Each user's weight and figures (stats.summarize) by phase."""
    return {u.name: {"weight": u.weight,
                     "phases": {phase: summarize(results, duration)
                                for phase, (results, duration) in by_phase.items()}}
            for u, by_phase in phases.items()}


def batch_chat_targets(batch: Mapping[str, dict], chat: Mapping[str, dict]) -> dict:
    """The person's TTFT p99 beside the batch against twice its idle p99 plus one decode
    step (the batch's TPOT p50 alone), and the batch's throughput beside the person over
    its throughput alone against THROUGHPUT_KEPT; None where a figure is missing."""
    idle, beside = chat["idle"]["ttft_ms"]["p99"], chat["beside"]["ttft_ms"]["p99"]
    step = batch["alone"]["tpot_ms"]["p50"]
    bound = None if idle is None or step is None else TTFT_TIMES_IDLE * idle + step
    alone = batch["alone"]["output_throughput"]
    kept = batch["beside"]["output_throughput"] / alone if alone else None
    return {"chat_ttft_p99_ms": beside, "chat_ttft_p99_idle_ms": idle, "decode_step_ms": step,
            "chat_ttft_idle_times": TTFT_TIMES_IDLE, "chat_ttft_p99_bound_ms": bound,
            "chat_ttft_met": None if bound is None or beside is None else beside <= bound,
            "batch_kept": kept, "batch_kept_min": THROUGHPUT_KEPT,
            "batch_kept_met": None if kept is None else kept >= THROUGHPUT_KEPT}


def shares_met(figures: Mapping[str, dict]) -> bool | None:
    """Whether every user's token share is within SHARE_POINTS of its weight's share; None
    when the shares are unknown."""
    shares = [(f["share"], f["target_share"]) for f in figures.values()]
    if any(share is None for share, _ in shares):
        return None
    return all(abs(share - target) <= SHARE_POINTS for share, target in shares)


def backlog_window(results: Sequence[Sequence[RequestResult]]) -> tuple[float, float] | None:
    """From the first request sent until the first user's last request got its first token:
    until then every user had a request waiting (a request waits until its first token
    comes). None if some user had no reply."""
    lasts = [max((r.start + r.ttft for r in rs if r.ok and r.ttft is not None), default=None)
             for rs in results]
    if not lasts or None in lasts:
        return None
    return min(r.start for rs in results for r in rs), min(lasts)


def token_shares(results: Mapping[User, Sequence[RequestResult]],
                 window: tuple[float, float] | None) -> dict[User, dict]:
    """Each user's output tokens that reached it within the window, their share of all
    users', and its weight's share of the weights."""
    weights = sum(u.weight for u in results)
    tokens = {u: sum(tokens_by(r, window[1]) for r in rs) if window else 0.0
              for u, rs in results.items()}
    total = sum(tokens.values())
    return {u: {"window_tokens": round(n, 1), "share": n / total if total else None,
                "target_share": u.weight / weights} for u, n in tokens.items()}


def _span(results: Sequence[RequestResult]) -> float:
    """From the first request sent to the last reply's end."""
    if not results:
        return 0.0
    return max(r.end for r in results) - min(r.start for r in results)
