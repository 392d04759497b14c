"""Chaos tests (issue #14, docs/faults.md): real daemons with Gemma, real Redis, real daphne,
each fault injected for real (kill -9, SIGTERM, a Redis restart, a dropped connection) and
every wait bounded. Each module starts what it kills (its own daphne, daemons, or
redis-server on its own port), never a shared one."""

from tests.daemon.conftest import daemon_env, make_daemon  # noqa: E402,F401  (fixtures)
