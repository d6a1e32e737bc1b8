"""The mixed-users workload: its options, plans, phases against fake senders, token shares,
targets and table, the users' keys on the wire; then one short run of each shape against a
real cllm started with its key file."""
import asyncio
import json
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cllm.bench import __main__ as bench_main
from cllm.bench import report, users
from cllm.bench.cli import load_settings, parse_args
from cllm.bench.loadgen import Connections, HttpTarget, RequestResult, Sized, first_model
from cllm.bench.stats import tokens_by
from cllm.config import parse_api_keys


def _args(*argv: str):
    return parse_args(["--url", "u", "--workload", "mixed-users", *argv])


# ---- the command line ----

def test_defaults_are_a_batch_beside_a_person_on_four_slots():
    args = _args()
    assert args.users_shape == "batch-chat" and args.weights == [1.0, 1.0]
    assert (args.parallel, args.prompt_tokens, args.max_tokens) == (4, 512, 256)
    assert args.endpoint == "chat" and [s.label for s in args.sampling] == ["greedy"]
    assert [level.concurrency for level in args.levels] == [4 * 4 + 1]  # the batch, the person
    backlogged = _args("--users-shape", "backlogged", "--requests", "45", "--weights", "1", "3")
    assert backlogged.levels[0].concurrency == 44 and backlogged.weights == [1.0, 3.0]


@pytest.mark.parametrize("argv", [
    ["--concurrency", "8"], ["--request-rate", "2"], ["--goodput", "ttft:100"],
    ["--engine-direct"], ["--endpoint", "completions"], ["--prompt-file", "f"],
    ["--sampling", "greedy", "t=1"], ["--weights", "0", "1"], ["--weights", "1"],
    ["--weights", "1", "nan"], ["--users-shape", "crowd"],
])
def test_options_it_would_not_use_are_refused(argv):
    with pytest.raises(SystemExit):
        _args(*argv)


@pytest.mark.parametrize("argv", [["--weights", "1", "3"], ["--users-shape", "backlogged"]])
def test_its_options_are_refused_for_other_workloads(argv):
    with pytest.raises(SystemExit):
        parse_args(["--url", "u", *argv])


def test_the_key_file_names_each_user_with_its_weight():
    keys = parse_api_keys(users.key_file(users.users("backlogged", [1.0, 3.0])))
    assert [(k.key, k.name, k.weight) for k in keys] == [("cllm-bench-big", "big", 1.0),
                                                        ("cllm-bench-small", "small", 3.0)]


# ---- plans ----

def test_batch_chat_plan():
    plan = users.plan(_args("--requests", "3", "--prompt-tokens", "20", "--warmup", "2"), seed=0)
    assert [u.name for u in plan.users] == ["batch", "chat"] and plan.concurrency == 16
    assert len(plan.batch_alone) == len(plan.batch_beside) == 3 and len(plan.warmup) == 2
    assert set(plan.batch_alone).isdisjoint(plan.batch_beside)  # nothing from the cache
    idle, beside = users.chat_turn(0, "idle", 0), users.chat_turn(0, "beside", 0)
    assert isinstance(idle, Sized) and idle.max_tokens == users.CHAT_TOKENS
    assert idle.prompt[0]["role"] == "user" and idle != beside
    assert users.chat_turn(0, "idle", 0) == idle  # seeded
    assert users.plan(_args("--requests", "3"), seed=1).batch_alone != plan.batch_alone


def test_backlogged_plan_has_volumes_ten_times_apart():
    plan = users.plan(_args("--users-shape", "backlogged", "--requests", "45"), seed=0)
    assert [u.name for u in plan.users] == ["big", "small"]
    assert (len(plan.big), len(plan.small)) == (40, 4)
    assert len(set(plan.big + plan.small)) == 44


# ---- tokens over time, shares ----

