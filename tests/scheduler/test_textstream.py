"""Incremental detokenization: whole codepoints only, stop strings withheld and removed."""

from __future__ import annotations

from scheduler_daemon.core.textstream import TextStream


def feed_all(stream: TextStream, pieces: list[bytes]) -> list[str]:
    return [stream.feed(p) for p in pieces]


def test_multibyte_codepoints_split_across_pieces_are_never_split():
    text = "猫🐱é"
    raw = text.encode()
    pieces = [raw[i : i + 1] for i in range(len(raw))]  # one byte per token: the worst case
    stream = TextStream()
    out = feed_all(stream, pieces)
    assert "".join(out) + stream.flush() == text
    assert all("\ufffd" not in part for part in out)
    assert out[:2] == ["", ""] and out[2] == "猫"


def test_stop_string_split_across_tokens_is_withheld_then_dropped():
    stream = TextStream(["END"])
    out = feed_all(stream, [b"hello E", b"N", b"D tail"])
    assert out == ["hello ", "", ""]
    assert stream.stopped_by == "END"
    assert stream.flush() == ""


def test_partial_stop_is_released_when_it_does_not_complete():
    stream = TextStream(["END"])
    assert stream.feed(b"an E") == "an "
    assert stream.feed(b"Nx") == "ENx"
    assert stream.feed(b" E") == " "
    assert stream.flush() == "E"


def test_earliest_of_several_stop_strings_wins():
    stream = TextStream(["world", "lo w"])
    assert stream.feed(b"hello world") == "hel"
    assert stream.stopped_by == "lo w"


def test_stop_inside_one_piece_keeps_the_text_before_it():
    stream = TextStream(["\n\n"])
    assert stream.feed(b"line one\n\nline two") == "line one"


def test_invalid_utf8_becomes_replacement_not_an_exception():
    stream = TextStream()
    assert stream.feed(b"ok \xff") == "ok \ufffd"
    assert stream.feed(b"\xe7\x8c") == ""
    assert stream.flush() == "\ufffd"
