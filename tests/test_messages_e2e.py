"""POST /v1/messages and /v1/messages/count_tokens (issue 37) with the official ``anthropic``
SDK against the live stack (daphne behind the door, Redis, the SmolLM2-135M-Instruct daemon):
a plain and a streamed message, a tool use round trip, the prefix cache in Anthropic's usage,
count_tokens, and the refusals as the SDK's typed exceptions."""
from __future__ import annotations

import anthropic
import httpx2
import pytest

from config.models import SMOLLM2
from tests.test_limits_http import make_tenant

pytestmark = pytest.mark.slow
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# several hundred tokens of system prompt, the same each time
LONG_SYSTEM = SYSTEM + " " + " ".join(
    f"Rule {i}: be polite, be accurate, and never invent facts about item {i}."
    for i in range(40))


def client(web, key: str | None = None, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=web.base_url, api_key=key or web.keys["owner"],
                               max_retries=0, **kwargs)


def create(api: anthropic.Anthropic, **fields):
    # temperature: not in this SDK's signature (it still sends what extra_body holds)
    return api.messages.create(**{"model": SMOLLM2, "max_tokens": 16, "system": SYSTEM,
                                  "messages": ASK, "extra_body": GREEDY, **fields})


def test_a_plain_message(web, chat_daemon):
    reply = create(client(web))
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model == SMOLLM2
    (block,) = reply.content
    assert block.type == "text" and block.text.strip()
    assert reply.stop_reason in ("end_turn", "max_tokens")
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 0
    assert 0 < usage.output_tokens <= 16
    assert usage.cache_creation_input_tokens == 0  # no cache_control breakpoint


def test_the_stream_helper_assembles_the_text(web, chat_daemon):
    api = client(web)
    with api.messages.stream(model=SMOLLM2, max_tokens=16, system=SYSTEM, messages=ASK,
                             extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces).strip() and final.content[0].text == "".join(pieces)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert 0 < final.usage.output_tokens <= 16
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0
    with api.messages.stream(model=SMOLLM2, max_tokens=16, system=SYSTEM, messages=ASK,
                             extra_body=GREEDY) as again:
        assert again.get_final_text() == "".join(pieces)


def test_a_tool_use_round_trip(web, chat_daemon):
    api = client(web)
    first = create(api, max_tokens=24, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"},
                   messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input["city"], str)
    second = create(api, max_tokens=16, tools=[WEATHER], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "Sunny, 21 degrees Celsius."}]}],
        tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text.strip()


def test_a_second_identical_long_prompt_reads_the_cache(web, chat_daemon):
    api = client(web)
    system = [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = create(api, max_tokens=4, system=system)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens \
        + first.usage.cache_creation_input_tokens
    assert total > 300  # several hundred tokens of prompt
    assert first.usage.cache_creation_input_tokens > 0  # a breakpoint: what it kept counts
    second = create(api, max_tokens=4, system=system)
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens \
        + second.usage.cache_creation_input_tokens == total


def test_count_tokens_is_the_prompt_a_message_reports(web, chat_daemon):
    api = client(web)
    counted = api.messages.count_tokens(model=SMOLLM2, system=SYSTEM, messages=ASK)
    reply = create(api, max_tokens=2)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    with_tools = api.messages.count_tokens(model=SMOLLM2, system=SYSTEM, messages=ASK,
                                           tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens  # the tools are shown to the model


def test_count_tokens_is_counted_not_generated(web, chat_daemon):
    """A count is a tokenize of the rendered chat on the daemon's vocabulary thread: its
    history row is a tokenize with no output, and the prompt it counts is the one a message
    gets, the model's default system prompt included when the body has no system."""
    api = client(web)
    raw = api.messages.with_raw_response.count_tokens(model=SMOLLM2, messages=ASK)
    counted = raw.parse().input_tokens
    row = web.request("GET", f"/v1/requests/{raw.headers['x-request-id']}",
                      key=web.keys["owner"]).json()
    assert (row["kind"], row["status"], row["completion_tokens"]) == ("tokenize", "done", 0)
    assert row["prompt_tokens"] == counted
    reply = api.messages.create(model=SMOLLM2, max_tokens=2, messages=ASK, extra_body=GREEDY)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_a_key_in_x_api_key_works(web, chat_daemon):
    api = anthropic.Anthropic(base_url=web.base_url, api_key=None, auth_token=None,
                              max_retries=0, default_headers={"x-api-key": web.keys["owner"]})
    assert create(api, max_tokens=2).content


@pytest.mark.parametrize("how", ["x-api-key", "bearer"])
def test_a_bad_key_is_an_authentication_error(web, chat_daemon, how):
    bad = "sk-nosuch.key"
    api = (client(web, bad) if how == "bearer" else anthropic.Anthropic(
        base_url=web.base_url, api_key=None, auth_token=None, max_retries=0,
        default_headers={"x-api-key": bad}))
    with pytest.raises(anthropic.AuthenticationError) as refused:
        create(api, max_tokens=2)
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_bad_requests_are_bad_request_errors(web, chat_daemon):
    api = client(web)
    with pytest.raises(anthropic.BadRequestError) as missing:
        # (the SDK's create needs max_tokens: the same path, the body written here)
        api.post("/v1/messages", cast_to=anthropic.types.Message,
                 body={"model": SMOLLM2, "messages": ASK})
    assert missing.value.body["error"]["param"] == "max_tokens"
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as bad_block:
        create(api, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    assert bad_block.value.body["error"]["param"] == "messages[0].content[0].type"


def test_an_unknown_model_is_not_found(web, chat_daemon):
    with pytest.raises(anthropic.NotFoundError) as refused:
        create(client(web), model="claude-nosuch", max_tokens=2)
    assert refused.value.body["error"]["type"] == "not_found_error"


def test_over_the_rate_is_a_rate_limit_error_with_retry_after(web, chat_daemon):
    _, key = make_tenant(web, requests_per_minute=1)
    api = client(web, key)
    create(api, max_tokens=2)
    with pytest.raises(anthropic.RateLimitError) as refused:
        create(api, max_tokens=2)
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert refused.value.body["error"]["code"] == "rpm_exceeded"


def test_the_doors_refusals_on_messages_are_anthropic_errors(web):
    too_big = httpx2.post(f"{web.base_url}/v1/messages", headers={
        "x-api-key": web.keys["owner"], "content-type": "application/json"},
        content=b'{"x": "' + b"a" * (web.door_config.max_body_bytes + 1) + b'"}')
    assert too_big.status_code in (400, 413)  # Django's limit or the door's
    assert too_big.json()["type"] == "error"
    assert too_big.json()["error"]["type"] == "request_too_large"
    no_key = httpx2.post(f"{web.base_url}/v1/messages/count_tokens", json={})
    assert no_key.status_code == 401
    assert no_key.json()["error"]["type"] == "authentication_error"