def test_tokens_by_a_moment():
    """Events at 0.1, 0.3 and 0.5 s: the first carries one token, the others two each."""
    r = RequestResult(start=0.0, end=0.6, ttft=0.1, itl=[0.2, 0.2], output_tokens=5)
    assert [tokens_by(r, t) for t in (0.05, 0.1, 0.35, 0.6)] == [0, 1, 3, 5]
    whole = RequestResult(start=0.0, end=1.0, ttft=1.0, output_tokens=5, streamed=False)
    assert (tokens_by(whole, 0.9), tokens_by(whole, 1.0)) == (0, 5)
    assert tokens_by(RequestResult(start=0, end=1, error="HTTP 500"), 2.0) == 0


def _one_event(start: float, first: float, tokens: int = 4) -> RequestResult:
    return RequestResult(start=start, end=first, ttft=first - start, output_tokens=tokens)


def test_shares_count_the_tokens_while_both_users_had_requests_waiting():
    """The small user's last request starts at 3 s, before the big one's: the window ends
    there, and the big user's request that started at 5 s counts for nothing."""
    big, small = users.users("backlogged", [1.0, 3.0])
    results = {big: [_one_event(0, 0.5), _one_event(0, 1.5), _one_event(0, 5.0)],
               small: [_one_event(0.1, 1.0), _one_event(0.1, 3.0)]}
    window = users.backlog_window(list(results.values()))
    assert window == (0, 3.0)
    shares = users.token_shares(results, window)
    assert shares[big] == {"window_tokens": 8, "share": 0.5, "target_share": 0.25}
    assert shares[small]["target_share"] == 0.75
    assert users.backlog_window([results[big], []]) is None


def test_backlogged_sends_the_big_users_requests_first():
    plan = users.plan(_args("--users-shape", "backlogged", "--requests", "20", "--warmup",
                            "1"), seed=0)
    sent: list[str] = []

    def sender(name: str):
        async def send(prompt) -> RequestResult:
            sent.append(name)
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            return _one_event(start, time.perf_counter(), tokens=3)
        return send

    figures = asyncio.run(plan.measure({"big": sender("big"), "small": sender("small")}))
    assert sent == ["small"] + ["big"] * 20 + ["small"] * 2  # the warm-up first
    assert figures["users"]["big"]["phases"]["backlogged"]["completed"] == 20
    assert figures["window_s"] > 0 and figures["warmup_failed"] == 0
    shares = [f["share"] for f in figures["users"].values()]
    assert sum(shares) == pytest.approx(1.0)
    assert figures["targets"]["shares_met"] in (True, False)


# ---- the person beside the batch ----

def test_the_person_sends_a_turn_every_interval_until_the_batch_ends():
    """Every 50 ms, the next no sooner than the last reply ended (the second takes 120 ms);
    nothing once the batch has ended."""
    sent: list[float] = []

    async def chat(prompt) -> RequestResult:
        sent.append(time.perf_counter())
        await asyncio.sleep(0.12 if prompt == 1 else 0.0)
        return RequestResult(start=sent[-1], end=time.perf_counter())

    async def run():
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.4, done.set)
        start = time.perf_counter()
        results = await users.chat_while(chat, iter(range(100)), done, every=0.05)
        return start, results, time.perf_counter()

    start, results, end = asyncio.run(run())
    gaps = [b - a for a, b in zip([start, *sent], sent)]
    assert len(results) == len(sent) >= 4 and sent[-1] < start + 0.4
    assert all(gap >= 0.045 for gap in gaps) and gaps[2] >= 0.12
    assert end - start < 0.4 + 0.2  # it stops with the batch, not after its next turn


