"""Each workload's level plans, and conversations against a fake chat server (aiohttp's
test server on 127.0.0.1) that answers with a reply naming the turn it was asked."""
import asyncio
import contextlib
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cllm.bench import prompts
from cllm.bench.cli import load_settings, parse_args
from cllm.bench.loadgen import Connections, HttpTarget, Level
from cllm.bench.workloads import SKIPPED, Conversation, plans


def _plans(*argv: str) -> list:
    return list(plans(parse_args(["--url", "u", "--concurrency", "1", "4", *argv])))


def test_standard_is_as_before():
    """One list for all levels, each level taking the next slice, warm-up first."""
    first, second = _plans("--prompt-tokens", "20", "--requests", "3", "--warmup", "2")
    texts = prompts.synthetic(20, 10)
    assert first.warmup + first.prompts == texts[:5] and second.warmup == texts[5:7]
    assert len(second.prompts) == 3 and not first.conversations


@pytest.mark.parametrize("workload", ["shared-prefix", "mixed"])
def test_prompt_workloads_are_seeded_per_level(workload):
    levels = _plans("--workload", workload, "--requests", "6", "--warmup", "2")
    assert levels == _plans("--workload", workload, "--requests", "6", "--warmup", "2")
    assert [(len(p.warmup), len(p.prompts)) for p in levels] == [(2, 6), (2, 6)]
    assert set(levels[0].prompts).isdisjoint(levels[1].prompts)


@pytest.mark.parametrize("workload", ["standard", "shared-prefix", "mixed", "multi-turn"])
def test_each_seed_is_its_own_series(workload):
    """Benchmark processes loading one server together pass their own --seed: none may send
    another's prompts; the same seed sends the same ones, and 0 those of a run without it."""
    argv = ("--workload", workload, "--prompt-tokens" if workload == "standard" else "--turns",
            "20" if workload == "standard" else "2", "--requests", "4")

    def texts(*seed: str) -> set:
        return {str(item) for plan in _plans(*argv, *seed)
                for item in plan.warmup + plan.prompts + plan.conversations}

    assert texts() == texts("--seed", "0")
    assert texts("--seed", "1") == texts("--seed", "1")
    assert texts("--seed", "1").isdisjoint(texts()) and texts("--seed", "1").isdisjoint(
        texts("--seed", "2"))


def test_shared_prefix_level_shares_one_document():
    plan = _plans("--workload", "shared-prefix", "--prefix-tokens", "50")[0]
    documents = {p.split("\n\nQuestion ")[0] for p in plan.warmup + plan.prompts}
    assert len(documents) == 1 and len(plan.prompts) == 72


def test_shared_prefix_level_over_several_documents():
    plan = _plans("--workload", "shared-prefix", "--prefix-tokens", "50", "--documents", "4")[0]
    assert len({p.split("\n\nQuestion ")[0] for p in plan.warmup + plan.prompts}) == 4


def test_multi_turn_plan():
    low, high = _plans("--workload", "multi-turn", "--turns", "3", "--requests", "6")
    assert len(low.conversations) == 2 and len(high.conversations) == 4  # at least the level
    assert all(len(c.users) == 3 for c in low.conversations + high.conversations)
    assert len(low.warmup) == 4 and [m["role"] for m in low.warmup[0]] == ["system", "user"]
    assert len({c.system for c in low.conversations + high.conversations}) == 6


@contextlib.asynccontextmanager
async def _chat_server(requests: list[dict], fail_at_turn: int | None = None):
    """Replies 'reply N' to a history with N user messages; with usage and llama-server's
    timings, cached = the prompt up to the last user message. Yields its URL."""
    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        requests.append(body)
        turn = sum(m["role"] == "user" for m in body["messages"])
        if turn == fail_at_turn:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        usage = {"prompt_tokens": 10 * turn, "completion_tokens": 2}
        timings = {"cache_n": 10 * (turn - 1)}
        if not body["stream"]:
            return web.json_response({
                "choices": [{"message": {"role": "assistant", "content": f"reply {turn}"},
                             "finish_reason": "length"}], "usage": usage, "timings": timings})
        chunks = [{"choices": [{"delta": {"content": f"reply {turn}"}}]},
                  {"choices": [], "usage": usage, "timings": timings}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return web.Response(text=sse, content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("/"))


async def _converse(conversation: Conversation, sent: list[dict], *argv: str,
                    fail_at_turn: int | None = None):
    load = load_settings(parse_args(["--url", "u", "--workload", "multi-turn", *argv]))
    async with (_chat_server(sent, fail_at_turn) as url,
                Connections(1, timeout=5) as connections):
        return await conversation.run(HttpTarget(url, "m", load, connections).send)


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_each_turn_resends_the_history_with_the_servers_replies(stream):
    sent: list[dict] = []
    conversation = Conversation("notes", ["q1", "q2", "q3"])
    results = asyncio.run(_converse(conversation, sent, stream))
    assert [r.text for r in results] == ["reply 1", "reply 2", "reply 3"]
    assert [m["content"] for m in sent[2]["messages"]] == [
        "notes", "q1", "reply 1", "q2", "reply 2", "q3"]
    assert [m["role"] for m in sent[2]["messages"]] == [
        "system", "user", "assistant", "user", "assistant", "user"]
    assert [len(body["messages"]) for body in sent] == [2, 4, 6]
    assert [(r.prompt_tokens, r.cached_tokens) for r in results] == [(10, 0), (20, 10), (30, 20)]


def test_cache_prompt_is_sent_only_when_asked():
    for argv, expected in (((), None), (("--cache-prompt",), True),
                           (("--no-cache-prompt",), False)):
        sent: list[dict] = []
        asyncio.run(_converse(Conversation("s", ["q"]), sent, *argv))
        assert sent[0].get("cache_prompt") is expected


def test_a_failed_turn_ends_its_conversation():
    sent: list[dict] = []
    conversation = Conversation("notes", ["q1", "q2", "q3", "q4"])
    results = asyncio.run(_converse(conversation, sent, fail_at_turn=2))
    assert len(sent) == 2 and len(results) == 4 and results[0].ok
    assert results[1].error == "HTTP 500: boom"
    assert [r.error for r in results[2:]] == [SKIPPED, SKIPPED]


def test_level_plan_runs_conversations_with_figures_per_turn():
    plan = _plans("--workload", "multi-turn", "--turns", "2", "--requests", "6")[1]
    sent: list[dict] = []
    load = load_settings(parse_args(["--url", "u", "--workload", "multi-turn"]))

    async def run():
        async with _chat_server(sent) as url, Connections(4, timeout=5) as connections:
            return await plan.run(HttpTarget(url, "m", load, connections).send,
                                  Level(concurrency=4))

    results, duration, figures = asyncio.run(run())
    assert len(results) == len(sent) == 8 and duration > 0 and all(r.ok for r in results)
    assert [t["turn"] for t in figures["turns"]] == [1, 2]
    assert figures["turns"][1]["cached_share"] == pytest.approx(0.5)
