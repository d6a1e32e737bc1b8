"""SSE parsing and per-request timing from synthetic lines and timestamps; no server, no model."""
import json

import pytest

from cllm.bench.loadgen import (
    EMPTY_RESPONSE,
    HttpTarget,
    LoadSettings,
    RequestResult,
    StreamParser,
    cached_tokens,
)


def _chunk(text: str, finish: str | None = None) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text,
                                               "finish_reason": finish}]})


def _usage(prompt: int, completion: int) -> str:
    return "data: " + json.dumps({"choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion}})


def _feed(parser: StreamParser, timed_lines: list[tuple[float, str]]) -> None:
    for now, line in timed_lines:
        parser.feed(line, now)


def test_stream_times_and_usage():
    parser = StreamParser(start=10.0)
    _feed(parser, [(10.5, _chunk("Hello")), (10.5, ""), (10.7, _chunk(" big")),
                   (11.0, _chunk(" world", "length")), (11.0, _usage(7, 3)), (11.0, "data: [DONE]")])
    r = parser.finish(11.25)
    assert r.ok and r.output_tokens == 3 and r.prompt_tokens == 7
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.2, 0.3])
    assert r.latency == pytest.approx(1.25)
    assert r.tpot == pytest.approx((1.25 - 0.5) / 2)
    assert r.finish_reason == "length"


def test_usage_counts_tokens_beyond_chunks():
    """A server may put several tokens in one chunk: usage, not the chunk count, is the count."""
    parser = StreamParser(start=0.0)
    _feed(parser, [(1.0, _chunk("ab")), (2.0, _chunk("cd", "length")), (2.0, _usage(3, 4)),
                   (2.0, "data: [DONE]")])
    r = parser.finish(2.0)
    assert r.output_tokens == 4 and parser.chunks == 2
    assert r.tpot == pytest.approx(1.0 / 3)


def test_without_usage_counts_chunks():
    parser = StreamParser(start=0.0)
    _feed(parser, [(1.0, _chunk("a")), (2.0, _chunk("b")), (2.5, "data:[DONE]")])
    assert parser.finish(2.5).output_tokens == 2


