"""wire/backoff.py: the delays between tries while Redis is away."""

import logging
import math

import pytest

from wire.backoff import CAP_S, FIRST_S, Backoff


def test_delays_double_from_the_first_to_the_cap_and_a_success_starts_over():
    outage = Backoff()
    delays = [outage.failed() for _ in range(64)]
    assert delays[0] == FIRST_S and 0 < FIRST_S < CAP_S
    for before, after in zip(delays, delays[1:], strict=False):
        assert after == min(2 * before, CAP_S)  # doubles, never past the cap
    assert delays[-1] == CAP_S
    assert outage.failing_for() >= 0.0
    assert outage.succeeded() is not None
    assert outage.failing_for() == 0.0
    assert outage.failed() == delays[0]  # a new outage starts over
    assert [outage.failed() for _ in range(1000)][-1] == CAP_S  # no overflow however long


def tries(outage: Backoff, down_s: float) -> tuple[float, int]:
    """A caller that tries at 0 s and after each delay while Redis is away for ``down_s``:
    (when its first try after Redis is back comes, how many tries failed meanwhile)."""
    at, failed = 0.0, 0
    while at < down_s:
        at += outage.failed()
        failed += 1
    return at, failed


@pytest.mark.parametrize("down_s", [FIRST_S / 2, 1.0, CAP_S * 3, 600.0, 86_400.0])
def test_a_waiting_caller_is_back_within_the_cap_and_a_long_outage_costs_a_try_per_cap(down_s):
    """A Redis restart (about a second) or any longer outage: the first try after Redis is
    back comes at most CAP_S later; meanwhile a caller tries at most once per CAP_S, plus
    the few quick tries of the ramp (a long outage does not hammer Redis)."""
    back_at, failed = tries(Backoff(), down_s)
    assert down_s <= back_at <= down_s + CAP_S
    ramp = math.ceil(math.log2(CAP_S / FIRST_S)) + 1
    assert failed <= down_s / CAP_S + ramp + 1


def test_a_success_without_failures_reports_no_outage():
    assert Backoff().succeeded() is None


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog):
    log = logging.getLogger("test.backoff")
    outage = Backoff("reading jobs", log)
    with caplog.at_level(logging.WARNING, logger="test.backoff"):
        for _ in range(5):
            outage.failed(ConnectionError("refused"))
        outage.succeeded()
        outage.succeeded()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "reading jobs failed" in messages[0] and "refused" in messages[0]
    assert "works again" in messages[1] and "5 failed tries" in messages[1]
