"""The stream interval (cllm/engine/pending.py): how pending tokens are grouped into deltas,
then through every streaming route of a real server whose decode runs make 8 tokens at once (as on a GPU),
so that a step's tokens must be split to keep the interval."""
import json
import math

import pytest
from http_checks import post_stream
from model_facts import ON_GPU_NOT_BATCH_INVARIANT
from server_process import ServerProcess

from cllm.engine.pending import PendingTokens

# ---- the grouping ----


def feed(pending, n, start=0):
    pending.add(list(range(start, start + n)), [f"<{t}>" for t in range(start, start + n)])


def test_first_token_at_once_then_whole_groups_and_the_rest_at_the_end():
    pending = PendingTokens(4, logprobs=False)
    feed(pending, 1)
    assert [g.token_ids for g in pending.due()] == [[0]]
    feed(pending, 3, 1)
    assert pending.due() == []  # 3 of 4: they wait
    feed(pending, 8, 4)
    groups = pending.due()
    assert [g.token_ids for g in groups] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert groups[0].text == "<1><2><3><4>" and groups[0].logprobs is None
    feed(pending, 2, 12)
    rest = pending.rest("!")
    assert [g.token_ids for g in rest] == [[9, 10, 11, 12], [13]]
    assert rest[-1].text == "<13>!"  # the text held back till the end goes with the last
    assert pending.rest("") == [("", [], None)]  # nothing left: still the final delta's group


def test_logprobs_go_with_their_tokens():
    pending = PendingTokens(2, logprobs=True)
    pending.add([0], ["<0>"], [["lp0"]])
    assert pending.due() == [("<0>", [0], ["lp0"])]
    pending.add([1, 2, 3], ["<1>", "<2>", "<3>"], [["lp1"], ["lp2"], ["lp3"]])
    assert pending.due() == [("<1><2>", [1, 2], ["lp1", "lp2"])]
    assert pending.rest("") == [("<3>", [3], ["lp3"])]
    assert pending.rest("") == [("", [], [])]


def test_logprobs_go_with_the_text_their_tokens_reached():
    """A token whose text is held back (it may begin a stop string) brings no logprob; the
    token that releases the text brings both; the end's held text brings its own."""
    pending = PendingTokens(1, logprobs=True)
    pending.add([0], ["a"], [["lp0"]])
    pending.add([1], [""], [[]])
    pending.add([2], ["bc"], [["lp1", "lp2"]])
    pending.add([3], [""], [[]])
    assert pending.due() == [("a", [0], ["lp0"]), ("", [1], []), ("bc", [2], ["lp1", "lp2"]),
                             ("", [3], [])]
    assert pending.rest("d", ["lp3"]) == [("d", [], ["lp3"])]


def test_no_interval_sends_each_batch_whole():
    pending = PendingTokens(None, logprobs=False)
    feed(pending, 1)
    feed(pending, 7, 1)
    assert [g.token_ids for g in pending.due()] == [list(range(8))]
    feed(pending, 5, 8)
    assert [g.token_ids for g in pending.rest("")] == [list(range(8, 13))]


@pytest.mark.parametrize("interval", [None, 1, 3, 4])
def test_push_gives_what_add_then_due_gives(interval):
    """push() takes a step as one group when it can; whatever the steps' sizes, the groups,
    and what is left for the end, are add()'s then due()'s."""
    pushed, added = PendingTokens(interval, logprobs=True), PendingTokens(interval, logprobs=True)
    start = 0
    for n in [1, 1, 3, 4, 1, 8, 2, 2, 4, 1]:
        ids = list(range(start, start + n))
        texts, lps = [f"<{t}>" for t in ids], [[f"lp{t}"] for t in ids]
        added.add(ids, texts, lps)
        assert pushed.push(list(ids), texts, lps) == added.due()
        start += n
    assert pushed.rest("!") == added.rest("!")


def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        PendingTokens(0, logprobs=False)


# ---- every streaming route, with decode runs of 8 ----

