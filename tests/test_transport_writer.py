"""The daemon's event writer against a real Redis, with no model: nothing buffered is lost
when a write fails, and the retry carries it."""
import uuid
from types import SimpleNamespace

import pytest
import redis

from scheduler_daemon.jobs import TokenEvent
from scheduler_daemon.transport import DaemonTransport
from tests.live_service import redis_conn
from wire import protocol


class FlakyRedis:
    """The test Redis, except that the next ``failures`` pipelines fail on execute."""

    def __init__(self, real: redis.Redis, failures: int) -> None:
        self.real, self.failures = real, failures

    def pipeline(self, transaction: bool = False):
        pipe = self.real.pipeline(transaction=transaction)
        if self.failures:
            self.failures -= 1

            def down():
                raise redis.ConnectionError("Redis went away")

            pipe.execute = down
        return pipe


def test_a_failed_write_keeps_the_events_for_the_next_one():
    real = redis_conn()
    core = SimpleNamespace(listeners=[], tick_listeners=[])
    transport = DaemonTransport(core, FlakyRedis(real, failures=1), f"m-{uuid.uuid4().hex[:6]}")
    request_id = uuid.uuid4().hex
    stream = protocol.events_stream(request_id)
    try:
        transport._on_event(TokenEvent(request_id, "Hel", 1))
        with pytest.raises(redis.ConnectionError):
            transport._flush()
        assert real.xlen(stream) == 0
        transport._on_event(TokenEvent(request_id, "lo", 1))
        transport._flush()
        [(_, fields)] = real.xrange(stream)
        assert protocol.decode_event(fields) == (protocol.TOKEN, {"text": "Hello", "n_tokens": 2})
    finally:
        real.delete(stream)
