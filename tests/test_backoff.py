"""wire/backoff.py: the delays between tries while Redis is away."""

import logging

from wire.backoff import CAP_S, FIRST_S, Backoff


def test_delays_double_from_the_first_to_the_cap_and_a_success_starts_over():
    outage = Backoff()
    assert [outage.failed() for _ in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert FIRST_S == 0.1 and CAP_S == 2.0
    assert outage.failing_for() >= 0.0
    assert outage.succeeded() is not None
    assert outage.failing_for() == 0.0
    assert outage.failed() == 0.1
    assert [outage.failed() for _ in range(1000)][-1] == CAP_S  # no overflow however long


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
