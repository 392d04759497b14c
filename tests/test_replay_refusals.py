"""A replay refusal remembered by the web process (inference/limits.py ``ReplayRefusals``),
against the real test Redis: while it holds, the tenant's replays are refused without the
replay script; it holds until the script's Retry-After and only under the limits it was
made under; the refusals made from it reach Redis's counters with the tenant's next script.
(Over HTTP, with Redis's MONITOR: tests/test_stream_shares.py.)"""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from inference import broker, limits
from inference.errors import ApiError
from wire import limits as wire_limits

PER_MINUTE = 2


def refused(limit: str = wire_limits.REPLAYS, retry_after_s: int = 5) -> wire_limits.Refused:
    return wire_limits.Refused(limit, wire_limits.OVER, retry_after_s, 3, 0)


def test_a_refusal_holds_until_its_retry_after():
    memo, t = limits.ReplayRefusals(), "t1"
    memo.remember(t, refused(retry_after_s=5), PER_MINUTE, None, now=100.0)
    assert memo.refusal(t, PER_MINUTE, now=104.9) is not None
    assert memo.refusal(t, PER_MINUTE, now=105.0) is None
    assert memo.refusal(t, PER_MINUTE, now=104.0) is None  # forgotten once over


def test_a_refusal_holds_only_under_its_terms():
    memo = limits.ReplayRefusals()
    memo.remember("replays", refused(), PER_MINUTE, None, now=0.0)
    assert memo.refusal("replays", PER_MINUTE, now=1.0, rpm=7) is not None  # rpm: not its
    assert memo.refusal("replays", PER_MINUTE + 1, now=1.0) is None  # the setting changed
    memo.remember("rpm", refused(wire_limits.RPM), PER_MINUTE, 3, now=0.0)
    assert memo.refusal("rpm", PER_MINUTE, now=1.0, rpm=3) is not None
    assert memo.refusal("rpm", PER_MINUTE, now=1.0, rpm=10) is None  # raised: ask the script


def test_refusals_made_from_memory_are_handed_over_once():
    memo, t = limits.ReplayRefusals(), "t2"
    memo.remember(t, refused(), PER_MINUTE, None, now=0.0)
    memo.refusal(t, PER_MINUTE, now=1.0).unreported += 2
    assert memo.unreported(t) == ("", 0)  # still held: nothing to hand over yet
    assert memo.refusal(t, PER_MINUTE, now=10.0) is None
    assert memo.unreported(t) == (wire_limits.REPLAYS_EXCEEDED, 2)
    assert memo.unreported(t) == ("", 0)


def test_the_script_counts_earlier_refusals_whatever_it_decides(redis_client):
    t, now = f"t-{uuid.uuid4().hex[:12]}", time.time()

    def run(earlier: int) -> wire_limits.Refused | None:
        script, keys, args = wire_limits.replay_call(
            t, now=now, replays_per_minute=1, requests_per_minute=None,
            earlier_code=wire_limits.REPLAYS_EXCEEDED, earlier_refusals=earlier)
        return wire_limits.decision(redis_client.eval(script, len(keys), *keys, *args))

    assert run(earlier=4) is None  # admitted, and 4 refusals counted
    assert run(earlier=0).code == wire_limits.REPLAYS_EXCEEDED
    assert wire_limits.refusal_counts(redis_client, t) == {wire_limits.REPLAYS_EXCEEDED: 5}


def a_key(tenant_id: str) -> Any:
    """What ``count_replay`` reads of an ApiKey: its tenant's id and limits (none), loaded now."""
    tenant = SimpleNamespace(**{field: None for field in limits.FIELDS})
    return SimpleNamespace(tenant_id=tenant_id, tenant=tenant, loaded_at=time.monotonic())


@pytest.mark.asyncio
async def test_a_remembered_refusal_runs_no_script(settings, monkeypatch, redis_client):
    """REPLAYS_PER_MINUTE 2: two replays and the third's refusal run the script; the next
    two are refused without it. Once the refusal is over (forgotten here as at its
    Retry-After), the next replay runs the script again, which counts the two refusals made
    meanwhile next to its own."""
    settings.REPLAYS_PER_MINUTE = PER_MINUTE
    t = f"t-{uuid.uuid4().hex[:12]}"
    api_key, scripts = a_key(t), []
    real = broker.async_client

    class Counting:
        async def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any:
            scripts.append(keys_and_args[0])
            return await real().eval(script, numkeys, *keys_and_args)

    monkeypatch.setattr(broker, "async_client", Counting)

    async def replay() -> str | None:
        try:
            await limits.count_replay(api_key)
        except ApiError as error:
            assert error.status == 429 and int(error.headers["Retry-After"]) >= 1
            return error.code
        return None

    assert [await replay() for _ in range(3)] == [None, None, wire_limits.REPLAYS_EXCEEDED]
    assert len(scripts) == 3
    assert [await replay() for _ in range(2)] == [wire_limits.REPLAYS_EXCEEDED] * 2
    assert len(scripts) == 3  # refused from memory
    assert wire_limits.refusal_counts(redis_client, t) == {wire_limits.REPLAYS_EXCEEDED: 1}
    assert limits.replay_refusals.refusal(t, PER_MINUTE, time.monotonic() + 120) is None
    assert await replay() == wire_limits.REPLAYS_EXCEEDED  # the window is still full
    assert len(scripts) == 4
    assert wire_limits.refusal_counts(redis_client, t) == {wire_limits.REPLAYS_EXCEEDED: 4}


