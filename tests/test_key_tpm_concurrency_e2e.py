"""A key's tokens-per-minute limit holds under concurrency (issue 38: "no overshoot beyond
one request"), end to end: a real daphne behind the door, the real SmolLM2 daemon. The
tenant has no limit; its key has its own. Twenty chat requests at once: the ones admitted
never use, in any minute, more than the key's limit plus one request's tokens; the others
are refused 429 ``tpm_exceeded`` with a Retry-After, naming the key's limit. The accounting
is read from the history rows and the key's counters, not from timing."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest

from config.models import SMOLLM2
from tests.live_service import redis_conn, wait_until
from tests.test_limits_http import shell
from wire import limits as wire_limits

pytestmark = pytest.mark.slow
KEY_TPM = 200
REQUESTS = 20
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."}]


def make_limited_key(web) -> tuple[int, int, str]:
    """A tenant without limits and its key with its own tokens per minute: (tenant id, key
    id, plaintext key), their counters in Redis clean (ids repeat across test servers)."""
    out = shell(web, (
        "import json, uuid; from accounts.models import ApiKey, Tenant; "
        "t = Tenant.objects.create(slug='ktpm-' + uuid.uuid4().hex[:8], name='Key TPM'); "
        "k, raw = ApiKey.issue(t, 'limited'); "
        f"k.tokens_per_minute = {KEY_TPM}; k.save(); "
        "print(json.dumps([t.id, k.id, raw]))"))
    tenant_id, key_id, raw = json.loads(out)
    r, now = redis_conn(), time.time()
    r.delete(wire_limits.key_rpm_key(str(key_id)), wire_limits.key_tpm_key(str(key_id)),
             wire_limits.key_month_key(str(key_id), now),
             wire_limits.key_reserved_key(str(key_id)), wire_limits.key_of_key(str(tenant_id)),
             wire_limits.inflight_key(str(tenant_id)), wire_limits.tpm_key(str(tenant_id)),
             wire_limits.month_key(str(tenant_id), now))
    return tenant_id, key_id, raw


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def test_twenty_concurrent_requests_stay_within_the_keys_tokens_per_minute(web, chat_daemon):
    tenant_id, key_id, key = make_limited_key(web)
    body = {"model": SMOLLM2, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}

    def one(_: int) -> tuple[int, dict, str | None]:
        reply = web.request("POST", "/v1/chat/completions", body, key)
        return reply.status, reply.json(), reply.header("Retry-After")

    with ThreadPoolExecutor(REQUESTS) as pool:
        results = list(pool.map(one, range(REQUESTS)))

    served = [data for status, data, _ in results if status == 200]
    refused = [(data, retry) for status, data, retry in results if status != 200]
    assert len(served) + len(refused) == REQUESTS
    assert served, "the key's limit admits a few"
    assert refused, "and refuses the rest: 20 of these reserve more than the key's minute"
    for data, retry in refused:
        error = data["error"]
        assert error["code"] == "tpm_exceeded" and error["type"] == "rate_limit_error", error
        assert "API key" in error["message"]
        assert retry is not None and int(retry) >= 1 and error["retry_after_s"] == int(retry)

    # the history: every admitted request has a row (refused ones have none), finished
    r = redis_conn()
    wait_until(lambda: r.hlen(wire_limits.key_of_key(str(tenant_id))) == 0, timeout_s=60)
    rows = web.request("GET", "/v1/requests?limit=500", key=key).json()["results"]
    assert len(rows) == len(served)
    assert all(row["status"] == "done" and row["finished"] for row in rows), rows
    tokens = [(stamp(row["finished"]), row["prompt_tokens"] + row["completion_tokens"])
              for row in rows]
    one_request = max(n for _, n in tokens)
    # in any minute (each request's tokens are charged when it ends), at most the key's
    # limit and one request more
    for end, _ in tokens:
        in_minute = sum(n for at, n in tokens if end - 60 < at <= end)
        assert in_minute <= KEY_TPM + one_request, (in_minute, tokens)
    # the key's own counters charged exactly what the rows say, and hold nothing now
    usage = wire_limits.current_key_usage(r, str(key_id), time.time())
    assert usage["tokens_this_month"] == sum(n for _, n in tokens)
    assert usage["requests_this_minute"] <= len(served)
    assert not r.hlen(wire_limits.key_reserved_key(str(key_id)))
