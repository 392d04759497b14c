"""The live admin pages' JSON endpoint and actions, against a snapshot written to the test
Redis (a pretend daemon): staff only, CSRF, admin log, and what reaches Redis."""
import json
import time
import uuid
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from inference.models import InferenceRequest
from wire import protocol

STATE_URL = "/admin/live/state.json"
ACTION_URL = "/admin/live/action"


@pytest.fixture
def daemon(redis_client, parties):
    """A live daemon snapshot: one generating slot (tenant A), one queued job (tenant B)."""
    daemon_id, now = f"admin-test-{uuid.uuid4().hex[:6]}", time.time()
    running, waiting = str(uuid.uuid4()), str(uuid.uuid4())
    snap = {
        "daemon_id": daemon_id, "model": "m", "host": "h", "pid": 1, "started_at": now - 60,
        "heartbeat_at": now, "draining": False, "config": {"n_parallel": 2, "n_ctx": 2048},
        "slots": [{"id": 0, "state": "generating", "request_id": running,
                   "cache_scope": str(parties.a.pk), "kv_tokens": 30, "prompt_tokens": 20,
                   "cached_tokens": 8, "generated_tokens": 10},
                  {"id": 1, "state": "idle", "request_id": None, "cache_scope": None}],
        "queue": [{"request_id": waiting, "cache_scope": str(parties.b.pk), "prompt_tokens": 7,
                   "max_tokens": 64, "age_ms": 1500.0}],
        "kv": {"block_tokens": 256, "blocks_total": 8, "blocks_used": 1, "n_ctx": 2048},
        "counters": {"finished_stop": 3, "finished_length": 1, "prompt_tokens": 100,
                     "cached_tokens": 25, "kv_pressure": 2, "refused_queue_full": 1},
        "cache": {"ram_budget_bytes": 1 << 20, "ram_bytes": 4096, "ram_entries": 1,
                  "entries": [{"tier": "ram", "slot": None, "cache_scope": str(parties.a.pk),
                               "tokens": 12, "bytes": 4096, "age_ms": 900.0, "hits": 2}]},
    }
    redis_client.set(protocol.daemon_key(daemon_id), json.dumps(snap), ex=30)
    redis_client.zadd(protocol.DAEMONS_ZSET, {daemon_id: now})
    yield {"id": daemon_id, "running": running, "waiting": waiting}
    redis_client.delete(protocol.daemon_key(daemon_id), protocol.control_stream(daemon_id))
    redis_client.zrem(protocol.DAEMONS_ZSET, daemon_id)


@pytest.fixture
def staff_member(db) -> Client:
    client = Client()
    client.force_login(User.objects.create_user("viewer", is_staff=False))
    return client


def test_state_names_tenants_and_summarises_daemons(admin_client, daemon, parties):
    state = admin_client.get(STATE_URL).json()
    mine = next(d for d in state["daemons"] if d["daemon_id"] == daemon["id"])
    assert mine["requests"] == 4 and mine["refusals"] == 1 and mine["kv_pressure"] == 2
    assert mine["hit_ratio"] == 0.25 and mine["slots_busy"] == 1 and mine["queue_depth"] == 1
    assert 59 <= mine["uptime_s"] <= 70
    slot = next(s for s in state["slots"] if s["request_id"] == daemon["running"])
    assert slot["tenant"] == "Alpha" and slot["cached_tokens"] == 8
    queued = next(q for q in state["queue"] if q["request_id"] == daemon["waiting"])
    assert queued["tenant"] == "Beta" and queued["age_ms"] == 1500.0
    entry = next(e for e in state["cache"] if e["daemon_id"] == daemon["id"])
    assert entry["tenant"] == "Alpha" and entry["bytes"] == 4096