def test_a_refusal_replacing_another_keeps_its_unreported_refusals():
    """Replays A and B pass the memo and wait for the script; A's refusal is remembered and
    refuses C from memory; B's refusal then replaces A's: C's refusal is still handed over."""
    memo, t = limits.ReplayRefusals(), "t3"
    memo.remember(t, refused(), PER_MINUTE, None, now=0.0)  # A's
    memo.refusal(t, PER_MINUTE, now=1.0).unreported += 1  # C
    memo.remember(t, refused(), PER_MINUTE, None, now=1.0)  # B's
    assert memo.refusal(t, PER_MINUTE, now=10.0) is None
    assert memo.unreported(t) == (wire_limits.REPLAYS_EXCEEDED, 1)
    assert memo.unreported(t) == ("", 0)


def test_unreported_refusals_are_added_to_until_handed_over():
    """A refusal forgotten while an earlier one's refusals wait for a script call: both
    counts are handed over, in one sum per code, one code per call."""
    memo, t = limits.ReplayRefusals(), "t4"
    memo.remember(t, refused(), PER_MINUTE, None, now=0.0)
    memo.refusal(t, PER_MINUTE, now=1.0).unreported += 2
    assert memo.refusal(t, PER_MINUTE, now=10.0) is None  # forgotten: 2 wait
    memo.remember(t, refused(), PER_MINUTE, None, now=10.0)
    memo.refusal(t, PER_MINUTE, now=11.0).unreported += 3
    assert memo.refusal(t, PER_MINUTE, now=20.0) is None  # forgotten: 3 more
    memo.remember(t, refused(wire_limits.RPM), PER_MINUTE, 3, now=20.0)
    memo.refusal(t, PER_MINUTE, now=21.0, rpm=3).unreported += 1
    assert memo.refusal(t, PER_MINUTE, now=30.0, rpm=3) is None
    handed = {memo.unreported(t), memo.unreported(t)}
    assert handed == {(wire_limits.REPLAYS_EXCEEDED, 5), (wire_limits.RPM_EXCEEDED, 1)}
    assert memo.unreported(t) == ("", 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", ["redis_error", "cancelled"])
async def test_refusals_handed_to_a_failed_script_call_are_handed_over_again(
        failure, settings, monkeypatch, redis_client):
    """Two refusals made from memory wait for the tenant's next script call; that call
    fails (Redis errs, or the replay is cancelled as it waits): the next one counts them."""
    settings.REPLAYS_PER_MINUTE = PER_MINUTE
    t = f"t-{uuid.uuid4().hex[:12]}"
    memo, real, calling = limits.replay_refusals, broker.async_client, asyncio.Event()
    memo.remember(t, refused(), PER_MINUTE, None, now=time.monotonic())
    memo.refusal(t, PER_MINUTE, now=time.monotonic()).unreported += 2
    assert memo.refusal(t, PER_MINUTE, now=time.monotonic() + 60) is None  # forgotten

    class Failing:
        async def eval(self, *args: Any) -> Any:
            calling.set()
            if failure == "redis_error":
                raise redis.ConnectionError("away")
            await asyncio.Event().wait()

    monkeypatch.setattr(broker, "async_client", Failing)
    replay = asyncio.create_task(limits.count_replay(a_key(t)))
    await asyncio.wait_for(calling.wait(), 5)
    if failure == "cancelled":
        replay.cancel()
    with pytest.raises(asyncio.CancelledError if failure == "cancelled"
                       else redis.ConnectionError):
        await replay
    monkeypatch.setattr(broker, "async_client", real)
    await limits.count_replay(a_key(t))  # admitted, and the two counted
    assert wire_limits.refusal_counts(redis_client, t) == {wire_limits.REPLAYS_EXCEEDED: 2}
