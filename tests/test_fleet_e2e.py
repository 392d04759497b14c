"""Two live daemons of one model behave as one service (issue 17): a real daphne, two real
daemons (Gemma, 2 slots, 1 thread each), real Redis.

- pull by capacity: a burst one daemon could not hold is served by both, with no 503;
- global admission: a burst past what the fleet queues gets 503 ``queue_full`` from the
  web, with a Retry-After; no daemon sees a refused job, and none gets a history row;
- a daemon killed with jobs in hand: the other serves them.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from tests.live_service import RealDaemon, patient_web, redis_conn, wait_until
from tests.test_limits_http import make_tenant
from wire import protocol, queue

pytestmark = pytest.mark.slow

DAEMON = dict(N_PARALLEL="2", N_CTX="1024", N_THREADS="1", LOCAL_QUEUE="2", MAX_QUEUE="1")


# a kill below: the web waits for another daemon to take over
web = pytest.fixture(scope="module", name="web")(patient_web)

@pytest.fixture(scope="module")
def fleet(web):
    model = f"gemma-fleet-{uuid.uuid4().hex[:6]}"
    daemons = [RealDaemon(web, model, **DAEMON).start(), RealDaemon(web, model, **DAEMON)]
    daemons[1].start()
    yield daemons
    for daemon in daemons:
        daemon.stop()


def served_by(request_id: str) -> str | None:
    """The daemon id of the request's last ``accepted`` event (the one that served it; its
    stream lives on a while)."""
    served = None
    for _, fields in redis_conn().xrange(protocol.events_stream(request_id)):
        kind, data = protocol.decode_event(fields)
        if kind == protocol.ACCEPTED:
            served = data.get("daemon_id")
    return served


def burst(web, model: str, key: str, n: int, max_tokens: int) -> list:
    replies: list = [None] * n

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"Count to ten, try {i}:", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        reply = web.request("POST", "/v1/completions", body, key, timeout=300)
        replies[i] = (reply.status, reply.header("X-Request-Id"), reply.header("Retry-After"),
                      reply.json())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return replies


def test_a_burst_one_daemon_could_not_hold_is_served_by_both_without_503(web, fleet):
    # one daemon holds 2 running + 2 queued and queues 1 more in Redis: 5 < 8 <= the fleet's
    _, key = make_tenant(web)
    replies = burst(web, fleet[0].model, key, 8, max_tokens=12)
    assert [status for status, *_ in replies] == [200] * 8, replies
    daemons = {served_by(request_id) for _, request_id, _, _ in replies}
    assert daemons == {fleet[0].daemon_id, fleet[1].daemon_id}


def test_past_the_fleets_queue_the_web_refuses_and_no_daemon_sees_the_refused(web, fleet):
    tenant_id, key = make_tenant(web)
    model = fleet[0].model
    before = [d.snapshot() for d in fleet]
    # fill both daemons (2 running + 2 queued each), and wait until their heartbeats say so
    holding: list = []
    filler = threading.Thread(target=lambda: holding.extend(
        burst(web, model, key, 8, max_tokens=160)))
    filler.start()
    wait_until(lambda: all(e["held"] == e["capacity"] for e in fleet_entries(model)),
               timeout_s=60)
    # now the fleet queues MAX_QUEUE (1) per daemon in Redis: 2 of these wait, 10 are refused
    replies = burst(web, model, key, 12, max_tokens=4)
    filler.join(300)
    refused = [r for r in replies if r[0] == 503]
    served = [r for r in [*holding, *replies] if r[0] == 200]
    # (at most 2 + the room a daemon had free at its last beat are admitted)
    assert len(refused) >= 6 and len(refused) + len(served) == 20, replies
    for _, _, retry_after, body in refused:
        assert body["error"]["code"] == "queue_full" and int(retry_after) >= 1
        waiting = int(body["error"]["message"].split()[0])
        assert waiting >= 2  # refused only with the fleet's MAX_QUEUE (1 + 1) waiting
    # no daemon refused anything: each job a daemon saw was served
    wait_until(lambda: all(d.snapshot()["heartbeat_at"] > b["heartbeat_at"]
                           for d, b in zip(fleet, before, strict=True)), timeout_s=10)
    for daemon, then in zip(fleet, before, strict=True):
        now = daemon.snapshot()
        assert now["rejected"] == then["rejected"] == {}
        assert now["counters"].get("refused_queue_full", 0) == 0
    rows = web.request("GET", "/v1/requests?limit=100", key=key).json()["results"]
    assert len(rows) == len(served)  # a refusal is counted, not stored
    assert all(served_by(row["id"]) for row in rows)
    counts = redis_conn().hgetall(f"llm:limit:refusals:{tenant_id}")
    assert int(counts[b"queue_full"]) == len(refused)


def fleet_entries(model: str) -> list[dict]:
    """The live daemons' entries in the model's fleet hash (what the web's gate reads)."""
    now = time.time()
    entries = [json.loads(v) for v in redis_conn().hvals(queue.fleet_key(model))]
    return [e for e in entries if now - e["at"] < protocol.HEARTBEAT_TTL_S]


def test_a_killed_daemons_jobs_are_served_by_the_other(web, fleet):
    """A session's turns are routed to its daemon (some wait there, routed); it is killed:
    the ones it ran are continued by the other, the ones routed to it move back to the
    shared queue and the other takes them."""
    _, key = make_tenant(web)
    model, session = fleet[0].model, f"kill-{uuid.uuid4().hex[:6]}"
    first, _ = complete(web, model, key, "Once upon a time", session)
    victim = next(d for d in fleet if d.daemon_id == served_by(first))
    survivor = next(d for d in fleet if d is not victim)
    before = routes(model).get(f"session:{victim.daemon_id}", 0)
    results: dict[int, tuple] = {}

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"Tell me a story, part {i}:", "stream": True,
                "max_tokens": 48, "temperature": 0, "ignore_eos": True, "session": session}
        reply = web.request("POST", "/v1/completions", body, key, timeout=300)
        chunks = [json.loads(d) for _, d in reply.sse() if d != "[DONE]"]
        results[i] = (reply.status, reply.header("X-Request-Id"), chunks)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    wait_until(lambda: routes(model).get(f"session:{victim.daemon_id}", 0) >= before + 4
               and any(s.get("request_id") for s in victim.snapshot().get("slots", [])),
               timeout_s=60)
    victim.kill()
    for thread in threads:
        thread.join(300)
    try:
        assert len(results) == 8
        for status, _, chunks in results.values():
            assert status == 200 and not [c for c in chunks if "error" in c], chunks[-1:]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert survivor.daemon_id in {served_by(r) for _, r, _ in results.values()}
        assert not redis_conn().exists(queue.routed_key(model, victim.daemon_id))
    finally:
        victim.start()  # the module's fleet again (a fresh id)