def test_state_shows_a_stuck_restarted_daemon_and_its_preempted_requests(
        admin_client, redis_client, parties):
    daemon_id, now = f"admin-stuck-{uuid.uuid4().hex[:6]}", time.time()
    preempted = str(uuid.uuid4())
    snap = {"daemon_id": daemon_id, "model": "m", "heartbeat_at": now, "started_at": now - 5,
            "stale": True, "restarts": 2, "last_exit": "hung: no loop turn for 31.0 s, killed",
            "loop": {"turns": 90, "stalled_s": 12.5, "stuck": True, "running": True,
                     "longest_turn_s": 0.4, "stuck_on": None},
            "slots": [], "queue": [],
            "preempted": [{"request_id": preempted, "cache_scope": str(parties.a.pk),
                           "prompt_tokens": 9, "output_tokens": 40, "max_tokens": 400}]}
    redis_client.set(protocol.daemon_key(daemon_id), json.dumps(snap), ex=30)
    redis_client.zadd(protocol.DAEMONS_ZSET, {daemon_id: now})
    try:
        state = admin_client.get(STATE_URL).json()
        health = admin_client.get("/v1/health").json()
    finally:
        redis_client.delete(protocol.daemon_key(daemon_id))
        redis_client.zrem(protocol.DAEMONS_ZSET, daemon_id)
    mine = next(d for d in state["daemons"] if d["daemon_id"] == daemon_id)
    assert (mine["stuck"], mine["loop_stalled_s"], mine["restarts"]) == (True, 12.5, 2)
    assert mine["last_exit"].startswith("hung: ")
    row = next(q for q in state["queue"] if q["request_id"] == preempted)
    assert row["preempted"] is True and row["tenant"] == "Alpha" and row["output_tokens"] == 40
    listed = next(d for d in health["daemons"] if d["daemon_id"] == daemon_id)
    assert listed["stuck"] is True and listed["restarts"] == 2
    if len(health["daemons"]) == 1:  # the only daemon: the scheduler as a whole is stuck
        assert health["scheduler"] == "stuck"


@pytest.mark.parametrize("page", ["queue", "slots", "cache", "daemons", "quarantine"])
def test_live_pages_render_in_the_admin(admin_client, page):
    body = admin_client.get(f"/admin/live/{page}/").content.decode()
    assert 'data-page="' + page + '"' in body and "admin_live.js" in body
    assert "Django administration" in body or "site-name" in body


def test_admin_index_links_the_live_pages(admin_client):
    body = admin_client.get("/admin/").content.decode()
    for page in ["queue", "slots", "cache", "daemons"]:
        assert f"/admin/live/{page}/" in body


@pytest.mark.parametrize("url", [STATE_URL, "/admin/live/slots/"])
def test_anonymous_and_non_staff_are_sent_to_login(client, staff_member, db, url):
    for who in (client, staff_member):
        response = who.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_non_staff_cannot_act(staff_member, daemon, redis_client):
    response = staff_member.post(ACTION_URL, {"action": "cancel", "request_id": daemon["running"]})
    assert response.status_code == 302
    assert not redis_client.exists(protocol.cancel_key(daemon["running"]))
    assert not LogEntry.objects.exists()


def test_actions_need_csrf(daemon, db):
    client = Client(enforce_csrf_checks=True)
    client.force_login(User.objects.create_superuser("boss", password="x"))
    response = client.post(ACTION_URL, {"action": "drain", "daemon_id": daemon["id"]})
    assert response.status_code == 403


def test_cancel_a_running_request(admin_client, daemon, redis_client):
    pubsub = redis_client.pubsub()
    pubsub.subscribe(protocol.CANCEL_CHANNEL)
    pubsub.get_message(timeout=1)
    response = admin_client.post(ACTION_URL, {"action": "cancel", "request_id": daemon["running"]})
    assert response.status_code == 200 and response.json()["ok"]
    assert redis_client.exists(protocol.cancel_key(daemon["running"]))
    message = pubsub.get_message(timeout=2)
    assert message and message["data"].decode() == daemon["running"]
    entry = LogEntry.objects.get()
    assert daemon["running"] in entry.change_message


def test_cancel_an_unknown_request_is_refused(admin_client, daemon, redis_client):
    unknown = str(uuid.uuid4())
    response = admin_client.post(ACTION_URL, {"action": "cancel", "request_id": unknown})
    assert response.status_code == 400
    assert not redis_client.exists(protocol.cancel_key(unknown))


@pytest.mark.parametrize("action", ["drain", "resume"])
def test_drain_and_resume_reach_the_control_stream(admin_client, daemon, redis_client, action):
    response = admin_client.post(ACTION_URL, {"action": action, "daemon_id": daemon["id"]})
    assert response.status_code == 200
    [(_, fields)] = redis_client.xrange(protocol.control_stream(daemon["id"]))
    assert protocol.decode_command(fields) == {"action": action}
    assert LogEntry.objects.get().change_message == f"Sent {action} to daemon {daemon['id']}"


def test_evict_scope_names_the_tenant_id(admin_client, daemon, redis_client, parties):
    response = admin_client.post(ACTION_URL, {"action": "evict_scope", "daemon_id": daemon["id"],
                                              "tenant_id": str(parties.a.pk)})
    assert response.status_code == 200
    [(_, fields)] = redis_client.xrange(protocol.control_stream(daemon["id"]))
    assert protocol.decode_command(fields) == {"action": "evict_scope", "scope": str(parties.a.pk)}
    entry = LogEntry.objects.get()
    assert entry.object_id == str(parties.a.pk) and "Alpha" in entry.change_message


