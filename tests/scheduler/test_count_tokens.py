"""A tokenize job of chat messages (Anthropic's count_tokens, inference/anthropic_api.py): the
daemon's vocabulary answer counts the prompt a chat job of those messages would get, on the
real model (Gemma's built-in template)."""
from __future__ import annotations

import pytest

from wire import protocol
from wire.errors import InvalidParameter

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
TOOLS = {"mode": "auto", "functions": [{"type": "function", "function": {
    "name": "f", "description": "", "parameters": {"type": "object"}}}]}


def test_messages_are_counted_as_a_chat_job_would_render_them(core):
    answer, counted = core.vocabulary_answer(protocol.TOKENIZE_KIND, None, {}, MESSAGES)
    tokens = core.prompt_tokens(None, MESSAGES)
    assert answer == {"input_tokens": len(tokens)} and counted == len(tokens)
    text_only, _ = core.vocabulary_answer(protocol.TOKENIZE_KIND, "Hi there",
                                          {"add_special": False, "with_pieces": False})
    assert len(tokens) > len(text_only["tokens"])  # the template's markup is counted too


@pytest.mark.parametrize(("prompt", "messages", "tools", "param"), [
    ("text", MESSAGES, None, "prompt"),  # one or the other
    (None, [{"role": "nobody", "content": "x"}], None, "messages[0].role"),
    (None, MESSAGES, {"mode": "auto"}, "tools"),  # the wire shape of a job's tools
    (None, MESSAGES, TOOLS, "tools"),  # Gemma's template renders no tools
])
def test_a_rogue_count_is_refused_by_field(core, prompt, messages, tools, param):
    with pytest.raises(InvalidParameter) as refused:
        core.vocabulary_answer(protocol.TOKENIZE_KIND, prompt, {}, messages, tools)
    assert refused.value.param == param
