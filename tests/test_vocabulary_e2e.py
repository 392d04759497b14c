"""POST /v1/tokenize and /v1/detokenize (#16), llama-server's shapes, answered by the
model's daemon from its vocabulary. Real daphne, Redis and daemons (Gemma, SmolLM2)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from config.models import SMOLLM2

pytestmark = pytest.mark.slow
MULTILINGUAL = "Grüße, 世界! Привет 👋🏽 — naïve café, emoji 🎉 and ﷺ"


def post(web, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{web.base_url}/v1/{path}", method="POST", data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key or web.keys['owner']}",
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("which", ["gemma", "chat"])
def test_tokenize_then_detokenize_round_trips_multilingual_text_with_emoji(web, daemon,
                                                                           chat_daemon, which):
    model = daemon.model if which == "gemma" else SMOLLM2
    status, tokenized = post(web, "tokenize", {"model": model, "content": MULTILINGUAL})
    assert status == 200 and all(type(t) is int for t in tokenized["tokens"])
    assert len(tokenized["tokens"]) > 10
    status, detokenized = post(web, "detokenize", {"model": model,
                                                   "tokens": tokenized["tokens"]})
    assert (status, detokenized) == (200, {"content": MULTILINGUAL})


def test_the_two_models_tokenize_differently_and_the_default_is_the_chat_model(web, daemon,
                                                                               chat_daemon):
    _, gemma = post(web, "tokenize", {"model": daemon.model, "content": MULTILINGUAL})
    _, smol = post(web, "tokenize", {"model": SMOLLM2, "content": MULTILINGUAL})
    _, default = post(web, "tokenize", {"content": MULTILINGUAL})
    assert gemma["tokens"] != smol["tokens"] and default == smol


def test_pieces_and_add_special(web, daemon):
    _, plain = post(web, "tokenize", {"model": daemon.model, "content": "Hello world"})
    _, special = post(web, "tokenize", {"model": daemon.model, "content": "Hello world",
                                        "add_special": True})
    assert special["tokens"][1:] == plain["tokens"]  # Gemma's BOS first
    _, pieces = post(web, "tokenize", {"model": daemon.model, "content": "Hello 👋",
                                       "with_pieces": True})
    ids = [p["id"] for p in pieces["tokens"]]
    _, again = post(web, "tokenize", {"model": daemon.model, "content": "Hello 👋"})
    assert ids == again["tokens"]
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                      for p in pieces["tokens"])
    assert joined == "Hello 👋".encode()


@pytest.mark.parametrize("path, body, param", [
    ("detokenize", {"tokens": [10**9]}, "tokens"),  # outside the vocabulary: the daemon says
    ("detokenize", {"tokens": [-1]}, "tokens"),
    ("detokenize", {"tokens": "abc"}, "tokens"),
    ("detokenize", {"tokens": [1.5]}, "tokens"),
    ("detokenize", {"tokens": [0] * 65_537}, "tokens"),
    ("detokenize", {}, "tokens"),
    ("tokenize", {}, "content"),
    ("tokenize", {"content": 7}, "content"),
    ("tokenize", {"content": "\ud800"}, "content"),
    ("tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("tokenize", {"content": "x", "frobnicate": 1}, "frobnicate"),
])
def test_bad_bodies_are_400s_naming_the_field(web, daemon, path, body, param):
    status, reply = post(web, path, {"model": daemon.model, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_the_daemon_survives_every_id_and_answers_after(web, daemon):
    """The last id of the vocabulary and the first past it: one answer, one refusal, then
    the daemon still serves (a token id past the end must never reach llama.cpp)."""
    _, vocab = post(web, "tokenize", {"model": daemon.model, "content": "x"})
    status, _ = post(web, "detokenize", {"model": daemon.model, "tokens": [262_143]})
    assert status == 200
    status, reply = post(web, "detokenize", {"model": daemon.model, "tokens": [262_144]})
    assert status == 400 and "vocabulary" in reply["error"]["message"]
    assert post(web, "tokenize", {"model": daemon.model, "content": "x"})[1] == vocab


def test_a_bad_key_is_401(web, daemon):
    status, reply = post(web, "tokenize", {"content": "x"}, key="sk-nope.nope")
    assert status == 401