def test_commands_to_a_dead_daemon_are_refused(admin_client, redis_client, db):
    response = admin_client.post(ACTION_URL, {"action": "drain", "daemon_id": "gone"})
    assert response.status_code == 400
    assert not redis_client.exists(protocol.control_stream("gone"))
    assert not LogEntry.objects.exists()


def test_state_is_read_only(admin_client, daemon):
    for method in (admin_client.post, admin_client.put, admin_client.delete):
        refused = method(STATE_URL)
        assert refused.status_code == 405, (method.__name__, refused.status_code)
        assert "POST" not in refused["Allow"] and "GET" in refused["Allow"]
    assert admin_client.get(ACTION_URL).status_code == 405


def test_history_cancel_action(admin_client, parties, redis_client):
    running = InferenceRequest.objects.create(tenant=parties.a, kind="chat", model="m",
                                              status="running")
    done = InferenceRequest.objects.create(tenant=parties.a, kind="chat", model="m", status="done")
    response = admin_client.post("/admin/inference/inferencerequest/", {
        "action": "cancel_requests", "_selected_action": [running.pk, done.pk]})
    assert response.status_code == 302
    assert redis_client.exists(protocol.cancel_key(str(running.pk)))
    assert not redis_client.exists(protocol.cancel_key(str(done.pk)))
    assert LogEntry.objects.get().object_id == str(running.pk)


def test_history_filters(admin_client, parties):
    InferenceRequest.objects.create(tenant=parties.a, kind="chat", model="gemma", status="done",
                                    finish_reason="stop")
    for query in ["status__exact=done", f"tenant__id__exact={parties.a.pk}", "model=gemma",
                  "finish_reason=stop", f"created__year={timezone.now().year}"]:
        assert admin_client.get(f"/admin/inference/inferencerequest/?{query}").status_code == 200


def test_tenant_usage_columns(admin_client, parties, django_assert_max_num_queries):
    now = timezone.now()
    for days, tokens in [(0, (10, 5)), (3, (100, 50)), (40, (1000, 500))]:
        row = InferenceRequest.objects.create(tenant=parties.a, kind="chat", model="m",
                                              prompt_tokens=tokens[0], completion_tokens=tokens[1])
        InferenceRequest.objects.filter(pk=row.pk).update(created=now - timedelta(days=days))
    InferenceRequest.objects.create(tenant=parties.a, kind="chat", model="m")  # no tokens yet
    response = admin_client.get("/admin/accounts/tenant/")
    alpha = next(t for t in response.context["cl"].result_list if t.pk == parties.a.pk)
    assert (alpha.requests_24h, alpha.tokens_24h) == (2, 15)
    assert (alpha.requests_30d, alpha.tokens_30d) == (3, 165)
    with django_assert_max_num_queries(12):
        admin_client.get("/admin/accounts/tenant/")


def test_quarantined_requests_are_listed_and_can_be_released(admin_client, redis_client, parties):
    fingerprint = "ab" * 32
    record = {"request_id": str(uuid.uuid4()), "tenant_id": str(parties.a.pk), "model": "m",
              "kind": "chat", "deaths": 2, "last_daemon": "d1", "at": time.time()}
    redis_client.hset(protocol.QUARANTINE_HASH, fingerprint, json.dumps(record))
    redis_client.set(protocol.deaths_key(fingerprint), 2)
    try:
        [row] = admin_client.get(STATE_URL).json()["quarantine"]
        assert row["fingerprint"] == fingerprint and row["tenant"] == "Alpha"
        assert row["deaths"] == 2 and "prompt" not in row
        refused = admin_client.post(ACTION_URL, {"action": "release", "fingerprint": "²" * 64})
        assert refused.status_code == 400
        released = admin_client.post(ACTION_URL, {"action": "release", "fingerprint": fingerprint})
        assert released.status_code == 200
        assert not redis_client.hexists(protocol.QUARANTINE_HASH, fingerprint)
        assert not redis_client.exists(protocol.deaths_key(fingerprint))
        assert "Released" in LogEntry.objects.get().change_message
        again = admin_client.post(ACTION_URL, {"action": "release", "fingerprint": fingerprint})
        assert again.status_code == 400
    finally:
        redis_client.hdel(protocol.QUARANTINE_HASH, fingerprint)
