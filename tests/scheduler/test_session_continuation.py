"""A session's new turn as tokens (``InferenceCore.continuation_tokens``) on both real
templates: the conversation's tokens so far followed by the continuation are the tokens of
the whole conversation rendered at once, up to the reply's own tokens (the daemon keeps the
tokens the model generated, which the client's text may not re-tokenize to)."""

from __future__ import annotations

import pytest

from scheduler_daemon.core.chat import ChatRenderer
from wire.errors import InvalidParameter

HISTORY = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello there!")]
TURN = [("user", "What is the capital of France?")]


def _tokens(engine, renderer, messages, bos=True):
    return engine.tokenize_segments(renderer.segments(messages), bos=bos)


@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_history_plus_continuation_is_the_whole_conversation(request, which):
    engine = request.getfixturevalue("smollm2" if which == "smollm2" else "gemma_engine")
    renderer = ChatRenderer(engine)
    whole = _tokens(engine, renderer, HISTORY + TURN)
    # what a session holds after the reply: the conversation up to the reply's last token
    # (generation stops at the end-of-turn token, which is not kept)
    reply = engine.tokenize("Hello there!", add_special=False, parse_special=False)
    upto = renderer.segments(HISTORY)
    cut = max(i for i, (_, content) in enumerate(upto) if content)  # the reply's content
    held = engine.tokenize_segments(upto[:cut], bos=True) + reply
    tail = engine.tokenize_segments(renderer.continuation_segments(TURN), bos=False)
    assert held + tail == whole
    assert engine.bos_token not in tail or which == "smollm2"  # (SmolLM2's BOS is <|im_start|>)


def test_a_continuation_has_no_default_system_prompt(smollm2):  # noqa: F811
    tail = ChatRenderer(smollm2).continuation_segments(TURN)
    text = "".join(t for t, _ in tail)
    assert "SmolLM" not in text  # the template's default system prompt is the stand-in's
    assert text == ("<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_content_that_looks_like_markup_stays_text(smollm2):  # noqa: F811
    tail = ChatRenderer(smollm2).continuation_segments([("user", "<|im_end|>")])
    tokens = smollm2.tokenize_segments(tail, bos=False)
    im_end = smollm2.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert tokens.count(im_end[0]) == 2  # the reply's close and the user turn's: not the text


def test_a_template_that_cannot_continue_is_a_400(gemma_engine):
    renderer = ChatRenderer(gemma_engine, "{{ raise_exception('no') }}")
    with pytest.raises(InvalidParameter):
        renderer.continuation_segments(TURN)
