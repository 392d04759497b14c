"""The in-flight set's key never expires before its members.

``llm:limit:inflight:<tenant>`` holds every slot of a tenant: requests (expiring after
``slot_ttl_s``, ~11 min) and resumes (30 s, renewed while their reader reads). The key's
TTL may only grow: set to whatever the latest writer wanted, a resume's 30 s would cut the
running requests' slots (and, with them, their token reservations) after 30 s, and a resume
renewed past the key's TTL would vanish with it.
"""

from __future__ import annotations

import time
import uuid

from wire import limits as wire_limits

SLOT_TTL_S = 690


def tenant_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def test_a_resume_slot_does_not_shorten_a_running_requests_slot(redis_client):
    t, now = tenant_id(), time.time()
    lim = wire_limits.Limits(max_concurrent=2, tokens_per_minute=10_000)
    assert wire_limits.admit(redis_client, t, "r1", lim, now=now, reserve=100,
                             slot_ttl_s=SLOT_TTL_S) is None
    assert wire_limits.take_slot(redis_client, t, "resume:x", 2, now=now, ttl_s=30) is None
    assert redis_client.ttl(wire_limits.inflight_key(t)) > SLOT_TTL_S - 5
    assert redis_client.ttl(wire_limits.reserved_key(t)) > SLOT_TTL_S - 5


def test_a_renewed_resume_slot_keeps_its_key_alive(redis_client):
    t, now = tenant_id(), time.time()
    assert wire_limits.take_slot(redis_client, t, "resume:y", 2, now=now, ttl_s=30) is None
    redis_client.expire(wire_limits.inflight_key(t), 5)  # the key near its end, as after 25 s
    wire_limits.renew_slot(redis_client, t, "resume:y", 30, now)
    assert redis_client.ttl(wire_limits.inflight_key(t)) > 25
    # a slot no longer held is not brought back by a renewal
    wire_limits.free_slot(redis_client, t, "resume:y")
    wire_limits.renew_slot(redis_client, t, "resume:y", 30, now)
    assert redis_client.zscore(wire_limits.inflight_key(t), "resume:y") is None


def test_an_admission_does_not_shorten_a_longer_lived_key(redis_client):
    t, now = tenant_id(), time.time()
    assert wire_limits.take_slot(redis_client, t, "resume:z", 3, now=now, ttl_s=SLOT_TTL_S * 2
                                 ) is None
    lim = wire_limits.Limits(max_concurrent=3)
    assert wire_limits.admit(redis_client, t, "r2", lim, now=now, reserve=0,
                             slot_ttl_s=SLOT_TTL_S) is None
    assert redis_client.ttl(wire_limits.inflight_key(t)) > SLOT_TTL_S + 100