def test_chat_deltas_and_empty_chunks():
    """The role-only first delta and the empty finish chunk carry no text, so no token arrival."""
    lines = [{"choices": [{"delta": {"role": "assistant"}}]},
             {"choices": [{"delta": {"content": "Hi"}}]},
             {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
    parser = StreamParser(start=0.0)
    for i, chunk in enumerate(lines):
        parser.feed("data: " + json.dumps(chunk), float(i + 1))
    parser.feed("data: [DONE]", 4.0)
    r = parser.finish(4.0)
    assert r.ttft == 2.0 and r.output_tokens == 1 and r.itl == [] and r.finish_reason == "stop"


def test_comments_and_other_fields_are_ignored():
    parser = StreamParser(start=0.0)
    _feed(parser, [(0.1, ": keep-alive"), (0.2, "event: message"), (0.3, _chunk("x")),
                   (0.4, "data: [DONE]")])
    assert parser.finish(0.4).output_tokens == 1


def test_empty_stream_is_a_failure():
    parser = StreamParser(start=0.0)
    _feed(parser, [(1.0, _usage(5, 0)), (1.0, "data: [DONE]")])
    r = parser.finish(1.0)
    assert not r.ok and r.error == EMPTY_RESPONSE


def test_missing_done_is_a_failure():
    parser = StreamParser(start=0.0)
    parser.feed(_chunk("a"), 1.0)
    assert parser.finish(1.0).error == "stream ended without [DONE]"


def test_error_event_is_a_failure():
    parser = StreamParser(start=0.0)
    parser.feed(_chunk("a"), 1.0)
    parser.feed('data: {"error": {"message": "context full", "code": 500}}', 1.1)
    parser.feed("data: [DONE]", 1.2)
    assert parser.finish(1.2).error == "stream error: context full"


def test_tpot_needs_two_tokens_and_a_stream():
    assert RequestResult(start=0, end=1, ttft=0.5, output_tokens=1).tpot is None
    assert RequestResult(start=0, end=1, ttft=1, output_tokens=5, streamed=False).tpot is None


def test_a_request_sends_its_sampling_fields():
    load = LoadSettings(sampling={"temperature": 0.7, "top_p": 0.95, "top_k": 0})
    body = HttpTarget("http://x/", "m", load, None).body("hi")
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.95, 0)
    assert "min_p" not in body


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_request_body(endpoint):
    target = HttpTarget("http://x/", "m", LoadSettings(endpoint=endpoint, max_tokens=9), None)
    body = target.body("hi")
    assert body["model"] == "m" and body["max_tokens"] == 9 and body["temperature"] == 0.0
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    if endpoint == "chat":
        assert target.endpoint_url == "http://x/v1/chat/completions"
        assert body["messages"] == [{"role": "user", "content": "hi"}]
    else:
        assert target.endpoint_url == "http://x/v1/completions" and body["prompt"] == "hi"


def test_request_body_without_stream_or_ignore_eos():
    body = HttpTarget("http://x", "m", LoadSettings(stream=False, ignore_eos=False), None).body("p")
    assert "stream_options" not in body and "ignore_eos" not in body and body["stream"] is False


def _final(usage: dict | None = None, timings: dict | None = None) -> str:
    chunk: dict = {"choices": []}
    if usage is not None:
        chunk["usage"] = {"prompt_tokens": 100, "completion_tokens": 2, **usage}
    if timings is not None:
        chunk["timings"] = timings
    return "data: " + json.dumps(chunk)


def _streamed(*tail: str) -> RequestResult:
    parser = StreamParser(start=0.0)
    _feed(parser, [(1.0, _chunk("a")), (2.0, _chunk("b", "length")),
                   *((2.0, line) for line in tail), (2.0, "data: [DONE]")])
    return parser.finish(2.0)


@pytest.mark.parametrize("tail, cached", [
    # OpenAI's field (cllm; llama-server too at this pin, beside its timings)
    ([_final({"prompt_tokens_details": {"cached_tokens": 96}})], 96),
    # llama-server's own: timings.cache_n, on text chunks too, the last one final
    ([_final(timings={"cache_n": 10}), _final({}, timings={"cache_n": 64})], 64),
    # both: usage wins, even where a later chunk carries timings only
    ([_final({"prompt_tokens_details": {"cached_tokens": 96}}, {"cache_n": 1}),
      _final(timings={"cache_n": 2})], 96),
    ([_final({})], None),  # a server that does not say is not a server with no hits
])
def test_cached_tokens_from_either_shape(tail, cached):
    r = _streamed(*tail)
    assert r.ok and r.prompt_tokens == 100 and r.cached_tokens == cached


def test_stream_keeps_the_reply_text():
    assert _streamed(_final({})).text == "ab"


@pytest.mark.parametrize("payload, cached", [
    ({"usage": {"prompt_tokens_details": {"cached_tokens": 7}}}, 7),
    ({"timings": {"cache_n": 5}}, 5),
    ({"usage": {"prompt_tokens_details": {"cached_tokens": 0}}, "timings": {"cache_n": 5}}, 0),
    ({"usage": {"prompt_tokens_details": {}}}, None),
    ({}, None),
])
def test_cached_tokens(payload, cached):
    assert cached_tokens(payload) == cached


def test_chat_messages_and_cache_prompt_in_body():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    target = HttpTarget("http://x", "m", LoadSettings(endpoint="chat"), None)
    body = target.body(messages)
    assert body["messages"] == messages and "cache_prompt" not in body
    for value in (True, False):
        load = LoadSettings(cache_prompt=value)
        assert HttpTarget("http://x", "m", load, None).body("p")["cache_prompt"] is value