SYSTEM = ("You are the assistant of a bakery. You answer questions about bread, cakes and "
          "opening hours in one short sentence, politely, and never mention prices. ") * 4


def complete(web, model: str, key: str, prompt: str, session: str | None = None,
             max_tokens: int = 8) -> tuple[str, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if session:
        body["session"] = session
    reply = web.request("POST", "/v1/completions", body, key, timeout=300)
    assert reply.status == 200, reply.json()
    return reply.header("X-Request-Id"), reply.json()


def routes(model: str) -> dict[str, int]:
    raw = redis_conn().hgetall(queue.routes_key(model))
    return {k.decode(): int(v) for k, v in raw.items()}


def test_a_conversation_stays_on_one_daemon_and_hits_its_cache(web, fleet):
    _, key = make_tenant(web)
    model, session = fleet[0].model, f"conv-{uuid.uuid4().hex[:6]}"
    prompt, served, cached = SYSTEM, [], []
    for turn in range(4):
        prompt += f"\nCustomer: question number {turn}?\nAssistant:"
        request_id, body = complete(web, model, key, prompt, session)
        served.append(served_by(request_id))
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompt += body["choices"][0]["text"]
    assert len(set(served)) == 1 and served[0] in {d.daemon_id for d in fleet}
    assert all(c > 0 for c in cached[1:]), cached


def test_another_tenant_sending_the_same_text_gets_no_affinity_and_no_cache(web, fleet):
    _, key_a = make_tenant(web)
    _, key_b = make_tenant(web)
    model = fleet[0].model
    text = SYSTEM + "\nCustomer: when do you open?\nAssistant:"
    complete(web, model, key_a, text)
    _, again = complete(web, model, key_a, text)  # tenant A: its own prefix, routed to it
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    before = routes(model)
    _, other = complete(web, model, key_b, text)
    after = routes(model)
    assert after.get("affinity", 0) == before.get("affinity", 0)  # no match for B
    assert after.get("least_loaded", 0) == before.get("least_loaded", 0) + 1
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]


def test_a_drained_daemon_gets_no_new_work_and_its_session_moves(web, fleet):
    _, key = make_tenant(web)
    model, session = fleet[0].model, f"drain-{uuid.uuid4().hex[:6]}"
    first, _ = complete(web, model, key, SYSTEM + "\nCustomer: hi\nAssistant:", session)
    drained = next(d for d in fleet if d.daemon_id == served_by(first))
    other = next(d for d in fleet if d is not drained)
    r = redis_conn()
    r.xadd(protocol.control_stream(drained.daemon_id), protocol.encode_command("drain"))
    try:
        wait_until(lambda: drained.snapshot().get("draining"), timeout_s=30)
        wait_until(lambda: not json.loads(r.hget(queue.fleet_key(model),
                                                 drained.daemon_id))["taking"], timeout_s=10)
        for turn in range(3):
            request_id, _ = complete(web, model, key, SYSTEM + f"\nCustomer: {turn}?\nAssistant:",
                                     session)
            assert served_by(request_id) == other.daemon_id
    finally:
        r.xadd(protocol.control_stream(drained.daemon_id), protocol.encode_command("resume"))
        wait_until(lambda: fleet_entries(model) and all(
            e["taking"] for e in fleet_entries(model)), timeout_s=30)
