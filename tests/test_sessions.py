"""The sessions' scripts (wire/sessions.py) on the tests' Redis: a turn begins once, only
the turn that began ends it, a tenant's sessions are its own and capped, a busy mark lapses
after its deadline, a session expires after its TTL."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.live_service import redis_conn, wait_until
from wire import protocol, sessions


@pytest.fixture
def r():
    client = redis_conn()
    yield client


def begin(r, mode, sid, tenant="t1", model="m", request_id=None, busy_s=60.0, ttl=60, cap=3):
    now = time.time()
    reply = r.eval(sessions.BEGIN, 2, sessions.key(sid), sessions.tenant_key(tenant), mode, sid,
                   tenant, model, request_id or uuid.uuid4().hex, now + busy_s, ttl, cap, now)
    return [protocol.as_text(x) if isinstance(x, bytes) else x for x in reply]


def end(r, sid, request_id, tokens=b"", tenant="t1", ttl=60):
    keys, args = sessions.end_args(sid, tenant, request_id, tokens, ttl, time.time())
    return r.eval(sessions.END, len(keys), *keys, *args)


def tenant_name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def test_a_session_holds_its_turns_tokens_and_is_busy_while_a_turn_runs(r):
    sid, tenant = sessions.new_id(), tenant_name()
    assert begin(r, "new", sid, tenant, request_id="r1") == ["ok", 0]
    assert begin(r, "continue", sid, tenant) == ["session_busy"]
    assert end(r, sid, "someone-else", sessions.pack([9, 9]), tenant) == 0  # not its turn
    assert end(r, sid, "r1", sessions.pack([1, 2, 3]), tenant) == 1
    assert sessions.unpack(r.hget(sessions.key(sid), "tokens")) == [1, 2, 3]
    assert begin(r, "continue", sid, tenant, request_id="r2") == ["ok", 3]
    assert end(r, sid, "r2", b"", tenant) == 1  # a failed turn: the tokens stay
    assert sessions.unpack(r.hget(sessions.key(sid), "tokens")) == [1, 2, 3]
    assert int(r.hget(sessions.key(sid), "turns")) == 1
    assert end(r, sid, "r2", sessions.pack([7]), tenant) == 0  # a repeated end: nothing


def test_a_session_is_its_tenants_and_its_models(r):
    sid, tenant = sessions.new_id(), tenant_name()
    begin(r, "new", sid, tenant, request_id="r1")
    end(r, sid, "r1", sessions.pack([1]), tenant)
    assert begin(r, "continue", sid, tenant_name()) == ["no_session"]
    assert begin(r, "continue", sid, tenant, model="other") == ["session_model_mismatch", "m"]
    deleted = r.eval(sessions.DELETE, 2, sessions.key(sid), sessions.tenant_key("x"), "x", sid)
    assert deleted == 0 and r.exists(sessions.key(sid))  # another tenant cannot delete it
    assert r.eval(sessions.DELETE, 2, sessions.key(sid), sessions.tenant_key(tenant), tenant,
                  sid) == 1
    assert begin(r, "continue", sid, tenant) == ["no_session"]


def test_a_continue_needs_a_finished_turn(r):
    sid, tenant = sessions.new_id(), tenant_name()
    begin(r, "new", sid, tenant, request_id="r1")
    end(r, sid, "r1", b"", tenant)  # the first turn failed: nothing to continue
    assert begin(r, "continue", sid, tenant) == ["no_session"]
    assert begin(r, "reset", sid, tenant)[0] == "ok"  # a full history may take it over


def test_a_tenant_holds_at_most_its_cap(r):
    tenant = tenant_name()
    for _ in range(3):
        assert begin(r, "new", sessions.new_id(), tenant, cap=3)[0] == "ok"
    assert begin(r, "new", sessions.new_id(), tenant, cap=3) == ["too_many_sessions"]
    assert begin(r, "new", sessions.new_id(), tenant_name(), cap=3)[0] == "ok"  # others' own


def test_a_busy_mark_lapses_after_its_deadline_and_a_session_after_its_ttl(r):
    sid, tenant = sessions.new_id(), tenant_name()
    begin(r, "new", sid, tenant, request_id="lost", busy_s=0.5, ttl=1)
    end(r, sid, "lost", sessions.pack([1]), tenant, ttl=1)
    begin(r, "continue", sid, tenant, request_id="lost-too", busy_s=0.5, ttl=1)
    wait_until(lambda: begin(r, "continue", sid, tenant, busy_s=0.5, ttl=1)[0] == "ok",
               timeout_s=5)  # the lost turn's mark lapsed
    wait_until(lambda: not r.exists(sessions.key(sid)), timeout_s=10)  # expired
    assert begin(r, "continue", sid, tenant) == ["no_session"]
    # the expired one no longer counts against the cap (pruned by the next begin)
    wait_until(lambda: begin(r, "new", sessions.new_id(), tenant, cap=1)[0] == "ok",
               timeout_s=5)
    assert r.zcard(sessions.tenant_key(tenant)) == 1


def test_ids_are_random_and_well_formed():
    ids = {sessions.new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(sessions.is_id(i) for i in ids)
    assert not sessions.is_id("sess_../../etc") and not sessions.is_id("new")
    assert not sessions.is_id("sess_" + "a" * 100)
