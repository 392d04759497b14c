"""The disk tier end to end: a conversation's next turn after a daemon restart is a disk hit,
for its tenant only, as the API's usage and the request's history say. Real daphne, a real
``run_scheduler`` (Gemma) stopped with SIGTERM and started again over the same folder."""

from __future__ import annotations

import pytest

from tests.live_service import RealDaemon

pytestmark = pytest.mark.slow

STORY = ("Remember this. The secret code word is ZEBRAFIX. " + (
    "The weather report says the morning will be cool and the afternoon warm. "
    "Farmers in the valley are harvesting apples and pears this week. ") * 6)


def chat(web, model: str, key: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0}
    reply = web.request("POST", "/v1/chat/completions", body, key, timeout=300)
    assert reply.status == 200, reply.json()
    return reply.json()


def test_the_next_turn_after_a_restart_is_a_disk_hit_for_its_tenant_only(web):
    daemon = RealDaemon(web, "gemma-disk-e2e", PROMPT_CACHE_DISK_MIN_TOKENS="64")
    turn1 = [{"role": "user", "content": STORY + "What is the weather like?"}]
    daemon.start()
    try:
        first = chat(web, daemon.model, web.keys["owner"], turn1)
    finally:
        daemon.stop()  # SIGTERM: the state was saved as the request ended, at the latest now

    daemon.start()
    try:
        turn2 = [*turn1, first["choices"][0]["message"],
                 {"role": "user", "content": "And what is the secret code word?"}]
        second = chat(web, daemon.model, web.keys["owner"], turn2)
        outsider = chat(web, daemon.model, web.keys["outsider"], turn2)
    finally:
        daemon.stop()
    details = second["usage"]["prompt_tokens_details"]
    assert details["cache_tier"] == "disk" and details["cache_hit"] == "prefix"
    assert details["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    assert details["cache_read_tokens"] == details["cached_tokens"]
    assert details["cache_created_tokens"] == (second["usage"]["prompt_tokens"]
                                               - details["cached_tokens"])
    theirs = outsider["usage"]["prompt_tokens_details"]
    assert theirs["cached_tokens"] == 0 and theirs["cache_tier"] is None
    row = web.request("GET", f"/v1/requests/{second['id'].split('-', 1)[1]}",
                      key=web.keys["owner"]).json()
    assert (row["cache_tier"], row["cache_hit"]) == ("disk", "prefix")
    assert row["cache_created_tokens"] == details["cache_created_tokens"]