PROMPT = "The history of the printing press begins"
MAX_TOKENS = 21
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module", params=[1, 4], ids=["interval1", "interval4"])
def server(request):
    with ServerProcess("--stream-interval", str(request.param), "--decode-steps", "8") as srv:
        srv.interval = request.param
        yield srv


def sse_data(raw: bytes) -> list:
    """The JSON payloads of the `data:` lines of an SSE body ([DONE] left out)."""
    lines = [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    return [json.loads(p) for p in lines if p != b"[DONE]"]


def stream(http, path, body):
    response, raw = post_stream(http, path, {**body, "stream": True})
    assert response.status_code == 200, raw
    return sse_data(raw)


def whole(http, path, body):
    response = http.post(path, json={**body, "stream": False})
    assert response.status_code == 200, response.text
    return response.json()


GREEDY = {"temperature": 0, "ignore_eos": True}
# route: (body, the whole response's text, each streamed event's (text, its tokens or None))
ROUTES = {
    "/v1/completions": (
        {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True, **GREEDY},
        lambda r: r["choices"][0]["text"],
        lambda e: ((e["choices"][0]["text"], e["choices"][0]["token_ids"])
                   if e["choices"] else None)),
    "/v1/chat/completions": (
        {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "return_token_ids": True, **GREEDY},
        lambda r: r["choices"][0]["message"]["content"],
        lambda e: ((e["choices"][0]["delta"]["content"], e["choices"][0]["token_ids"])
                   if e["choices"] and e["choices"][0]["delta"].get("content") else None)),
    "/completion": (
        {"prompt": PROMPT, "n_predict": MAX_TOKENS, "return_tokens": True, **GREEDY},
        lambda r: r["content"],
        lambda e: (e["content"], e["tokens"]) if not e["stop"] else None),
    "/generate": (
        {"prompt": PROMPT, "max_tokens": MAX_TOKENS, **GREEDY},
        lambda r: r["data"]["text"],
        lambda e: (e["data"]["text"], e["data"]["generated_tokens"])),  # a running count
    "/v1/responses": (
        {"input": MESSAGES[0]["content"], "max_output_tokens": MAX_TOKENS, **GREEDY},
        lambda r: r["output"][0]["content"][0]["text"],
        lambda e: (e["delta"], None) if e["type"] == "response.output_text.delta" else None),
    "/v1/messages": (  # no ignore_eos in Anthropic's API: a story does not end in 21 tokens
        {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0},
        lambda r: r["content"][0]["text"],
        lambda e: ((e["delta"]["text"], None) if e["type"] == "content_block_delta" else None)),
}


def token_counts(path, tokens):
    """Tokens per event: the ids' count, or the differences of /generate's running count."""
    if path != "/generate":
        return [len(t) for t in tokens]
    return [b - a for a, b in zip([0, *tokens], tokens)]


@ON_GPU_NOT_BATCH_INVARIANT  # the second request's prompt comes from the prefix cache
@pytest.mark.parametrize("path", ROUTES)
def test_events_carry_at_most_the_interval_and_add_up_to_the_whole_text(server, http, path):
    body, text_of, event_of = ROUTES[path]
    events = [e for e in map(event_of, stream(http, path, body)) if e is not None]
    texts, tokens = zip(*events)
    assert "".join(texts) == text_of(whole(http, path, body))
    n = server.interval
    if tokens[0] is not None:
        counts = token_counts(path, tokens)
        assert sum(counts) == MAX_TOKENS
        assert all(1 <= c <= n for c in counts)
        assert all(c == n for c in counts[1:-1])  # whole groups between the first and the last
    else:  # no counts in this API: as many text events as groups of at most n tokens make
        assert math.ceil(MAX_TOKENS / n) <= len(events) <= 1 + math.ceil((MAX_TOKENS - 1) / n)


@pytest.mark.parametrize("server", [1], indirect=True, ids=["interval1"])
def test_interval_one_sends_each_tokens_own_text(server, http):
    body, _, event_of = ROUTES["/v1/completions"]
    for text, ids in filter(None, map(event_of, stream(http, "/v1/completions", body))):
        assert len(ids) == 1
        assert text == http.post("/detokenize", json={"tokens": ids}).json()["content"]
