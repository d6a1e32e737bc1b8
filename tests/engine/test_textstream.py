"""TextStream alone: whole characters out, stop strings never emitted, and which pieces the\nemitted text has reached (their logprobs go with it)."""
from cllm.engine.textstream import TextStream


def feed_all(stream, pieces):
    return [stream.feed(p) for p in pieces]


def test_multibyte_character_split_across_pieces_comes_out_whole():
    data = "é🎉".encode()
    stream = TextStream()
    out = feed_all(stream, [data[:1], data[1:3], data[3:5], data[5:]])
    assert out == ["", "é", "", "🎉"]
    assert stream.flush() == ""


def test_stop_string_spanning_pieces_is_cut_before_it():
    stream = TextStream(stop=("STOP",))
    out = feed_all(stream, [b"hello S", b"TO", b"P and more"])
    assert "".join(out) == "hello "
    assert stream.stopped
    assert stream.feed(b"after") == "" and stream.flush() == ""


def test_text_that_only_looks_like_a_stop_is_released():
    stream = TextStream(stop=("STOP",))
    assert stream.feed(b"a ST") == "a "  # "ST" may begin the stop string: held back
    assert stream.feed(b"ART") == "START"
    assert not stream.stopped


def test_earliest_of_several_stops_wins():
    stream = TextStream(stop=("world", "lo w"))
    assert stream.feed(b"hello world") == "hel"
    assert stream.stopped


def test_held_text_is_flushed_when_generation_ends_otherwise():
    stream = TextStream(stop=("\n\n",))
    assert stream.feed(b"line\n") == "line"
    assert stream.flush() == "\n"


def test_invalid_utf8_becomes_replacement_characters():
    stream = TextStream()
    assert stream.feed(b"a\xffb") == "a\ufffdb"


def test_a_piece_is_reached_once_one_of_its_characters_is_emitted():
    stream = TextStream(stop=("STOP",), count_tokens=True)
    assert stream.feed(b"a") == "a" and stream.take_reached() == 1
    assert stream.feed(b" S") == " " and stream.take_reached() == 1  # " " out, "S" held
    assert stream.feed(b"T") == "" and stream.take_reached() == 0
    assert stream.feed(b"AR") == "STAR" and stream.take_reached() == 2  # both now out


def test_pieces_wholly_in_a_stop_string_are_never_reached():
    """A piece partly before the stop string counts; one wholly in it does not."""
    stream = TextStream(stop=("STOP",), count_tokens=True)
    feed_all(stream, [b"hi", b" S", b"TO", b"P!"])
    assert stream.stopped and stream.take_reached() == 2
    assert stream.flush() == "" and stream.take_reached() == 0


def test_flush_reaches_every_piece_left():
    stream = TextStream(stop=("\n\n",), count_tokens=True)
    data = "é".encode()
    assert feed_all(stream, [b"line", b"\n", data[:1]]) == ["line", "", ""]
    assert stream.take_reached() == 1
    assert stream.flush() == "\n\ufffd" and stream.take_reached() == 2
