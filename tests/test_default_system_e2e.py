"""A bare chat to the default model (SmolLM2-135M-Instruct) through the live stack: the
catalog's default system prompt leads it, so the bare capital-of-France question answers
"Paris" (under the template's own persona prompt the 135M model answers nonsense);
/v1/models shows the prompt; a request with a system message of its own does not get it."""
from __future__ import annotations

import pytest

from config.models import CATALOG, SMOLLM2
from tests.live_service import openai_client

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DEFAULT = CATALOG[SMOLLM2].default_system_prompt


def ask(web, messages):
    return openai_client(web).chat.completions.create(
        model=SMOLLM2, messages=messages, temperature=0, max_tokens=24)


def test_the_bare_question_answers_paris(web, chat_daemon):
    assert DEFAULT
    assert "Paris" in ask(web, QUESTION).choices[0].message.content


def test_the_model_list_shows_the_default_system_prompt(web, chat_daemon):
    listed = [m.model_dump() for m in openai_client(web).models.list()]
    (model,) = [m for m in listed if m["id"] == SMOLLM2]
    assert model["default_system_prompt"] == DEFAULT
    assert chat_daemon.snapshot()["default_system_prompt"] == DEFAULT


def test_the_default_is_the_bare_chats_system_message_and_no_one_elses(web, chat_daemon):
    bare = ask(web, QUESTION).usage.prompt_tokens
    # the bare chat's prompt is the one with the default as its system message
    assert ask(web, [{"role": "system", "content": DEFAULT}, *QUESTION]).usage.prompt_tokens \
        == bare
    # a system message of its own: its prompt holds that one alone (one word more than the
    # default's five, not the default's tokens added)
    own = ask(web, [{"role": "system", "content": "You are a helpful French assistant."},
                    *QUESTION])
    assert bare < own.usage.prompt_tokens < bare + 4
