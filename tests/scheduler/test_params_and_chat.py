"""Request field checks and chat template choice (no model needed)."""

from __future__ import annotations

import json

import pytest

from scheduler_daemon.core.chat import ChatRenderer
from wire.errors import InvalidParameter
from wire.messages import parse_messages
from wire.sampling import SamplingParams


@pytest.mark.parametrize(
    "body, field",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 2}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": "x"}, "presence_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**40}, "seed"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"grammar": ""}, "grammar"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": [1]}, "json_schema"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_values_are_refused_naming_the_field(body, field):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams.from_dict(body)
    assert err.value.param == field and err.value.code == "invalid_request_error"
    assert field in err.value.message


def test_good_values_are_normalised():
    params = SamplingParams.from_dict(
        {
            "temperature": 0,
            "top_k": 5,
            "seed": 3,
            "stop": "END",
            "logit_bias": {"7": -2, 3: 1.5},
            "json_schema": '{"type": "object"}',
            "max_tokens": 9,
            "ignore_eos": True,
            "unknown": 1,
        }
    )
    assert (
        params.is_greedy and params.stop == ("END",) and params.logit_bias == ((3, 1.5), (7, -2.0))
    )
    assert json.loads(params.json_schema) == {"type": "object"} and params.max_tokens == 9
    assert (
        SamplingParams.from_dict({"temperature": None}).temperature == SamplingParams().temperature
    )


@pytest.mark.parametrize(
    "messages, field",
    [
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            "messages[0].content",
        ),
    ],
)
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(InvalidParameter) as err:
        parse_messages(messages)
    assert err.value.param == field


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse_messages([{"role": "user", "content": parts}]) == [("user", "ab")]


class Source:
    """A template source like the engine, without a model."""

    def __init__(self, template: str | None, adds_bos: bool = True) -> None:
        self.template = template
        self.adds_bos = adds_bos
        self.builtin_calls = []

    def model_chat_template(self):
        return self.template

    def builtin_template_name(self):
        return "gemma"

    def apply_builtin_template(self, name, messages):
        self.builtin_calls.append(name)
        return f"[{name}]" + "".join(c for _, c in messages)

    def token_text(self, token):
        return {1: "<bos>", 2: "<eos>"}[token]

    bos_token = 1
    eos_token = 2


JINJA = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_gguf_jinja_template_is_used_and_its_bos_left_to_the_tokenizer():
    renderer = ChatRenderer(Source(JINJA))
    assert renderer.kind == "jinja"
    assert renderer.render([("user", "hi")]) == "<user>hi<assistant>"


def test_a_leading_bos_stays_when_the_tokenizer_adds_none():
    """SmolLM2's BOS is <|im_start|> and its tokenizer adds no BOS: dropping it would cut
    the first turn's marker."""
    assert ChatRenderer(Source(JINJA, adds_bos=False)).render([("user", "hi")]) == (
        "<bos><user>hi<assistant>")


def test_configured_template_wins_and_a_name_means_a_builtin():
    source = Source(JINJA)
    assert ChatRenderer(source, "chatml").render([("user", "hi")]) == "[chatml]hi"
    assert ChatRenderer(source, "{{ messages[0].content }}!").render([("user", "hi")]) == "hi!"


def test_no_template_falls_back_to_the_architecture_builtin():
    renderer = ChatRenderer(Source(None))
    assert renderer.kind == "builtin:gemma" and renderer.render([("user", "x")]) == "[gemma]x"


def test_template_raise_exception_becomes_a_field_error():
    renderer = ChatRenderer(Source("{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(InvalidParameter) as err:
        renderer.render([("user", "x")])
    assert err.value.param == "messages" and "alternate" in err.value.message