def test_batch_chat_measures_the_batch_alone_and_beside_then_as_many_turns_idle(monkeypatch):
    monkeypatch.setattr(users, "CHAT_EVERY", 0.02)
    plan = users.plan(_args("--requests", "6", "--prompt-tokens", "8", "--warmup", "1"), seed=0)
    log: list[tuple[str, object]] = []

    def sender(name: str, seconds: float):
        async def send(prompt) -> RequestResult:
            log.append((name, prompt))
            start = time.perf_counter()
            await asyncio.sleep(seconds)
            return RequestResult(start=start, end=time.perf_counter(), ttft=seconds / 2,
                                 itl=[seconds / 2], output_tokens=2)
        return send

    figures = asyncio.run(plan.measure({"batch": sender("batch", 0.15),
                                        "chat": sender("chat", 0.001)}))
    batch, chat = (figures["users"][name]["phases"] for name in ("batch", "chat"))
    assert batch["alone"]["completed"] == batch["beside"]["completed"] == 6
    assert chat["beside"]["completed"] >= 2
    assert chat["idle"]["completed"] == chat["beside"]["completed"]
    order = [name for name, _ in log]
    assert order[:7] == ["chat"] + ["batch"] * 6  # warm-up, then the batch alone
    assert order[-chat["idle"]["completed"]:] == ["chat"] * chat["idle"]["completed"]
    turns = [prompt for name, prompt in log if name == "chat"]
    assert len(set(json.dumps(t.prompt) for t in turns)) == len(turns)  # each turn its own
    assert set(figures["targets"]) >= {"chat_ttft_met", "batch_kept", "decode_step_ms"}


def test_batch_chat_targets():
    batch = {"alone": {"tpot_ms": {"p50": 40.0}, "output_throughput": 100.0},
             "beside": {"output_throughput": 92.0}}
    chat = {"idle": {"ttft_ms": {"p99": 50.0}}, "beside": {"ttft_ms": {"p99": 140.0}}}
    t = users.batch_chat_targets(batch, chat)
    assert (t["chat_ttft_p99_bound_ms"], t["chat_ttft_met"]) == (140.0, True)
    assert (t["batch_kept"], t["batch_kept_met"]) == (0.92, True)
    chat["beside"]["ttft_ms"]["p99"], batch["beside"]["output_throughput"] = 141.0, 89.0
    t = users.batch_chat_targets(batch, chat)
    assert (t["chat_ttft_met"], t["batch_kept_met"]) == (False, False)
    chat["beside"]["ttft_ms"]["p99"] = None  # no turn beside the batch
    assert users.batch_chat_targets(batch, chat)["chat_ttft_met"] is None


# ---- the report ----

def _users_run(shape: str) -> dict:
    ok = RequestResult(start=0, end=0.5, ttft=0.1, itl=[0.2, 0.2], output_tokens=3)
    failed = RequestResult(start=0, end=0.1, error="HTTP 429: busy")
    phases = {"batch-chat": ({"alone": ([ok], 1.0), "beside": ([ok, failed], 2.0)},
                             {"idle": ([ok], 1.0), "beside": ([ok], 1.0)}),
              "backlogged": ({"backlogged": ([ok], 1.0)}, {"backlogged": ([ok], 1.0)})}[shape]
    people = users.users(shape, [1.0, 3.0])
    figures = users.by_user(dict(zip(people, phases)))
    run = {"server": "cllm", "shape": shape, "users": figures}
    if shape == "batch-chat":
        named = [figures[u.name]["phases"] for u in people]
        return run | {"targets": users.batch_chat_targets(*named)}
    for f, share in zip(figures.values(), (0.3, 0.7)):
        f |= {"share": share, "target_share": f["weight"] / 4}
    return run | {"window_s": 2.5, "targets": {"share_points": 0.05, "shares_met": True}}


def test_the_table_has_a_row_a_user_and_phase_and_each_runs_targets():
    data = report.new_report({"workload": "mixed-users", "users_shape": "backlogged",
                              "weights": [1.0, 3.0], "prompt_tokens": 64, "max_tokens": 16,
                              "parallel": 4}, None)
    assert "mixed-users (backlogged, weights 1:3)" in report.header(data)
    lines = report.table([_users_run("batch-chat"), _users_run("backlogged")]).splitlines()
    assert lines[0].split()[:5] == ["server", "shape", "user", "weight", "phase"]
    rows = [line.split() for line in lines[1:] if line.startswith(" ") and "cllm" in line]
    assert [(r[2], r[4]) for r in rows] == [("batch", "alone"), ("batch", "beside"),
                                            ("chat", "idle"), ("chat", "beside"),
                                            ("big", "backlogged"), ("small", "backlogged")]
    assert rows[-1][-1] == "70.0%"
    text = "\n".join(lines)
    assert "1 × HTTP 429: busy" in text and "the batch keeps 0.50 of its throughput" in text
    assert "shares while both had requests waiting (2.5 s): big 30.0% (target 25%), " \
           "small 70.0% (target 75%), within ±5 points: met" in text



# ---- the keys on the wire ----

def test_each_request_sends_its_users_key_and_the_rest_the_first_users():
    seen: list[tuple[str, str]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("Authorization")))
        if request.method == "GET":
            return web.json_response({"data": [{"id": "m"}]})
        chunks = [{"choices": [{"delta": {"content": "hi"}}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return web.Response(text=sse, content_type="text/event-stream")

    async def run():
        app = web.Application()
        app.router.add_get("/v1/models", handle)
        app.router.add_post("/v1/chat/completions", handle)
        load = load_settings(_args())
        async with (TestServer(app, host="127.0.0.1") as server,
                    Connections(2, timeout=5, api_key="cllm-bench-batch") as connections):
            url = str(server.make_url("/"))
            await first_model(connections, url)
            return await HttpTarget(url, "m", load, connections,
                                    api_key="cllm-bench-chat").send("hello")

    assert asyncio.run(run()).ok
    assert seen == [("/v1/models", "Bearer cllm-bench-batch"),
                    ("/v1/chat/completions", "Bearer cllm-bench-chat")]


# ---- against cllm, with the real model ----

@pytest.mark.parametrize("shape, requests", [("batch-chat", 6), ("backlogged", 20)])
def test_a_short_run_against_cllm_reports_each_user(model_path, tmp_path, monkeypatch, shape,
                                                     requests):
    """cllm starts with the generated key file (every request then needs its user's key,
    or it fails with a 401) and the report holds each user's figures and the targets."""
    monkeypatch.setattr(users, "CHAT_EVERY", 0.1)
    bench_main.main(["--cllm", "--model", model_path, "--workload", "mixed-users",
                     "--users-shape", shape, "--weights", "1", "3", "--parallel", "2",
                     "--ctx-size", "2048", "--threads", "1", "--requests", str(requests),
                     "--prompt-tokens", "32", "--max-tokens", "8", "--warmup", "1",
                     "--out", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    assert "--api-key-file" in data["servers"]["cllm"]["command"]
    keys = parse_api_keys((tmp_path / "logs" / "users.keys").read_text())
    assert [(k.name, k.weight) for k in keys] == [(u.name, u.weight)
                                                  for u in users.users(shape, [1, 3])]
    (run,) = data["runs"]
    assert run["server"] == "cllm" and run["shape"] == shape and run["warmup_failed"] == 0
    phases = {name: f["phases"] for name, f in run["users"].items()}
    assert all(m["failed"] == 0 for by_phase in phases.values() for m in by_phase.values())
    if shape == "batch-chat":
        assert phases["batch"]["alone"]["completed"] == phases["batch"]["beside"]["completed"] \
            == requests
        assert phases["chat"]["beside"]["completed"] >= 1
        assert phases["chat"]["idle"]["completed"] == phases["chat"]["beside"]["completed"]
        t = run["targets"]
        assert t["chat_ttft_met"] in (True, False) and t["batch_kept"] > 0
    else:
        assert phases["big"]["backlogged"]["completed"] == requests
        assert phases["small"]["backlogged"]["completed"] == requests // 10
        assert sum(f["share"] for f in run["users"].values()) == pytest.approx(1.0)
        assert run["window_s"] > 0 and run["targets"]["shares_met"] in (True, False)
